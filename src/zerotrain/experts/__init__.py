"""Mixture of experts: DeepSpeed's MoE layer, gates and local experts, with expert parallelism over
the topology's ``ep_size_N`` groups (docs/moe.md). ``zerotrain.moe.layer``, ``.sharded_moe`` and
``.experts`` re-export these under DeepSpeed's paths."""

from zerotrain.experts.gating import TopKGate, top1gating, top2gating, topkgating
from zerotrain.experts.hf import expert_parallel, gather_expert_state_dict, shard_expert_state_dict
from zerotrain.experts.layer import Experts, MoE, MOELayer

__all__ = [
    "MoE",
    "MOELayer",
    "Experts",
    "TopKGate",
    "top1gating",
    "top2gating",
    "topkgating",
    "expert_parallel",
    "gather_expert_state_dict",
    "shard_expert_state_dict",
]
