"""``deepspeed.ops.adam.fused_adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` under DeepSpeed's path
(implemented in ``zerotrain.optim.fused_adam``)."""

from zerotrain.optim.fused_adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
