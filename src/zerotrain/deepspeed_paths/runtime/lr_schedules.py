"""``deepspeed.runtime.lr_schedules``: DeepSpeed's LR schedules (implemented in ``zerotrain.optim``)."""

from zerotrain.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
