"""DeepSpeed's ``deepspeed.ops`` names that training scripts import (``ops.adam``), on torch's kernels.

``zerotrain.ops.adam`` is an attribute of this package as after ``import deepspeed``; it loads on
first access.
"""

from zerotrain._lazy import lazy_attributes

SUBMODULES = ("adam",)

__getattr__, __dir__ = lazy_attributes(__name__, SUBMODULES)
