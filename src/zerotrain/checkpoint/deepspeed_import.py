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
import os
import shutil
import time
from pathlib import Path

import torch

from zerotrain.checkpoint.deepspeed_files import DeepSpeedFolder, plain
from zerotrain.checkpoint.deepspeed_params import assign_groups, module_layout
from zerotrain.checkpoint.deepspeed_zero_layouts import ZeroLayouts, hyperparameters
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


class _Converter(ZeroLayouts):
    """One conversion: reads ``source``, writes the zerotrain checkpoint's files into ``folder``
    and returns its metadata. Stage 0's per-parameter state is converted here; ZeRO 1-3's flat
    partitions by ``ZeroLayouts`` (checkpoint/deepspeed_zero_layouts.py)."""

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
        self.hyper = [hyperparameters(g) for g in groups]
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
