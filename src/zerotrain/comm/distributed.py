"""Process-group set-up and tear-down.

zerotrain creates the default process group when the user has not, from the usual launcher
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or as a world of one when
there is no such environment. A group zerotrain created is destroyed at interpreter exit, so a
script that never calls ``destroy_process_group()`` still exits cleanly on every rank.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket

import torch.distributed as dist

from zerotrain.accelerator import get_accelerator

logger = logging.getLogger("zerotrain")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_created_here = False


def default_timeout() -> datetime.timedelta:
    """Collective timeout: ``ZEROTRAIN_COMM_TIMEOUT`` seconds if set, else 30 minutes (as DeepSpeed)."""
    seconds = os.environ.get("ZEROTRAIN_COMM_TIMEOUT")
    if seconds:
        return datetime.timedelta(seconds=float(seconds))
    return DEFAULT_TIMEOUT


def free_port() -> int:
    """A local port that was free a moment ago (chosen by the OS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group if there is none (DeepSpeed's signature).

    The backend defaults to the accelerator's (gloo on CPU, NCCL on CUDA). With no launcher
    environment at all, a single-process group is created on a free local port.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        return
    if rank < 0:
        rank = int(os.environ.get("RANK", "0"))
    if world_size < 0:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator = get_accelerator()
    backend = dist_backend or accelerator.communication_backend
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise RuntimeError(
                    f"WORLD_SIZE={world_size} but MASTER_PORT is not set: start the script with "
                    "`zerotrain launch` (or torchrun), or set MASTER_ADDR and MASTER_PORT"
                )
            os.environ["MASTER_PORT"] = str(free_port())
        init_method = "env://"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accelerator.set_device(local_rank)
    kwargs = {}
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
        logger.info("initialized %s process group: world size %d", backend, world_size)


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
