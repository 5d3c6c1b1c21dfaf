"""Checkpoints of models with experts (DeepSpeed's MoE layer, ``zerotrain.moe.layer.MoE``).

The ranks of an expert-parallel group hold different experts under the same *local* names
(``moe.deepspeed_moe.experts.deepspeed_experts.<j>.*``, j < num_local_experts); the ranks of an
expert-data group hold the same ones. A checkpoint names every expert by its *global* id
(``ep_rank * num_local_experts + j``, DeepSpeed's rule), i.e. by the names a single-process model
(``ep_size`` 1) has, so it is resharded by name like every other parameter: it loads at another
``ep_size`` and world size, and ``zero_to_fp32`` gives the single-process state dict.

Each expert is written once, by the first rank of its expert-data group, into DeepSpeed's
per-expert file ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` (L: the MoE layer's index in
``named_modules`` order, E: the global expert id):

- DeepSpeed's content: ``{global state-dict key: tensor}`` for the expert's parameters (training
  dtype) and buffers;
- ``zerotrain_tensors``: ``param/<name>`` (the same tensors: stored once), ``master/<name>`` (fp32
  master, 16-bit training), ``state/<key>/<name>`` (elementwise optimizer state), ``buffer/<name>``;
- ``zerotrain_scalars``: ``{name: scalar optimizer state}`` (Adam's ``step``).

Sharded state (ZeRO 1-2: expert units are sharded over the expert-data group) is all-gathered
over that group at save, one unit at a time. metadata.json describes each expert parameter as a
whole parameter with its ``file`` (the reader needs nothing else), lists each file's checksum
like every other file, and records the layers under ``"moe"``.

Hugging Face fused experts (``zerotrain.experts.expert_parallel``: ``gate_up_proj[E, 2I, H]``,
``down_proj[E, H, I]``, rows ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` on each rank under the
model's own names) are checkpointed by rows: row E of each fused parameter goes into the same
per-expert file, under DeepSpeed AutoEP's key ``<name>.<E>`` (its ``_save_moe_checkpoint``) and
``zerotrain_tensors`` ``param/<name>``, ``master/<name>``, ``state/<key>/<name>`` (row E alone).
metadata.json describes the parameter whole (``[E, ...]``, the unsharded model's shape) with its
``row_files`` (one per expert, in expert order): the reader assembles any element range from the
rows (``format.CheckpointReader``), so a rank of another ``ep_size`` reads its own rows, and
``zero_to_fp32`` gives the unsharded HF state dict.

Everything here works from the stage's units by name (``sharded_state().units``, each unit's
``layout``/``named_slots``/``shard_values``/``master``), so a stage that partitions expert units
another way (stage 3) goes through the same code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from zerotrain.checkpoint.format import PT_TENSORS, CheckpointError, dtype_name

# DeepSpeed's ``moe_str_prefix``: where a MoE layer keeps its local experts.
EXPERTS_INFIX = "deepspeed_moe.experts.deepspeed_experts."
SCALARS = "zerotrain_scalars"


def expert_file(layer_id: int, expert_id: int, mp_rank: int = 0) -> str:
    """DeepSpeed's ``_get_expert_ckpt_name``: the file of global expert ``expert_id`` of MoE
    layer ``layer_id``."""
    return f"layer_{layer_id}_expert_{expert_id}_mp_rank_{mp_rank:02d}_model_states.pt"


EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


@dataclass
class ExpertLayer:
    """One MoE layer of the model as this rank holds it."""

    layer_id: int
    path: str  # the MoE module's name
    num_experts: int
    ep_size: int
    num_local: int
    ep_rank: int
    edp_rank: int  # this rank's place among the ranks holding the same experts
    edp_size: int
    groups: object  # the topology's ExpertGroups of ep_size (None without torch.distributed)
    fused: bool = False  # a Hugging Face fused experts module: its experts are rows of each parameter

    @property
    def prefix(self) -> str:
        return f"{self.path}.{EXPERTS_INFIX}" if self.path else EXPERTS_INFIX

    def global_id(self, local: int) -> int:
        return self.ep_rank * self.num_local + local

    def holds(self, global_id: int) -> bool:
        return self.ep_rank * self.num_local <= global_id < (self.ep_rank + 1) * self.num_local

    def describe(self) -> dict:
        out = {
            "id": self.layer_id,
            "module": self.path,
            "num_experts": self.num_experts,
            "ep_size": self.ep_size,
            "num_local_experts": self.num_local,
        }
        return dict(out, fused=True) if self.fused else out


class ExpertNames:
    """This rank's MoE layers and its experts' names: local state-dict key <-> checkpoint name."""

    def __init__(self, module: torch.nn.Module, topology):
        from zerotrain.experts.hf import expert_shard
        from zerotrain.experts.layer import MoE
        from zerotrain.optim.expert_groups import is_moe_param

        self.layers: list[ExpertLayer] = []
        # local key of a fused HF expert parameter -> its layer (the key is the checkpoint's name)
        self.rows: dict[str, ExpertLayer] = {}
        for path, m in module.named_modules():
            shard = expert_shard(m)
            if shard is not None:  # its groups are those its forward dispatches over
                layer = ExpertLayer(
                    len(self.layers),
                    path,
                    shard.num_experts,
                    shard.ep_size,
                    shard.num_local_experts,
                    shard.ep_rank,
                    shard.groups.expert_data_rank if shard.groups is not None else 0,
                    shard.groups.expert_data_size if shard.groups is not None else 1,
                    shard.groups,
                    fused=True,
                )
                self.layers.append(layer)
                self.rows.update({f"{path}.{n}" if path else n: layer for n in shard.param_names})
                continue
            if not isinstance(m, MoE):
                continue
            if topology is not None and topology.distributed:
                groups = topology.expert_groups(m.ep_size)
                ep_rank, edp_rank, edp_size = groups.expert_rank, groups.expert_data_rank, groups.expert_data_size
            elif m.ep_size == 1:
                groups, ep_rank, edp_rank, edp_size = None, 0, 0, 1
            else:
                raise ValueError(f"MoE layer {path!r} has ep_size={m.ep_size} without torch.distributed")
            self.layers.append(
                ExpertLayer(
                    len(self.layers),
                    path,
                    m.num_experts,
                    m.ep_size,
                    m.num_local_experts,
                    ep_rank,
                    edp_rank,
                    edp_size,
                    groups,
                )
            )
        # local key -> (layer, global id, key inside the expert)
        self.local: dict[str, tuple[ExpertLayer, int, str]] = {}
        for key in module.state_dict(keep_vars=True):
            hit = self._split(key)
            if hit is not None:
                layer, number, rest = hit
                if number >= layer.num_local:
                    raise CheckpointError(f"{key}: MoE layer {layer.path!r} has {layer.num_local} local experts")
                self.local[key] = (layer, layer.global_id(number), rest)
        for name, p in module.named_parameters():
            if is_moe_param(p) and name not in self.local and name not in self.rows:
                raise NotImplementedError(
                    f"expert parameter {name!r} (allreduce=False) is neither inside a zerotrain.moe.layer.MoE "
                    "nor a Hugging Face fused experts module made expert-parallel by "
                    "zerotrain.experts.expert_parallel, whose global expert ids checkpoints name experts by: "
                    "checkpoints of other expert parameters are not supported yet; build the experts with "
                    "MoE(...), or save each rank's engine.module_state_dict() yourself"
                )

    def _split(self, key: str):
        for layer in self.layers:
            if key.startswith(layer.prefix):
                number, _, rest = key[len(layer.prefix) :].partition(".")
                if number.isdigit() and rest:
                    return layer, int(number), rest
        return None

    def __bool__(self) -> bool:
        return bool(self.layers)

    def is_expert(self, local_name: str) -> bool:
        return local_name in self.local or local_name in self.rows

    def is_rows(self, local_name: str) -> bool:
        """Whether ``local_name`` is a fused HF expert parameter (this rank holds some of its rows)."""
        return local_name in self.rows

    def row_offset(self, local_name: str, shape) -> int:
        """Where this rank's part of ``local_name`` (local shape ``shape``) starts in the
        checkpoint's flattened parameter, in elements: 0 but for fused expert rows."""
        layer = self.rows.get(local_name)
        if layer is None:
            return 0
        return layer.ep_rank * _numel(shape)

    def checkpoint_shape(self, local_name: str, shape) -> list[int]:
        """The shape ``local_name`` (local shape ``shape``) has in a checkpoint (fused expert
        parameters: every expert's rows)."""
        layer = self.rows.get(local_name)
        shape = list(shape)
        return [layer.num_experts] + shape[1:] if layer is not None and shape else shape

    def checkpoint_name(self, local_name: str) -> str:
        """The name ``local_name`` has in a checkpoint (the global expert id for experts)."""
        hit = self.local.get(local_name)
        if hit is None:
            return local_name
        layer, global_id, rest = hit
        return f"{layer.prefix}{global_id}.{rest}"

    def elsewhere(self, saved_name: str) -> bool:
        """Whether ``saved_name`` is an expert of one of this model's layers held by another
        expert-parallel rank (expected in the checkpoint, not loaded here)."""
        hit = self._split(saved_name)
        return hit is not None and not hit[0].holds(hit[1])

    def layer_of(self, local_name: str) -> ExpertLayer:
        return self.rows[local_name] if local_name in self.rows else self.local[local_name][0]

    def file_of(self, local_name: str) -> str:
        layer, global_id, _ = self.local[local_name]
        return expert_file(layer.layer_id, global_id)

    def location(self, local_name: str) -> dict:
        """Where metadata.json says the expert's values are: its ``file``, or for a fused
        parameter the ``row_files`` of its rows (one per global expert, in expert order)."""
        layer = self.rows.get(local_name)
        if layer is None:
            return {"file": self.file_of(local_name)}
        return {"row_files": [expert_file(layer.layer_id, e) for e in range(layer.num_experts)]}

    def global_keys(self, keys: list[str]) -> list[str]:
        """The state-dict key order of the single-process model: each layer's local expert keys
        replaced, where the first of them stood, by every global expert's (in id order)."""
        out, done = [], set()
        for key in keys:
            hit = self.local.get(key)
            if hit is None:  # a dense key, or a fused expert parameter (named as unsharded)
                out.append(key)
                continue
            layer = hit[0]
            if layer.layer_id in done:
                continue
            done.add(layer.layer_id)
            first = layer.global_id(0)
            rests = [r for k, (lay, g, r) in self.local.items() if lay is layer and g == first and k in keys]
            out.extend(f"{layer.prefix}{g}.{r}" for g in range(layer.num_experts) for r in rests)
        return out

    def unit_shard_rank(self, unit, dense_rank: int) -> int:
        """Which shard of ``unit`` this rank holds: expert units are sharded over their layer's
        expert-data group (whole where the stage keeps them whole), dense ones as the stage says."""
        expert = [self.is_expert(n) for n in unit.names]
        if not any(expert):
            return dense_rank
        if not all(expert) or len({id(self.layer_of(n).groups) for n in unit.names}) != 1:
            raise CheckpointError(f"a unit mixes experts of different groups with other parameters: {unit.names[:4]}")
        if unit.layout.world_size == 1:
            return 0
        layer = self.layer_of(unit.names[0])
        if unit.layout.world_size != layer.edp_size:
            raise CheckpointError(
                f"expert unit {unit.names[:2]} is sharded {unit.layout.world_size} ways, its "
                f"expert-data group has {layer.edp_size} ranks"
            )
        return layer.edp_rank

    def expert_unit(self, unit) -> bool:
        return any(self.is_expert(n) for n in unit.names)


def expert_names(engine) -> ExpertNames:
    return ExpertNames(engine.module, engine.topology)


# -- save ---------------------------------------------------------------------------------
def _refuse_frozen(names: ExpertNames, module, exclude_frozen: bool) -> None:
    for name, p in module.named_parameters():
        if names.is_expert(name) and not p.requires_grad and not exclude_frozen:
            raise NotImplementedError(
                f"save_checkpoint: expert parameter {name!r} is frozen (requires_grad=False); "
                "checkpoints of frozen experts are not supported yet: pass "
                "exclude_frozen_parameters=True (and load them separately)"
            )


def describe_experts(engine, names: ExpertNames, exclude_frozen: bool) -> dict:
    """This rank's experts as metadata entries under their checkpoint names: ``{"whole": {...},
    "buffers": {...}}``, each entry with its ``file``. Every rank describes its own; the ranks
    agree and the first one merges them (``merge_experts``)."""
    from zerotrain.checkpoint.layout import (
        group_of_whole,
        persistent_buffers,
        split_state,
        stage_units,
        unit_training_state,
        whole_parameters,
    )

    module, optimizer = engine.module, engine.optimizer
    _refuse_frozen(names, module, exclude_frozen)
    whole: dict[str, dict] = {}
    excluded = [
        names.checkpoint_name(n)
        for n, p in module.named_parameters()
        if exclude_frozen and names.is_expert(n) and not p.requires_grad
    ]
    for unit in stage_units(engine):
        if not names.expert_unit(unit) or (exclude_frozen and unit.group is None):
            continue
        master, elementwise, _ = unit_training_state(engine, unit, optimizer)
        saved = ["param"] + (["master"] if master is not None else [])
        saved += [f"state/{k}" for k in elementwise] if optimizer is not None and unit.group is not None else []
        for name, slot in unit.named_slots():
            whole[names.checkpoint_name(name)] = {
                "shape": names.checkpoint_shape(name, slot.shape),
                "dtype": dtype_name(unit.dtype),
                "group": unit.group,
                "requires_grad": unit.group is not None,
                "saved": saved,
                **names.location(name),
            }
    groups = group_of_whole(engine)
    for name, p in whole_parameters(engine):
        if not names.is_expert(name) or (exclude_frozen and not p.requires_grad):
            continue
        saved = ["param"]
        if optimizer is not None and id(p) in groups:
            elementwise, _ = split_state(optimizer.state.get(p, {}), shape=p.shape)
            saved += [f"state/{k}" for k in elementwise]
        whole[names.checkpoint_name(name)] = {
            "shape": names.checkpoint_shape(name, p.shape),
            "dtype": dtype_name(p.dtype),
            "group": groups.get(id(p)),
            "requires_grad": p.requires_grad,
            "saved": saved,
            **names.location(name),
        }
    buffers = {
        names.checkpoint_name(n): {"shape": list(b.shape), "dtype": dtype_name(b.dtype), "file": names.file_of(n)}
        for n, b in persistent_buffers(module)[0]
        if names.is_expert(n)
    }
    return {
        "whole": whole,
        "buffers": buffers,
        "excluded": excluded,
        "layers": [layer.describe() for layer in names.layers],
    }


def merge_experts(meta: dict, described: list[dict], names: ExpertNames) -> dict:
    """``meta`` (the first rank's description of the dense part) with every rank's experts."""
    whole, buffers = dict(meta["whole"]), dict(meta["buffers"])
    excluded = set(meta["excluded_frozen"])
    for part in described:
        whole.update(part["whole"])
        buffers.update(part["buffers"])
        excluded.update(part["excluded"])
    layers = described[0]["layers"]
    for layer in layers:
        prefix = f"{layer['module']}.{EXPERTS_INFIX}" if layer["module"] else EXPERTS_INFIX
        ids = {int(n[len(prefix) :].partition(".")[0]) for n in list(whole) + list(buffers) if n.startswith(prefix)}
        if ids and ids != set(range(layer["num_experts"])):
            raise CheckpointError(
                f"MoE layer {layer['module']!r}: the ranks described experts {sorted(ids)}, "
                f"expected 0..{layer['num_experts'] - 1}"
            )
    return dict(
        meta,
        whole=whole,
        buffers=buffers,
        excluded_frozen=sorted(excluded),
        moe={"layers": layers, "num_experts": [layer["num_experts"] for layer in layers]},
    )


def _gathered(t: torch.Tensor, unit, layer: ExpertLayer) -> torch.Tensor | None:
    """The whole flat ``t`` (this rank's shard of ``unit``) on the first rank of its expert-data
    group (None on the others); ``t`` itself where the unit is whole."""
    from zerotrain.comm import collectives

    world = unit.layout.world_size
    t = t.detach()  # an NVMe-swapped tensor (SwappedTensor, _ResidentShard) is read in here
    if world == 1:
        return t.reshape(-1) if layer.edp_rank == 0 else None
    out = torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
    collectives.all_gather_into(out, t.reshape(-1), group=layer.groups.expert_data_group)
    return out if layer.edp_rank == 0 else None


def expert_files(engine, names: ExpertNames, exclude_frozen: bool) -> dict[str, dict]:
    """The per-expert files this rank writes (the first rank of each expert-data group), as
    ``{file name: content}``. Collective over each expert-data group at sharded stages: every
    rank calls it."""
    from zerotrain.checkpoint.layout import (
        group_of_whole,
        persistent_buffers,
        split_state,
        stage_units,
        unit_training_state,
        whole_parameters,
    )

    module, optimizer = engine.module, engine.optimizer
    _refuse_frozen(names, module, exclude_frozen)
    files: dict[str, dict] = {}

    def store(filename: str, name: str, ds_key: str, what: str, value: torch.Tensor, scalars) -> None:
        content = files.setdefault(filename, {PT_TENSORS: {}, SCALARS: {}})
        value = value.detach().to("cpu").clone()  # its own storage: a view would save the whole unit
        content[PT_TENSORS][f"{what}/{name}"] = value
        if what in ("param", "buffer"):
            content[ds_key] = value  # DeepSpeed's key (torch.save stores the storage once)
        if scalars is not None:
            content[SCALARS][name] = scalars

    def put(local: str, what: str, value: torch.Tensor, scalars: dict | None = None) -> None:
        name = names.checkpoint_name(local)
        if not names.is_rows(local):
            store(names.file_of(local), name, name, what, value, scalars)
            return
        # a fused HF parameter: row j is global expert first + j, into that expert's file under
        # DeepSpeed AutoEP's key <name>.<E>
        layer = names.layer_of(local)
        for j in range(layer.num_local):
            expert = layer.global_id(j)
            store(expert_file(layer.layer_id, expert), name, f"{name}.{expert}", what, value[j], scalars)

    for unit in stage_units(engine):
        if not names.expert_unit(unit) or (exclude_frozen and unit.group is None):
            continue
        names.unit_shard_rank(unit, 0)  # checks the unit is sharded over its expert-data group
        layer = names.layer_of(unit.names[0])
        master, elementwise, scalars = unit_training_state(engine, unit, optimizer)
        if optimizer is None or unit.group is None:
            elementwise, scalars = {}, {}
        whole = {"param": _gathered(unit.shard_values(), unit, layer)}
        if master is not None:
            whole["master"] = _gathered(master, unit, layer)
        for key, value in elementwise.items():
            whole[f"state/{key}"] = _gathered(value, unit, layer)
        if layer.edp_rank != 0:
            continue
        for name, slot in unit.named_slots():
            for what, flat in whole.items():
                put(
                    name,
                    what,
                    flat.narrow(0, slot.offset, slot.numel).view(slot.shape),
                    scalars if what == "param" else None,
                )
    groups = group_of_whole(engine)
    for name, p in whole_parameters(engine):
        if not names.is_expert(name) or names.layer_of(name).edp_rank != 0:
            continue
        if exclude_frozen and not p.requires_grad:
            continue
        elementwise, scalars = {}, {}
        if optimizer is not None and id(p) in groups:
            elementwise, scalars = split_state(optimizer.state.get(p, {}), shape=p.shape)
        put(name, "param", p, scalars)
        for key, value in elementwise.items():
            put(name, f"state/{key}", value)
    for name, b in persistent_buffers(module)[0]:
        if names.is_expert(name) and names.layer_of(name).edp_rank == 0:
            put(name, "buffer", b)
    return files


# -- load ---------------------------------------------------------------------------------
def expert_scalars(reader, saved_names) -> dict[str, dict]:
    """``{"param/<name>": scalars}`` of the saved experts ``saved_names`` (from their files,
    checksummed first), keyed as the loader looks scalar state up."""
    by_file: dict[str, list[str]] = {}
    for name in saved_names:
        entry = reader.sources.get(reader.canonical(name))
        # a fused parameter's rows were stepped together: every row file holds the same scalars
        filename = entry[1].get("file", entry[1].get("row_files", [""])[0]) if entry is not None else ""
        if entry is not None and entry[0] == "whole" and EXPERT_FILE.match(filename):
            by_file.setdefault(filename, []).append(name)
    out = {}
    for filename, wanted in by_file.items():
        path: Path = reader.check_file(filename)
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # noqa: BLE001 - name the file
            raise CheckpointError(f"{path} cannot be loaded safely: {error}") from None
        scalars = raw.get(SCALARS, {}) if isinstance(raw, dict) else {}
        for name in wanted:
            if name in scalars:
                out[f"param/{name}"] = scalars[name]
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = [
    "EXPERTS_INFIX",
    "ExpertNames",
    "expert_file",
    "expert_names",
    "describe_experts",
    "merge_experts",
    "expert_files",
    "expert_scalars",
]
