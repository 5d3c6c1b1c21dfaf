"""DeepSpeed's ``deepspeed.profiling`` path: ``profiling.flops_profiler`` re-exports the FLOPs
profiler of ``zerotrain.monitor.flops`` (loaded on first access)."""

from zerotrain._lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(__name__, ("flops_profiler",))
