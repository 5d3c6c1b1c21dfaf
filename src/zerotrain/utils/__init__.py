"""``deepspeed.utils`` names scripts import: ``logger``, ``log_dist``, ``RepeatingLoader``, and the
stage-3 leaf-module functions (``set_z3_leaf_modules`` and friends, zerotrain.zero.leaves)."""

from __future__ import annotations

import logging

from zerotrain.log import logger
from zerotrain.runtime.dataloader import RepeatingLoader

_LEAF_FUNCTIONS = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
                   "z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")
__all__ = ["logger", "log_dist", "RepeatingLoader", "ThroughputTimer", *_LEAF_FUNCTIONS]


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


def __getattr__(name: str):
    if name == "ThroughputTimer":
        from zerotrain.utils.timer import ThroughputTimer

        return ThroughputTimer
    if name in _LEAF_FUNCTIONS:
        from zerotrain.zero import leaves

        return getattr(leaves, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
