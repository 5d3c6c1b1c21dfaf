"""DeepSpeed's public engine accessors (``engine.fp16_enabled()``, ``engine.zero_offload_optimizer()``,
``engine.tput_timer``, ...) as a mixin of ``ZeroTrainEngine``.

Each reads state the engine already keeps: the validated config (``self._config``), the dtype
policy (``self.precision``) and the ZeRO stage (``self._zero``). Methods the engine defines itself
take precedence (the engine class comes first in the method order). docs/engine.md lists every
public DeepSpeed engine method and whether zerotrain has it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zerotrain.engine.timers import ThroughputTimer
from zerotrain.precision.autocast import safe_module_names

if TYPE_CHECKING:
    from zerotrain.config.schema import ZeroTrainConfig
    from zerotrain.engine.step_core import StepCore
    from zerotrain.precision.policy import PrecisionPolicy
    from zerotrain.topology import Topology
    from zerotrain.zero.interface import StageInterface


def _observe_throughput(engine, inputs) -> None:
    engine.tput_timer.observe_forward(engine.global_steps)


class EngineAccessors:
    """Read-only views of the engine's configuration and state, under DeepSpeed's names."""

    # What this mixin reads of ZeroTrainEngine (set in its __init__; annotations only).
    _config: ZeroTrainConfig
    _core: StepCore
    _zero: StageInterface
    precision: PrecisionPolicy
    topology: Topology
    dp_world_size: int
    optimizer: torch.optim.Optimizer | None

    if TYPE_CHECKING:

        def train_batch_size(self) -> int: ...

        def save_16bit_model(
            self, save_dir, save_filename: str = ..., exclude_frozen_parameters: bool = ...
        ) -> bool: ...

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # engine(...) calls drive tput_timer (see ThroughputTimer.observe_forward).
        self.register_forward_pre_hook(_observe_throughput)

    # -- throughput ----------------------------------------------------------------------
    @property
    def tput_timer(self) -> ThroughputTimer:
        """Samples/s over optimizer steps (``avg_samples_per_sec()``), from engine forwards."""
        timer = self.__dict__.get("_tput_timer")
        if timer is None:
            timer = ThroughputTimer(batch_size=self.train_batch_size(), steps_per_output=self.steps_per_print())
            self.__dict__["_tput_timer"] = timer
        return timer

    # -- batch sizes ---------------------------------------------------------------------
    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self._config_batch_shape()

    def _config_batch_shape(self) -> tuple[int, int, int]:
        """The config's three batch sizes: optional in the schema only until validation resolves
        all three (``zerotrain.config.batch``)."""
        c = self._config
        batch, micro, accumulation = c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps
        assert batch is not None and micro is not None and accumulation is not None
        return batch, micro, accumulation

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (micro-batch unchanged)."""
        micro_batch_size = self._config_batch_shape()[1]
        per_window = micro_batch_size * self.dp_world_size
        if train_batch_size <= 0 or train_batch_size % per_window:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): must be a positive multiple of "
                f"train_micro_batch_size_per_gpu x data-parallel ranks = {per_window}"
            )
        self._resize_batch(train_batch_size, micro_batch_size, train_batch_size // per_window)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch size, keeping the accumulation steps (global batch follows).
        A dataloader built by ``initialize`` keeps its batch size, as in DeepSpeed."""
        if micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): must be positive")
        accumulation = self._config_batch_shape()[2]
        self._resize_batch(micro_batch_size * accumulation * self.dp_world_size, micro_batch_size, accumulation)

    def _resize_batch(self, train_batch_size: int, micro_batch_size: int, accumulation_steps: int) -> None:
        """The new batch shape in the config (as DeepSpeed's setters leave it), the step core
        (which counts samples and windows by it) and the throughput timer."""
        self._config.train_batch_size = train_batch_size
        self._config.train_micro_batch_size_per_gpu = micro_batch_size
        self._config.gradient_accumulation_steps = accumulation_steps
        self._core.resize(train_batch_size, micro_batch_size, accumulation_steps)
        if "_tput_timer" in self.__dict__:
            self.tput_timer.batch_size = train_batch_size

    def steps_per_print(self):
        return self._config.steps_per_print

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    # -- precision -----------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def fp16_auto_cast(self) -> bool:
        return self._config.fp16.auto_cast

    def fp16_master_weights_and_gradients(self) -> bool:
        return self._config.fp16.fp16_master_weights_and_grads

    def bf16_master_weights_and_gradients(self) -> bool:
        return self._config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self._config.bf16.bf16_optimizer_states

    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """The dtype forward is autocast to; when the section is off, its ``dtype`` (None if
        unset, as in DeepSpeed)."""
        if self.precision.autocast_dtype is not None:
            return self.precision.autocast_dtype
        return {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}[self._config.torch_autocast.dtype]

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The section's module names, or DeepSpeed's default list (``torch.nn`` Linear and Conv1d-3d)."""
        return safe_module_names(self._config.torch_autocast)

    def amp_enabled(self) -> bool:
        """Always False: apex ``amp`` is not supported (initialize rejects a config enabling it)."""
        return False

    def dynamic_loss_scale(self) -> bool:
        """fp16 with dynamic loss scaling (``loss_scale`` 0)."""
        return self._config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return 2.0**self._config.fp16.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict:
        """DeepSpeed's ``DynamicLossScaler`` keyword arguments from the ``fp16`` section."""
        fp16 = self._config.fp16
        return {
            "init_scale": 2.0**fp16.initial_scale_power,
            "scale_window": fp16.loss_scale_window,
            "delayed_shift": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
            "min_scale": fp16.min_loss_scale,
        }

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """``(model dtype, gradient accumulation dtype)``."""
        return self.precision.param_dtype, self.precision.grad_accum_dtype

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in (``communication_data_type``, default the model's)."""
        return self.precision.comm_dtype

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    # -- ZeRO ----------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        """Whether ZeRO is on (stage 1 or higher)."""
        return self._zero.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self._zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._zero.stage >= 3

    def zero_offload_optimizer(self):
        """The ``offload_optimizer`` section, or None when the optimizer is not offloaded."""
        section = self._config.zero_optimization.offload_optimizer
        return section if section is not None and section.device != "none" else None

    def zero_offload_param(self):
        """The ``offload_param`` section, or None when parameters are not offloaded."""
        section = self._config.zero_optimization.offload_param
        return section if section is not None and section.device != "none" else None

    def zero_use_cpu_optimizer(self) -> bool:
        return self._config.zero_optimization.offload_optimizer_device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        return self._config.zero_optimization.offload_optimizer_device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        return self._config.zero_optimization.offload_optimizer_device == "nvme"

    def zero_partial_offload(self) -> float:
        section = self._config.zero_optimization.offload_optimizer
        return 1.0 if section is None else section.ratio

    def zero_overlap_comm(self) -> bool:
        return self._config.zero_optimization.effective_overlap_comm

    def super_offload(self) -> bool:
        section = self._config.zero_optimization.offload_optimizer
        return False if section is None else section.super_offload

    def cpuadam_cores_perc(self) -> float:
        section = self._config.zero_optimization.offload_optimizer
        return 0.9 if section is None else section.cpuadam_cores_perc  # DeepSpeed's 0.9 without one

    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self._config.zero_force_ds_cpu_optimizer

    # -- other sections ------------------------------------------------------------------
    def optimizer_params(self):
        """The config's ``optimizer.params`` (None without an optimizer section)."""
        return None if self._config.optimizer is None else self._config.optimizer.params

    def optimizer_legacy_fusion(self) -> bool:
        return False if self._config.optimizer is None else self._config.optimizer.legacy_fusion

    def scheduler_name(self):
        return None if self._config.scheduler is None else self._config.scheduler.type

    def scheduler_params(self):
        return None if self._config.scheduler is None else self._config.scheduler.params

    def get_type(self) -> list:
        """Each optimizer param group's ``type`` entry (0.0 where absent), as DeepSpeed."""
        return [] if self.optimizer is None else [g.get("type", 0.0) for g in self.optimizer.param_groups]

    def graph_harvesting(self) -> bool:
        return self._config.graph_harvesting

    def managed_gradient_accumulation(self) -> bool:
        return self._config.managed_gradient_accumulation

    def log_level(self):
        return self._config.log_level

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of ``save_16bit_model`` (with its default file name)."""
        return self.save_16bit_model(save_dir, save_filename)

    def dump_state(self) -> bool:
        return self._config.dump_state

    def sparse_gradients_enabled(self) -> bool:
        return self._config.sparse_gradients

    def flops_profiler_enabled(self) -> bool:
        return self._config.flops_profiler.enabled

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self._config.flops_profiler.recompute_fwd_factor

    def flops_profiler_profile_step(self) -> int:
        return self._config.flops_profiler.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self._config.flops_profiler.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self._config.flops_profiler.top_modules

    def flops_profiler_detailed(self) -> bool:
        return self._config.flops_profiler.detailed

    def flops_profiler_output_file(self):
        return self._config.flops_profiler.output_file

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint.tag_validation == "Fail"

    def checkpoint_serialization_enabled(self) -> bool:
        return self._config.checkpoint.checkpoint_serialization

    def checkpoint_writer_enabled(self) -> bool:
        return self._config.checkpoint.writer is not None

    def use_node_local_storage(self) -> bool:
        return self._config.checkpoint.use_node_local_storage

    def load_universal_checkpoint(self) -> bool:
        return self._config.checkpoint.load_universal

    # -- parallel layout: every answer is the engine's topology's (engine.topology) ------------
    # data axis: the ranks that shard the state and average gradients (ZeRO's group)
    def get_data_parallel_rank(self) -> int:
        """This rank's position in the engine's data-parallel group (not its global rank)."""
        return self.topology.data_rank

    def get_data_parallel_world_size(self) -> int:
        return self.topology.data_size

    def get_data_parallel_group(self):
        return self.topology.data_group

    # pipe axis: pipeline stages
    def get_pipe_parallel_rank(self) -> int:
        return self.topology.rank("pipe")

    def get_pipe_parallel_world_size(self) -> int:
        return self.topology.size("pipe")

    def get_pipe_parallel_group(self):
        return self.topology.group("pipe")

    # DeepSpeed's "model parallel" (its PipelineParallelGrid's): every pipeline stage and model
    # slice of one replica, ranked stage x slices + slice; the model axis alone when there is no
    # pipe axis. DeepSpeed's mp_rank checkpoint names use it.
    def get_model_parallel_rank(self) -> int:
        t = self.topology
        return t.rank("pipe") * t.size("model") + t.rank("model")

    def get_model_parallel_world_size(self) -> int:
        return self.topology.distinct_size

    @property
    def mp_world_size(self) -> int:
        return self.get_model_parallel_world_size()

    # model axis alone: tensor slices of a layer
    def get_tensor_parallel_rank(self) -> int:
        return self.topology.rank("model")

    # experts: DeepSpeed's ep_size_N groups, looked up among those built (never built here: that
    # is a collective every rank must start in the same order, done by the MoE layers or
    # zerotrain.utils.groups._create_expert_and_data_parallel).
    def _expert_groups(self, group_name: str):
        topology = self.topology
        for size in topology.expert_group_sizes():
            groups = topology.expert_groups(size)
            if groups.name == group_name:
                return groups
        built = ", ".join(f"ep_size_{s}" for s in topology.expert_group_sizes()) or "none"
        raise ValueError(
            f"expert group {group_name!r} is not built on this engine (built: {built}); "
            "build it on every rank with zerotrain.utils.groups._create_expert_and_data_parallel(N) "
            "for the engine's topology, or engine.topology.expert_groups(N)"
        )

    def get_expert_parallel_rank(self, group_name: str) -> int:
        return self._expert_groups(group_name).expert_rank

    def get_expert_parallel_world_size(self, group_name: str) -> int:
        return self._expert_groups(group_name).expert_size

    def get_expert_parallel_group(self, group_name: str):
        return self._expert_groups(group_name).expert_group

    def get_expert_data_parallel_rank(self, group_name: str) -> int:
        return self._expert_groups(group_name).expert_data_rank

    def get_expert_data_parallel_world_size(self, group_name: str) -> int:
        return self._expert_groups(group_name).expert_data_size

    def get_expert_data_parallel_group(self, group_name: str):
        return self._expert_groups(group_name).expert_data_group


def _zero_field(field: str, doc: str):
    def accessor(self):
        return getattr(self._config.zero_optimization, field)

    accessor.__doc__ = f"``zero_optimization.{doc}``"
    return accessor


# DeepSpeed's zero_* accessors that return one zero_optimization field as it is.
ZERO_FIELD_ACCESSORS = {
    "zero_reduce_scatter": "reduce_scatter",
    "zero_contiguous_gradients": "contiguous_gradients",
    "zero_reduce_bucket_size": "reduce_bucket_size",
    "zero_allgather_bucket_size": "allgather_bucket_size",
    "zero_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce",
    "zero_allgather_partitions": "allgather_partitions",
    "zero_load_from_fp32_weights": "load_from_fp32_weights",
    "zero_elastic_checkpoint": "elastic_checkpoint",
    "zero_sub_group_size": "sub_group_size",
    "zero_ignore_unused_parameters": "ignore_unused_parameters",
    "zero_legacy_stage1": "legacy_stage1",
    "zero_round_robin_gradients": "round_robin_gradients",
    "zero_hpz_partition_size": "zero_hpz_partition_size",
    "zero_quantized_weights": "zero_quantized_weights",
    "zero_quantized_nontrainable_weights": "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients": "zero_quantized_gradients",
    "zeropp_loco_param": "zeropp_loco_param",
    "mics_shard_size": "mics_shard_size",
    "zero_log_trace_cache_warnings": "log_trace_cache_warnings",
    "is_sanity_checks_enabled": "enable_sanity_checks",
    "zero_save_muon_momentum_buffer_in_memory": "save_muon_momentum_buffer_in_memory",
    "zenflow_config": "zenflow",
    "zero_prefetch_bucket_size": "prefetch_bucket_size",
    "zero_param_persistence_threshold": "param_persistence_threshold",
    "zero_model_persistence_threshold": "model_persistence_threshold",
    "zero_max_live_parameters": "max_live_parameters",
    "zero_max_reuse_distance": "max_reuse_distance",
    "zero_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "zero_module_granularity_threshold": "module_granularity_threshold",
    "zero_allgather_sequential": "allgather_sequential",
}
for _name, _field in ZERO_FIELD_ACCESSORS.items():
    setattr(EngineAccessors, _name, _zero_field(_field, _field))
