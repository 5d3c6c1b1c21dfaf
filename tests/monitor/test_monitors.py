"""TensorBoard, CSV and MLflow monitors: what a 2-rank run writes, read back (wandb and Comet:
test_wandb_comet.py)."""

from __future__ import annotations

import csv
import glob
from pathlib import Path

import pytest

from tests.engine.workloads import adamw_config, make_model, recorded_steps
from zerotrain.testing import run_on_ranks

STEPS, MICRO, WORLD = 3, 2, 2
TIMERS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")
HAS_MLFLOW = __import__("importlib.util").util.find_spec("mlflow") is not None
MLFLOW_ENV = {"MLFLOW_ALLOW_FILE_STORE": "true"}  # MLflow 3 wants a database, tests use files


def _monitor_config(out: str, mlflow: bool) -> dict:
    cfg = adamw_config(
        MICRO,
        wall_clock_breakdown=True,
        tensorboard={"enabled": True, "output_path": f"{out}/tb", "job_name": "job"},
        csv_monitor={"enabled": True, "output_path": f"{out}/csv", "job_name": "job"},
    )
    if mlflow:
        cfg["mlflow"] = {
            "enabled": True,
            "tracking_uri": f"file://{out}/mlruns",
            "experiment_name": "zt",
            "run_name": "run1",
        }
    return cfg


def _train(out: str, mlflow: bool):
    import zerotrain
    from zerotrain.runtime.utils import peak_rss_bytes

    model = make_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=_monitor_config(out, mlflow))
    losses, lrs, samples = recorded_steps(engine, STEPS, MICRO)
    writers = len(engine.monitor.monitors)
    engine.destroy()  # closes the writers (the exit test covers scripts that never call it)
    return {
        "losses": losses,
        "lrs": lrs,
        "samples": samples,
        "writers": writers,
        "peak_rss_MB": peak_rss_bytes() / 2**20,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitors")
    results = run_on_ranks(_train, WORLD, args=(str(out), HAS_MLFLOW), env=MLFLOW_ENV)
    return out, results


def _scalars(log_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_only_rank0_writes(run):
    out, results = run
    assert [r["writers"] for r in results] == [3 if HAS_MLFLOW else 2, 0]
    assert len(glob.glob(f"{out}/tb/job/events.out.tfevents.*")) == 1


def test_tensorboard_scalars(run):
    out, results = run
    scalars = _scalars(out / "tb" / "job")
    rank0 = results[0]
    steps = [MICRO * WORLD * (i + 1) for i in range(STEPS)]  # x axis: global_samples
    assert rank0["samples"] == steps
    expected = {
        "Train/Samples/train_loss",
        "Train/Samples/lr",
        *(f"Train/Samples/elapsed_time_ms_{t}" for t in TIMERS),
        *(f"Hardware/rank{r}/{name}" for r in range(WORLD) for name in ("cpu_percent", "rss_MB")),
    }
    assert set(scalars) == expected  # no loss_scale without fp16
    assert [s for s, _ in scalars["Train/Samples/train_loss"]] == steps
    assert [v for _, v in scalars["Train/Samples/train_loss"]] == pytest.approx(rank0["losses"], rel=1e-6)
    assert [v for _, v in scalars["Train/Samples/lr"]] == pytest.approx(rank0["lrs"], rel=1e-6)
    for t in TIMERS:
        assert [s for s, _ in scalars[f"Train/Samples/elapsed_time_ms_{t}"]] == steps
        assert all(v > 0 for _, v in scalars[f"Train/Samples/elapsed_time_ms_{t}"])
    fwd = dict(scalars["Train/Samples/elapsed_time_ms_backward"])
    inner = dict(scalars["Train/Samples/elapsed_time_ms_backward_inner"])
    assert all(inner[s] <= fwd[s] for s in steps)  # the inner phase is part of backward
    for r in range(WORLD):  # each rank's own figures, gathered to rank 0
        rss = [v for _, v in scalars[f"Hardware/rank{r}/rss_MB"]]
        assert all(50 < v <= results[r]["peak_rss_MB"] + 1 for v in rss), (r, rss)


def test_csv_files(run):
    out, results = run
    job = out / "csv" / "job"
    rows = list(csv.reader(open(job / "Train_Samples_train_loss.csv")))
    assert rows[0] == ["step", "train_loss"]
    assert [int(s) for s, _ in rows[1:]] == results[0]["samples"]
    assert [float(v) for _, v in rows[1:]] == pytest.approx(results[0]["losses"], rel=1e-6)
    assert list(csv.reader(open(job / "Train_Samples_lr.csv")))[0] == ["step", "lr"]
    assert (job / "Train_Samples_elapsed_time_ms_backward_allreduce.csv").exists()
    assert list(csv.reader(open(job / "Hardware_rank1_rss_MB.csv")))[0] == ["step", "rss_MB"]


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'zerotrain[mlflow]')")
def test_mlflow_run(run, monkeypatch):
    from mlflow.tracking import MlflowClient

    out, results = run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file://{out}/mlruns")
    experiment = client.get_experiment_by_name("zt")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "run1" and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "Train/Samples/train_loss")
    assert [m.step for m in history] == results[0]["samples"]
    assert [m.value for m in history] == pytest.approx(results[0]["losses"], rel=1e-6)
    params = found.data.params
    assert params["optimizer.type"] == "AdamW" and params["world_size"] == "2"
    assert params["train_batch_size"] == str(MICRO * WORLD)
    assert "Hardware/rank1/cpu_percent" in found.data.metrics


def _config(**sections):
    from zerotrain.config import load_config

    return load_config({"train_batch_size": 1, **sections}, world_size=1)


def test_missing_extra_names_what_to_install(monkeypatch, tmp_path):
    import importlib.util

    from zerotrain.monitor import MonitorMaster

    real = importlib.util.find_spec
    absent = ("mlflow", "wandb", "comet_ml")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    for section, package, extra in (
        ("mlflow", "mlflow", "mlflow"),
        ("wandb", "wandb", "wandb"),
        ("comet", "comet_ml", "comet"),
    ):
        with pytest.raises(
            ImportError,
            match=rf'"{section}.enabled" needs the {package} package.*'
            rf'pip install "zerotrain\[{extra}\]"',
        ):
            MonitorMaster(_config(**{section: {"enabled": True}}), rank=0, world_size=1)
    assert not MonitorMaster(_config(), rank=0, world_size=1).enabled


def test_writers_are_closed_when_dropped_or_at_exit(tmp_path, monkeypatch):
    """A script that never calls destroy(): the master's finalizer closes the writers when it is
    garbage collected, and runs at interpreter exit otherwise."""
    import gc

    from zerotrain.monitor import MonitorMaster

    sections = {"tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}}
    if HAS_MLFLOW:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")  # URI from the environment
        sections["mlflow"] = {"enabled": True, "experiment_name": "exit"}
    master = MonitorMaster(_config(**sections), rank=0, world_size=1)
    assert master._finalizer.atexit and master._finalizer.alive
    writer = master.tb_monitor.summary_writer
    run_id = master.mlflow_monitor.run_id if HAS_MLFLOW else None
    master.write_events([("Train/Samples/lr", 0.5, 2), ("Train/Samples/lr", 0.25, 4)])
    del master
    gc.collect()
    assert writer.all_writers is None  # SummaryWriter.close() ran
    assert _scalars(tmp_path / "tb")["Train/Samples/lr"] == [(2, 0.5), (4, 0.25)]
    if HAS_MLFLOW:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
        assert client.get_run(run_id).info.status == "FINISHED"  # the run was ended
        assert [m.step for m in client.get_metric_history(run_id, "Train/Samples/lr")] == [2, 4]


def test_csv_appends_without_repeating_the_header(tmp_path):
    from zerotrain.monitor.csv_monitor import CSVMonitor

    section = _config(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"}).csv_monitor
    for start in (0, 2):
        monitor = CSVMonitor(section)
        monitor.write_events(
            [("Train/Samples/train_loss", 1.5 + start, start), ("Train/Samples/train_loss", 2.5 + start, start + 1)]
        )
        monitor.close()
    assert (tmp_path / "j" / "Train_Samples_train_loss.csv").read_text().splitlines() == [
        "step,train_loss",
        "0,1.5",
        "1,2.5",
        "2,3.5",
        "3,4.5",
    ]
