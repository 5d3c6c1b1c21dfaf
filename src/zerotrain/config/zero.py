"""The `zero_optimization` section and its `offload_optimizer` / `offload_param` sub-sections.

Field names, aliases and defaults follow DeepSpeed 0.19 (`DeepSpeedZeroConfig`): the stage-3
knobs are stored under their unprefixed names and accept the `stage3_`-prefixed spelling too.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .fields import Float, Int, NonNegInt, Section, aliased, reject_both_spellings

OffloadDevice = Literal["none", "cpu", "nvme"]

#: unprefixed field name -> the `stage3_` spelling DeepSpeed users usually write
STAGE3_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
    "partition_stream_chunk_size": "stage3_partition_stream_chunk_size",
}


class _OffloadBase(Section):
    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False

    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device 'nvme' needs 'nvme_path' (a directory on the NVMe drive)")
        return self


class OffloadOptimizerConfig(_OffloadBase):
    """`zero_optimization.offload_optimizer`: where optimizer states live (none|cpu|nvme)."""

    buffer_count: NonNegInt = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: Float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    convert_grad_on_cpu: bool = True
    cpuadam_cores_perc: Float = Field(0.8, ge=0.0, le=1.0)


class OffloadParamConfig(_OffloadBase):
    """`zero_optimization.offload_param` (stage 3 only): where parameters live (none|cpu|nvme)."""

    buffer_count: NonNegInt = 5
    buffer_size: NonNegInt = int(1e8)
    max_in_cpu: NonNegInt = int(1e9)


class AioConfig(Section):
    """The top-level `aio` section: how NVMe swap files are read and written (zerotrain.offload).

    DeepSpeed's names and defaults. `intra_op_parallelism` (older spelling `thread_count`): I/O
    threads per rank; `block_size`: bytes per read/write system call; `queue_depth`: file
    operations queued at once. `single_submit`, `overlap_events` and `use_gds` choose how
    DeepSpeed's libaio/GDS handle submits; zerotrain's threads over pread/pwrite have no such
    modes, so they are accepted with no effect (use_gds=true is refused)."""

    block_size: NonNegInt = 1048576
    queue_depth: NonNegInt = 8
    intra_op_parallelism: NonNegInt = aliased(1, "intra_op_parallelism", "thread_count")
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    @model_validator(mode="before")
    @classmethod
    def _one_spelling_each(cls, data: Any) -> Any:
        reject_both_spellings(data, {"intra_op_parallelism": "thread_count"})
        return data

    @model_validator(mode="after")
    def _usable(self):
        for name in ("block_size", "queue_depth", "intra_op_parallelism"):
            if getattr(self, name) < 1:
                raise ValueError(f"aio.{name} must be at least 1")
        if self.use_gds:
            raise ValueError(
                "aio.use_gds (GPUDirect Storage) is not implemented by zerotrain's "
                "swapper; remove it or set it to false"
            )
        return self


class LeafModuleConfig(Section):
    """`zero_optimization.leaf_module` (stage 3): modules whose whole subtree is gathered at once.

    Each entry may be a string or a list of strings, as in DeepSpeed. Without the section,
    zerotrain.zero.leaves picks the default (DeepSpeed's three Hugging Face MoE block classes,
    zerotrain's MoE ``Experts``, and the model's ``_no_split_modules``, on the CPU only blocks
    of at most 4 MiB); a given section replaces it."""

    classes: list[str] = Field(default_factory=list)
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class ZeroConfig(Section):
    """`zero_optimization`: ZeRO stage and its tuning knobs, with DeepSpeed's defaults."""

    stage: Int = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: NonNegInt = int(5e8)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: NonNegInt = int(5e8)
    # None means "the default": on at every stage in zerotrain (see effective_overlap_comm).
    overlap_comm: bool | None = None
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    zenflow: dict[str, Any] | None = None
    sub_group_size: NonNegInt = int(1e9)
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    zero_hpz_partition_size: NonNegInt = 1
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: dict[str, Any] | None = None
    mics_shard_size: Int = -1
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    # Stage-3 knobs: unprefixed name, `stage3_` alias.
    prefetch_bucket_size: NonNegInt = aliased(int(5e7), "prefetch_bucket_size", STAGE3_ALIASES["prefetch_bucket_size"])
    param_persistence_threshold: NonNegInt = aliased(
        int(1e5), "param_persistence_threshold", STAGE3_ALIASES["param_persistence_threshold"]
    )
    model_persistence_threshold: NonNegInt = aliased(
        sys.maxsize, "model_persistence_threshold", STAGE3_ALIASES["model_persistence_threshold"]
    )
    max_live_parameters: NonNegInt = aliased(int(1e9), "max_live_parameters", STAGE3_ALIASES["max_live_parameters"])
    max_reuse_distance: NonNegInt = aliased(int(1e9), "max_reuse_distance", STAGE3_ALIASES["max_reuse_distance"])
    gather_16bit_weights_on_model_save: bool = aliased(
        False, "gather_16bit_weights_on_model_save", STAGE3_ALIASES["gather_16bit_weights_on_model_save"]
    )
    module_granularity_threshold: Int = aliased(
        0, "module_granularity_threshold", STAGE3_ALIASES["module_granularity_threshold"]
    )
    use_all_reduce_for_fetch_params: bool = aliased(
        False, "use_all_reduce_for_fetch_params", STAGE3_ALIASES["use_all_reduce_for_fetch_params"]
    )
    allgather_sequential: bool = aliased(False, "allgather_sequential", STAGE3_ALIASES["allgather_sequential"])
    partition_stream_chunk_size: NonNegInt = aliased(
        0, "partition_stream_chunk_size", STAGE3_ALIASES["partition_stream_chunk_size"]
    )

    # Deprecated spellings, mapped onto their replacements after validation.
    cpu_offload: bool | None = None
    cpu_offload_param: bool | None = None
    cpu_offload_use_pin_memory: bool | None = None
    stage3_gather_fp16_weights_on_model_save: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_spelling_each(cls, data: Any) -> Any:
        reject_both_spellings(data, STAGE3_ALIASES)
        return data

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, stage: int) -> int:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"must be 0, 1, 2 or 3, got {stage}")
        return stage

    @model_validator(mode="after")
    def _map_deprecated(self):
        self._map_cpu_offload("cpu_offload", "offload_optimizer", OffloadOptimizerConfig)
        self._map_cpu_offload("cpu_offload_param", "offload_param", OffloadParamConfig)
        if self.cpu_offload_use_pin_memory is not None:
            _deprecated("cpu_offload_use_pin_memory", "offload_optimizer.pin_memory / offload_param.pin_memory")
        if self.stage3_gather_fp16_weights_on_model_save is not None:
            self._map_gather_fp16()
        return self

    @model_validator(mode="after")
    def _partial_offload_needs_stage3(self):
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise ValueError(f"offload_optimizer.ratio < 1 (partial offload) needs stage 3, but stage is {self.stage}")
        return self

    def _map_cpu_offload(self, old: str, new: str, model: type[_OffloadBase]) -> None:
        value = getattr(self, old)
        if value is None:
            return
        _deprecated(old, f'{new}: {{"device": "cpu"}}')
        if new in self.model_fields_set:
            raise ValueError(f"'{old}' (deprecated) and '{new}' cannot both be given; keep '{new}'")
        if value:
            setattr(self, new, model(device="cpu", pin_memory=bool(self.cpu_offload_use_pin_memory)))

    def _map_gather_fp16(self) -> None:
        old, new = "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
        _deprecated(old, new)
        if "gather_16bit_weights_on_model_save" in self.model_fields_set:
            raise ValueError(f"'{old}' (deprecated) and '{new}' cannot both be given; keep '{new}'")
        self.gather_16bit_weights_on_model_save = self.stage3_gather_fp16_weights_on_model_save

    @property
    def effective_overlap_comm(self) -> bool:
        """Whether gradient reductions are launched during backward: `overlap_comm`, on when unset.

        The one value the ZeRO stages use. DeepSpeed leaves it off at stages 0-2 when unset because
        its overlap costs several reduce buckets of extra memory. zerotrain's costs a few staging
        slots (one bucket in all) and, at stages 2-3, frees each unit's full-size gradients during
        backward instead of after it; results are the same either way. So it is on at every stage.
        """
        return True if self.overlap_comm is None else self.overlap_comm

    @property
    def offload_optimizer_device(self) -> str:
        """`offload_optimizer.device`, or "none" when the sub-section is absent."""
        return "none" if self.offload_optimizer is None else self.offload_optimizer.device

    @property
    def offload_param_device(self) -> str:
        """`offload_param.device`, or "none" when the sub-section is absent."""
        return "none" if self.offload_param is None else self.offload_param.device


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"zero_optimization.{old} is deprecated; use zero_optimization.{new}", DeprecationWarning, stacklevel=2
    )


def legacy_zero_section(enabled: bool, allgather_size: Any) -> dict[str, Any]:
    """The dict meaning of the old boolean form `"zero_optimization": true|false` (true = stage 1)."""
    warnings.warn(
        '"zero_optimization": true/false is deprecated; use "zero_optimization": {"stage": N}',
        DeprecationWarning,
        stacklevel=2,
    )
    if not enabled:
        return {"stage": 0}
    return {"stage": 1, "allgather_bucket_size": int(5e8) if allgather_size is None else allgather_size}
