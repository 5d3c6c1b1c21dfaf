"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` under DeepSpeed's module path (TRL imports it
from here for its type hints); it is zerotrain's engine, as ``zerotrain.DeepSpeedEngine`` is."""

from zerotrain.engine.engine import ZeroTrainEngine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
