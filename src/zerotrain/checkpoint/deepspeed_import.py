"""``zerotrain convert-deepspeed``: a DeepSpeed 0.1x checkpoint (ZeRO stage 0-3, fp32/fp16/bf16)
as a zerotrain checkpoint that ``engine.load_checkpoint`` loads on any world size and stage.

What is converted: the weights (and persistent buffers, frozen and tied parameters), the fp32
master weights, the elementwise optimizer state (Adam's moments, ...) and its scalars (``step``),
the optimizer param groups' hyperparameters, the LR scheduler's state, the loss scaler, the
engine counters, and the client state ``save_checkpoint(client_state=...)`` added. DeepSpeed
saves no random-number state and no dataloader position: those stay as the new run has them.

DeepSpeed's layouts map onto zerotrain's without gathering anything:

- ZeRO 1-2 (and bf16's ``BF16_Optimizer``): each optimizer param group is one flat fp32 buffer
  split into equal partitions, one per rank; it becomes one flat unit with the same partitions,
  the parameters at the offsets DeepSpeed's ``param_shapes`` order (and alignment paddings)
  give. Each rank's file is converted on its own, so memory holds one rank's partition.
- ZeRO 3: every parameter is split into ``ceil(numel / world)`` elements per rank; each
  parameter becomes a unit of its own with those partitions.
- Stage 0: the whole optimizer state, per parameter (``torch.optim`` state, or fp16/bf16's
  ``FP16_UnfusedOptimizer`` with its fp32 copies) becomes whole parameters. DeepSpeed records
  that state by position, not by name: names come from torch's ``param_names`` where the
  optimizer was built with named parameters, else from matching the groups' shapes against the
  model's parameter order (one group: the model's order), else from ``param_groups``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch

from zerotrain.checkpoint.deepspeed_experts import ByExpertRank
from zerotrain.checkpoint.deepspeed_files import DeepSpeedFolder, plain
from zerotrain.checkpoint.deepspeed_params import assign_groups, module_layout, unit_entry
from zerotrain.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    METADATA,
    MODEL_FILE,
    CheckpointError,
    dtype_name,
    encode_metadata,
    file_digest,
    shard_file,
    state_file,
    write_safetensors,
)
from zerotrain.checkpoint.stateful import COUNTERS, LOSS_SCALER, LR_SCHEDULER
from zerotrain.checkpoint.training_state import plain as plain_state

logger = logging.getLogger("zerotrain")

# Keys of DeepSpeed's model-states file that are its own; the rest is the client state.
DEEPSPEED_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
    "sparse_tensor_module_names",
    "num_experts",
}


def convert_deepspeed_checkpoint(
    checkpoint_dir, output_dir, tag: str | None = None, param_groups: list[list[str]] | None = None
) -> Path:
    """Convert DeepSpeed's checkpoint ``checkpoint_dir`` (``tag``, else the one its ``latest``
    names; or a tag folder itself) into ``output_dir/<tag>`` and point ``output_dir/latest`` at
    it. ``param_groups`` (each optimizer param group's parameter names, in the optimizer's
    order) is needed only for a stage-0 checkpoint whose groups cannot be told apart by shape.
    Returns the new checkpoint's folder."""
    source = DeepSpeedFolder(checkpoint_dir, tag)
    out = Path(output_dir)
    final = out / source.tag
    if final.exists():
        raise CheckpointError(f"{final} already exists: remove it or convert into another folder")
    partial = out / f".{source.tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        meta = _Converter(source, partial, param_groups).run()
        (partial / METADATA).write_bytes(encode_metadata(meta))  # with its own digest
        from zerotrain.checkpoint.save import SCRIPT_NAMES, SCRIPTS

        here = Path(__file__).resolve().parent
        for script in SCRIPTS:  # the standalone consolidation script, as in every checkpoint
            shutil.copyfile(here / script, partial / SCRIPT_NAMES[script])
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    tmp = out / f".{LATEST}.tmp"
    tmp.write_text(source.tag)
    os.replace(tmp, out / LATEST)
    logger.info("converted DeepSpeed checkpoint %s into %s", source.folder, final)
    return final


class _Converter:
    def __init__(self, source: DeepSpeedFolder, folder: Path, param_groups):
        self.source, self.folder, self.user_groups = source, folder, param_groups
        self.main = source.model_states(0)
        if self.main.get("mp_world_size", 1) != 1:
            raise CheckpointError(
                f"{source.folder}: mp_world_size is {self.main['mp_world_size']}; "
                "only data-parallel checkpoints can be converted"
            )
        config = self.main.get("ds_config")
        self.config = config if isinstance(config, dict) else {}
        self.stage = self._stage()
        self.layout = module_layout(self.main, source.folder, self.stage == 3)
        del self.main["module"]  # the layout holds what is needed; trainable values go early
        self.dtype = self.layout.dtype
        self.mixed = self.dtype != torch.float32
        self.files: dict[str, dict] = {}
        self.model_tensors: dict[str, torch.Tensor] = {}
        self.whole: dict[str, dict] = {}
        self.units: list[dict] = []
        self.scalars: dict[str, dict] = {}
        self.hyper: list[dict] = []
        self.scaler: dict | None = None
        self.experts = None  # a MoE checkpoint's DeepSpeedExperts (ZeRO 1-2)
        self.moe: dict | None = None

    # -- the whole conversion ----------------------------------------------------------------
    def run(self) -> dict:
        stage = self.stage
        if stage == 0:
            self._stage0()
        elif stage in (1, 2):
            self._zero12()
        else:
            self._zero3()
        if self.experts is not None:  # expert buffers and frozen experts, every expert's key
            self.moe = self.experts.add_module_values(self.layout, self.units, set(self.main.get("buffer_names") or []))
        for name, value in self.layout.frozen.items():
            self._add_whole(
                name, value.to(self.dtype) if value.is_floating_point() else value, None, requires_grad=False
            )
        for name, value in self.layout.buffers.items():
            self.model_tensors[f"buffer/{name}"] = value
        self.files[MODEL_FILE] = write_safetensors(self.folder / MODEL_FILE, self.model_tensors, {"format": "pt"})
        self._write_state()
        return self._metadata(stage)

    def _stage(self) -> int:
        stage = self.config.get("zero_optimization", {}).get("stage")
        if not isinstance(stage, int):
            stage = 3 if len(self.source.model_files) > 1 else (1 if self.source.optim_files else 0)
        if stage > 0 and not self.source.optim_files:
            raise CheckpointError(
                f"{self.source.folder}: a ZeRO stage {stage} checkpoint without "
                "its *_optim_states.pt files (copy every rank's file)"
            )
        if stage == 0 and self.source.optim_files:
            raise CheckpointError(
                f"{self.source.folder}: a stage-0 checkpoint with per-rank optimizer files "
                "(DeepSpeed's BF16_Optimizer without ZeRO, as some DeepSpeed versions wrote for "
                "bf16 at stage 0) records no parameter shapes and cannot be converted; save it "
                "with ZeRO stage 1 instead"
            )
        if self.source.expert_files and stage != 2 and stage != 1:
            raise CheckpointError(
                f"{self.source.folder}: a mixture-of-experts checkpoint at ZeRO stage {stage} "
                "cannot be converted yet; only ZeRO stages 1-2 with MoE layers can"
            )
        if stage > 0 and self.user_groups is not None:
            raise CheckpointError(
                "param_groups (--param-groups) applies to stage-0 checkpoints "
                f"only; {self.source.folder} is ZeRO stage {stage}, whose files "
                "name every parameter: leave it out"
            )
        return stage

    # -- stage 0: per-parameter optimizer state in the model-states file ---------------------
    def _stage0(self) -> None:
        saved = self.main.get("optimizer")
        if saved is None:
            raise CheckpointError(
                f"{self.source.model_files[0]} holds no optimizer state (saved without an optimizer): nothing to resume"
            )
        if "fp32_groups_flat" in saved:
            raise CheckpointError(
                f"{self.source.model_files[0]}: DeepSpeed's fused FP16_Optimizer checkpoint "
                "(fp16 without ZeRO, FusedAdam) cannot be converted yet; resave with ZeRO stage 1"
            )
        masters = saved.get("fp32_groups")  # FP16_UnfusedOptimizer (fp16/bf16 without ZeRO)
        torch_state = saved["optimizer_state_dict"] if masters is not None else saved
        if "state" not in torch_state or "param_groups" not in torch_state:
            raise CheckpointError(
                f"{self.source.model_files[0]}: 'optimizer' is not a torch "
                f"optimizer state dict (keys {sorted(saved)[:8]})"
            )
        groups = torch_state["param_groups"]
        indices = [list(g["params"]) for g in groups]
        shapes = [
            [self._stage0_shape(torch_state, masters, g, i, index) for i, index in enumerate(ids)]
            for g, ids in enumerate(indices)
        ]
        names = self._stage0_names(groups, shapes)
        for g, (group_names, ids) in enumerate(zip(names, indices)):
            for i, (name, index) in enumerate(zip(group_names, ids)):
                value = self.layout.values.pop(name)
                state = torch_state["state"].get(index, {})
                master = masters[g][i] if masters is not None else None
                self._add_whole(name, value, g, state=state, master=master)
        self.layout.frozen.update(self.layout.values)  # in no optimizer group
        self.layout.values.clear()
        self.hyper = [_hyperparameters(g) for g in groups]
        if masters is not None:
            fp16 = self.config.get("fp16", {})
            self.scaler = {
                "cur_scale": float(saved.get("cur_scale", 1.0)),
                "cur_iter": int(saved.get("cur_iter", 0)),
                "last_overflow_iter": int(saved.get("last_overflow_iter", -1)),
                "cur_hysteresis": int(fp16.get("hysteresis", 2)),
            }

    @staticmethod
    def _stage0_shape(torch_state, masters, g, i, index):
        if masters is not None:
            return tuple(masters[g][i].shape)
        for value in torch_state["state"].get(index, {}).values():
            if torch.is_tensor(value) and value.dim() > 0:
                return tuple(value.shape)
        return None  # no state yet: matches any shape

    def _stage0_names(self, groups, shapes) -> list[list[str]]:
        where = str(self.source.model_files[0])
        if self.user_groups is not None:
            named = [list(g) for g in self.user_groups]
        elif all("param_names" in g for g in groups):
            named = [list(g["param_names"]) for g in groups]
        else:
            return assign_groups(self.layout.order, shapes, where)
        if [len(g) for g in named] != [len(s) for s in shapes]:
            raise CheckpointError(
                f"{where}: the optimizer has groups of {[len(s) for s in shapes]} "
                f"parameters, the names given list {[len(g) for g in named]}"
            )
        for group_names, group_shapes in zip(named, shapes):
            for name, shape in zip(group_names, group_shapes):
                if name not in self.layout.values:
                    raise CheckpointError(f"{where}: {name!r} is not a parameter of the saved module")
                if shape is not None and tuple(self.layout.values[name].shape) != shape:
                    raise CheckpointError(
                        f"{where}: {name} has shape {tuple(self.layout.values[name].shape)}, "
                        f"its optimizer state {shape}"
                    )
        return named

    # -- ZeRO 1-2: one flat buffer per param group, in equal partitions ----------------------
    def _zero12(self) -> None:
        shapes = self._param_shapes()
        ranks = sorted(self.source.optim_files)
        plan = []
        for rank in ranks:
            saved = self.source.optim_states(rank)
            if "single_partition_of_fp32_groups" not in saved:
                raise CheckpointError(
                    f"{self.source.optim_files[rank]} has no fp32 partitions: not a ZeRO stage 1-2 optimizer file"
                )
            base = saved.get("base_optimizer_state")
            if not isinstance(base, dict):
                raise CheckpointError(
                    f"{self.source.optim_files[rank]}: an elastic checkpoint "
                    "(zero_optimization.elastic_checkpoint) cannot be converted; "
                    "save with elastic_checkpoint: false"
                )
            flats = saved["single_partition_of_fp32_groups"]
            if rank == 0:
                if self.source.expert_files:
                    from zerotrain.checkpoint.deepspeed_experts import DeepSpeedExperts

                    self.experts = DeepSpeedExperts(
                        self.source, self.main, self.config, base["param_groups"], len(ranks)
                    )
                plan = self._plan12(saved, shapes, flats, len(ranks))
                for units, group in zip(plan, base["param_groups"]):  # one flat tensor per group
                    for unit in units.values() if isinstance(units, ByExpertRank) else [units]:
                        unit["_source"] = group["params"][0]
                self._rank0_optimizer(saved, base)
            # an expert group: this rank holds expert-parallel rank r % N's partition r // N
            mine = [
                (units[rank % self.experts.groups[g]], rank // self.experts.groups[g])
                if isinstance(units, ByExpertRank)
                else (units, rank)
                for g, units in enumerate(plan)
            ]
            tensors = {}
            for (unit, _), flat in zip(mine, flats):
                state = base["state"].get(unit["_source"], {})
                tensors.update(self._unit_tensors(unit, rank, flat, state, 0))
            self._check_slices(saved, [u for u, _ in mine], [part for _, part in mine], rank)
            self._write_shard(rank, tensors)
            del saved, base, flats, tensors

    def _plan12(self, saved, shapes, flats, world) -> list:
        """One unit per param group; for a MoE checkpoint's expert group, ``{ep_rank: unit}``."""
        counts = saved.get("partition_count", world)
        paddings = saved.get("param_alignment_paddings")
        units = []
        experts = self.experts.groups if self.experts is not None else {}
        for g, (group_shapes, flat) in enumerate(zip(shapes, flats)):
            count = counts[g] if isinstance(counts, list) else counts
            if g in experts:
                units.append(
                    self.experts.plan_group(g, group_shapes, flat, count, paddings, self.units, self.dtype, self.mixed)
                )
                continue
            if count != world:
                raise CheckpointError(
                    f"{self.source.optim_files[0]}: param group {g} is partitioned "
                    f"over {count} ranks, the checkpoint has {world} rank files "
                    "(expert/sub-group parallelism cannot be converted)"
                )
            params, offset = [], 0
            for i, (name, shape) in enumerate(group_shapes.items()):
                numel = math.prod(shape)
                params.append([name, offset, numel, list(shape)])
                offset += numel + (paddings[g][i] if paddings is not None else 0)
            units.append(unit_entry(len(self.units), g, self.dtype, world, flat.numel(), params, self.mixed))
            self.units.append(units[-1])
        return units

    def _check_slices(self, saved, plan, parts, rank) -> None:
        """DeepSpeed's own record of which parameter elements this rank holds must agree
        (``parts``: which partition of each unit this rank holds)."""
        for unit, part, mapping in zip(plan, parts, saved.get("param_slice_mappings") or []):
            local = unit.get("_local", {})
            starts = {local.get(name, name): (offset, numel) for name, offset, numel, _ in unit["params"]}
            shard = unit["shard_numel"]
            for name, address in mapping.items():
                offset, numel = starts.get(name, (None, None))
                address = plain(address, name)
                begin = max(offset, part * shard) if offset is not None else None
                if (
                    begin != part * shard + address["start"]
                    or address["numel"] != min(offset + numel, (part + 1) * shard) - begin
                ):
                    raise CheckpointError(
                        f"{self.source.optim_files[rank]}: {name} is at {address} of this rank's "
                        f"partition, not where the parameter order puts it: unexpected layout"
                    )

    # -- ZeRO 3: every parameter partitioned on its own --------------------------------------
    def _zero3(self) -> None:
        shapes = self._param_shapes()
        ranks = sorted(self.source.optim_files)
        world = len(ranks)
        if sorted(self.source.model_files) != ranks:
            raise CheckpointError(
                f"{self.source.folder}: model-states files of ranks "
                f"{sorted(self.source.model_files)}, optimizer files of {ranks}"
            )
        self._frozen3(world)
        plan = []  # per sub-group: [(unit, start in the rank's flat)]
        for rank in ranks:
            saved = self.source.optim_states(rank)
            if "fp32_flat_groups" not in saved:
                raise CheckpointError(
                    f"{self.source.optim_files[rank]} has no fp32_flat_groups: not a ZeRO stage 3 optimizer file"
                )
            torch_state = saved["optimizer_state_dict"]
            flats = saved["fp32_flat_groups"]
            if rank == 0:
                owner = {i: g for g, group in enumerate(torch_state["param_groups"]) for i in group["params"]}
                plan = self._plan3(shapes, flats, owner, world)
                self._rank0_optimizer(saved, torch_state)
            tensors = {}
            for sub, (pieces, flat) in enumerate(zip(plan, flats)):
                state = torch_state["state"].get(sub, {})
                for unit, start in pieces:
                    tensors.update(self._unit_tensors(unit, rank, flat, state, start))
            self._write_shard(rank, tensors)
            del saved, torch_state, flats, tensors

    def _plan3(self, shapes, flats, owner, world) -> list[list]:
        if len(shapes) != len(flats):
            raise CheckpointError(
                f"{self.source.folder}: {len(shapes)} parameter sub-groups in "
                f"param_shapes, {len(flats)} fp32 flat groups"
            )
        plan = []
        for sub, (group_shapes, flat) in enumerate(zip(shapes, flats)):
            pieces, start = [], 0
            for name, shape in group_shapes.items():
                numel = math.prod(shape)
                shard = -(-numel // world)
                unit = unit_entry(
                    len(self.units), owner[sub], self.dtype, world, shard, [[name, 0, numel, list(shape)]], self.mixed
                )
                unit["_source"] = sub
                self.units.append(unit)
                pieces.append((unit, start))
                start += shard
            if start != flat.numel():
                raise CheckpointError(
                    f"{self.source.optim_files[0]}: sub-group {sub} holds "
                    f"{flat.numel()} elements per rank, its parameters need {start}"
                )
            plan.append(pieces)
        return plan

    def _frozen3(self, world) -> None:
        """Frozen parameters at stage 3: each rank's model-states file holds its partition."""
        shapes = self.main.get("frozen_param_shapes") or {}
        if not shapes:
            return
        fragments = [self.main["frozen_param_fragments"]]
        fragments += [self.source.model_states(r)["frozen_param_fragments"] for r in range(1, world)]
        for name, shape in shapes.items():
            whole = torch.cat([f[name].reshape(-1) for f in fragments])
            self.layout.frozen[name] = whole[: math.prod(shape)].view(tuple(shape)).clone()

    # -- pieces shared by the ZeRO layouts ---------------------------------------------------
    def _param_shapes(self) -> list[dict]:
        shapes = self.main.get("param_shapes")
        if not shapes:
            raise CheckpointError(
                f"{self.source.model_files[0]} has no param_shapes: not a ZeRO checkpoint of DeepSpeed 0.1x"
            )
        for group in shapes:
            for name in group:
                self.layout.values.pop(name, None)  # trainable: its values come from the masters
        self.layout.frozen.update(self.layout.values)  # the rest: frozen at stages 1-2
        self.layout.values.clear()
        return [{name: tuple(shape) for name, shape in group.items()} for group in shapes]

    def _rank0_optimizer(self, saved, torch_state) -> None:
        """Scalar optimizer state per unit, the groups' hyperparameters and the loss scaler."""
        for index, state in torch_state["state"].items():
            scalars = {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}
            for unit in self.units:
                if unit["_source"] == index:
                    self.scalars[f"u{unit['id']}"] = scalars
        self.hyper = [_hyperparameters(g) for g in torch_state["param_groups"]]
        scaler = saved.get("loss_scaler")
        if scaler is not None:
            scaler = plain(scaler, "loss_scaler")
            self.scaler = {"cur_scale": float(scaler["cur_scale"])}
            if scaler.get("dynamic"):
                self.scaler.update(
                    cur_iter=int(scaler["cur_iter"]),
                    last_overflow_iter=int(scaler["last_overflow_iter"]),
                    cur_hysteresis=int(scaler["cur_hysteresis"]),
                )

    def _unit_tensors(self, unit, rank, flat, state, start) -> dict[str, torch.Tensor]:
        """This rank's partition of ``unit``: elements ``[start, start + shard_numel)`` of the
        rank's fp32 flat buffer and of every elementwise optimizer state (zero past the end)."""

        def piece(t):
            out = t.reshape(-1)[start : start + unit["shard_numel"]].float()
            if out.numel() < unit["shard_numel"]:  # DeepSpeed dropped the padding of the last rank
                out = torch.cat([out, out.new_zeros(unit["shard_numel"] - out.numel())])
            return out

        key = f"u{unit['id']}"
        master = piece(flat)
        tensors = {f"{key}/param": master.to(self.dtype)}
        if self.mixed:
            tensors[f"{key}/master"] = master
        for name, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"{key}/state/{name}"] = piece(value)
                if f"state/{name}" not in unit["saved"]:
                    unit["saved"].append(f"state/{name}")
        return tensors

    def _add_whole(self, name, value, group, state=None, master=None, requires_grad=True) -> None:
        saved = ["param"]
        self.model_tensors[f"param/{name}"] = value
        if master is not None:
            self.model_tensors[f"master/{name}"] = master.float().reshape(value.shape)
            saved.append("master")
        scalars = {}
        for key, v in (state or {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                self.model_tensors[f"state/{key}/{name}"] = v.reshape(value.shape)
                saved.append(f"state/{key}")
            else:
                scalars[key] = v
        if state:
            self.scalars[f"param/{name}"] = scalars
        self.whole[name] = {
            "shape": list(value.shape),
            "dtype": dtype_name(value.dtype),
            "group": group,
            "requires_grad": requires_grad,
            "saved": saved,
        }

    def _write_shard(self, rank: int, tensors: dict) -> None:
        self.files[shard_file(rank)] = write_safetensors(self.folder / shard_file(rank), tensors, {"format": "pt"})

    # -- small state and metadata ------------------------------------------------------------
    def _write_state(self) -> None:
        main = self.main
        gas = self.config.get("gradient_accumulation_steps")
        gas = gas if isinstance(gas, int) and gas > 0 else 1
        # the engine's components (zerotrain.checkpoint.stateful) DeepSpeed's files hold
        engine = {
            COUNTERS: {
                "global_steps": int(main.get("global_steps", 0)),
                "global_samples": int(main.get("global_samples", 0)),
                "skipped_steps": int(main.get("skipped_steps", 0)),
                "micro_steps": int(main.get("global_steps", 0)) * gas,
            },
            LOSS_SCALER: self.scaler or {"cur_scale": 1.0},
        }
        if main.get("lr_scheduler") is not None:
            engine[LR_SCHEDULER] = self._plain(main["lr_scheduler"], "lr_scheduler")
        for key in ("data_sampler", "random_ltd"):
            if main.get(key) is not None:
                logger.warning(
                    "%s: DeepSpeed's %s state is not converted (zerotrain has no "
                    "equivalent); the new run starts it afresh",
                    self.source.folder,
                    key,
                )
        client = {k: v for k, v in main.items() if k not in DEEPSPEED_KEYS}
        state = {
            "rank": 0,
            "world_size": self._world(),
            "scalars": self._plain(self.scalars, "optimizer state"),
            "param_groups": [self._plain(g, f"param_groups[{i}]") for i, g in enumerate(self.hyper)],
            "engine": engine,
            "client_state": self._plain(client, "client_state"),
        }
        path = self.folder / state_file(0)
        torch.save(state, path)
        self.files[state_file(0)] = {"sha256": file_digest(path), "bytes": path.stat().st_size}

    def _plain(self, value, where):
        try:
            return plain_state(plain(value, where), where)
        except TypeError as error:
            raise CheckpointError(f"{self.source.model_files[0]}: {error}") from None

    def _world(self) -> int:
        return len(self.source.optim_files) or int(self.main.get("dp_world_size", 1))

    def _metadata(self, stage: int) -> dict:
        import zerotrain

        for unit in self.units:
            unit.pop("_source", None)
            unit.pop("_local", None)
        layout = self.layout
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "tag": self.source.tag,
            "zerotrain_version": zerotrain.__version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": self._world(),
            "stage": stage,
            "param_dtype": dtype_name(self.dtype),
            "mixed_precision": self.mixed,
            "global_steps": int(self.main.get("global_steps", 0)),
            "global_samples": int(self.main.get("global_samples", 0)),
            "units": self.units,
            "whole": self.whole,
            "buffers": {n: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)} for n, b in layout.buffers.items()},
            "aliases": layout.aliases,
            "keys": layout.keys,
            "frozen": [n for n, e in self.whole.items() if not e["requires_grad"]],
            "excluded_frozen": [],
            "param_groups": len(self.hyper),
            "config": self.config or None,
            "files": self.files,
            **({"moe": self.moe} if self.moe is not None else {}),
            "converted_from": {
                "program": "deepspeed",
                "version": self.main.get("ds_version"),
                "folder": str(self.source.folder),
                "stage": stage,
            },
        }


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}
