"""``offload_states``, ``reload_states`` and ``empty_partition_cache`` (DeepSpeed's names): RL
frameworks move the training state out of device memory while they generate, then back.
The moving itself is zerotrain.zero.offload_states; this mixin is the engine's side of it."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch
from torch import nn

from zerotrain.zero.offload_states import OffloadDeviceEnum, StateOffloader

if TYPE_CHECKING:
    from zerotrain.accelerator.base import Accelerator
    from zerotrain.engine.plain_backward import PlainBackward
    from zerotrain.zero.interface import StageInterface


class EngineStateOffload:
    """The engine's ``offload_states`` / ``reload_states`` / ``empty_partition_cache``."""

    _state_offloader: StateOffloader | None = None

    # What this mixin reads of ZeroTrainEngine (set in its __init__; annotations only).
    accelerator: Accelerator
    device: torch.device
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    _plain_backward: PlainBackward
    _zero: StageInterface

    def offload_states(
        self, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """Move the training state named by ``include`` (``OffloadStateTypeEnum`` members;
        None: all of optimizer states, fp32 masters, 16-bit parameters, gradients, staging
        buffers) off the device to host memory until ``reload_states()``; at stage 3 the
        gathered parameters are released first. No communication. A forward while parameters
        are offloaded, and a backward or step while anything is, raise."""
        if self._state_offloader is None:
            self._state_offloader = StateOffloader(self.accelerator, self.device)
        self._plain_backward.settle()
        self._zero.empty_partition_cache()  # gathered buffers are a cache: not kept, not moved
        tensors = self._zero.state_tensors(self.module, self.optimizer)
        self._state_offloader.offload(tensors, include, device, pin_memory, non_blocking)
        gc.collect()
        self.accelerator.empty_cache()

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back everything ``offload_states`` moved, byte for byte."""
        if self._state_offloader is not None:
            self._state_offloader.reload(non_blocking)

    def empty_partition_cache(self) -> None:
        """Release the parameters stage 3 keeps gathered beyond their use (the unit kept from
        forward into backward, prefetched units, the gather buffer pool) and return the memory
        to the device (or, on the CPU, to the OS). A no-op below stage 3."""
        self._zero.empty_partition_cache()
        gc.collect()
        self.accelerator.empty_cache()

    def _require_states(self, action: str, forward: bool = False) -> None:
        """Refuse ``action`` while state it reads is offloaded: a forward, the parameters'
        storage (with the masters where stage 3 derives the 16-bit shards from them, and the
        shards in fp32, which are the parameters' buffers); anything else, any state."""
        offloader = self._state_offloader
        if offloader is None or not offloader.offloaded:
            return
        if forward:
            params = self._zero.state_tensors(self.module, self.optimizer)["lp_params"]
            if not offloader.holds_any(params):
                return
        raise RuntimeError(
            f"{action} while {', '.join(sorted(offloader.offloaded))} are offloaded: call engine.reload_states() first"
        )

    def _offloaded_nbytes(self) -> int:
        """Bytes of offloaded training state held in host buffers."""
        return 0 if self._state_offloader is None else self._state_offloader.host_nbytes
