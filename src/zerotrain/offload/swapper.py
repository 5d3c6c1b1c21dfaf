"""NVMe optimizer offload: fp32 masters and optimizer state in swap files, stepped chunk by chunk.

Each trained unit's shard is cut into chunks of at most ``chunk_numel`` elements. A chunk is an
``nn.Parameter`` placeholder in the user's optimizer (so its param group, hyperparameters and LR
schedule apply); between steps it holds no memory, and its fp32 master (16-bit training, or a
shard that is not in host memory) and every elementwise optimizer state tensor live in files
under the run folder. The step walks the chunks in order: read (ahead, into one of
``buffer_count`` slots), point the placeholder at the master, hand the optimizer the state
tensors and the chunk's gradient, ``optimizer.step()``, copy the master into the 16-bit shard,
write master and state back (behind, from the slot). At most ``buffer_count`` chunks are in
memory at once. Any elementwise torch optimizer works: state keys are whatever the optimizer
creates on a chunk's first step (scalars such as Adam's ``step`` stay in memory).
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from zerotrain.offload.aio import ALIGN, AsyncFileIO, aligned_bytes, round_up, wait
from zerotrain.precision.masters import adopt_changed


@dataclass(eq=False)
class Chunk:
    """``numel`` elements of a unit's shard from ``start``: what one optimizer step updates."""

    index: int
    unit_index: int
    start: int
    numel: int
    param: nn.Parameter
    swap_master: bool
    state_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # elementwise state
    scalars: dict = field(default_factory=dict)  # non-elementwise state (Adam's step)
    generations: dict[str, int] = field(default_factory=dict)  # last write of each file

    def stored(self) -> dict[str, torch.dtype]:
        """The tensors this chunk keeps on disk: its master (if swapped) and its state."""
        out = {"master": torch.float32} if self.swap_master else {}
        out.update(self.state_dtypes)
        return out


class Slot:
    """One chunk's worth of aligned host buffers (one per stored tensor), reused."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict[str, torch.Tensor] = {}
        self.writes: list = []

    def buffer(self, key: str, nbytes: int) -> torch.Tensor:
        need = round_up(nbytes) + ALIGN  # data padded to 4096, then the trailer block
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < need:
            buf = self.buffers[key] = aligned_bytes(need, self.pin)
        return buf

    def view(self, key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        return self.buffer(key, nbytes).narrow(0, 0, nbytes).view(dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


class OptimizerSwapper:
    """The chunks of every trained unit, their files in ``folder``, and the chunked step."""

    def __init__(self, folder: str, chunk_numel: int, buffer_count: int, io: AsyncFileIO, pin: bool):
        self.folder = folder
        self.io = io
        self.chunk_numel = chunk_numel
        self.units = []
        self.chunks: list[Chunk] = []
        self.slots = [Slot(pin) for _ in range(buffer_count)]
        self.stats = {"bytes_read": 0, "bytes_written": 0, "io_wait_s": 0.0, "step_s": 0.0}
        self._grad32 = None  # the chunk's gradient cast to the master's dtype

    def add_unit(self, unit, master: torch.Tensor | None) -> None:
        """Cut ``unit``'s shard into chunks; ``master`` (fp32, or None to step the shard itself
        in place) is written to the swap files now."""
        u = len(self.units)
        self.units.append(unit)
        shard_numel = unit.layout.shard_numel
        for start in range(0, shard_numel, self.chunk_numel):
            numel = min(self.chunk_numel, shard_numel - start)
            placeholder = torch.empty(0, dtype=torch.float32)
            self.chunks.append(Chunk(len(self.chunks), u, start, numel, nn.Parameter(placeholder), master is not None))
        if master is not None:
            self.write_masters(u, master)

    def params_of_group(self, group: int) -> list[nn.Parameter]:
        return [c.param for c in self.chunks if self.units[c.unit_index].group == group]

    def path(self, chunk: Chunk, key: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
        return f"{self.folder}/c{chunk.index:06d}.{safe}.swp"

    # -- writing and reading whole chunks ---------------------------------------------
    def _write(self, chunk: Chunk, slot: Slot, key: str, dtype: torch.dtype) -> None:
        generation = chunk.generations.get(key, 0) + 1
        chunk.generations[key] = generation
        nbytes = chunk.numel * dtype.itemsize
        slot.writes.append(self.io.write(self.path(chunk, key), slot.buffer(key, nbytes), nbytes, generation))

    def _read(self, chunk: Chunk, slot: Slot) -> list:
        return [
            self.io.read(
                self.path(chunk, key),
                slot.buffer(key, chunk.numel * dtype.itemsize),
                chunk.numel * dtype.itemsize,
                chunk.generations[key],
            )
            for key, dtype in chunk.stored().items()
        ]

    def write_masters(self, unit_index: int, master: torch.Tensor) -> None:
        """The initial fp32 master of a unit, chunk by chunk (synchronously)."""
        slot = self.slots[0]
        for chunk in self.chunks:
            if chunk.unit_index == unit_index and chunk.swap_master:
                slot.view("master", torch.float32, chunk.numel).copy_(master.narrow(0, chunk.start, chunk.numel))
                self._write(chunk, slot, "master", torch.float32)
                wait(slot.writes)
                slot.writes = []

    # -- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self, optimizer, shard_grads, grad_scale: float, edited=None, param_swapper=None, grad_swapper=None
    ) -> None:
        """One optimizer step over every chunk. ``edited``: the units whose 16-bit weights were
        written outside the step since the last one (adopted into the master); None: all.
        ``param_swapper`` / ``grad_swapper`` (NVMe parameter offload): the shards and gradient
        shards live in swap files too, read ahead of each unit's update."""
        started = time.perf_counter()
        clock = [0.0]
        read0, written0 = self.io.bytes_read, self.io.bytes_written
        free, busy = deque(self.slots), deque()
        reads: dict[int, tuple[Slot, list]] = {}
        upcoming = 0  # the next chunk whose read has not been issued

        def reap() -> None:  # slots whose writes have finished are free again
            while busy and all(f.done() for f in busy[0].writes):
                slot = busy.popleft()
                wait(slot.writes)  # raises a failed write's error
                slot.writes = []
                free.append(slot)

        def issue(blocking: bool) -> bool:
            nonlocal upcoming
            reap()
            if not free:
                if not blocking or not busy:
                    return False
                slot = busy.popleft()
                wait(slot.writes, clock)
                slot.writes = []
                free.append(slot)
            slot = free.popleft()
            reads[upcoming] = (slot, self._read(self.chunks[upcoming], slot))
            upcoming += 1
            return True

        try:
            for i, chunk in enumerate(self.chunks):
                if chunk.start == 0:  # a new unit: read shards and gradients ahead
                    if grad_swapper is not None:
                        grad_swapper.read_ahead(self.units[chunk.unit_index :])
                    if param_swapper is not None:  # only shards the step reads
                        param_swapper.read_ahead(
                            [
                                u
                                for u in self.units[chunk.unit_index :]
                                if self._reads_shard(u, chunk.swap_master, edited)
                            ]
                        )
                if upcoming == i:
                    issue(blocking=True)
                while upcoming < len(self.chunks) and issue(blocking=False):
                    pass  # read ahead into every free slot
                slot, futures = reads.pop(i)
                wait(futures, clock)
                self._update(optimizer, chunk, slot, shard_grads[chunk.unit_index], grad_scale, edited, grad_swapper)
                for key, dtype in chunk.stored().items():
                    self._write(chunk, slot, key, dtype)
                busy.append(slot)
            for slot in busy:
                wait(slot.writes, clock)
                slot.writes = []
        except BaseException:
            for _slot, futures in reads.values():  # let nothing write into buffers we drop
                for f in futures:
                    f.cancel()
            raise
        stats = self.stats
        stats["bytes_read"] = self.io.bytes_read - read0
        stats["bytes_written"] = self.io.bytes_written - written0
        stats["io_wait_s"] = clock[0]
        stats["step_s"] = time.perf_counter() - started

    @staticmethod
    def _reads_shard(unit, swap_master: bool, edited) -> bool:
        """Whether the step needs the shard's values (else it only writes it)."""
        return not swap_master or edited is None or unit in edited

    def _update(
        self, optimizer, chunk: Chunk, slot: Slot, grad: torch.Tensor, grad_scale: float, edited=None, grad_swapper=None
    ) -> None:
        unit = self.units[chunk.unit_index]
        adopt = self._reads_shard(unit, chunk.swap_master, edited)
        shard = unit.resident_shard(dirty=True, fill=adopt).detach().narrow(0, chunk.start, chunk.numel)
        if chunk.swap_master:
            master = slot.view("master", torch.float32, chunk.numel)
            if adopt:  # in-place edits of the 16-bit weights since the last step
                adopt_changed(master, shard)
        else:
            master = shard  # fp32 in host memory: the shard itself is stepped
        p = chunk.param
        p.data = master
        if grad_swapper is not None:  # read back if it was written out
            grad_swapper.ensure(unit)
        g = grad.narrow(0, chunk.start, chunk.numel)
        if g.dtype == master.dtype and g.device == master.device:
            p.grad = g
        else:  # cast into one reused buffer (a fresh chunk-sized one each time page-faults)
            if self._grad32 is None or self._grad32.numel() < chunk.numel:
                self._grad32 = torch.empty(self.chunk_numel, dtype=master.dtype, device=master.device)
            p.grad = self._grad32.narrow(0, 0, chunk.numel).copy_(g)
        if grad_scale != 1.0:
            p.grad.mul_(grad_scale)
        if chunk.state_dtypes or chunk.scalars:  # stepped before: hand back its state
            state = {k: slot.view(k, dtype, chunk.numel) for k, dtype in chunk.state_dtypes.items()}
            state.update(chunk.scalars)
            optimizer.state[p] = state
        try:
            optimizer.step()
        finally:
            state = optimizer.state.pop(p, {})
            p.grad = None
            p.data = torch.empty(0, dtype=torch.float32)
        dtypes, scalars = {}, {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == chunk.numel:
                dtypes[key] = value.dtype
                target = slot.view(key, value.dtype, chunk.numel)
                if target.data_ptr() != value.data_ptr():  # created by this step: into the slot
                    target.copy_(value)
            elif torch.is_tensor(value) and value.dim() > 0:
                raise ValueError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}, not the stepped "
                    f"chunk's ({chunk.numel},): NVMe offload swaps elementwise optimizer state only"
                )
            else:
                scalars[key] = value
        chunk.state_dtypes, chunk.scalars = dtypes, scalars
        if chunk.swap_master:
            shard.copy_(master)

    # -- reading state outside the step (checkpoints) -------------------------------------
    def chunks_of(self, unit) -> list[Chunk]:
        """``unit``'s chunks in shard order."""
        return [c for c in self.chunks if self.units[c.unit_index] is unit]

    def unit_state(self, unit) -> tuple[bool, dict[str, torch.dtype], dict]:
        """``(master swapped, {elementwise state key: dtype}, scalars)`` of ``unit`` (its first
        chunk's scalars: every chunk of a unit is stepped alike)."""
        chunks = self.chunks_of(unit)
        first = chunks[0]
        return first.swap_master, dict(first.state_dtypes), dict(first.scalars)

    def unit_tensor(self, unit, key: str) -> SwappedTensor:
        """``unit``'s whole-shard tensor ``key`` (``"master"`` or a state key), read chunk by
        chunk when written out (see ``SwappedTensor``)."""
        chunks = self.chunks_of(unit)
        dtype = torch.float32 if key == "master" else chunks[0].state_dtypes[key]
        return SwappedTensor(self, chunks, key, dtype)

    def read_key(self, chunk: Chunk, key: str) -> torch.Tensor:
        """One stored tensor of a chunk, read now into fresh memory."""
        dtype = chunk.stored()[key]
        nbytes = chunk.numel * dtype.itemsize
        buffer = aligned_bytes(round_up(nbytes) + ALIGN)
        wait([self.io.read(self.path(chunk, key), buffer, nbytes, chunk.generations[key])])
        return buffer.narrow(0, 0, nbytes).view(dtype)

    def load_chunk(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """``{key: tensor}`` of a chunk's stored tensors, read now into fresh memory."""
        slot = Slot(pin=False)
        wait(self._read(chunk, slot))
        return {k: slot.view(k, dtype, chunk.numel).clone() for k, dtype in chunk.stored().items()}

    def iter_state(self):
        """``(unit, start, {"numel", "state"})`` for every chunk that has optimizer state, one
        chunk read at a time (``start``: the chunk's first element within the unit's shard)."""
        for chunk in self.chunks:
            if not chunk.state_dtypes and not chunk.scalars:
                continue
            tensors = self.load_chunk(chunk)
            tensors.pop("master", None)
            state = {**tensors, **chunk.scalars}
            yield self.units[chunk.unit_index], chunk.start, {"numel": chunk.numel, "state": state}

    def store_chunk(self, chunk: Chunk, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        """Replace a chunk's stored tensors (``master`` and state) and scalars."""
        slot = Slot(pin=False)
        if chunk.swap_master:
            slot.view("master", torch.float32, chunk.numel).copy_(tensors["master"])
        chunk.state_dtypes = {k: v.dtype for k, v in tensors.items() if k != "master"}
        for k, v in tensors.items():
            if k != "master":
                slot.view(k, v.dtype, chunk.numel).copy_(v)
        chunk.scalars = dict(scalars)
        for key in list(chunk.generations):  # files of state no longer kept are stale
            if key not in chunk.stored():
                del chunk.generations[key]
        for key, dtype in chunk.stored().items():
            self._write(chunk, slot, key, dtype)
        wait(slot.writes)

    @property
    def buffer_nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def file_nbytes(self) -> int:
        """Bytes the swap files take on disk (data, padding and trailers)."""
        return sum(
            round_up(c.numel * dtype.itemsize) + ALIGN
            for c in self.chunks
            for key, dtype in c.stored().items()
            if key in c.generations
        )


class SwappedTensor:
    """A unit's whole-shard tensor that lives in swap files: ``dtype``, ``shape`` and
    ``numel()`` like a tensor; ``pieces()`` reads it one chunk at a time (what checkpoint
    writing streams, so the state is never all in memory); ``detach()`` reads all of it."""

    def __init__(self, swapper: OptimizerSwapper, chunks: list[Chunk], key: str, dtype: torch.dtype):
        self.swapper, self.chunks, self.key, self.dtype = swapper, chunks, key, dtype
        self.shape = torch.Size([sum(c.numel for c in chunks)])

    def numel(self) -> int:
        return self.shape[0]

    def pieces(self):
        for chunk in self.chunks:
            yield self.swapper.read_key(chunk, self.key)

    def detach(self) -> torch.Tensor:
        return torch.cat(list(self.pieces())) if self.chunks else torch.empty(0, dtype=self.dtype)
