"""``deepspeed.runtime.dataloader.RepeatingLoader`` (also ``deepspeed.utils.RepeatingLoader``),
implemented in ``zerotrain.engine.data``."""

from zerotrain.engine.data import RepeatingLoader

__all__ = ["RepeatingLoader"]
