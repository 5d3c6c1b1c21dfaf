"""DeepSpeed's ``deepspeed.runtime.zero.offload_config`` enums for ``engine.offload_states()``;
zerotrain's code lives in ``zerotrain.zero.offload_states``."""

from zerotrain.zero.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
