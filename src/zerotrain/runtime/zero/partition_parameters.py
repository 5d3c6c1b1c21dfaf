"""``deepspeed.runtime.zero.partition_parameters``: ``ZeroParamStatus`` (zerotrain.zero.param_status),
and ``Init`` / ``GatheredParameters`` (zerotrain.zero's) under this path too; those two load on
first access."""

from zerotrain._lazy import lazy_attributes
from zerotrain.zero.param_status import ZeroParamStatus

__all__ = ["ZeroParamStatus", "Init", "GatheredParameters"]

__getattr__, __dir__ = lazy_attributes(__name__, names={"Init": "zerotrain.zero",
                                                       "GatheredParameters": "zerotrain.zero"})
