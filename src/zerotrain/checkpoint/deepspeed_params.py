"""The parameters of a DeepSpeed checkpoint by name: the saved module's weights, buffers and tied
names; the flat-unit entries of the converted checkpoint; and, for stage 0 (where DeepSpeed
records the optimizer state by position only), which parameter each optimizer slot holds."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from zerotrain.checkpoint.format import CheckpointError, dtype_name

logger = logging.getLogger("zerotrain")


@dataclass
class ModuleLayout:
    """What the model-states file says about the module.

    ``values``: parameters with their saved values (stages 0-2), by first name; the converter
    moves them into ``frozen`` (no optimizer state) or drops them (trainable: the optimizer's
    values are used). ``order``: ``(name, shape)`` of every parameter in the module's order."""

    dtype: torch.dtype
    values: dict[str, torch.Tensor]
    order: list[tuple[str, tuple]]
    buffers: dict[str, torch.Tensor]
    aliases: dict[str, str]
    keys: list[str]
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)


def training_dtype(config: dict, module: dict) -> torch.dtype:
    """bf16/fp16/fp32 from the DeepSpeed config, else from the saved module's weights."""
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return dtype
    if config:
        return torch.float32
    for value in module.values():
        if torch.is_tensor(value) and value.is_floating_point():
            return value.dtype
    return torch.float32


def module_layout(main: dict, folder, stage3: bool) -> ModuleLayout:
    """Parameters, buffers and tied names of the model-states file ``main`` (rank 0's). At
    stage 3 the module holds placeholders: names come from ``param_shapes`` instead."""
    module = main.get("module")
    if not isinstance(module, dict):
        raise CheckpointError(f"{folder}: the model-states file has no 'module' state dict")
    config = main.get("ds_config") if isinstance(main.get("ds_config"), dict) else {}
    buffer_names = set(main.get("buffer_names") or [])
    buffers = {n: v for n, v in module.items() if n in buffer_names}
    values, order, aliases, keys = {}, [], {}, []
    if stage3:
        known = {n for g in main.get("param_shapes") or [] for n in g} | set(main.get("frozen_param_shapes") or {})
        dropped = [n for n in module if n not in known and n not in buffer_names]
        if dropped:
            logger.warning(
                "%s: DeepSpeed's ZeRO-3 checkpoint records neither the values of %s "
                "nor the parameter they are tied to; they are left out (a model that "
                "ties them loads them through the parameter they share)",
                folder,
                ", ".join(dropped),
            )
        keys = [n for n in module if n not in dropped]
    else:
        first: dict[tuple, str] = {}
        for name, value in module.items():
            keys.append(name)
            if name in buffer_names:
                continue
            ident = (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
            if value.numel() > 0 and ident in first:  # the same tensor under a second name
                aliases[name] = first[ident]
                continue
            first[ident] = name
            values[name] = value
            order.append((name, tuple(value.shape)))
    return ModuleLayout(training_dtype(config, module), values, order, buffers, aliases, keys)


def unit_entry(
    unit_id: int, group, dtype: torch.dtype, world: int, shard_numel: int, params: list, mixed: bool
) -> dict:
    """A flat unit of the converted checkpoint: ``params`` as ``[name, offset, numel, shape]``
    in a buffer split into ``world`` partitions of ``shard_numel`` elements."""
    numel = max(offset + n for _, offset, n, _ in params)
    if numel > shard_numel * world:
        raise CheckpointError(
            f"parameters {[p[0] for p in params][:5]} end at element {numel}, past "
            f"the {world} partitions of {shard_numel} elements that hold them"
        )
    return {
        "id": unit_id,
        "group": group,
        "dtype": dtype_name(dtype),
        "world_size": world,
        "shard_numel": shard_numel,
        "numel": numel,
        "padded_numel": shard_numel * world,
        "saved": ["param"] + (["master"] if mixed else []),
        "params": params,
    }


def assign_groups(order: list[tuple[str, tuple]], shapes: list[list], where: str) -> list[list[str]]:
    """Which parameter each optimizer slot holds, when only shapes are known.

    ``shapes[g][i]`` is the shape of group ``g``'s ``i``-th parameter (``None``: unknown). Each
    group is assumed to list its parameters in the module's order (as a comprehension over
    ``named_parameters()`` does); parameters in no group (frozen) are skipped. The assignment
    must be the only one the shapes allow, else the caller must name the groups."""
    slots = sum(len(g) for g in shapes)
    skips = len(order) - slots
    if skips < 0:
        raise CheckpointError(f"{where}: the optimizer holds {slots} parameters, the module has only {len(order)}")
    start = tuple(0 for _ in shapes)
    # layer i: state (next slot of each group) -> (number of ways, capped at 2; predecessor, move)
    layers = [{start: (1, None, None)}]
    for i, (_, shape) in enumerate(order):
        nxt: dict[tuple, tuple] = {}
        for pos, (ways, _, _) in layers[-1].items():
            moves = [None] if i - sum(pos) < skips else []
            moves += [g for g, group in enumerate(shapes) if pos[g] < len(group) and group[pos[g]] in (None, shape)]
            for g in moves:
                new = pos if g is None else pos[:g] + (pos[g] + 1,) + pos[g + 1 :]
                before = nxt.get(new, (0, None, None))
                nxt[new] = (min(2, before[0] + ways), before[1] or pos, g if before[1] is None else before[2])
        layers.append(nxt)
    end = tuple(len(g) for g in shapes)
    ways = layers[-1].get(end, (0,))[0]
    hint = "pass the groups' parameter names (--param-groups FILE.json: a list of lists, in the optimizer's order)"
    if ways == 0:
        raise CheckpointError(
            f"{where}: the optimizer's groups (shapes {_brief(shapes)}) cannot be "
            f"matched to the module's parameters in order; {hint}"
        )
    if ways > 1:
        raise CheckpointError(
            f"{where}: several parameters have the same shape, so the optimizer "
            f"state (recorded by position at stage 0) could belong to more than "
            f"one of them; {hint}"
        )
    names: list[list[str]] = [[] for _ in shapes]
    pos = end
    for i in range(len(order), 0, -1):
        _, previous, group = layers[i][pos]
        if group is not None:
            names[group].append(order[i - 1][0])
        pos = previous
    return [list(reversed(g)) for g in names]


def _brief(shapes) -> str:
    return "; ".join(
        f"group {g}: {[tuple(s) if s else None for s in group][:4]}{'...' if len(group) > 4 else ''}"
        for g, group in enumerate(shapes)
    )
