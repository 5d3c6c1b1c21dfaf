"""Suite-wide fixtures.

Ranks run in spawned processes (zerotrain.testing.run_on_ranks). A test that makes a process
group in the pytest process itself takes ``in_process_rank``, which destroys it afterwards: the
suite runs two tests at a time, each file's tests in one worker, so a group left behind reaches
whatever tests that worker runs next ("without a process group" checks in
tests/comm/test_distributed.py then passed or failed by file order). The autouse guard fails the
test that leaves one."""

from __future__ import annotations

import pytest
import torch.distributed as dist


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
