"""Pydantic models for every section of a zerotrain / DeepSpeed JSON config.

Names and defaults follow DeepSpeed 0.19 so that an existing ds_config.json validates unchanged.
`ZeroTrainConfig` is the root; build it with `load_config`, which also fills in the batch triple.
"""

from __future__ import annotations

import copy
import difflib
import os
import warnings
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BeforeValidator,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .batch import resolve_batch_sizes
from .errors import UnknownConfigKeyWarning
from .fields import (
    BatchSize,
    FiniteFloat,
    Float,
    GradAccum,
    Int,
    LowerStr,
    NonNegInt,
    PosInt,
    Section,
    known_keys,
    lower,
    reject_both_spellings,
    steps_or_never,
)
from .pipeline import PipelineConfig
from .ranges import MAX_LOSS_SCALE, MAX_SCALE_POWER, in_range, optimizer_param_problems, scheduler_param_problems
from .zero import ZeroConfig, legacy_zero_section


class OptimizerConfig(Section):
    """`optimizer`: `type` is a DeepSpeed or torch.optim name, `params` its keyword arguments."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False

    @field_validator("params")
    @classmethod
    def _no_max_grad_norm(cls, params: dict[str, Any]) -> dict[str, Any]:
        if "max_grad_norm" in params:
            raise ValueError(
                "max_grad_norm is not allowed here (DeepSpeed rejects it too); "
                "remove it and set the top-level 'gradient_clipping' instead"
            )
        return params


class SchedulerConfig(Section):
    """`scheduler`: `type` is a DeepSpeed or torch.optim.lr_scheduler name, `params` its arguments."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class FP16Config(Section):
    """`fp16`: fp16 mixed precision with (dynamic, when loss_scale is 0) loss scaling."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: Annotated[Float, AfterValidator(in_range(0, MAX_LOSS_SCALE, hint="0 = dynamic scaling"))] = 0.0
    initial_scale_power: Annotated[
        Int,
        AfterValidator(
            in_range(
                0, MAX_SCALE_POWER, hint="the dynamic scale starts at 2**initial_scale_power; DeepSpeed's default is 16"
            )
        ),
    ] = 16
    loss_scale_window: Annotated[Int, AfterValidator(in_range(1, hint="clean steps before the scale doubles"))] = 1000
    hysteresis: Annotated[Int, AfterValidator(in_range(1, hint="overflows tolerated before the scale halves"))] = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: Annotated[
        Int, AfterValidator(in_range(0, low_open=True, hint="the floor of the dynamic scale"))
    ] = 1
    fp16_master_weights_and_grads: bool = False
    # DeepSpeed raises at the minimum scale by default and the run dies (its most reported fp16
    # failure); zerotrain keeps skipping with a warning unless this is set to true.
    raise_error_at_min_scale: bool = False


class BF16Config(Section):
    """`bf16` (old spelling `bfloat16`): bf16 mixed precision."""

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


_AUTOCAST_DTYPES = {
    "torch.float16": "fp16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.bfloat16": "bf16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}


def _autocast_dtype(value: Any) -> Any:
    if value is None:
        return None
    name = _AUTOCAST_DTYPES.get(str(value).strip().lower())
    if name is None:
        raise ValueError(f'{value!r} is not a dtype torch.autocast lowers to: use "bfloat16" or "float16"')
    return name


class TorchAutocastConfig(Section):
    """`torch_autocast`: fp32 parameters, forward under `torch.autocast(device, dtype)`.
    `dtype` None: torch.autocast's default for the device (bf16 on CPU, fp16 on CUDA)."""

    enabled: bool = False
    dtype: Annotated[Literal["fp16", "bf16"] | None, BeforeValidator(_autocast_dtype)] = None
    lower_precision_safe_modules: list[str] | None = None


class CommsLoggerConfig(Section):
    """`comms_logger`: per-collective timing and size logging."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = Field(default_factory=list)
    debug: bool = False


class ActivationCheckpointingConfig(Section):
    """`activation_checkpointing`: options of `zerotrain.checkpointing` (DeepSpeed's)."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: NonNegInt | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class TensorBoardConfig(Section):
    """`tensorboard`: event files go to `output_path/job_name`."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CSVMonitorConfig(TensorBoardConfig):
    """`csv_monitor`: one CSV file per logged event under `output_path/job_name`."""


class WandbConfig(Section):
    """`wandb`: Weights & Biases logging (`wandb.init(project, group, entity=team)` on the first
    data rank)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(Section):
    """`comet`: Comet logging through `comet_ml.start(...)` on the first data rank; None values
    fall back to Comet's own configuration (`.comet.config`, `COMET_*` environment variables)."""

    enabled: bool = False
    samples_log_interval: NonNegInt = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: Annotated[Literal["get", "create", "get_or_create"] | None, BeforeValidator(lower)] = None


class MLflowConfig(Section):
    """`mlflow` (zerotrain only): MLflow logging; None values fall back to MLflow's own defaults."""

    enabled: bool = False
    tracking_uri: str | None = None
    experiment_name: str | None = None
    run_name: str | None = None


class FlopsProfilerConfig(Section):
    """`flops_profiler`: profile the forward of one training step (zerotrain.monitor.flops)."""

    enabled: bool = False
    recompute_fwd_factor: FiniteFloat = Field(0.0, ge=0.0)
    profile_step: PosInt = 1
    module_depth: Int = -1
    top_modules: PosInt = 1
    detailed: bool = True
    output_file: str | None = None
    # zerotrain only: the peak TFLOPS of one device for MFU, where the accelerator knows none
    peak_tflops: FiniteFloat | None = Field(None, gt=0.0)


class ParallelWriteConfig(Section):
    """`checkpoint.parallel_write`."""

    pipeline_stage: bool = False


class ProgressiveLayerDropConfig(Section):
    """`progressive_layer_drop`: the keep ratio theta decays from 1 to `theta` at rate `gamma`
    (zerotrain.pld, docs/pld.md). Defaults are DeepSpeed's constants (PLD_THETA_DEFAULT 1.0:
    nothing dropped until `theta` is set; the paper uses 0.5)."""

    enabled: bool = False
    theta: Annotated[
        Float, AfterValidator(in_range(0, 1, low_open=True, hint="the keep ratio theta decays to; the paper uses 0.5"))
    ] = 1.0
    gamma: Annotated[Float, AfterValidator(in_range(0, hint="the decay rate; the paper uses 0.001"))] = 0.001


class CheckpointConfig(Section):
    """`checkpoint`: tag validation and storage options for save/load_checkpoint."""

    tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    writer: dict[str, Any] | None = None

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalize(cls, value: Any) -> Any:
        # DeepSpeed upper-cases the mode, so "WARN" and "warn" are valid too.
        return value.capitalize() if isinstance(value, str) else value


#: DeepSpeed top-level sections zerotrain accepts but does not implement (see support.py), and
#: expert_parallel (AutoEP), read as a dict by zerotrain.experts.autoep at initialize (its "auto"s
#: are DeepSpeed's defaults: taken from the model).
FOREIGN_SECTIONS = (
    "amp",
    "elasticity",
    "autotuning",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "nebula",
    "aio",
    "hybrid_engine",
    "tensor_parallel",
    "eigenvalue",
    "sparse_attention",
    "data_types",
    "weight_quantization",
    "quantize_training",
    "compile",
    "timers",
    "expert_parallel",
    "datastates_ckpt",
)


class _UnimplementedKeys(Section):
    """DeepSpeed keys that parse but are not implemented; check_supported rejects them when active."""

    amp: Any = None
    elasticity: Any = None
    autotuning: Any = None
    compression_training: Any = None
    data_efficiency: Any = None
    curriculum_learning: Any = None
    nebula: Any = None
    aio: Any = None
    hybrid_engine: Any = None
    tensor_parallel: Any = None
    eigenvalue: Any = None
    sparse_attention: Any = None
    data_types: Any = None
    weight_quantization: Any = None
    quantize_training: Any = None
    compile: Any = None
    timers: Any = None
    expert_parallel: Any = None
    datastates_ckpt: Any = None
    sparse_gradients: bool = False
    dump_state: bool = False
    disable_allgather: bool = False
    graph_harvesting: bool = False
    managed_gradient_accumulation: bool = True
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(lower)] = "mean"
    seq_parallel_communication_data_type: LowerStr = "fp32"
    use_data_before_expert_parallelism: bool = False
    log_level: str | None = None
    vocabulary_size: Int | None = None  # DeepSpeed only warns about it; no effect here either


class ZeroTrainConfig(_UnimplementedKeys):
    """The whole validated config. Batch sizes are resolved (never None) once validation succeeds.

    Pass `context={"world_size": N}` to `model_validate` for the data-parallel size (default 1);
    `load_config` does this for you. `raw` is the config dict as given (after "auto" filling).
    """

    train_batch_size: BatchSize | None = None
    train_micro_batch_size_per_gpu: BatchSize | None = None
    gradient_accumulation_steps: GradAccum | None = None
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config, validation_alias=AliasChoices("bf16", "bfloat16"))
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    allgather_size: NonNegInt | None = None  # only read with the legacy `"zero_optimization": true`
    gradient_clipping: Float = Field(1.0, ge=0.0)
    steps_per_print: Annotated[PosInt | None, BeforeValidator(steps_or_never)] = None
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: FiniteFloat = Field(1.0, gt=0.0)
    communication_data_type: Annotated[Literal["fp32", "fp16", "bf16"] | None, BeforeValidator(lower)] = None
    dataloader_drop_last: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(default_factory=ProgressiveLayerDropConfig)
    # Read by the pipeline engine only (a PipelineModule); docs/pipeline.md.
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    # zerotrain only: unknown top-level keys are errors instead of warnings (ZEROTRAIN_STRICT_CONFIG=1 too).
    strict: bool = False
    # zerotrain only (zerotrain.memory_release): "eager" hands freed memory back to the OS several
    # times a step (lowest peak RSS), "per_step" once a step, "off" never (fastest on CPU); None:
    # ZEROTRAIN_MEMORY_RELEASE, else "eager" at stage 3 and "per_step" at stages 0-2.
    memory_release: Literal["eager", "per_step", "off"] | None = None

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_raw(cls, data: Any, handler: Any) -> ZeroTrainConfig:
        raw = copy.deepcopy(data) if isinstance(data, dict) else None
        model = handler(data)
        if raw is not None:
            model._raw = raw
        return model

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        reject_both_spellings(data, {"bf16": "bfloat16"})
        data = dict(data)
        if not _strict(data):
            for key in unknown_top_level_keys(data):
                del data[key]
                _warn_unknown(key)
        if isinstance(data.get("zero_optimization"), bool):
            data["zero_optimization"] = legacy_zero_section(data["zero_optimization"], data.get("allgather_size"))
        return data

    @field_validator("bf16", mode="before")
    @classmethod
    def _bf16_default(cls, value: Any) -> Any:
        return {} if value is None else value

    @model_validator(mode="after")
    def _one_half_precision(self):
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16 and bf16 cannot both be enabled; set one of fp16.enabled / bf16.enabled to false")
        if self.torch_autocast.enabled and (self.fp16.enabled or self.bf16.enabled):
            other = "fp16" if self.fp16.enabled else "bf16"
            raise ValueError(
                f"torch_autocast.enabled and {other}.enabled cannot both be true: torch_autocast keeps "
                f"fp32 parameters, {other} casts them; set {other}.enabled to false"
            )
        return self

    @model_validator(mode="after")
    def _param_ranges(self):
        problems = []
        if self.optimizer is not None:
            problems += optimizer_param_problems(self.optimizer.type, self.optimizer.params)
        if self.scheduler is not None:
            problems += scheduler_param_problems(self.scheduler.params)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _resolve_batch(self, info: ValidationInfo):
        world_size = (info.context or {}).get("world_size", 1)
        resolved = resolve_batch_sizes(
            self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps, world_size
        )
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = resolved
        return self

    @property
    def raw(self) -> dict[str, Any]:
        """The config dict this object was validated from (after "auto" filling), for checkpoints."""
        return self._raw

    def get(self, key: str, default: Any = None) -> Any:
        """``raw.get(key, default)``: DeepSpeed's ``engine.config`` is the config dict itself, and
        code written for it (transformers' Trainer) reads it as ``engine.config.get(...)``."""
        return self._raw.get(key, default)

    def __getitem__(self, key: str) -> Any:
        """``raw[key]``, for code that subscripts DeepSpeed's config dict (OpenRLHF:
        ``engine.config["zero_optimization"]["offload_optimizer"]["device"]``)."""
        return self._raw[key]

    def __contains__(self, key: object) -> bool:
        return key in self._raw


STRICT_ENV = "ZEROTRAIN_STRICT_CONFIG"


def unknown_top_level_keys(data: dict[str, Any]) -> list[str]:
    """Top-level keys of a config dict that the schema does not know."""
    known = set(known_keys(ZeroTrainConfig))
    return [key for key in data if key not in known]


def _strict(data: dict[str, Any]) -> bool:
    # A malformed "strict" value counts as strict here; the field's own validation then reports it.
    return _on(data.get("strict", False)) or _on(os.environ.get(STRICT_ENV, ""))


def _on(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(value)


def _warn_unknown(key: str) -> None:
    nearest = difflib.get_close_matches(str(key), known_keys(ZeroTrainConfig), n=1, cutoff=0.6)
    hint = f"did you mean '{nearest[0]}'?" if nearest else "no known key is close (docs/config.md lists them)"
    warnings.warn(
        f"unknown top-level config key '{key}' ignored; {hint} DeepSpeed ignores unknown top-level "
        f'keys too. Set "strict": true in the config or {STRICT_ENV}=1 to make this an error.',
        UnknownConfigKeyWarning,
        stacklevel=2,
    )
