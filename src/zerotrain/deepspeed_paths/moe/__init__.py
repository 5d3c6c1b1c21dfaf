"""DeepSpeed's ``deepspeed.moe`` paths: ``moe.layer`` (``MoE``), ``moe.sharded_moe`` (gates,
``MOELayer``), ``moe.experts`` (``Experts``), implemented in ``zerotrain.experts``, and ``moe.utils``
(expert parameter groups, in ``zerotrain.optim.expert_groups``). Each submodule is an attribute of
this package, as after ``import deepspeed``; it loads on first access.
"""

from zerotrain._lazy import lazy_attributes

SUBMODULES = ("utils", "layer", "sharded_moe", "experts")

__getattr__, __dir__ = lazy_attributes(__name__, SUBMODULES)
