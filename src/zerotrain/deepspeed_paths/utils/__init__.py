"""``deepspeed.utils`` names scripts import: ``logger``, ``log_dist``, ``RepeatingLoader``, the
stage-3 leaf-module functions (``set_z3_leaf_modules`` and friends, zerotrain.zero.leaves) and
``recursive_getattr`` / ``recursive_setattr``. The submodules ``timer``, ``zero_to_fp32``, ``groups``
and ``logging`` are
attributes, as after ``import deepspeed``; they and the leaf functions load on first access.
Everything here is a re-export (``log_dist``: zerotrain.log)."""

from __future__ import annotations

from zerotrain._lazy import lazy_attributes
from zerotrain.log import log_dist, logger

_LEAF_FUNCTIONS = (
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "get_z3_leaf_modules",
    "z3_leaf_module",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
)
__all__ = [
    "logger",
    "log_dist",
    "RepeatingLoader",
    "ThroughputTimer",
    "recursive_getattr",
    "recursive_setattr",
    *_LEAF_FUNCTIONS,
]
SUBMODULES = ("timer", "zero_to_fp32", "groups", "logging")

__getattr__, __dir__ = lazy_attributes(
    __name__,
    SUBMODULES,
    names={
        "ThroughputTimer": "zerotrain.engine.timers",
        "RepeatingLoader": "zerotrain.engine.data",
        "recursive_getattr": "zerotrain.module_paths",
        "recursive_setattr": "zerotrain.module_paths",
        **{name: "zerotrain.zero.leaves" for name in _LEAF_FUNCTIONS},
    },
)
