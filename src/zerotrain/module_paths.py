"""Get and set a submodule by its dotted name (DeepSpeed's ``compression.helper`` and
``utils.recursive_getattr`` / ``recursive_setattr`` re-export these)."""

from __future__ import annotations

from torch import nn


def recursive_getattr(model: nn.Module, module_name: str):
    """``model.a.b.c`` for ``module_name="a.b.c"``."""
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model: nn.Module, module_name: str, module) -> None:
    """Replace ``model.a.b.c`` with ``module`` for ``module_name="a.b.c"``."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, leaf, module)
