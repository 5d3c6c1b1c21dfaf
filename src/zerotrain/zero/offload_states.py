"""``engine.offload_states()`` / ``engine.reload_states()``: the training state out of device
memory between training phases (an RL loop's generation), and back, bit for bit.

The stage names its tensors by kind (``StageInterface.state_tensors``). What moves is each
tensor's *storage*: its bytes are copied into a host buffer and the storage is resized to 0
bytes; reloading resizes it back and copies the bytes in. Every tensor object, and every view
of the storage (parameters viewing a flat buffer, ``.grad`` views of a gradient bucket, the
optimizer's keys, ``ds_tensor``), stays what it was, so nothing has to be re-pointed and a
round trip leaves training exactly where it was. Storages already away from the engine's device
(masters under ZeRO-Offload) are left alone; on a machine without an accelerator the engine's
device is the CPU, and the bytes still go to a separate host buffer (the original storage is
freed), which is what the CPU tests observe.
"""

from __future__ import annotations

from enum import Enum

import torch


class OffloadStateTypeEnum(str, Enum):
    """The kinds of training state ``offload_states(include=...)`` moves (DeepSpeed's names)."""

    optim_states = "optim_states"  # the optimizer's state tensors (moments, momentum buffers)
    hp_params = "hp_params"  # what the optimizer steps: fp32 masters (the shards in fp32 training)
    lp_params = "lp_params"  # the training-dtype parameters: flat buffers, stage-3 shards
    lp_grads = "lp_grads"  # the accumulated gradients (buckets, gradient shards)
    contiguous_grad_buffer = "contiguous_grad_buffer"  # the reductions' staging buffers


class OffloadDeviceEnum(str, Enum):
    """Where offloaded states go (DeepSpeed's names; ``offload_states`` takes ``cpu``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class _Moved:
    """One storage whose bytes live in a host buffer meanwhile."""

    def __init__(self, storage, host: torch.Tensor, device: torch.device):
        self.storage, self.host, self.device = storage, host, device

    @property
    def nbytes(self) -> int:
        return self.host.numel()


def _bytes_of(storage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class StateOffloader:
    """The storages one engine has offloaded, by kind."""

    def __init__(self, accelerator, device: torch.device):
        self._accelerator = accelerator
        self._device = device  # the engine's compute device: what is moved off it
        self._moved: dict[str, list[_Moved]] = {}
        self._kinds: set[str] = set()  # offloaded since the last reload (storages may be shared)

    @property
    def offloaded(self) -> frozenset:
        """The kinds offloaded now."""
        return frozenset(self._kinds)

    def holds_any(self, tensors) -> bool:
        """Whether the storage of any of ``tensors`` is offloaded now."""
        moved = {m.storage._cdata for ms in self._moved.values() for m in ms}
        return any(t is not None and t.untyped_storage()._cdata in moved for t in tensors)

    @property
    def host_nbytes(self) -> int:
        """Bytes held in host buffers for offloaded states."""
        return sum(m.nbytes for moved in self._moved.values() for m in moved)

    def offload(self, tensors: dict[str, list], include, device, pin_memory: bool, non_blocking: bool) -> None:
        """Move the storages of ``tensors[kind]`` for each kind in ``include`` (None: all)."""
        kinds = _kinds(include)
        device = OffloadDeviceEnum(device.value if isinstance(device, Enum) else device)
        if device == OffloadDeviceEnum.nvme:
            raise ValueError(
                "offload_states(device=nvme) is not supported: offload to "
                "OffloadDeviceEnum.cpu (NVMe is for zero_optimization.offload_*)"
            )
        if device == OffloadDeviceEnum.none:
            return
        self._kinds.update(kinds)
        pin = pin_memory and self._device.type != "cpu"  # pinning is for copies to a device
        seen = {m.storage._cdata for moved in self._moved.values() for m in moved}
        for kind in kinds:
            for tensor in tensors.get(kind, ()):
                if tensor is None or tensor.device != self._device:
                    continue
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage._cdata in seen:
                    continue
                seen.add(storage._cdata)
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes_of(storage, tensor.device), non_blocking=non_blocking)
                storage.resize_(0)
                self._moved.setdefault(kind, []).append(_Moved(storage, host, tensor.device))
        if not non_blocking:
            self._accelerator.synchronize()

    def reload(self, non_blocking: bool) -> None:
        """Every offloaded storage back at its size on its device, with its bytes."""
        self._kinds.clear()
        for kind in list(self._moved):
            for moved in self._moved.pop(kind):
                moved.storage.resize_(moved.nbytes)
                _bytes_of(moved.storage, moved.device).copy_(moved.host, non_blocking=non_blocking)
        if not non_blocking:
            self._accelerator.synchronize()


def _kinds(include) -> list[str]:
    if include is None:
        return [kind.value for kind in OffloadStateTypeEnum]
    kinds = []
    for kind in include:
        try:
            kinds.append(OffloadStateTypeEnum(kind.value if isinstance(kind, Enum) else kind).value)
        except ValueError:
            names = ", ".join(k.value for k in OffloadStateTypeEnum)
            raise ValueError(
                f"offload_states(include=...): unknown state {kind!r}; use OffloadStateTypeEnum members ({names})"
            ) from None
    return kinds


def core_state_tensors(stage, optimizer) -> dict[str, list]:
    """``ZeroStage.state_tensors``: its units, masters, gradient buffers and staging slots."""
    if stage.offload is not None or stage.param_offload is not None:
        raise ValueError(
            "offload_states with zero_optimization.offload_optimizer/offload_param "
            'device "nvme": that state lives in swap files already; use device '
            '"none" or "cpu" to move it with offload_states'
        )
    from zerotrain.zero.memory import optimizer_state_tensors

    # A shard derived from its master is the master rounded: the master is its storage.
    lp = [u.flat if not u.resharded else u.master if u.derived else u.shard for u in stage.units]
    outside = stage.outside
    if outside is not None:
        lp += outside.params
    reduction = stage.reduction
    grads = reduction.grads.flats() + list(reduction.shard_grads)
    if outside is not None:
        grads += outside.grads.flats()
    staging = [slot.flat for slot in reduction.staging.slots] if reduction.staging else []
    return {
        "optim_states": optimizer_state_tensors(optimizer),
        "hp_params": list(stage.masters),
        "lp_params": lp,
        "lp_grads": grads,
        "contiguous_grad_buffer": staging,
    }
