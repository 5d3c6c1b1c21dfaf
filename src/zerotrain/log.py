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
