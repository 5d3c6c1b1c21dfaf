"""A small pool of reusable staging buffers for gradient collectives.

Stage 2 copies finished gradients into a slot and reduce-scatters them in place (this rank keeps
its slice of the slot); any stage reducing in another dtype than it accumulates in casts through a slot.

Reusing a fixed number of buffers (four of a quarter bucket when communication overlaps
backward, one otherwise) bounds the full-size gradient memory to one bucket however large the
model is. A slot's memory is allocated when it is first acquired; ``release_memory()`` hands it
back between backwards (the reduce-scatter stages under ``memory_release: "eager"``: stage 3's
peak comes early in backward, before any unit is reduced, and need not hold idle slots).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Pending:
    """A launched collective plus what to do with its result once it has finished."""

    def __init__(self, work, then: Callable[[], object]):
        self._work, self._then = work, then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._then()


class StagingSlot:
    def __init__(self, numel: int, dtype: torch.dtype, device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self.flat: torch.Tensor | None = None  # allocated when first acquired
        self.pending: _Pending | None = None

    def allocate(self) -> None:
        if self.flat is None:
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def track(self, work, then: Callable[[], object]) -> _Pending:
        self.pending = _Pending(work, then)
        return self.pending

    def release(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


class StagingPool:
    """``count`` slots used round-robin; acquiring a busy slot waits for its collective."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, device):
        self.slots = [StagingSlot(numel, dtype, device) for _ in range(count)]
        self._next = 0

    def chunk_numel(self, rows: int) -> int:
        """Elements of each rank's shard that one slot can reduce at a time, when a chunk takes
        ``rows`` rows of the slot (one per rank, plus any the backend receives into)."""
        return max(1, self.slots[0].numel // rows)

    def acquire(self) -> StagingSlot:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        slot.release()
        slot.allocate()
        return slot

    def release_memory(self) -> None:
        """Wait for every slot's collective and free the slots' memory (reallocated on use)."""
        for slot in self.slots:
            slot.release()
            slot.flat = None

    @property
    def nbytes(self) -> int:
        """Bytes of the slots while allocated (during a backward's reductions)."""
        return sum(s.numel * s.dtype.itemsize for s in self.slots)
