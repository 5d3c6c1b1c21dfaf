"""Stage 3's full buffers for gathered units (``ParameterCoordinator``'s, zero/stage3.py).

Released full buffers are pooled for the next gather of the same size, so steady-state steps
allocate nothing; pooled + live elements never exceed the peak of live elements (the caller
passes the ``room`` left: peak minus live). A buffer autograd still refers to (views saved for
backward) is never pooled: its unit keeps it as its own storage, emptied (0 bytes) while the
unit is released and refilled in place when it is gathered again.
"""

from __future__ import annotations

import torch

from zerotrain.zero.partition import FlatParamUnit


class GatherBuffers:
    """The pool of released full buffers and the units' own (emptied) storages."""

    def __init__(self) -> None:
        self.pool: dict[tuple, list[torch.Tensor]] = {}
        self.pool_numel = 0
        self.buffers_allocated = 0  # full buffers allocated for gathers so far (not reused)
        # Units whose buffer autograd still referred to at a release: that buffer is theirs.
        self.own_storage: dict[FlatParamUnit, torch.Tensor] = {}
        self.storage_refills = 0  # gathers into such an emptied storage (each allocates)

    def acquire(self, unit: FlatParamUnit, room: int) -> torch.Tensor:
        """A full buffer for ``unit``: its own emptied storage refilled, a pooled one nothing else
        refers to any more (autograd may still hold views of a buffer released in forward), else
        a new one (then the pool is trimmed to ``room`` elements)."""
        layout = unit.layout
        own = self.own_storage.get(unit)
        if own is not None:  # emptied at its last release: refill the same storage
            own.untyped_storage().resize_(layout.padded_numel * own.element_size())
            self.storage_refills += 1
            return own
        free = self.pool.get((layout.padded_numel, layout.dtype, layout.device), [])
        for i, buf in enumerate(free):
            if _sole_owner(buf):
                self.pool_numel -= buf.numel()
                return free.pop(i)
        self.buffers_allocated += 1
        if self.pool_numel > room:
            self._trim_pool(room)
        return layout.empty(zero=False)

    def keep(self, unit: FlatParamUnit, flat: torch.Tensor, room: int) -> None:
        """``unit`` was released, ``flat`` its full buffer: empty it as the unit's own storage
        when autograd still refers to it, else pool it if ``room`` elements allow."""
        if unit in self.own_storage or not _sole_owner(flat):
            # Autograd saved views of it for backward (nn.Linear saves ``weight.t()``): free
            # its memory anyway and refill this same storage at the next gather, so those
            # views read the gathered values again (FSDP2 frees unsharded parameters the same
            # way). Dropping the buffer instead would keep every layer whole until backward.
            # Such a unit keeps this storage from now on (pooling it would hand the pool's
            # buffers to autograd every forward).
            flat.untyped_storage().resize_(0)
            self.own_storage[unit] = flat
        elif self.pool_numel + flat.numel() <= room:
            self.pool.setdefault(_key(flat), []).append(flat)
            self.pool_numel += flat.numel()

    def attach_empty(self, unit: FlatParamUnit) -> None:
        """Give a released unit's parameters their shapes over its own storage, holding 0 bytes."""
        # Views need the memory to exist when made: allocated untouched and handed back at
        # once, no page is written.
        storage = self.own_storage.get(unit)
        if storage is None:
            storage = self.own_storage[unit] = unit.layout.empty(zero=False)
        else:
            storage.untyped_storage().resize_(unit.layout.padded_numel * storage.element_size())
        unit.attach(storage)
        storage.untyped_storage().resize_(0)

    def _trim_pool(self, room: int) -> None:
        """Drop pooled buffers (largest first) until they hold ``room`` elements or fewer."""
        for key in sorted(self.pool, key=lambda k: -k[0]):
            free = self.pool[key]
            while free and self.pool_numel > room:
                self.pool_numel -= free.pop().numel()
        self.pool = {k: v for k, v in self.pool.items() if v}

    def drop_pool(self) -> None:
        self.pool, self.pool_numel = {}, 0

    @property
    def pool_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for free in self.pool.values() for b in free)

    def clear(self) -> None:
        """Forget every buffer (the coordinator gave the module back whole)."""
        self.drop_pool()
        self.own_storage = {}


def _key(buf: torch.Tensor) -> tuple:
    return buf.numel(), buf.dtype, buf.device


def _sole_owner(buf: torch.Tensor) -> bool:
    """True when no other tensor (e.g. a view saved for backward) shares ``buf``'s storage."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False  # cannot tell: never reuse
    return use_count(buf.untyped_storage()._cdata) <= 2  # ``buf`` + the temporary storage object
