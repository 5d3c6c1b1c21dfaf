"""Suite-wide fixtures.

Ranks run in spawned processes (zerotrain.testing.run_on_ranks). A test that makes a process
group in the pytest process itself takes ``in_process_rank``, which destroys it afterwards: the
suite runs two tests at a time, each file's tests in one worker, so a group left behind reaches
whatever tests that worker runs next ("without a process group" checks in
tests/comm/test_distributed.py then passed or failed by file order). The autouse guard fails the
test that leaves one.

The slowest files start first (``pytest_collection_modifyitems`` below, with pyproject's
``--no-loadscope-reorder``): pytest-xdist otherwise sends the files with the most tests first,
which left the few-test, minutes-long launcher files (TRL, the switch's install, Ray, ...) to the
end, one worker running them while the other sat idle."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

# transformers and TRL import mlflow at start-up when it is installed (~2 CPU-s in each process
# that imports the Trainer: ranks, launchers). No test reports to MLflow through transformers
# (report_to=[]); zerotrain's own MLflow monitor imports mlflow itself and is unaffected.
os.environ.setdefault("DISABLE_MLFLOW_INTEGRATION", "TRUE")

# Files by their cost on the 2-core CI machine (seconds, `--durations=0` summed per file, CI run
# of the whole suite), longest first; the rest keep collection order after them. A file missing
# here only starts later; a renamed one is ignored.
SLOWEST_FILES = [
    "tests/hf/test_trl.py",
    "tests/integrations/test_ray.py",
    "tests/hf/test_accelerate.py",
    "tests/hf/test_switch.py",
    "tests/launcher/test_elastic_resume.py",
    "tests/integrations/test_spark.py",
    "tests/launcher/test_multinode_run.py",
    "tests/checkpoint/test_checkpoints.py",
    "tests/checkpoint/test_crash_points.py",
    "tests/hf/test_trainer.py",
    "tests/engine/test_combinations.py",
    "tests/pipeline/test_bench_vs_deepspeed.py",
    "tests/pipeline/test_timeline_bubble.py",
    "tests/checkpoint/test_hf_expert_checkpoint.py",
    "tests/offload/test_offload.py",
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
        pytest.fail(f"{request.node.nodeid} left a default process group in the pytest process; "
                    "take the in_process_rank fixture (tests/conftest.py) or destroy it")


@pytest.fixture
def in_process_rank(monkeypatch):
    """The pytest process as rank 0 of a world of one, on a port the OS just gave out (not one
    derived from the pid: two workers' ranges overlap); its process group is destroyed after."""
    from zerotrain.comm.distributed import free_port

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    yield
    if _group_exists():
        dist.destroy_process_group()
