"""wandb and Comet monitors, for real in their offline modes: what a 2-rank run logs, read back
from the offline run (wandb's ``run-*.wandb`` records, Comet's offline zip)."""

from __future__ import annotations

import glob
import importlib.util
import json
import struct
import zipfile

import pytest

from tests.engine.workloads import adamw_config, make_model, recorded_steps
from zerotrain.testing import run_on_ranks

STEPS, MICRO, WORLD = 4, 2, 2
COMET_INTERVAL = 8  # samples: with 4 a step, Comet logs at 4 and 12 only
HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_COMET = importlib.util.find_spec("comet_ml") is not None
pytestmark = pytest.mark.skipif(
    not (HAS_WANDB and HAS_COMET), reason='needs wandb and comet_ml (pip install "zerotrain[wandb,comet]")'
)


def _train(out: str):
    import zerotrain

    cfg = adamw_config(
        MICRO,
        wandb={"enabled": True, "project": "zt-proj", "group": "zt-group", "team": "zt-team"},
        comet={
            "enabled": True,
            "online": False,
            "project": "zt-proj",
            "workspace": "zt-ws",
            "experiment_name": "zt-exp",
            "samples_log_interval": COMET_INTERVAL,
        },
    )
    engine, _, _, _ = zerotrain.initialize(model=make_model(), config=cfg)
    losses, lrs, samples = recorded_steps(engine, STEPS, MICRO)
    writers = [type(m).__name__ for m in engine.monitor.monitors]
    engine.destroy()  # finishes the wandb run, ends (and zips) the Comet experiment
    return {"losses": losses, "lrs": lrs, "samples": samples, "writers": writers}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("wandb_comet")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(out),
        "WANDB_SILENT": "true",
        "COMET_OFFLINE_DIRECTORY": str(out / "comet"),
        "COMET_DISABLE_AUTO_LOGGING": "1",
    }
    return out, run_on_ranks(_train, WORLD, args=(str(out),), env=env, timeout=300)


def _wandb_records(path: str) -> list:
    """The protobuf records of an offline run file: W&B's 7-byte header, then LevelDB-log blocks
    of 32 KiB whose records (7-byte header: crc, length, type) may be split across blocks."""
    from wandb.proto import wandb_internal_pb2

    raw, block = open(path, "rb").read(), 32768
    assert raw[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_only_the_first_rank_writes(run):
    out, results = run
    assert results[0]["writers"] == ["WandbMonitor", "CometMonitor"] and results[1]["writers"] == []
    assert len(glob.glob(f"{out}/wandb/offline-run-*/run-*.wandb")) == 1
    assert len(glob.glob(f"{out}/comet/*.zip")) == 1


def test_wandb_offline_run(run):
    out, results = run
    (path,) = glob.glob(f"{out}/wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(path)
    (init,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (init.project, init.run_group, init.entity) == ("zt-proj", "zt-group", "zt-team")
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    rank0 = results[0]
    assert [h["_step"] for h in history] == rank0["samples"] == [4, 8, 12, 16]
    assert [h["Train/Samples/train_loss"] for h in history] == pytest.approx(rank0["losses"], rel=1e-6)
    assert [h["Train/Samples/lr"] for h in history] == pytest.approx(rank0["lrs"], rel=1e-6)
    assert all(f"Hardware/rank{r}/rss_MB" in h for h in history for r in range(WORLD))
    config = {
        item.key or "/".join(item.nested_key): json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["optimizer.type"] == "AdamW" and config["world_size"] == WORLD
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished by destroy()


def test_comet_offline_experiment(run):
    out, results = run
    (path,) = glob.glob(f"{out}/comet/*.zip")
    with zipfile.ZipFile(path) as archive:
        experiment = json.loads(archive.read("experiment.json"))
        messages = [json.loads(line) for line in archive.read("messages.json").decode().splitlines() if line]
    assert (experiment["project_name"], experiment["workspace"]) == ("zt-proj", "zt-ws")
    metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
    loss = [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == "Train/Samples/train_loss"]
    rank0 = results[0]
    logged = [i for i, s in enumerate(rank0["samples"]) if s in (4, 12)]  # every 8 samples
    assert [s for s, _ in loss] == [4, 12]
    assert [v for _, v in loss] == pytest.approx([rank0["losses"][i] for i in logged], rel=1e-6)
    lr = [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == "Train/Samples/lr"]
    assert lr == [(4, pytest.approx(rank0["lrs"][0], rel=1e-6)), (12, pytest.approx(rank0["lrs"][2], rel=1e-6))]
    others = {m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"}
    assert others["Name"] == "zt-exp" and others["offline_experiment"] is True
    params = {
        m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"]
        for m in messages
        if m["type"] == "parameter_msg"
    }
    assert params["optimizer.type"] == "AdamW" and params["world_size"] == WORLD
