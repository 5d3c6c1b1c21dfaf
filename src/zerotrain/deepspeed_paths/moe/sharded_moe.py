"""``deepspeed.moe.sharded_moe``: gates and the dispatching layer (implemented in
``zerotrain.experts.gating`` and ``zerotrain.experts.layer``)."""

from zerotrain.experts.gating import TopKGate, gumbel_rsample, multiplicative_jitter, top1gating, top2gating, topkgating
from zerotrain.experts.layer import MOELayer

__all__ = ["TopKGate", "MOELayer", "top1gating", "top2gating", "topkgating", "multiplicative_jitter", "gumbel_rsample"]
