"""DeepSpeed's ``deepspeed.runtime`` names that scripts use (``runtime.utils.set_random_seed``).

As after ``import deepspeed``, the submodules are attributes of the package
(``zerotrain.runtime.utils``); they load on first access, so ``import zerotrain`` stays light.
"""

from zerotrain._lazy import lazy_attributes

#: DeepSpeed-named submodules (``import deepspeed`` loads each of them).
SUBMODULES = ("dataloader", "engine", "lr_schedules", "pipe", "progressive_layer_drop", "utils", "zero")

__getattr__, __dir__ = lazy_attributes(__name__, SUBMODULES)
