"""Which device this process trains on and which collective backend goes with it.

Everything that needs a device or a backend asks here, so the same code runs on CPU (gloo)
and CUDA (NCCL) without a hard-coded device string anywhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accelerator:
    """The device kind of this machine: ``"cuda"`` or ``"cpu"``."""

    name: str

    @property
    def communication_backend(self) -> str:
        return "nccl" if self.name == "cuda" else "gloo"

    def device(self, local_rank: int | None = None) -> torch.device:
        """The device of this process: ``cuda:<local_rank>`` on GPU, ``cpu`` on CPU."""
        if self.name == "cpu":
            return torch.device("cpu")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(self.name, local_rank)

    def set_device(self, local_rank: int) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        """Wait for queued device work, so host timers measure the device (no-op on CPU)."""
        if self.name == "cuda":
            torch.cuda.synchronize()

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.name == "cuda" else 1


def get_accelerator() -> Accelerator:
    """The accelerator to use; ``ZEROTRAIN_ACCELERATOR=cpu`` forces the CPU on a GPU machine."""
    forced = os.environ.get("ZEROTRAIN_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if forced:
        if forced not in ("cpu", "cuda"):
            raise ValueError(f"ZEROTRAIN_ACCELERATOR={forced!r}: expected 'cpu' or 'cuda'")
        return Accelerator(forced)
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")
