"""``Placement``: where a ZeRO unit's fp32 master, its optimizer state and its stage-3 shard live.

Defined here, with the offload settings it is built from, so ZeRO depends on offload and never
the other way round (docs/design.md, "Dependency rule").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from zerotrain.accelerator import get_accelerator

if TYPE_CHECKING:
    from zerotrain.offload.nvme import NvmeParamSettings, NvmeSettings


@dataclass(frozen=True)
class Placement:
    """Where a unit's fp32 master (and so its optimizer state, which the optimizer allocates like
    its parameters) lives, and where stage-3 shards live. Built from the offload settings by
    ``zerotrain.offload.build_placement``; ``zerotrain.zero.build`` builds the units with it. The default
    keeps everything on the training device."""

    master_device: torch.device | None = None  # None: beside the unit's shard
    pin_memory: bool = False  # page-locked masters (where the accelerator supports it)
    param_device: torch.device | None = None  # stage-3 shards (offload_param); None: the device
    param_pin_memory: bool = False
    nvme: NvmeSettings | None = None  # masters and optimizer state in swap files
    param_nvme: NvmeParamSettings | None = None  # stage-3 shards on disk
    local_ranks: int = 1  # ranks sharing this node's disk (for the swap space check)

    def separate_master(self, shard: torch.Tensor, mixed: bool) -> bool:
        """Whether the optimizer steps an fp32 copy rather than the shard itself: in 16-bit
        training, or when the master lives on another device than the shard."""
        device = self.master_device or shard.device
        return mixed or device != shard.device or (self.nvme is not None and device.type != "cpu")

    def master_for(self, shard: torch.Tensor) -> nn.Parameter:
        device = self.master_device or shard.device
        master = shard.detach().to(device, torch.float32, copy=True)
        if self.pin_memory and device != shard.device:
            master = get_accelerator().pin_memory(master)
        return nn.Parameter(master)

    def place_shard(self, shard: torch.Tensor) -> nn.Parameter:
        """A stage-3 shard where ``offload_param`` puts it."""
        if self.param_device is None or shard.device == self.param_device:
            return shard
        moved = shard.detach().to(self.param_device)
        if self.param_pin_memory:
            moved = get_accelerator().pin_memory(moved)
        return nn.Parameter(moved)
