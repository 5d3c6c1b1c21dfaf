"""NVMe parameter offload (stage 3): partitioned shards, and the gradient shards of trained units,
in swap files, at most ``max_in_cpu`` elements of each in memory.

Each partitioned unit's shard (this rank's 1/N of its parameters, in the training dtype) is one
swap file. In memory a shard is *resident* (its storage filled) or *evicted* (its storage
resized to 0 bytes: the same tensor object, so views and references stay valid and refill in
place). ``ensure(unit)`` makes a shard resident: it takes the data of a read issued ahead
(``read_ahead``, along the stage-3 coordinator's recorded order of use) or reads it now, and
first evicts the least recently used shards until the resident ones fit in ``max_in_cpu``
elements (a shard written since it was read is written back before its storage goes).

Who reads or writes a shard calls ``ensure`` first (``FlatParamUnit.resident_shard``): the
gather before a module runs, the optimizer step (which marks it written), checkpoint save and
load, ``GatheredParameters`` edits.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from zerotrain.memory_release import release_freed_memory
from zerotrain.offload.aio import ALIGN, AsyncFileIO, aligned_bytes, round_up, wait

TRIM_BYTES = 32 << 20


class _Slot:
    """One aligned host buffer (data padded to 4096 + the trailer block), grown to the largest
    tensor it has carried."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.unit = None  # the unit whose read fills it
        self.futures: list = []

    def fit(self, nbytes: int) -> torch.Tensor:
        if self.buffer.numel() < round_up(nbytes) + ALIGN:
            self.buffer = aligned_bytes(round_up(nbytes) + ALIGN, self.pin)
        return self.buffer


class ShardSwapper:
    """Per-unit tensors of one rank in swap files, at most ``max_in_cpu`` elements of them in
    memory (least recently used go first). ``tensor_of(unit)`` is the unit's tensor (the
    same object all along: only its storage is emptied and refilled). A tensor never written
    (a fresh gradient) is all zeros: made resident by filling, not by reading."""

    kind = "shard"

    def __init__(self, folder: str, io: AsyncFileIO, max_in_cpu: int, buffer_count: int, buffer_numel: int, pin: bool):
        self.folder, self.io = folder, io
        self.max_in_cpu = int(max_in_cpu)
        self.buffer_numel = int(buffer_numel)
        self._pin = pin
        self._slot_count = max(1, int(buffer_count))
        self._slots: list[_Slot] = []  # allocated on first use, at most buffer_count
        self._reading: dict[object, _Slot] = {}  # unit -> slot of its read issued ahead
        self.resident: OrderedDict = OrderedDict()  # unit -> None, least recently used first
        self.resident_numel = 0
        self.peak_resident_numel = 0
        self._dirty: set = set()
        self._generation: dict = {}
        self._index: dict = {}
        self.norms: dict = {}  # unit -> fp32 norm of what its file holds (gradients)
        self._freed = 0  # bytes evicted since memory was last returned to the OS
        self.stats = {"bytes_read": 0, "bytes_written": 0, "io_wait_s": 0.0, "reads_ahead": 0, "reads_on_demand": 0}

    def tensor_of(self, unit) -> torch.Tensor:
        raise NotImplementedError

    # -- files ------------------------------------------------------------------------
    def path(self, unit) -> str:
        return f"{self.folder}/{self.kind}{self._index[unit]:06d}.swp"

    def _nbytes(self, unit) -> int:
        t = self.tensor_of(unit)
        return t.numel() * t.element_size()

    def add_unit(self, unit, write: bool = True) -> None:
        """Take ``unit``'s tensor (resident now): written to its swap file (``write``) or
        dropped as all zeros, and evicted."""
        numel = self.tensor_of(unit).numel()
        if numel > self.buffer_numel:
            raise ValueError(
                f"zero_optimization.offload_param.buffer_size ({self.buffer_numel} elements) is "
                f"smaller than the shard of unit {unit.names[:3]} ({numel} elements on this rank): "
                f"raise buffer_size to at least {numel}"
            )
        self._index[unit] = len(self._index)
        self.resident[unit] = None
        self.resident_numel += numel
        if write:
            self._dirty.add(unit)
        self._evict(unit)

    # -- residency ----------------------------------------------------------------------
    def ensure(self, unit, dirty: bool = False, fill: bool = True) -> torch.Tensor:
        """``unit``'s tensor, resident; ``dirty``: the caller will write it; ``fill=False``:
        the caller overwrites all of it (nothing is read)."""
        if unit in self.resident:
            self.resident.move_to_end(unit)
        else:
            tensor = self.tensor_of(unit).detach()
            numel = tensor.numel()
            self._make_room(numel, keep=unit)
            if unit not in self._generation or not fill:  # never written (zeros), or overwritten
                slot = self._reading.pop(unit, None)
                if slot is not None:  # a read ahead nobody needs
                    self._wait(slot.futures)
                    slot.unit, slot.futures = None, []
                tensor.untyped_storage().resize_(self._nbytes(unit))
                if fill:
                    tensor.zero_()
            else:
                slot = self._reading.pop(unit, None)
                if slot is None:
                    self.stats["reads_on_demand"] += 1
                    slot = self._free_slot(keep=unit)
                    self._issue(unit, slot)
                else:
                    self.stats["reads_ahead"] += 1
                self._wait(slot.futures)
                tensor.untyped_storage().resize_(self._nbytes(unit))
                tensor.view(-1).view(torch.uint8).copy_(slot.buffer.narrow(0, 0, self._nbytes(unit)))
                slot.unit, slot.futures = None, []
            self.resident[unit] = None
            self.resident_numel += numel
            self.peak_resident_numel = max(self.peak_resident_numel, self.resident_numel)
        if dirty:
            self._dirty.add(unit)
            self.norms.pop(unit, None)
        return self.tensor_of(unit)

    def ready(self, unit) -> bool:
        """Whether ``unit``'s shard is resident or its read was issued ahead. (Not whether the
        read has arrived: stage 3 decides prefetch gathers, collectives, by this, so it must be
        the same on every rank, and I/O timing is not.)"""
        return unit in self.resident or unit not in self._generation or unit in self._reading

    def read_ahead(self, units) -> None:
        """Start reading the next evicted shards of ``units`` (in order of use) into the free
        buffers (``buffer_count`` of them: what bounds reading ahead)."""
        for unit in units:
            if unit not in self._generation or unit in self.resident or unit in self._reading:
                continue  # not ours, never written (zeros), in memory, or being read
            slot = next((s for s in self._slot_pool() if s.unit is None), None)
            if slot is None:
                return
            self._issue(unit, slot)  # (the slot list is in order of use)
            self._reading[unit] = slot

    def _slot_pool(self) -> list[_Slot]:
        if len(self._slots) < self._slot_count:
            self._slots.append(_Slot(self._pin))
        return self._slots

    def _free_slot(self, keep) -> _Slot:
        slot = next((s for s in self._slot_pool() if s.unit is None), None)
        if slot is None:  # every buffer holds a read ahead: drop the one needed last
            victim = next(reversed(self._reading))
            slot = self._reading.pop(victim)
            self._wait(slot.futures)
            slot.unit, slot.futures = None, []
        return slot

    def _issue(self, unit, slot: _Slot) -> None:
        slot.unit = unit
        nbytes = self._nbytes(unit)
        slot.futures = [self.io.read(self.path(unit), slot.fit(nbytes), nbytes, self._generation[unit])]
        self.stats["bytes_read"] += round_up(nbytes) + ALIGN

    def _make_room(self, numel: int, keep) -> None:
        while self.resident and self.resident_numel + numel > self.max_in_cpu:
            victim = next(iter(self.resident))
            if victim is keep:
                break
            self._evict(victim)

    def before_evict(self, unit) -> None:
        """Hook: make sure nothing still writes into ``unit``'s tensor."""

    def _evict(self, unit) -> None:
        self.before_evict(unit)
        tensor = self.tensor_of(unit).detach()
        if unit in self._dirty:  # written since read: back to its file first
            if self.track_norms:
                self.norms[unit] = torch._foreach_norm([tensor], 2, dtype=torch.float32)[0]
            slot = self._free_slot(keep=unit)
            nbytes = self._nbytes(unit)
            slot.fit(nbytes).narrow(0, 0, nbytes).copy_(tensor.view(-1).view(torch.uint8))
            generation = self._generation.get(unit, 0) + 1
            self._generation[unit] = generation
            self._wait([self.io.write(self.path(unit), slot.buffer, nbytes, generation)])
            self.stats["bytes_written"] += round_up(nbytes) + ALIGN
            self._dirty.discard(unit)
        tensor.untyped_storage().resize_(0)
        del self.resident[unit]
        self.resident_numel -= tensor.numel()
        self._freed += tensor.numel() * tensor.element_size()
        if self._freed >= TRIM_BYTES:  # evicted storage mostly lands in glibc's heap: hand it back
            self._freed = 0
            release_freed_memory()

    track_norms = False

    def norm_of(self, unit) -> torch.Tensor:
        """fp32 L2 norm of ``unit``'s tensor, without reading it back when evicted."""
        if unit in self.resident:
            return torch._foreach_norm([self.tensor_of(unit).detach()], 2, dtype=torch.float32)[0]
        if unit not in self._generation:  # never written: zeros (on the tensor's device)
            return torch.zeros((), device=self.tensor_of(unit).device)
        return self.norms[unit]

    def discard_all(self) -> None:
        """Every tensor back to all zeros (nothing read or written)."""
        for slot in list(self._reading.values()):
            self._wait(slot.futures)
            slot.unit, slot.futures = None, []
        self._reading.clear()
        for unit in list(self.resident):
            self.before_evict(unit)
            self.tensor_of(unit).detach().untyped_storage().resize_(0)
        self.resident.clear()
        self.resident_numel = 0
        self._dirty.clear()
        self._generation.clear()
        self.norms.clear()

    def _wait(self, futures) -> None:
        clock = [0.0]
        wait(futures, clock)
        self.stats["io_wait_s"] += clock[0]

    def evict_all(self) -> None:
        for unit in list(self.resident):
            self._evict(unit)

    # -- accounting ---------------------------------------------------------------------
    def take_stats(self) -> dict:
        """The counters since the last call (then reset)."""
        out = dict(self.stats)
        for key in self.stats:
            self.stats[key] = 0.0 if key == "io_wait_s" else 0
        return out

    @property
    def buffer_nbytes(self) -> int:
        return sum(s.buffer.numel() for s in self._slots)

    @property
    def resident_nbytes(self) -> int:
        return sum(self._nbytes(u) for u in self.resident)

    def file_nbytes(self) -> int:
        return sum(round_up(self._nbytes(u)) + ALIGN for u in self._generation)

    def restore_all(self) -> None:
        """Every tensor resident again and in memory only (the engine is closing)."""
        for unit in list(self._index):
            self.max_in_cpu = max(self.max_in_cpu, self.resident_numel + self.tensor_of(unit).numel())
            self.ensure(unit)


class ParamSwapper(ShardSwapper):
    """Stage-3 shards (``offload_param.device: "nvme"``)."""

    kind = "param"

    def tensor_of(self, unit) -> torch.Tensor:
        return unit.shard

    def add_unit(self, unit, write: bool = True) -> None:
        super().add_unit(unit, write)
        unit.param_swapper = self

    def restore_all(self) -> None:
        super().restore_all()
        for unit in self._index:
            unit.param_swapper = None


class GradSwapper(ShardSwapper):
    """The reduced gradient shards of trained units, with parameters on NVMe: written out when
    memory is needed (their norm is kept, for clipping), read back for the optimizer step or to
    accumulate the next micro-batch; ``discard_all`` is ``zero_grad``."""

    kind = "grad"
    track_norms = True

    def __init__(self, *args, grads: dict, wait_reduction, **kwargs):
        super().__init__(*args, **kwargs)
        self._grads = grads  # unit -> its shard gradient tensor
        self._wait_reduction = wait_reduction  # unit -> None: its reduction has landed

    def tensor_of(self, unit) -> torch.Tensor:
        return self._grads[unit]

    def before_evict(self, unit) -> None:
        self._wait_reduction(unit)
