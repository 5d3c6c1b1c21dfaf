"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` with DeepSpeed's arguments, run on
torch's fastest Adam kernel for the parameters' device (implemented in ``zerotrain.optim.fused_adam``;
docs/compat.md has the measurement)."""

from zerotrain.ops.adam.fused_adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
