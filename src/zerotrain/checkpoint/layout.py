"""What a checkpoint holds, described from a live engine: the name -> (unit, offset, shape) map
of every flat unit, the whole (unsharded) parameters and buffers, tied names, versions.

The stage object is read through its declared interface only (``engine.zero_stage_object``, a
``zerotrain.zero.interface.StageInterface``): ``sharded_state()`` gives the ``units``
(``FlatParamUnit``s with ``names``, ``layout``, ``shard_values()``, ``master``, ``group``), the
shard rank and the NVMe optimizer swapper; for fp32 stage 0 there are no units and the module's
own parameters are stepped.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from zerotrain.checkpoint.format import FORMAT, FORMAT_VERSION, dtype_name


def stage_units(engine) -> list:
    return list(engine.zero_stage_object.sharded_state().units)


def shard_rank_of(engine) -> int:
    """Which shard of each unit this rank holds (0 where shards are whole)."""
    return engine.zero_stage_object.sharded_state().shard_rank


def swapper_of(engine):
    """The NVMe optimizer swapper (``zerotrain.offload.swapper.OptimizerSwapper``) holding the
    masters and optimizer state of trained units in swap files, or None."""
    return engine.zero_stage_object.sharded_state().optimizer_swapper


class _ResidentShard:
    """A shard kept in an NVMe parameter swap file, read back only when it is written out."""

    def __init__(self, unit):
        self.unit, self.dtype, self.shape = unit, unit.dtype, unit.shard.shape

    def numel(self) -> int:
        return self.shape.numel()

    def pieces(self):
        # a copy: the writer's numpy view would make the shard's storage non-resizable, and
        # eviction resizes it
        yield self.unit.resident_shard().detach().clone()

    def detach(self) -> torch.Tensor:
        return self.unit.resident_shard().detach().clone()


def unit_param(unit):
    """The unit's shard as a checkpoint writes it (read from its swap file when it is there)."""
    if unit.param_swapper is not None:
        return _ResidentShard(unit)
    return unit.shard_values()  # cast from the master where the shard is derived from it


def unit_training_state(engine, unit, optimizer) -> tuple[object, dict, dict]:
    """``(fp32 master or None, {state key: whole-shard tensor}, scalars)`` of a trained unit.
    With NVMe offload the master and state tensors are ``SwappedTensor``s, read chunk by chunk
    only when written."""
    swapper = swapper_of(engine)
    if swapper is not None and unit.group is not None:
        swapped_master, dtypes, scalars = swapper.unit_state(unit)
        master = swapper.unit_tensor(unit, "master") if swapped_master else None
        return master, {k: swapper.unit_tensor(unit, k) for k in dtypes}, scalars
    master = unit.master.detach() if unit.master is not None else None
    if optimizer is None or unit.group is None:
        return master, {}, {}
    elementwise, scalars = split_state(optimizer.state.get(optimizer_key(unit), {}), unit.layout.shard_numel)
    return master, elementwise, scalars


def optimizer_key(unit) -> torch.Tensor:
    """The tensor the optimizer steps for ``unit`` (its state is keyed by it)."""
    return unit.master if unit.master is not None else unit.shard


def data_rank(engine) -> int:
    """This rank's position in the engine's data-parallel group (``engine.topology``): what its
    checkpoint files are named by, so a group's checkpoint holds the same files as the same run on
    a world of the group's size, whichever global ranks the group has."""
    return engine.topology.data_rank


def first_of_group(engine) -> bool:
    """Whether this rank is the first of the engine's data-parallel group (it writes the model
    file and the metadata, and commits)."""
    return engine.topology.is_first("data")


def shard_writer(engine, experts=None) -> bool:
    """Whether this rank holds shards no lower rank of its data group holds (stage 0 replicates:
    the group's first rank writes). Expert units (``experts``: ``checkpoint.experts.ExpertNames``)
    are written to their own files and do not count."""
    units = [u for u in stage_units(engine) if not (experts and experts.expert_unit(u))]
    if not units:
        return False
    return data_rank(engine) < units[0].layout.world_size


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
                raise ValueError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}, not the "
                    f"stepped tensor's {tuple(want)}: only elementwise optimizer state "
                    "can be checkpointed by parameter"
                )
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


def describe(engine, tag: str, exclude_frozen: bool, experts=None) -> dict:
    """The metadata of a checkpoint of ``engine`` (files and checksums are added at commit).
    Experts (``experts``: ``checkpoint.experts.ExpertNames``) are left out but for the key order,
    which is the single-process model's: every rank describes its own (``describe_experts``)."""
    import zerotrain

    module, optimizer = engine.module, engine.optimizer
    first, aliases = parameter_names(module)
    units_meta, excluded = [], []
    for i, unit in enumerate(stage_units(engine)):
        if experts and experts.expert_unit(unit):
            continue
        if exclude_frozen and unit.group is None:
            excluded.extend(unit.names)
            continue
        master, elementwise, _ = unit_training_state(engine, unit, optimizer)
        saved = ["param"] + (["master"] if master is not None else [])
        saved += [f"state/{k}" for k in elementwise]
        layout = unit.layout
        units_meta.append(
            {
                "id": i,
                "group": unit.group,
                "dtype": dtype_name(unit.dtype),
                "world_size": layout.world_size,
                "shard_numel": layout.shard_numel,
                "numel": layout.numel,
                "padded_numel": layout.padded_numel,
                "saved": saved,
                "params": [[name, s.offset, s.numel, list(s.shape)] for name, s in unit.named_slots()],
            }
        )
    groups = group_of_whole(engine)
    whole = {}
    for name, p in whole_parameters(engine):
        if exclude_frozen and not p.requires_grad:
            excluded.append(experts.checkpoint_name(name) if experts else name)
            continue
        if experts and experts.is_expert(name):
            continue
        saved = ["param"]
        if optimizer is not None and id(p) in groups:
            elementwise, _ = split_state(optimizer.state.get(p, {}), shape=p.shape)
            saved += [f"state/{k}" for k in elementwise]
        whole[name] = {
            "shape": list(p.shape),
            "dtype": dtype_name(p.dtype),
            "group": groups.get(id(p)),
            "requires_grad": p.requires_grad,
            "saved": saved,
        }
    named_buffers, buffer_aliases = persistent_buffers(module)
    aliases.update(buffer_aliases)
    buffers = {
        name: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)}
        for name, b in named_buffers
        if not (experts and experts.is_expert(name))
    }
    excluded_set = set(excluded)
    rename = experts.checkpoint_name if experts else (lambda n: n)
    keys = [k for k in module.state_dict(keep_vars=True).keys() if rename(aliases.get(k, k)) not in excluded_set]
    if experts:
        keys = experts.global_keys(keys)
    frozen = [first[id(p)] for p in module.parameters() if not p.requires_grad]
    precision = engine.precision
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "zerotrain_version": zerotrain.__version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": engine.dp_world_size,
        "stage": engine.zero_optimization_stage(),
        "param_dtype": dtype_name(precision.param_dtype),
        "mixed_precision": bool(precision.mixed),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "units": units_meta,
        "whole": whole,
        "buffers": buffers,
        "aliases": aliases,
        "keys": keys,
        "frozen": frozen,
        "excluded_frozen": sorted(excluded_set),
        "param_groups": len(optimizer.param_groups) if optimizer is not None else 0,
        "config": engine.config.raw,
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
