"""Flat buffers: many parameters (or their gradients) laid out back to back in one tensor.

Every ZeRO stage's units and gradient buckets are laid out this way. A ``FlatLayout`` fixes where each
parameter lives in a flat buffer and pads the buffer so its length divides by the world size
(times an alignment). Rank ``r`` owns the contiguous shard ``[r * shard_numel, (r+1) * shard_numel)``;
``shard_pieces(r)`` maps that shard back to (parameter, offset) ranges.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in a flat buffer."""

    index: int
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class ShardPiece:
    """The part of parameter ``slot`` that falls in a rank's shard."""

    slot: ParamSlot
    param_start: int  # first element within the flattened parameter
    shard_start: int  # first element within the shard
    numel: int


class FlatLayout:
    """Offsets of ``params`` in a flat buffer padded to a multiple of ``world_size * align``."""

    def __init__(self, params: Sequence[torch.Tensor], world_size: int = 1, align: int = 1):
        if not params:
            raise ValueError("FlatLayout needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"FlatLayout needs one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.world_size = world_size
        slots, offset = [], 0
        for i, p in enumerate(params):
            slots.append(ParamSlot(i, offset, p.numel(), p.shape))
            offset += p.numel()
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.numel = offset
        unit = world_size * align
        self.padded_numel = -(-offset // unit) * unit
        self.shard_numel = self.padded_numel // world_size

    def with_dtype(self, dtype: torch.dtype) -> FlatLayout:
        """The same offsets for a buffer of another dtype."""
        other = object.__new__(FlatLayout)
        other.__dict__.update(self.__dict__, dtype=dtype)
        return other

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def empty(self, dtype: torch.dtype | None = None, device=None, zero: bool = True) -> torch.Tensor:
        make = torch.zeros if zero else torch.empty
        return make(self.padded_numel, dtype=dtype or self.dtype, device=device or self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``flat`` per parameter, shaped like it."""
        return [flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]

    def copy_in(self, flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        return flat.narrow(0, rank * self.shard_numel, self.shard_numel)

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The parameter ranges that fall inside rank ``rank``'s shard, in order."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for s in self.slots:
            start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
            if start < end:
                pieces.append(ShardPiece(s, start - s.offset, start - lo, end - start))
        return pieces


_T = TypeVar("_T", bound=torch.Tensor)  # parameters stay parameters through the split


def split_into_buckets(params: Sequence[_T], bucket_numel: int) -> list[list[_T]]:
    """Group ``params`` (already in reduction order) into buckets of at most ``bucket_numel``
    elements each, one dtype and device per bucket. A parameter larger than the cap gets a
    bucket of its own."""
    buckets: list[list[_T]] = []
    open_by_kind: dict[tuple, tuple[list[_T], int]] = {}
    for p in params:
        kind = (p.dtype, p.device)
        current, size = open_by_kind.get(kind, (None, 0))
        if current is None or (size + p.numel() > bucket_numel and current):
            current, size = [], 0
            buckets.append(current)
        current.append(p)
        open_by_kind[kind] = (current, size + p.numel())
    return buckets
