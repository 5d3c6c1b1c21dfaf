"""Suite-wide fixtures.

Ranks run in spawned processes (zerotrain.testing.run_on_ranks). A test that makes a process
group in the pytest process itself takes ``in_process_rank``, which destroys it afterwards: the
suite runs two tests at a time, each file's tests in one worker, so a group left behind reaches
whatever tests that worker runs next ("without a process group" checks in
tests/comm/test_distributed.py then passed or failed by file order). The autouse guard fails the
test that leaves one.

The slowest files start first (``pytest_collection_modifyitems`` below, with pyproject's
``--no-loadscope-reorder``): pytest-xdist otherwise sends the files with the most tests first, so
few-test, minutes-long launcher files start late (the 2-test TRL file started in the run's last
minutes), and the run's end waits on whichever of them started last."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

# transformers and TRL import mlflow at start-up when it is installed (~2 CPU-s in each process
# that imports the Trainer: ranks, launchers). No test reports to MLflow through transformers
# (report_to=[]); zerotrain's own MLflow monitor imports mlflow itself and is unaffected.
os.environ.setdefault("DISABLE_MLFLOW_INTEGRATION", "TRUE")

# Files by their cost, longest first: seconds summed over each file's `--durations=0` lines in a
# whole-suite run on the 2-core machine under ~3x CI's load (2937 s of pytest; Ray and Spark,
# not installed there, placed by CI's times scaled alike). The rest keep collection order after
# them. A file missing here only starts later; a renamed one is ignored.
SLOWEST_FILES = [
    "tests/launcher/test_launcher_run.py",  # 444
    "tests/launcher/test_multinode_run.py",  # 407
    "tests/hf/test_switch.py",  # 386
    "tests/hf/test_accelerate.py",  # 369
    "tests/integrations/test_ray.py",  # 360
    "tests/hf/test_trl.py",  # 300
    "tests/checkpoint/test_crash_points.py",  # 232
    "tests/checkpoint/test_hf_expert_checkpoint.py",  # 227
    "tests/integrations/test_spark.py",  # 225
    "tests/engine/test_combinations.py",  # 219
    "tests/hf/test_trainer.py",  # 214
    "tests/pipeline/test_hf.py",  # 207
    "tests/offload/test_nvme_errors.py",  # 202
    "tests/launcher/test_orphans.py",  # 200
    "tests/zero/test_leaf_modules.py",  # 166
    "tests/hf/test_gradient_checkpointing.py",  # 131
    "tests/checkpoint/test_split_groups.py",  # 126
    "tests/estimate/test_tune.py",  # 116
    "tests/pipeline/test_engine_interleaved.py",  # 89
    "tests/checkpoint/test_expert_checkpoint.py",  # 87
    "tests/launcher/test_elastic_resume.py",  # 83
    "tests/pipeline/test_bench_vs_deepspeed.py",  # 82
    "tests/monitor/test_monitors.py",  # 82
    "tests/hf/test_models.py",  # 74
    "tests/hf/test_lora.py",  # 61
    "tests/pipeline/test_engine_vshape.py",  # 55
    "tests/launcher/test_hostfile_cli.py",  # 54
    "tests/experts/test_hf_moe.py",  # 46
    "tests/test_rank_decisions.py",  # 45
    "tests/checkpoint/test_checkpoints.py",  # 44
    "tests/engine/test_offload_states.py",  # 44
    "tests/zero/test_stage_interface.py",  # 44
]


def pytest_collection_modifyitems(config, items):
    rank = {path: index for index, path in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: a file's order kept


def _group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


@pytest.fixture(autouse=True)
def _no_leaked_process_group(request):
    before = _group_exists()
    yield
    if not before and _group_exists():
        dist.destroy_process_group()
        pytest.fail(
            f"{request.node.nodeid} left a default process group in the pytest process; "
            "take the in_process_rank fixture (tests/conftest.py) or destroy it"
        )


@pytest.fixture
def in_process_rank(monkeypatch):
    """The pytest process as rank 0 of a world of one, on a port the OS just gave out (not one
    derived from the pid: two workers' ranges overlap); its process group is destroyed after."""
    from zerotrain.comm.distributed import free_port

    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    yield
    if _group_exists():
        dist.destroy_process_group()
