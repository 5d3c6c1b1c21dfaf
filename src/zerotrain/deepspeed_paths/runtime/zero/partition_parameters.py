"""``deepspeed.runtime.zero.partition_parameters``: ``ZeroParamStatus`` (zerotrain.zero.param_status),
and ``Init`` / ``GatheredParameters`` (zerotrain.zero's) and ``get_accelerator`` (which DeepSpeed's
module imports and transformers reads from it) under this path too; those load on first access."""

from zerotrain._lazy import lazy_attributes
from zerotrain.zero.param_status import ZeroParamStatus

__all__ = ["ZeroParamStatus", "Init", "GatheredParameters", "get_accelerator"]  # noqa: F822 - loaded on first access

__getattr__, __dir__ = lazy_attributes(
    __name__,
    names={
        "Init": "zerotrain.zero",
        "GatheredParameters": "zerotrain.zero",
        "get_accelerator": "zerotrain.accelerator",
    },
)
