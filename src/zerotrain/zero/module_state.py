"""Loading whole-model weights into partitioned training state (``engine.load_state_dict``).

Every rank passes the same whole state dict (as with ``nn.Module.load_state_dict``). Each rank
writes only what it holds: its shard of every partitioned unit, the fp32 master of that shard
(taken from the given tensors' own precision, not from a 16-bit rounding), and whole parameters
and buffers. No collective is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from zerotrain.zero.partition import FlatParamUnit


def strip_engine_prefix(state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Accept the engine's own ``state_dict()`` keys (``module.`` prefix) as well."""
    if state_dict and all(k.startswith("module.") for k in state_dict):
        return {k[len("module.") :]: v for k, v in state_dict.items()}
    return state_dict


@torch.no_grad()
def load_module_state(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], units: Sequence[FlatParamUnit], strict: bool = True
) -> _IncompatibleKeys:
    state_dict = strip_engine_prefix(state_dict)
    expected = module.state_dict(keep_vars=True)  # names only: stage-3 entries are placeholders
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise RuntimeError(
            "engine.load_state_dict: the state dict does not match the model "
            f"(missing keys: {missing[:10]}{' ...' if len(missing) > 10 else ''}; unexpected keys: "
            f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}); pass strict=False to load "
            "the keys that match"
        )
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)

    def checked(name: str, shape: torch.Size) -> torch.Tensor:
        value = state_dict[name]
        if value.shape != shape:
            raise RuntimeError(
                f"engine.load_state_dict: {name} has shape {tuple(value.shape)} in "
                f"the state dict but {tuple(shape)} in the model"
            )
        return value

    def value_for(param: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
        name = next((n for n in names_of.get(id(param), []) if n in state_dict), None)
        return None if name is None else checked(name, shape)

    in_units: set[int] = set()
    for unit in units:
        values = [value_for(p, slot.shape) for p, slot in zip(unit.params, unit.layout.slots)]
        unit.load_values([None if v is None else v.to(unit.device) for v in values])
        in_units.update(id(p) for p in unit.params)
    for name, tensor in expected.items():
        if id(tensor) in in_units or name not in state_dict:
            continue
        tensor.copy_(checked(name, tensor.shape))
    return _IncompatibleKeys(missing, unexpected)
