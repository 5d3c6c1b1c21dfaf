"""Muon on ZeRO shards: each Muon unit's update is orthogonalized as whole matrices.

Muon's momentum and its nesterov blend are elementwise, so they run on this rank's flat shard
(the momentum buffer stays partitioned like Adam's moments). Newton-Schulz is not: for each
unit in a Muon group the optimizer calls the function attached here with its update shard; it
all-gathers the unit's update over the group the unit is sharded over (one all-gather of the
unit's size, what the step's parameter all-gather costs), orthogonalizes the matrices its shard
holds a piece of and returns this rank's slice, with each piece's learning-rate factor. Ranks
sharing a matrix orthogonalize it alike, on the same inputs, so their slices agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerotrain.comm import collectives
from zerotrain.optim.muon import orthogonalize
from zerotrain.zero.flat import FlatLayout


def full_matrix_update(layout: FlatLayout, group, rank: int) -> Callable:
    """``run(update_shard, ns_method)`` for a unit laid out as ``layout``, sharded over ``group``
    where this rank is ``rank`` (``layout.world_size`` 1: the shard is the whole unit): the
    orthogonalized update sliced like the shard, and ``(start, numel, lr factor)`` of each
    matrix's piece in the shard."""
    pieces = [(p.shard_start, p.numel, p.slot) for p in layout.shard_pieces(rank)]

    def run(update: torch.Tensor, ns_method: str):
        if layout.world_size > 1:
            full = torch.empty(layout.padded_numel, dtype=update.dtype, device=update.device)
            collectives.all_gather_into(full, update.contiguous(), group=group)
        else:
            full = update
        out = torch.zeros_like(full)  # padding stays zero
        scales = {}
        for slot in {id(s): s for _, _, s in pieces}.values():  # the matrices this shard touches
            matrix = full.narrow(0, slot.offset, slot.numel).view(slot.shape)
            ortho, scales[slot.index] = orthogonalize(matrix, ns_method)
            out.narrow(0, slot.offset, slot.numel).view(slot.shape).copy_(ortho)
        return layout.shard(out, rank), [(start, n, scales[slot.index]) for start, n, slot in pieces]

    return run


def attach_muon(optimizer, units, masters, param_groups, reductions, offloaded: bool) -> None:
    """Register each Muon unit's full-matrix function with ``optimizer`` (a
    ``zerotrain.optim.muon.MuonWithAuxAdam``); ``reductions[id(unit)]`` is the unit's
    ``UnitReduction`` (the group it is sharded over and its rank there)."""
    if offloaded and any(param_groups[u.group].get("use_muon") for u in units):
        raise NotImplementedError(
            "optimizer Muon with zero_optimization.offload_optimizer: the orthogonalized "
            "update is gathered on the training device; remove offload_optimizer"
        )
    for unit, master in zip(units, masters):
        if not param_groups[unit.group].get("use_muon"):
            continue
        for shape in (s.shape for s in unit.layout.slots):
            if len(shape) < 2:
                raise ValueError(
                    f"optimizer Muon: a {len(shape)}-D parameter of shape {tuple(shape)} is in a "
                    "use_muon group; Muon orthogonalizes matrices (2 or more dimensions)"
                )
        spec = reductions[id(unit)]
        rank = spec.rank if unit.layout.world_size > 1 else 0
        optimizer.attach_full_matrix(master, full_matrix_update(unit.layout, spec.group, rank))
