"""A pipeline engine's checkpoint: DeepSpeed's layout, zerotrain's guarantees.

One tag folder holds every stage's files (P stages, D data ranks per stage)::

    <tag>/layer_XX-model_states.pt                 each stateful layer's state_dict, by GLOBAL
                                                   layer index (the stage's first data rank,
                                                   PipelineModule.save_state_dict)
    <tag>/mp_rank_{s:02d}_model_states.pt          stage s: DeepSpeed's keys (module None,
                                                   counters, lr_scheduler, ds_config, client
                                                   state) + the stage's whole parameters, their
                                                   optimizer state and buffers
    <tag>/[bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt   data rank d of stage s: its
                                                   shard of every flat unit (parameters, fp32
                                                   masters, optimizer state)
    <tag>/state.mp_rank_{s:02d}.rank{d:05d}.pt     data rank d of stage s: counters, RNG, scalar
                                                   optimizer state (as state.rank*.pt)
    <tag>/metadata.json                            every stage's layout by parameter name, every
                                                   file's sha256 (the commit merges the stages')

Unit ids are prefixed by their stage (``s1u0``) so one metadata describes every stage; the
parameter names are the ``PipelineModule``'s (global layer index: ``3.weight``, as an
``nn.Sequential`` of the same layers names them), so the by-name loader reshards to any number
of stages or data ranks, or into a non-pipeline engine.
"""

from __future__ import annotations

import torch

from zerotrain.checkpoint.format import (
    MODEL_FILE,
    PT_TENSORS,
    pipe_model_file,
    pipe_optim_file,
    pipe_state_file,
    shard_file,
    state_file,
)
from zerotrain.checkpoint.stateful import COUNTERS, LR_SCHEDULER


class FileNames:
    """Where a data-parallel engine's rank writes (zerotrain's own layout). An engine declares its
    layout (``engine.checkpoint_layout()``): this one, or a pipeline stage's
    (:class:`PipelineFileNames`); the checkpoint code asks it, never the engine's type."""

    pipeline = False
    stage: int | None = None
    stages = 1

    def shard(self, rank: int) -> str:
        return shard_file(rank)

    @property
    def model(self) -> str:
        return MODEL_FILE

    def state(self, rank: int) -> str:
        return state_file(rank)

    def unit_key(self, i: int) -> str:
        return f"u{i}"

    def elsewhere(self, name: str) -> bool:
        """Whether a saved parameter or buffer ``name`` belongs to another rank's part of the
        model (a load expects it there rather than calling it unexpected)."""
        return False


class PipelineFileNames(FileNames):
    """DeepSpeed's names for stage ``stage`` of ``stages`` (``bf16_`` optimizer files in bf16, as
    DeepSpeed); ``elsewhere(name)``: whether a saved name is a layer another stage holds."""

    pipeline = True

    def __init__(self, stage: int, stages: int, bf16: bool, elsewhere=None):
        self.stage, self.stages, self.bf16 = stage, stages, bf16
        self._elsewhere = elsewhere

    def shard(self, rank: int) -> str:
        return pipe_optim_file(rank, self.stage, self.bf16)

    @property
    def model(self) -> str:
        return pipe_model_file(self.stage)

    def state(self, rank: int) -> str:
        return pipe_state_file(rank, self.stage)

    def unit_key(self, i: int) -> str:
        return f"s{self.stage}u{i}"

    def elsewhere(self, name: str) -> bool:
        return self._elsewhere is not None and self._elsewhere(name)


def is_pipeline(engine) -> bool:
    return engine.checkpoint_layout().pipeline


def file_names(engine) -> FileNames:
    return engine.checkpoint_layout()


class _LayerCollector:
    """A ``checkpoint_engine`` for ``PipelineModule.save_state_dict`` that keeps each layer's
    state dict (already cloned by it) instead of writing: the save writes, hashes and commits it
    with the rest (synchronously or from its background thread)."""

    def __init__(self):
        self.files: dict[str, dict] = {}

    def makedirs(self, path, exist_ok=True) -> None:
        pass

    def save(self, state: dict, path) -> None:
        self.files[str(path).rsplit("/", 1)[-1]] = state


def layer_files(engine, exclude_frozen: bool) -> dict[str, dict]:
    """``{layer file name: state dict}`` of this stage's layers (on its first data rank; with
    ``checkpoint_parallel_write_pipeline`` the stage's data ranks split them)."""
    collector = _LayerCollector()
    engine.module.save_state_dict("", checkpoint_engine=collector, exclude_frozen_params=exclude_frozen)
    return collector.files


def model_states(engine, tensors: dict, engine_state: dict, client_state: dict) -> dict:
    """This stage's ``mp_rank_XX_model_states.pt``: DeepSpeed's keys with
    ``module`` None (the weights are in the layer files), then the client state's keys, as
    DeepSpeed merges them; the stage's whole tensors under ``PT_TENSORS``. Values are already
    encoded for ``weights_only`` loading."""
    import zerotrain

    counters = engine_state[COUNTERS]
    out = {
        "module": None,
        "buffer_names": [k.removeprefix("buffer/") for k in tensors if k.startswith("buffer/")],
        "optimizer": None,
        "lr_scheduler": engine_state.get(LR_SCHEDULER),
        "sparse_tensor_module_names": [],
        "skipped_steps": counters["skipped_steps"],
        "global_steps": counters["global_steps"],
        "global_samples": counters["global_samples"],
        "dp_world_size": engine.dp_world_size,
        "mp_world_size": engine.checkpoint_layout().stages,
        "ds_config": engine.config.raw,
        "ds_version": zerotrain.__version__,
    }
    for key, value in client_state.items():
        out.setdefault(key, value)
    out[PT_TENSORS] = {k: _own_storage(v) for k, v in tensors.items()}
    return out


def _own_storage(t):
    """A tensor ``torch.save`` writes alone (a view would drag its whole storage into the file);
    an NVMe-swapped one is read into memory."""
    if hasattr(t, "pieces") and not torch.is_tensor(t):
        return torch.cat([p.reshape(-1) for p in t.pieces()]).view(t.shape)
    t = t.detach()
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def shard_content(tensors: dict) -> dict:
    """A ``zero_pp_rank_*_optim_states.pt`` file's content."""
    import zerotrain

    return {"ds_version": zerotrain.__version__, PT_TENSORS: {k: _own_storage(v) for k, v in tensors.items()}}


def merge_stages(metas: list[dict]) -> dict:
    """One metadata for the tag from every stage's description (stage order). A tied parameter
    that several stages hold (the same name) is kept once, from its lowest stage: its copies are
    equal after every step."""
    metas = sorted(metas, key=lambda m: m["pipeline"]["stage"])
    merged = dict(metas[0])
    merged["units"], merged["whole"], merged["buffers"], merged["aliases"] = [], {}, {}, {}
    keys, frozen, excluded, layer_names, seen = {}, set(), set(), [], set()
    for meta in metas:
        for unit in meta["units"]:
            unit = dict(unit, params=[p for p in unit["params"] if p[0] not in seen])
            merged["units"].append(unit)
        for name, entry in meta["whole"].items():
            if name not in seen and name not in merged["whole"]:
                merged["whole"][name] = entry
        for name, entry in meta["buffers"].items():
            merged["buffers"].setdefault(name, entry)
        for alias, name in meta["aliases"].items():
            merged["aliases"].setdefault(alias, name)
        seen.update(p[0] for u in meta["units"] for p in u["params"])
        seen.update(meta["whole"])
        keys.update(dict.fromkeys(meta["keys"]))
        frozen.update(meta["frozen"])
        excluded.update(meta["excluded_frozen"])
        layer_names += meta["pipeline"]["layer_files"]
    merged.update(
        keys=list(keys),
        frozen=sorted(frozen),
        excluded_frozen=sorted(excluded),
        param_groups=max(m["param_groups"] for m in metas),
    )
    merged["pipeline"] = {
        "stages": len(metas),
        "data_size": metas[0]["world_size"],
        "parts": metas[0]["pipeline"]["parts"],
        "layer_files": sorted(layer_names),
    }
    return merged


def annotate_stage(meta: dict, engine, names: FileNames) -> dict:
    """This stage's description (``layout.describe``) with where each of its tensors lives:
    unit keys and their shard files, the stage's model-states file, its layer files."""
    from torch import nn

    for unit in meta["units"]:
        unit["key"] = names.unit_key(unit["id"])
        unit["files"] = [names.shard(rank) for rank in range(unit["world_size"])]
    for entry in list(meta["whole"].values()) + list(meta["buffers"].values()):
        entry["file"] = names.model
    module = engine.module
    layer_names = [
        module.ckpt_layer_path("", i) for i, layer in enumerate(module.forward_funcs) if isinstance(layer, nn.Module)
    ]
    meta["pipeline"] = {"stage": names.stage, "parts": list(module.parts), "layer_files": layer_names}
    return meta
