"""DeepSpeed names that transformers/accelerate use and zerotrain's own modules do not have.

Only consulted through the ``deepspeed`` alias (:mod:`zerotrain.hf.deepspeed_alias`), after the
matching ``zerotrain.*`` module: a name zerotrain gains later wins over the entry here. Each entry
says who uses it and why this definition is what that code needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerotrain.hf.switch import DEEPSPEED_VERSION

MISSING = object()

# deepspeed.launcher.runner: accelerate's launcher writes a multi-node environment file by this name.
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"

# deepspeed.runtime.lr_schedules: accelerate recognises a DeepSpeed scheduler object by its class
# name in this list (zerotrain's schedules carry the same class names).
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


class DeepSpeedOptimizer:
    """``deepspeed.runtime.base_optimizer``: the base class of DeepSpeed's optimizer wrappers (its
    ZeRO optimizers), empty in DeepSpeed too. Lightning's ``load_checkpoint`` imports it to find
    optimizers in a state with ``isinstance(item, (Optimizer, DeepSpeedOptimizer))``; zerotrain's
    ``initialize`` returns the torch optimizer itself, which the first class matches, so no
    zerotrain object derives from this one."""


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """``deepspeed.checkpoint.utils``: ``item`` with every nested tensor detached and copied to
    ``device`` (accelerate's ``get_state_dict`` at stages 0-2)."""
    device = torch.device(device)
    if torch.is_tensor(item):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """``deepspeed.runtime.zero.partition_parameters``: DeepSpeed's ``zero.Init`` wraps tensor
    constructors to cast their dtype; transformers' ``prevent_arange_dtype_change`` swaps this
    function around ``zero.Init``. zerotrain's ``zero.Init`` wraps no constructors (it casts
    parameters when it partitions them), so the constructor is returned unchanged."""
    return fn


def init_distributed(*args, **kwargs):
    """``deepspeed.comm.init_distributed``: zerotrain's, then :func:`_tell_accelerate_backend`."""
    from zerotrain.comm.distributed import init_distributed as zerotrain_init

    zerotrain_init(*args, **kwargs)
    _tell_accelerate_backend()


def is_initialized() -> bool:
    """``deepspeed.comm.is_initialized``: torch's answer, after :func:`_tell_accelerate_backend`."""
    _tell_accelerate_backend()
    return dist.is_initialized()


def _tell_accelerate_backend() -> None:
    """Record the process group's backend in accelerate's process state when it has none.

    accelerate's process state, on its DeepSpeed path, takes the backend only from the
    accelerator device it finds, then asks ``deepspeed.comm.is_initialized()`` and calls
    ``init_distributed`` when needed. On a machine with no GPU it keeps ``backend = None`` and
    right after those calls concludes it is a world of one (every rank rank 0, data unsharded).
    Filling in the backend the group really has (gloo) lets its own code count the ranks.
    Where accelerate already knows the backend (GPUs) nothing changes."""
    import sys

    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None)
    if isinstance(shared, dict) and "backend" in shared and shared["backend"] is None and dist.is_initialized():
        shared["backend"] = dist.get_backend()


# Consulted before zerotrain's own module: these replace the zerotrain name under the alias.
_OVERRIDES: dict[str, dict[str, object]] = {
    "deepspeed.comm": {"init_distributed": init_distributed, "is_initialized": is_initialized},
}

_EXTRAS: dict[str, dict[str, object]] = {
    # DeepSpeed's version string under its second name (OpenRLHF compares ``deepspeed.version``).
    "deepspeed": {"version": DEEPSPEED_VERSION},
    "deepspeed.runtime.base_optimizer": {"DeepSpeedOptimizer": DeepSpeedOptimizer},
    "deepspeed.runtime.lr_schedules": {"VALID_LR_SCHEDULES": VALID_LR_SCHEDULES},
    "deepspeed.checkpoint.utils": {"clone_tensors_for_torch_save": clone_tensors_for_torch_save},
    "deepspeed.launcher.runner": {"DEEPSPEED_ENVIRONMENT_NAME": DEEPSPEED_ENVIRONMENT_NAME},
    "deepspeed.runtime.zero.partition_parameters": {
        "zero_wrapper_for_fp_tensor_constructor": zero_wrapper_for_fp_tensor_constructor,
        "_orig_torch_arange": torch.arange,
    },
}
# Parent packages of the modules above that zerotrain has no module for.
_EXTRA_PACKAGES = {name.rsplit(".", i)[0] for name in _EXTRAS for i in range(1, name.count("."))}


def lookup(module_name: str, attr: str):
    """The extra ``module_name.attr``, or ``MISSING``."""
    return _EXTRAS.get(module_name, {}).get(attr, MISSING)


def override(module_name: str, attr: str):
    """The replacement for zerotrain's ``module_name.attr`` under the alias, or ``MISSING``."""
    return _OVERRIDES.get(module_name, {}).get(attr, MISSING)


def is_extra_module(module_name: str) -> bool:
    return module_name in _EXTRAS or module_name in _EXTRA_PACKAGES


def provided() -> dict[str, list[str]]:
    """Every extra name by module (documentation and tests)."""
    merged: dict[str, set[str]] = {}
    for table in (_EXTRAS, _OVERRIDES):
        for module, names in table.items():
            merged.setdefault(module, set()).update(names)
    return {module: sorted(names) for module, names in merged.items()}
