"""Which device this process trains on and which collective backend goes with it.

Everything that needs a device or a backend asks here, so the same code runs on CPU (gloo)
and CUDA (NCCL) without a hard-coded device string anywhere else. The object implements
DeepSpeed's accelerator interface (``from deepspeed.accelerator import get_accelerator``)::

    from zerotrain.accelerator import get_accelerator   # or: from zerotrain import get_accelerator
    device = torch.device(get_accelerator().device_name(), local_rank)
    get_accelerator().manual_seed_all(1234)
"""

from __future__ import annotations

import os

import torch

from zerotrain.accelerator.base import Accelerator
from zerotrain.accelerator.cpu import CPUAccelerator
from zerotrain.accelerator.cuda import CUDAAccelerator

# DeepSpeed's class names, for isinstance checks and type hints in ported code.
DeepSpeedAccelerator = Accelerator
CPU_Accelerator = CPUAccelerator
CUDA_Accelerator = CUDAAccelerator

_CLASSES = {"cpu": CPUAccelerator, "cuda": CUDAAccelerator}
_instances: dict[str, Accelerator] = {}
_chosen: Accelerator | None = None

__all__ = [
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "DeepSpeedAccelerator",
    "get_accelerator",
    "set_accelerator",
    "is_current_accelerator_supported",
]


def _name_from_environment() -> str:
    forced = os.environ.get("ZEROTRAIN_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if forced:
        if forced not in _CLASSES:
            raise ValueError(
                f"ZEROTRAIN_ACCELERATOR={forced!r} (or DS_ACCELERATOR): expected 'cpu' or "
                f"'cuda'; unset it to pick CUDA when available, else the CPU"
            )
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_accelerator() -> Accelerator:
    """The accelerator of this process (one object per kind, reused).

    Set by ``set_accelerator``; otherwise ``ZEROTRAIN_ACCELERATOR`` (or DeepSpeed's
    ``DS_ACCELERATOR``) = ``cpu``/``cuda``, else CUDA when available, else the CPU.
    """
    if _chosen is not None:
        return _chosen
    name = _name_from_environment()
    if name not in _instances:
        _instances[name] = _CLASSES[name]()
    return _instances[name]


def set_accelerator(accelerator: Accelerator | None) -> None:
    """Use ``accelerator`` from now on (``None`` goes back to choosing from the environment)."""
    global _chosen
    if accelerator is not None and not isinstance(accelerator, Accelerator):
        raise TypeError(f"set_accelerator needs a zerotrain Accelerator, got {type(accelerator).__name__}")
    _chosen = accelerator


def is_current_accelerator_supported() -> bool:
    """Whether the accelerator in use is one zerotrain supports (CPU or CUDA: always true)."""
    return get_accelerator().name in _CLASSES
