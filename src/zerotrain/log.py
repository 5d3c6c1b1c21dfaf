"""zerotrain's logger: messages from rank 0 by default, each line tagged ``[zerotrain]``."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("zerotrain")


def _configure() -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[zerotrain] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_configure()


def _process_rank() -> int:
    # The process's global rank (-1 before torch.distributed): the topology's answer, asked
    # without building one (zerotrain.topology.process_rank says why).
    from zerotrain.topology.process_rank import process_rank

    return process_rank()


def log_rank0(message: str, *args, topology=None) -> None:
    """Log ``message`` once: on global rank 0 for a process-wide message (the default), on the
    first rank of ``topology``'s data group for one engine's message (pass ``engine.topology``:
    two engines on disjoint groups each log their own)."""
    if topology is not None:
        first = topology.is_first("data")  # this engine's first data-parallel rank
    else:
        first = _process_rank() in (0, -1)  # the job's rank 0 (every process before init)
    if first:
        logger.info(message, *args)


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log ``[Rank r] message`` on the ranks listed in ``ranks`` (``[-1]``: every rank).

    ``r`` and ``ranks`` are global ranks (the process's, as in DeepSpeed). Before
    ``torch.distributed`` is initialized every call logs (as rank -1), and after it a call
    without ``ranks`` logs nothing.
    """
    rank = _process_rank()
    ranks = list(ranks or [])
    if rank == -1 or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, "[Rank %d] %s", rank, message)
