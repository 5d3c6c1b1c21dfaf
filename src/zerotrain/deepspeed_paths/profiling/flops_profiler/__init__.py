"""DeepSpeed's ``deepspeed.profiling.flops_profiler``: ``FlopsProfiler``, ``get_model_profile``
and the number formatters, from ``zerotrain.monitor.flops``."""

from zerotrain._lazy import lazy_attributes
from zerotrain.monitor.flops import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "get_model_profile",
    "number_to_string",
    "flops_to_string",
    "macs_to_string",
    "params_to_string",
    "duration_to_string",
]

__getattr__, __dir__ = lazy_attributes(__name__, ("profiler",))
