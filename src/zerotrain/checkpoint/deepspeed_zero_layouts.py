"""``zerotrain convert-deepspeed``'s ZeRO 1-3 layouts (the converter is ``_Converter`` in
checkpoint/deepspeed_import.py, whose docstring describes the mapping): DeepSpeed's per-rank fp32
flat partitions and their elementwise optimizer state become zerotrain units with the same
partitions, one rank's file at a time, written as that rank's shard file.

- ZeRO 1-2: one unit per optimizer param group (a MoE checkpoint's expert group: one per expert
  rank), the parameters at the offsets ``param_shapes`` and the alignment paddings give.
- ZeRO 3: one unit per parameter, ``ceil(numel / world)`` elements per rank; frozen parameters
  are gathered from every rank's model-states file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerotrain.checkpoint.deepspeed_experts import ByExpertRank
from zerotrain.checkpoint.deepspeed_files import DeepSpeedFolder, plain
from zerotrain.checkpoint.deepspeed_params import ModuleLayout, unit_entry
from zerotrain.checkpoint.format import CheckpointError, shard_file, write_safetensors

if TYPE_CHECKING:
    from zerotrain.checkpoint.deepspeed_experts import DeepSpeedExperts


class ZeroLayouts:
    """The ZeRO 1-3 part of a conversion (a base of ``_Converter``, which sets the state below)."""

    source: DeepSpeedFolder
    folder: Path
    main: dict
    layout: ModuleLayout
    dtype: torch.dtype
    mixed: bool
    files: dict[str, dict]
    units: list[dict]
    scalars: dict[str, dict]
    hyper: list[dict]
    scaler: dict | None
    experts: DeepSpeedExperts | None
    config: dict[str, Any]

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
        self.hyper = [hyperparameters(g) for g in torch_state["param_groups"]]
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

    def _write_shard(self, rank: int, tensors: dict) -> None:
        self.files[shard_file(rank)] = write_safetensors(self.folder / shard_file(rank), tensors, {"format": "pt"})


def hyperparameters(group: dict) -> dict:
    """An optimizer param group's settings: all but its parameters."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}
