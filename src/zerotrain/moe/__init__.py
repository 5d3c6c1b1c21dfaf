"""DeepSpeed's ``deepspeed.moe`` helpers that scripts import even without MoE (``moe.utils``).

zerotrain has no mixture-of-experts layer or expert parallelism yet; these helpers work on any
parameters and leave a model without expert parameters unchanged. ``zerotrain.moe.utils`` is an
attribute of this package, as after ``import deepspeed``; it loads on first access.
"""

from zerotrain._lazy import lazy_attributes

SUBMODULES = ("utils",)

__getattr__, __dir__ = lazy_attributes(__name__, SUBMODULES)
