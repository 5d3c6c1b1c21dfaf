"""``deepspeed.moe.experts``: the local experts (implemented in ``zerotrain.experts.layer``)."""

from zerotrain.experts.layer import Experts

__all__ = ["Experts"]
