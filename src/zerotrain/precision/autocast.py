"""The ``torch_autocast`` section: fp32 parameters, the engine's forward under ``torch.autocast``.

``lower_precision_safe_modules`` names module classes (``"package.module.Class"``, matched
exactly, not subclasses) whose parameters' gradients ZeRO stages 1-3 reduce in the autocast dtype
(``zerotrain.zero.autocast_reductions``; docs/precision.md).
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from torch import nn

# DeepSpeed's default list, under the names its accessor reports.
DEFAULT_SAFE_MODULES = tuple(f"{cls.__module__}.{cls.__name__}" for cls in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast_dtype(section, device: torch.device) -> torch.dtype | None:
    """The dtype forward is autocast to (None: the section is off). Without ``dtype``:
    torch.autocast's default for the device (bf16 on CPU, fp16 on CUDA)."""
    if not section.enabled:
        return None
    if section.dtype is None:
        return torch.get_autocast_dtype(device.type)
    return _DTYPES[section.dtype]


def safe_module_names(section) -> list[str]:
    """``lower_precision_safe_modules``, or DeepSpeed's default list when absent."""
    names = section.lower_precision_safe_modules
    return list(DEFAULT_SAFE_MODULES) if names is None else list(names)


def resolve_safe_modules(names: list[str]) -> list[type]:
    """The classes ``names`` import to; a name that does not import raises naming the key."""
    classes = []
    for name in names:
        package, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), attr) if package else None
        except (ImportError, AttributeError):
            cls = None
        if not isinstance(cls, type):
            raise ValueError(
                f"torch_autocast.lower_precision_safe_modules: {name!r} does not import as a "
                'class; give its full path, e.g. "torch.nn.Linear"'
            )
        classes.append(cls)
    return classes


def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """Fail at initialize when torch.autocast cannot lower to ``dtype`` on ``device``."""
    layer = nn.Linear(4, 4).to(device)
    with torch.autocast(device.type, dtype=dtype):
        out = layer(torch.ones(2, 4, device=device))
    if out.dtype != dtype:
        raise ValueError(
            f"torch_autocast.dtype: torch.autocast on {device.type} does not compute in {dtype}; "
            "use the other 16-bit dtype"
        )


def forward_context(dtype: torch.dtype | None, device: torch.device):
    """The context the engine's forward runs in: ``torch.autocast(device, dtype)`` when the
    section is on (it replaces an autocast the caller entered, as in DeepSpeed); otherwise
    nothing changes (a caller's own autocast stays in force)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
