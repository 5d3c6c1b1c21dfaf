"""``deepspeed.moe.layer``: the MoE layer (implemented in ``zerotrain.experts.layer``)."""

from zerotrain.experts.layer import MoE

__all__ = ["MoE"]
