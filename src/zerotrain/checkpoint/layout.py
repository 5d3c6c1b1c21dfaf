"""What a checkpoint holds, described from a live engine: the name -> (unit, offset, shape) map
of every flat unit, the whole (unsharded) parameters and buffers, tied names, versions.

The stage object is read through its stable interface only: ``units`` (``FlatParamUnit``s
with ``names``, ``layout``, ``shard``, ``master``, ``group``) when it partitions anything; for
fp32 stage 0 there are no units and the module's own parameters are stepped.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from zerotrain.checkpoint.format import FORMAT, FORMAT_VERSION, dtype_name


def stage_units(engine) -> list:
    if getattr(engine._zero, "offload", None) is not None:  # state in swap files, not in units
        raise NotImplementedError(
            "save_checkpoint/load_checkpoint with zero_optimization.offload_optimizer.device "
            "\"nvme\" is not implemented yet: the optimizer state lives in swap files; use "
            "device \"cpu\" (or none) for runs that must checkpoint")
    return list(getattr(engine._zero, "units", None) or [])


def optimizer_key(unit) -> torch.Tensor:
    """The tensor the optimizer steps for ``unit`` (its state is keyed by it)."""
    return unit.master if unit.master is not None else unit.shard


def shard_writer(engine) -> bool:
    """Whether this rank holds shards no lower rank holds (stage 0 replicates: rank 0 writes)."""
    units = stage_units(engine)
    if not units:
        return False
    return engine.global_rank < units[0].layout.world_size


def parameter_names(module: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """``id(param) -> first name`` and ``alias -> first name`` for tied parameters."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return first, aliases


def split_state(state: dict, shard_numel: int | None = None, shape=None) -> tuple[dict, dict]:
    """An optimizer state entry as ``(elementwise tensors, scalars)``. Elementwise tensors have
    the stepped tensor's shape; anything else (``step``, numbers) is a scalar."""
    elementwise, scalars = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            want = [shard_numel] if shard_numel is not None else list(shape)
            if list(value.shape) != want:
                raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)}, not the "
                                 f"stepped tensor's {tuple(want)}: only elementwise optimizer state "
                                 "can be checkpointed by parameter")
            elementwise[key] = value
        else:
            scalars[key] = value
    return elementwise, scalars


def whole_parameters(engine) -> list[tuple[str, nn.Parameter]]:
    """Parameters held whole (not in any flat unit), by first name."""
    in_units = {id(p) for u in stage_units(engine) for p in u.params}
    return [(n, p) for n, p in engine.module.named_parameters() if id(p) not in in_units]


def group_of_whole(engine) -> dict[int, int]:
    if engine.optimizer is None:
        return {}
    return {id(p): g for g, group in enumerate(engine.optimizer.param_groups) for p in group["params"]}


def describe(engine, tag: str, exclude_frozen: bool) -> dict:
    """The metadata of a checkpoint of ``engine`` (files and checksums are added at commit)."""
    import zerotrain

    module, optimizer = engine.module, engine.optimizer
    first, aliases = parameter_names(module)
    units_meta, excluded = [], []
    for i, unit in enumerate(stage_units(engine)):
        if exclude_frozen and unit.group is None:
            excluded.extend(unit.names)
            continue
        saved = ["param"] + (["master"] if unit.master is not None else [])
        if optimizer is not None and unit.group is not None:
            elementwise, _ = split_state(optimizer.state.get(optimizer_key(unit), {}),
                                         unit.layout.shard_numel)
            saved += [f"state/{k}" for k in elementwise]
        layout = unit.layout
        units_meta.append({
            "id": i, "group": unit.group, "dtype": dtype_name(unit.shard.dtype),
            "world_size": layout.world_size, "shard_numel": layout.shard_numel,
            "numel": layout.numel, "padded_numel": layout.padded_numel, "saved": saved,
            "params": [[name, s.offset, s.numel, list(s.shape)] for name, s in unit.named_slots()],
        })
    groups = group_of_whole(engine)
    whole = {}
    for name, p in whole_parameters(engine):
        if exclude_frozen and not p.requires_grad:
            excluded.append(name)
            continue
        saved = ["param"]
        if optimizer is not None and id(p) in groups:
            elementwise, _ = split_state(optimizer.state.get(p, {}), shape=p.shape)
            saved += [f"state/{k}" for k in elementwise]
        whole[name] = {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "group": groups.get(id(p)),
                       "requires_grad": p.requires_grad, "saved": saved}
    named_buffers, buffer_aliases = persistent_buffers(module)
    aliases.update(buffer_aliases)
    buffers = {name: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)} for name, b in named_buffers}
    excluded_set = set(excluded)
    keys = [k for k in module.state_dict(keep_vars=True).keys()
            if aliases.get(k, k) not in excluded_set]
    frozen = [first[id(p)] for p in module.parameters() if not p.requires_grad]
    precision = engine.precision
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tag": tag,
        "zerotrain_version": zerotrain.__version__, "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": engine.dp_world_size, "stage": engine.zero_optimization_stage(),
        "param_dtype": dtype_name(precision.param_dtype), "mixed_precision": bool(precision.mixed),
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "units": units_meta, "whole": whole, "buffers": buffers, "aliases": aliases, "keys": keys,
        "frozen": frozen, "excluded_frozen": sorted(excluded_set),
        "param_groups": len(optimizer.param_groups) if optimizer is not None else 0,
        "config": getattr(engine.config, "raw", None),
    }


def persistent_buffers(module: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Buffers that ``state_dict`` holds, by first name, and ``alias -> first name`` of shared ones."""
    params = {id(p) for p in module.parameters()}
    first: dict[int, str] = {}
    out, aliases = [], {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in params or isinstance(t, nn.Parameter):
            continue
        if id(t) in first:
            aliases[name] = first[id(t)]
            continue
        first[id(t)] = name
        out.append((name, t))
    return out, aliases
