"""init_distributed: every DeepSpeed argument works or raises (deepspeed.comm.init_distributed)."""

from __future__ import annotations

import datetime
import logging
import os

import pytest

from zerotrain.comm import distributed
from zerotrain.testing import run_on_ranks

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _recording_init(calls):
    """Wrap torch's init_process_group to record the arguments zerotrain passes."""
    import torch.distributed as dist

    real = dist.init_process_group

    def init(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    dist.init_process_group = init
    return real


def _two_ranks(mpi_port: int, env_port: int):
    import torch
    import torch.distributed as dist

    from zerotrain.comm import logger as comms_logging
    from zerotrain.comm.distributed import init_distributed

    rank = int(os.environ["RANK"])
    out = {}
    logs = _Recorder()
    logging.getLogger("zerotrain").addHandler(logs)
    calls: list[dict] = []
    _recording_init(calls)

    # 1. An mpirun-style start: no RANK/MASTER_* at all, only Open MPI's variables.
    for name in LAUNCHER_VARS:
        os.environ.pop(name)
    os.environ.update(
        OMPI_COMM_WORLD_RANK=str(rank),
        OMPI_COMM_WORLD_SIZE="2",
        OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
    )
    init_distributed(
        distributed_port=mpi_port,
        timeout=datetime.timedelta(seconds=77),
        config={"comms_logger": {"enabled": "true", "prof_all": False, "prof_ops": ["all_reduce"]}},
    )
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["mpi"] = (
        dist.get_rank(),
        dist.get_world_size(),
        t.item(),
        os.environ["MASTER_PORT"],
        os.environ["RANK"],
        os.environ["LOCAL_RANK"],
        calls[-1]["timeout"].total_seconds(),
    )
    out["comms_logger"] = (comms_logging.comms_logger.enabled, comms_logging.comms_logger.prof_ops)
    comms_logging.comms_logger.configure(enabled=False)
    init_distributed(dist_init_required=False)  # a group exists: nothing to do, no error
    dist.destroy_process_group()
    for name in (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ):
        os.environ.pop(name)

    # 2. A launcher that sets RANK/WORLD_SIZE but no MASTER_PORT: distributed_port is the rendezvous.
    os.environ.pop("MASTER_PORT")
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    init_distributed(distributed_port=env_port, verbose=False)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["env"] = (dist.get_world_size(), t.item(), os.environ["MASTER_PORT"], calls[-1]["init_method"])
    out["logs"] = logs.messages
    return out


def test_mpi_discovery_port_timeout_config_and_verbose_on_two_ranks():
    mpi_port, env_port = distributed.free_port(), distributed.free_port()
    results = run_on_ranks(_two_ranks, world_size=2, args=(mpi_port, env_port))
    for rank, out in enumerate(results):
        assert out["mpi"] == (rank, 2, 3.0, str(mpi_port), str(rank), str(rank), 77.0)
        assert out["comms_logger"] == (True, ["all_reduce"])
        assert out["env"] == (2, 3.0, str(env_port), "env://")
    # verbose (the default) logs on rank 0 only; verbose=False logs nothing.
    assert results[1]["logs"] == []
    assert results[0]["logs"] == [
        "discovered MPI environment (OMPI): world size 2",
        f"initialized gloo process group: world size 2, rendezvous 127.0.0.1:{mpi_port}",
    ]


def _one_rank(tcp_port: int):
    import torch.distributed as dist

    from zerotrain.comm.distributed import DEFAULT_PORT, init_distributed

    logs = _Recorder()
    logging.getLogger("zerotrain").addHandler(logs)
    calls: list[dict] = []
    _recording_init(calls)
    for name in LAUNCHER_VARS:
        os.environ.pop(name)
    out = {}
    # No launcher at all: a world of one on a free port (never the shared default 29500).
    init_distributed(verbose=False)
    out["alone"] = (dist.get_world_size(), os.environ["MASTER_PORT"] != str(DEFAULT_PORT), calls[-1]["timeout"])
    dist.destroy_process_group()
    # rank/world_size/init_method, as a tcp:// rendezvous needs them; and the backend by name.
    init_distributed(dist_backend="gloo", init_method=f"tcp://127.0.0.1:{tcp_port}", rank=0, world_size=1)
    out["tcp"] = (dist.get_backend(), calls[-1]["init_method"], calls[-1]["rank"], calls[-1]["world_size"])
    dist.destroy_process_group()
    out["logs"] = logs.messages
    return out


def test_rank_world_size_init_method_backend_on_one_rank():
    port = distributed.free_port()
    (out,) = run_on_ranks(
        _one_rank, world_size=1, args=(port,), env={"ZEROTRAIN_COMM_TIMEOUT": "", "DEEPSPEED_TIMEOUT": "3"}
    )
    assert out["alone"] == (1, True, datetime.timedelta(minutes=3))
    assert out["tcp"] == ("gloo", f"tcp://127.0.0.1:{port}", 0, 1)
    assert out["logs"] == [f"initialized gloo process group: world size 1, rendezvous tcp://127.0.0.1:{port}"]


# -- without a process group --------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    # discover_mpi_environment writes os.environ itself: restore all of it afterwards.
    saved = dict(os.environ)
    for name in LAUNCHER_VARS + ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    monkeypatch.undo()
    os.environ.clear()
    os.environ.update(saved)


def test_dist_init_required_false_without_a_group_raises(clean_env):
    with pytest.raises(RuntimeError, match="dist_init_required=False but no process group exists"):
        distributed.init_distributed(dist_init_required=False)


def test_bad_timeout_and_rank_raise_before_any_group_is_made(clean_env):
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta, got 30"):
        distributed.init_distributed(timeout=30)
    with pytest.raises(ValueError, match="rank 2 is not in range for world_size 2"):
        distributed.init_distributed(rank=2, world_size=2)


@pytest.mark.parametrize(
    "variables, expected",
    [
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "3",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            },
            ("3", "4", "3", "127.0.0.1"),
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            ("1", "2", "1", "127.0.0.1"),
        ),
        (
            {
                "MV2_COMM_WORLD_RANK": "5",
                "MV2_COMM_WORLD_SIZE": "8",
                "MV2_COMM_WORLD_LOCAL_RANK": "1",
                "MV2_COMM_WORLD_LOCAL_SIZE": "4",
                "MASTER_ADDR": "node0",
            },
            ("5", "8", "1", "node0"),
        ),
    ],
)
def test_mpi_discovery_exports_the_launcher_variables(clean_env, variables, expected):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    assert distributed.discover_mpi_environment()
    assert tuple(os.environ[n] for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")) == expected


def test_mpi_discovery_across_nodes_needs_master_addr(clean_env):
    for name, value in {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "16",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
    }.items():
        clean_env.setenv(name, value)
    with pytest.raises(RuntimeError, match="set MASTER_ADDR to rank 0's host"):
        distributed.discover_mpi_environment()
    assert "RANK" not in os.environ


def test_no_mpi_launcher_changes_nothing(clean_env):
    assert distributed.discover_mpi_environment() is False
    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ


# -- teardown -------------------------------------------------------------------------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _teardown_while_the_engine_lives(folder: str):
    import torch

    import zerotrain
    from zerotrain.comm.distributed import destroy_distributed
    from zerotrain.models import GPT, GPTConfig

    before = _threads()
    model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.randint(0, 64, (2, 16))
    engine.backward(engine(ids, labels=ids).loss)
    engine.step()
    torch.optim.SGD(model.parameters(), lr=0.1)  # user code building torch optimizers after init
    engine.save_checkpoint(folder, tag="t")  # a save creates the checkpoint agreement's group
    zerotrain.utils.groups._get_data_parallel_group()  # the process-wide current topology
    during = _threads()
    destroy_distributed()  # what the atexit hook runs; the engine is still referenced here
    return before, during, _threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_teardown_joins_the_gloo_worker_threads_before_interpreter_exit(tmp_path):
    """A group that outlives destroy_process_group() keeps gloo's worker threads until the
    interpreter finalizes; one still finishing a collective then needs the GIL and the rank
    aborts ("terminate called without an active exception"). torch.distributed.nn.functional,
    which torch.optim imports lazily, pinned the group in its default arguments."""
    for before, during, after in run_on_ranks(_teardown_while_the_engine_lives, world_size=2, args=(str(tmp_path),)):
        assert during > before  # gloo's transport loop and worker threads
        assert after == before
