"""DeepspeedTorchDistributor on a real local Spark: local[2] (localMode=True: the driver runs
both ranks) and local-cluster[2,1,1024] (localMode=False: two executors as two nodes)."""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import time

import pytest

pytest.importorskip("pyspark", reason="needs pyspark: pip install 'zerotrain[spark]' (CI installs it)")
if not shutil.which("java"):
    pytest.skip("needs Java for Spark (apt-get install default-jre-headless)", allow_module_level=True)

from pyspark import cloudpickle  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from zerotrain.integrations.spark import DeepspeedTorchDistributor  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 2},
}
EXAMPLE_ARGS = [
    "--steps",
    "3",
    "--seq_len",
    "32",
    "--n_layer",
    "1",
    "--n_embd",
    "32",
    "--n_head",
    "2",
    "--text_bytes",
    "20000",
    "--save_dir",
    "",
    "--sample_bytes",
    "4",
]


# The training functions below travel by value (the ranks cannot import this test module).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def spark_session(master: str) -> SparkSession:
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks' gloo traffic stays on loopback
    os.environ["PYSPARK_PYTHON"] = sys.executable  # executors run the driver's interpreter
    return (
        SparkSession.builder.master(master)
        .appName("zerotrain-test")
        .config("spark.ui.enabled", "false")
        .config("spark.task.maxFailures", "1")
        .config("spark.executorEnv.OMP_NUM_THREADS", "1")
        .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "lo")
        .getOrCreate()
    )


def config_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "zerotrain_ds_config_*")))


def train_tiny_gpt(steps: int):
    """Runs on every rank: a few ZeRO-2 steps on the config the distributor passes."""
    import os

    import torch

    import zerotrain
    from zerotrain.integrations.spark import CONFIG_ENV
    from zerotrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    engine, _, _, _ = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=os.environ[CONFIG_ENV]
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(engine.global_rank))
    losses = []
    for _ in range(steps):
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "rank": engine.global_rank,
        "world": engine.dp_world_size,
        "stage": engine.zero_optimization_stage(),
        "losses": losses,
    }


def fail_on_rank_1(marker_dir):
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("bad batch on rank 1")
    # Longer than the test's own timeout: rank 0 must be stopped, not waited for (the marker
    # it would write says so, not a clock).
    time.sleep(600)
    open(os.path.join(marker_dir, "rank0_finished"), "w").close()


@pytest.fixture(scope="module")
def local_spark():
    spark = spark_session("local[2]")
    yield spark
    spark.stop()


def test_local_mode_function_returns_rank0_value_and_cleans_up(local_spark):
    before = config_files()
    distributor = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False, deepspeedConfig=CONFIG)
    result = distributor.run(train_tiny_gpt, 3)
    assert (result["rank"], result["world"], result["stage"]) == (0, 2, 2)
    assert result["losses"][-1] < result["losses"][0]
    assert config_files() == before  # the temporary config file is gone


def test_local_mode_failing_function_raises_with_the_rank(local_spark, tmp_path):
    distributor = DeepspeedTorchDistributor(numGpus=2, localMode=True, useGpu=False, deepspeedConfig=CONFIG)
    with pytest.raises(RuntimeError) as err:
        distributor.run(fail_on_rank_1, str(tmp_path))
    assert not (tmp_path / "rank0_finished").exists()  # rank 0 was stopped, not waited for
    assert "rank 1" in str(err.value) and "ValueError: bad batch on rank 1" in str(err.value)
    with pytest.raises(ValueError, match="keyword"):
        distributor.run("train.py", steps=3)
    with pytest.raises(ValueError, match="numGpus must be a positive int"):
        DeepspeedTorchDistributor(numGpus=0)


WRAPPER = """
import os, runpy, sys
# The example's output, per rank, where the test can read it (executors' stdout is not the test's).
sys.stdout = open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".out"), "w", buffering=1)
sys.argv = [{example!r}, *sys.argv[1:]]
runpy.run_path({example!r}, run_name="__main__")
"""


def test_local_cluster_two_nodes_train_the_example_and_slot_shortage_fails_fast(local_spark, tmp_path):
    local_spark.stop()
    script = tmp_path / "run_example.py"
    script.write_text(WRAPPER.format(out=str(tmp_path), example=os.path.abspath(EXAMPLE)))
    spark = spark_session("local-cluster[2,1,1024]")
    try:
        before = config_files()
        distributor = DeepspeedTorchDistributor(
            numGpus=1, nnodes=2, localMode=False, useGpu=False, deepspeedConfig=CONFIG
        )
        assert distributor.run(str(script), *EXAMPLE_ARGS) is None
        assert config_files() == before
        tracker = spark.sparkContext.statusTracker()
        jobs = sorted(tracker.getJobIdsForGroup())
        assert jobs  # the run above shows up: the check below can see a submitted job
        with pytest.raises(RuntimeError, match=r"3 barrier task\(s\) needed .* runs 2 task\(s\) at once"):
            DeepspeedTorchDistributor(numGpus=1, nnodes=3, localMode=False, useGpu=False).run(EXAMPLE)
        # It fails before submitting anything (Spark would wait for slots that never come).
        assert sorted(tracker.getJobIdsForGroup()) == jobs
        out = (tmp_path / "rank0.out").read_text()
        assert "ranks: 2 | ZeRO stage 2" in out and "done: 3 steps" in out, out
        assert (tmp_path / "rank1.out").exists()
    finally:
        spark.stop()
