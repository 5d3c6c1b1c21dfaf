"""Byte counts of tensors actually held, for ``engine.memory_breakdown()``."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared or tied tensors count once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (moments, momentum buffers, step counters)."""
    if optimizer is None:
        return []
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (moments, momentum buffers, step counters)."""
    return tensor_bytes(optimizer_state_tensors(optimizer))
