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


def log_rank0(message: str, *args) -> None:
    """Log ``message`` on global rank 0 only."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message, *args)


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log ``[Rank r] message`` on the ranks listed in ``ranks`` (``[-1]``: every rank).

    As in DeepSpeed, before ``torch.distributed`` is initialized every call logs (as rank -1),
    and after it a call without ``ranks`` logs nothing.
    """
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    ranks = list(ranks or [])
    if not initialized or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, "[Rank %d] %s", rank, message)
