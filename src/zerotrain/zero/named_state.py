"""A ``ZeroStage``'s optimizer state by parameter name, what checkpoints save to reload by name
on any world size or stage."""

from __future__ import annotations

import torch


def named_optimizer_state(optimizer, trained, masters, reductions, swapper=None) -> dict[str, list[tuple[int, dict]]]:
    """This rank's optimizer state by parameter name: for each parameter with elements in this
    rank's shards, ``[(start, {key: flat slice})]`` where ``start`` is the slice's first element
    within the flattened parameter, and each tensor-valued state entry shaped like the shard is
    sliced to the parameter's part (scalars such as ``step`` are passed as they are).

    ``trained``: the trained units, ``masters`` what the optimizer steps for each,
    ``reductions`` each unit's ``UnitReduction`` by ``id`` (its rank within the group it is
    sharded over); ``swapper``: the NVMe ``OptimizerSwapper`` holding the state instead."""
    out: dict[str, list[tuple[int, dict]]] = {}
    if swapper is not None:
        for unit, start, state in swapper.iter_state():
            spec = reductions[id(unit)]
            for piece in unit.layout.shard_pieces(spec.rank if unit.layout.world_size > 1 else 0):
                lo = max(piece.shard_start, start)
                hi = min(piece.shard_start + piece.numel, start + state["numel"])
                if lo >= hi:
                    continue
                sliced = {
                    k: (
                        v.narrow(0, lo - start, hi - lo)
                        if torch.is_tensor(v) and v.dim() == 1 and v.numel() == state["numel"]
                        else v
                    )
                    for k, v in state["state"].items()
                }
                out.setdefault(unit.names[piece.slot.index], []).append(
                    (piece.param_start + lo - piece.shard_start, sliced)
                )
        return out
    for unit, master in zip(trained, masters):
        state = optimizer.state.get(master, {})
        spec = reductions[id(unit)]
        for piece in unit.layout.shard_pieces(spec.rank if unit.layout.world_size > 1 else 0):
            sliced = {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == master.shape:
                    sliced[key] = value.narrow(0, piece.shard_start, piece.numel)
                else:
                    sliced[key] = value
            name = unit.names[piece.slot.index]
            out.setdefault(name, []).append((piece.param_start, sliced))
    return out
