"""Process-group set-up and tear-down.

zerotrain creates the default process group when the user has not, from the usual launcher
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), from an MPI launcher's
environment (``mpirun``: Open MPI, MPICH/Intel MPI, MVAPICH2), or as a world of one when there is
no such environment. A group zerotrain created is destroyed at interpreter exit, so a script that
never calls ``destroy_process_group()`` still exits cleanly on every rank.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

if dist.is_available():
    # torch.distributed.nn.functional binds ``group.WORLD`` into its functions' default
    # arguments when first imported (torch.optim imports it lazily). Imported once a default
    # group exists, it pins that group past destroy_process_group(): gloo's worker threads then
    # outlive the interpreter and a rank aborts at exit ("terminate called without an active
    # exception"). Imported now, before any group exists, it binds None.
    import torch.distributed.nn.functional  # noqa: F401

from zerotrain.accelerator import get_accelerator
from zerotrain.log import logger

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
DEFAULT_PORT = 29500  # DeepSpeed's (and torch's) TORCH_DISTRIBUTED_DEFAULT_PORT
_created_here = False


@dataclass(frozen=True)
class _MPIVars:
    """The environment variable names one MPI implementation sets for each process."""

    rank: str
    size: str
    local_rank: str
    local_size: str


#: Tried in order; the first whose rank variable is set wins.
MPI_ENVIRONMENTS = (
    _MPIVars(
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"
    ),  # Open MPI
    _MPIVars("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH, Intel MPI
    _MPIVars(
        "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"
    ),  # MVAPICH2
)


def default_timeout() -> datetime.timedelta:
    """Collective timeout: ``ZEROTRAIN_COMM_TIMEOUT`` seconds, else ``DEEPSPEED_TIMEOUT`` minutes
    (DeepSpeed's variable), else 30 minutes (DeepSpeed's default is 10)."""
    seconds = os.environ.get("ZEROTRAIN_COMM_TIMEOUT")
    if seconds:
        return datetime.timedelta(seconds=float(seconds))
    minutes = os.environ.get("DEEPSPEED_TIMEOUT")
    if minutes:
        return datetime.timedelta(minutes=float(minutes))
    return DEFAULT_TIMEOUT


def free_port() -> int:
    """A local port that was free a moment ago (chosen by the OS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group if there is none (DeepSpeed's signature and meaning).

    - ``dist_backend``: default the accelerator's (gloo on CPU, NCCL on CUDA).
    - ``auto_mpi_discovery``: when ``RANK`` is not set, take rank, size and local rank from an
      MPI launcher's environment (Open MPI ``OMPI_COMM_WORLD_*``, MPICH/Intel ``PMI_*``, MVAPICH2
      ``MV2_COMM_WORLD_*``) and export them as ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, as DeepSpeed
      does (it asks mpi4py). Across nodes ``MASTER_ADDR`` must be set (rank 0's host).
    - ``distributed_port``: ``MASTER_PORT`` when the environment has none and there is more than
      one rank. A world of one uses a free port instead, so concurrent single-process runs never
      collide.
    - ``verbose``: log the discovery and the new group on rank 0.
    - ``timeout``: a ``datetime.timedelta`` for collectives (default: ``default_timeout()``).
    - ``init_method``: a torch rendezvous URL (``tcp://host:port``, ``file://...``); default
      ``env://``.
    - ``dist_init_required``: ``False`` asserts that a group already exists (RuntimeError if not);
      ``None``/``True`` create one when needed.
    - ``config``: a config (dict, JSON path or ``ZeroTrainConfig``) whose ``comms_logger`` section,
      if present, configures the comms logger.
    - ``rank``, ``world_size``: override the environment (needed with ``tcp://``/``file://``).

    Already initialized: nothing happens (the config's comms logger section still applies).
    """
    if config is not None:
        _configure_comms_logger(config)
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError(
            "dist_init_required=False but no process group exists: call "
            "torch.distributed.init_process_group(...) first, or leave dist_init_required "
            "as None so zerotrain creates the group"
        )
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r} ({type(timeout).__name__})")
    if auto_mpi_discovery and "RANK" not in os.environ and rank < 0:
        discover_mpi_environment(verbose=verbose)
    rank = rank if rank >= 0 else int(os.environ.get("RANK", "0"))
    world_size = world_size if world_size >= 0 else int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank} is not in range for world_size {world_size} "
            "(check RANK/WORLD_SIZE or the rank=/world_size= arguments)"
        )
    accelerator = get_accelerator()
    backend = dist_backend or accelerator.communication_backend
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(distributed_port if world_size > 1 else free_port())
        init_method = "env://"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accelerator.set_device(local_rank)
    kwargs: dict = {}
    if backend == "nccl":
        kwargs["device_id"] = accelerator.device(local_rank)
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        timeout=timeout or default_timeout(),
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    _register_teardown()
    if verbose and rank == 0:
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if init_method == "env://" else init_method
        logger.info("initialized %s process group: world size %d, rendezvous %s", backend, world_size, where)


def discover_mpi_environment(verbose: bool = False) -> bool:
    """Export RANK/WORLD_SIZE/LOCAL_RANK (and MASTER_ADDR on one node) from an MPI launcher's
    environment. Returns False, changing nothing, when no MPI launcher is found."""
    found = next((names for names in MPI_ENVIRONMENTS if names.rank in os.environ), None)
    if found is None:
        return False
    missing = [name for name in (found.rank, found.size) if name not in os.environ]
    if missing:
        raise RuntimeError(f"MPI launch detected ({found.rank} is set) but {missing} is not")
    rank, size = os.environ[found.rank], os.environ[found.size]
    local_rank = os.environ.get(found.local_rank, "0" if size == "1" else None)
    local_size = os.environ.get(found.local_size)
    if local_rank is None:
        raise RuntimeError(f"MPI launch detected but {found.local_rank} is not set; set LOCAL_RANK")
    if "MASTER_ADDR" not in os.environ:
        if local_size != size:
            raise RuntimeError(
                f"MPI launch across nodes ({found.size}={size}, {found.local_size}={local_size}): set "
                "MASTER_ADDR to rank 0's host name or address (DeepSpeed looks it up with mpi4py)"
            )
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.update(RANK=rank, WORLD_SIZE=size, LOCAL_RANK=local_rank)
    if verbose and rank == "0":
        logger.info("discovered MPI environment (%s): world size %s", found.rank.split("_")[0], size)
    return True


def _configure_comms_logger(config) -> None:
    # Only a config that has a comms_logger section changes the logger (DeepSpeed would reset it).
    from zerotrain.comm import logger as comms_logging
    from zerotrain.config import CommsLoggerConfig, ConfigError, read_config

    if hasattr(config, "comms_logger"):  # a validated ZeroTrainConfig
        if "comms_logger" in config.model_fields_set:
            comms_logging.configure(config.comms_logger)
        return
    section = read_config(config).get("comms_logger")
    if section is None:
        return
    try:
        comms_logging.configure(CommsLoggerConfig.model_validate(section))
    except ValueError as exc:  # pydantic's ValidationError
        raise ConfigError(f"init_distributed(config=...): comms_logger: {exc}") from None


def _register_teardown() -> None:
    global _created_here
    if not _created_here:
        _created_here = True
        atexit.register(destroy_distributed)


def destroy_distributed() -> None:
    """Destroy the default process group if it still exists (safe to call more than once)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
