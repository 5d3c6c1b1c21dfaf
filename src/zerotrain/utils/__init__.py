"""``deepspeed.utils`` names scripts import: ``logger``, ``log_dist``, ``RepeatingLoader``, the
stage-3 leaf-module functions (``set_z3_leaf_modules`` and friends, zerotrain.zero.leaves) and
``recursive_getattr`` / ``recursive_setattr``. The submodules ``timer`` and ``zero_to_fp32`` are
attributes, as after ``import deepspeed``; they and the leaf functions load on first access."""

from __future__ import annotations

import logging

from zerotrain._lazy import lazy_attributes
from zerotrain.log import logger
from zerotrain.runtime.dataloader import RepeatingLoader

_LEAF_FUNCTIONS = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
                   "z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")
__all__ = ["logger", "log_dist", "RepeatingLoader", "ThroughputTimer", "recursive_getattr", "recursive_setattr",
           *_LEAF_FUNCTIONS]
SUBMODULES = ("timer", "zero_to_fp32")


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


__getattr__, __dir__ = lazy_attributes(
    __name__, SUBMODULES,
    names={"ThroughputTimer": "zerotrain.utils.timer",
           "recursive_getattr": "zerotrain.compression.helper", "recursive_setattr": "zerotrain.compression.helper",
           **{name: "zerotrain.zero.leaves" for name in _LEAF_FUNCTIONS}})
