"""Which config settings zerotrain does not implement yet.

`PENDING` is the single table. When a feature lands, delete its row(s); nothing else changes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .schema import ZeroTrainConfig


@dataclass(frozen=True)
class Pending:
    """A dotted config key, when its value needs a missing feature, and the feature that will bring it."""

    key: str
    active: Callable[[ZeroTrainConfig], bool]
    feature: str


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "0", "no", "off", "none")
    return bool(value)


def _section_on(value: Any) -> bool:
    """A foreign section counts as used unless absent, false, empty, or {"enabled": false, ...}."""
    if isinstance(value, dict) and "enabled" in value:
        return _truthy(value["enabled"])
    return _truthy(value)


def _data_types_on(value: Any) -> bool:
    # data_types.grad_accum_dtype is implemented (zerotrain.precision); any other key is not.
    if isinstance(value, dict):
        return any(v is not None for k, v in value.items() if k != "grad_accum_dtype") or (
            value.get("grad_accum_dtype") not in (None, "fp32", "fp16", "bf16")
        )
    return _truthy(value)


def _tensor_parallel_on(value: Any) -> bool:
    if not isinstance(value, dict):
        return _truthy(value)
    tp = value.get("tp") or value.get("tensor_parallel") or {}
    return _int(value.get("autotp_size", 0)) > 1 or (isinstance(tp, dict) and _int(tp.get("tp_size", 1)) > 1)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 2  # unreadable -> treat as "set", so the user hears about it


def _foreign(name: str, feature: str, active: Callable[[Any], bool] = _section_on) -> Pending:
    return Pending(name, lambda c: active(getattr(c, name)), feature)


_Z = "zero_optimization"


def _stage3(c: ZeroTrainConfig) -> bool:
    return c.zero_optimization.stage == 3


def _fp32_stage0(c: ZeroTrainConfig) -> bool:
    # Stage 0 in fp32 all-reduces the parameters' own .grad tensors (zero/stage0.py), so neither a
    # 16-bit communication dtype nor a 16-bit accumulation dtype can apply there.
    return c.zero_optimization.stage == 0 and not (c.fp16.enabled or c.bf16.enabled)


def _bf16_masters(c: ZeroTrainConfig) -> bool:
    return c.bf16.enabled and c.bf16.bf16_master_weights_and_grads


def _grad_accum_dtype(c: ZeroTrainConfig) -> Any:
    return c.data_types.get("grad_accum_dtype") if isinstance(c.data_types, dict) else None


PENDING: tuple[Pending, ...] = (
    Pending(
        "fp16.fp16_master_weights_and_grads",
        lambda c: c.fp16.fp16_master_weights_and_grads,
        "fp16 master weights (zerotrain always keeps fp32 masters)",
    ),
    Pending("bf16.immediate_grad_update", lambda c: c.bf16.immediate_grad_update, "immediate bf16 gradient updates"),
    Pending(
        "bf16.bf16_master_weights_and_grads",
        lambda c: c.bf16.bf16_master_weights_and_grads and not c.bf16.enabled,
        "bf16.enabled: true (bf16 master weights are the bf16 parameters' shards)",
    ),
    Pending(
        "bf16.bf16_master_weights_and_grads",
        lambda c: _bf16_masters(c) and not c.bf16.bf16_optimizer_states,
        "bf16 master weights with fp32 optimizer states (DeepSpeed: CPU offload with DeepSpeedCPUAdam); "
        "set bf16.bf16_optimizer_states to true as well",
    ),
    Pending(
        "bf16.bf16_master_weights_and_grads",
        lambda c: _bf16_masters(c) and c.zero_optimization.stage == 0,
        "a ZeRO stage: bf16 master weights work at stages 1-3 (set zero_optimization.stage)",
    ),
    Pending(
        "bf16.bf16_master_weights_and_grads",
        lambda c: (
            _bf16_masters(c)
            and (
                c.zero_optimization.offload_optimizer_device != "none"
                or c.zero_optimization.offload_param_device != "none"
            )
        ),
        "bf16 master weights with optimizer or parameter offload (offload keeps fp32 masters; remove "
        "offload_optimizer/offload_param)",
    ),
    Pending(
        "bf16.bf16_optimizer_states",
        lambda c: c.bf16.bf16_optimizer_states and not _bf16_masters(c),
        "bf16 master weights: set bf16.bf16_master_weights_and_grads to true as well (DeepSpeed requires "
        "it too), with bf16.enabled",
    ),
    Pending(
        f"{_Z}.offload_optimizer.device",
        lambda c: c.zero_optimization.offload_optimizer_device != "none" and c.zero_optimization.stage == 0,
        "a ZeRO stage: optimizer offload works at stages 1-3 (set zero_optimization.stage)",
    ),
    Pending(
        f"{_Z}.offload_optimizer.ratio",
        lambda c: (
            c.zero_optimization.offload_optimizer is not None and c.zero_optimization.offload_optimizer.ratio < 1.0
        ),
        "partial optimizer offload (ZeRO++ Twin-Flow; offload all of it: ratio 1.0)",
    ),
    Pending(
        f"{_Z}.offload_optimizer.super_offload",
        lambda c: (
            c.zero_optimization.offload_optimizer is not None and c.zero_optimization.offload_optimizer.super_offload
        ),
        "SuperOffload (superchip CPU-GPU offload)",
    ),
    Pending(
        f"{_Z}.offload_param.device",
        lambda c: c.zero_optimization.offload_param_device != "none" and not _stage3(c),
        "ZeRO stage 3: parameter offload partitions parameters (set zero_optimization.stage to 3)",
    ),
    Pending(
        f"{_Z}.offload_param.device",
        lambda c: (
            _stage3(c)
            and c.zero_optimization.offload_param_device == "nvme"
            and c.zero_optimization.offload_optimizer_device != "nvme"
        ),
        "parameters on NVMe with the optimizer state anywhere but NVMe (set offload_optimizer.device "
        'to "nvme" as well, or offload_param.device to "cpu")',
    ),
    Pending(
        f"{_Z}.zero_hpz_partition_size",
        lambda c: c.zero_optimization.zero_hpz_partition_size > 1,
        "ZeRO++ hierarchical partitioning (hpZ)",
    ),
    Pending(
        f"{_Z}.zero_quantized_weights",
        lambda c: c.zero_optimization.zero_quantized_weights,
        "ZeRO++ quantized weight all-gather (qwZ)",
    ),
    Pending(
        f"{_Z}.zero_quantized_nontrainable_weights",
        lambda c: c.zero_optimization.zero_quantized_nontrainable_weights,
        "ZeRO++ quantized frozen weights",
    ),
    Pending(
        f"{_Z}.zero_quantized_gradients",
        lambda c: c.zero_optimization.zero_quantized_gradients,
        "ZeRO++ quantized gradients (qgZ)",
    ),
    Pending(
        f"{_Z}.zeropp_loco_param",
        lambda c: c.zero_optimization.zeropp_loco_param is not None,
        "ZeRO++ LoCo error feedback",
    ),
    Pending(f"{_Z}.mics_shard_size", lambda c: c.zero_optimization.mics_shard_size > 0, "MiCS sharding"),
    Pending(
        f"{_Z}.mics_hierarchical_params_gather",
        lambda c: c.zero_optimization.mics_hierarchical_params_gather,
        "MiCS sharding",
    ),
    Pending(f"{_Z}.legacy_stage1", lambda c: c.zero_optimization.legacy_stage1, "legacy ZeRO-1 (not planned)"),
    Pending(f"{_Z}.zenflow", lambda c: c.zero_optimization.zenflow is not None, "ZenFlow offload"),
    Pending(
        f"{_Z}.pipeline_loading_checkpoint",
        lambda c: c.zero_optimization.pipeline_loading_checkpoint,
        "pipeline parallelism",
    ),
    Pending(
        f"{_Z}.model_persistence_threshold",
        lambda c: _stage3(c) and c.zero_optimization.model_persistence_threshold != sys.maxsize,
        "a cap on the total size of persistent stage-3 parameters (lower stage3_param_persistence_threshold instead)",
    ),
    Pending(
        f"{_Z}.override_module_apply",
        lambda c: _stage3(c) and not c.zero_optimization.override_module_apply,
        "zero.Init with an unpatched Module.apply",
    ),
    Pending(
        f"{_Z}.log_trace_cache_warnings",
        lambda c: _stage3(c) and c.zero_optimization.log_trace_cache_warnings,
        "logging of stage-3 prefetch-trace invalidations",
    ),
    Pending(
        f"{_Z}.enable_sanity_checks",
        lambda c: _stage3(c) and c.zero_optimization.enable_sanity_checks,
        "DeepSpeed's optional stage-3 internal sanity checks",
    ),
    Pending(
        "communication_data_type",
        lambda c: _fp32_stage0(c) and c.communication_data_type in ("fp16", "bf16"),
        "16-bit gradient all-reduce at stage 0 in fp32 training (use stage 1-3, or fp16/bf16)",
    ),
    Pending(
        "data_types.grad_accum_dtype",
        lambda c: _fp32_stage0(c) and _grad_accum_dtype(c) in ("fp16", "bf16"),
        "16-bit gradient accumulation at stage 0 in fp32 training (DeepSpeed rejects it too)",
    ),
    Pending("memory_breakdown", lambda c: c.memory_breakdown, "memory breakdown logging"),
    Pending("prescale_gradients", lambda c: c.prescale_gradients, "gradient pre-scaling"),
    Pending("gradient_predivide_factor", lambda c: c.gradient_predivide_factor != 1.0, "gradient pre-division"),
    Pending(
        "checkpoint.use_node_local_storage",
        lambda c: c.checkpoint.use_node_local_storage,
        "node-local checkpoint storage (zerotrain reshards on load by reading every rank's "
        "files, so the checkpoint folder must be one every rank can read: a shared filesystem)",
    ),
    Pending(
        "checkpoint.parallel_write.pipeline_stage",
        lambda c: c.checkpoint.parallel_write.pipeline_stage,
        "pipeline parallelism",
    ),
    Pending(
        "checkpoint.writer",
        lambda c: c.checkpoint.writer is not None,
        "DeepSpeed's fast checkpoint writer engines (zerotrain streams its own safetensors "
        "files; for background writes use save_checkpoint(..., async_save=True))",
    ),
    Pending(
        "checkpoint.checkpoint_serialization",
        lambda c: not c.checkpoint.checkpoint_serialization,
        "the legacy torch.save checkpoint format (zerotrain writes safetensors)",
    ),
    Pending("sparse_gradients", lambda c: c.sparse_gradients, "sparse gradient all-reduce"),
    Pending("dump_state", lambda c: c.dump_state, "engine state dump"),
    Pending("disable_allgather", lambda c: c.disable_allgather, "ZeRO stages 1-3 (zerotrain.zero)"),
    Pending("graph_harvesting", lambda c: c.graph_harvesting, "CUDA graph harvesting"),
    Pending(
        "managed_gradient_accumulation",
        lambda c: not c.managed_gradient_accumulation,
        "user-managed gradient accumulation",
    ),
    Pending("gradient_allreduce_op", lambda c: c.gradient_allreduce_op != "mean", "sum gradient all-reduce"),
    Pending(
        "seq_parallel_communication_data_type",
        lambda c: c.seq_parallel_communication_data_type != "fp32",
        "sequence parallelism",
    ),
    Pending("use_data_before_expert_parallelism", lambda c: c.use_data_before_expert_parallelism, "expert parallelism"),
    Pending("log_level", lambda c: c.log_level is not None, "config-driven log level"),
    _foreign("amp", "apex AMP (not planned: use bf16 or fp16)"),
    _foreign("elasticity", "elastic training"),
    _foreign("autotuning", "autotuning"),
    _foreign("compression_training", "compression training"),
    _foreign("data_efficiency", "data efficiency library"),
    _foreign("curriculum_learning", "curriculum learning"),
    _foreign("nebula", "Nebula checkpointing"),
    _foreign("hybrid_engine", "RLHF hybrid engine"),
    _foreign("tensor_parallel", "tensor parallelism (AutoTP)", _tensor_parallel_on),
    _foreign("eigenvalue", "eigenvalue computation"),
    _foreign("sparse_attention", "sparse attention kernels"),
    _foreign("data_types", "data_types keys other than grad_accum_dtype", _data_types_on),
    _foreign("weight_quantization", "weight quantization"),
    _foreign("quantize_training", "quantized training"),
    _foreign("compile", "torch.compile / DeepCompile integration"),
    _foreign("timers", "throughput timers"),
    _foreign("datastates_ckpt", "DataStates checkpointing"),
)


def unsupported(cfg: ZeroTrainConfig) -> list[str]:
    """One line `<key>=<value> needs <feature>` per setting in `cfg` that zerotrain cannot honour yet."""
    return [f"{row.key}={_short(_value(cfg, row.key))} needs {row.feature}" for row in PENDING if row.active(cfg)]


def check_supported(cfg: ZeroTrainConfig) -> None:
    """Raise NotImplementedError naming every dotted key in `cfg` that needs a feature not landed yet."""
    lines = unsupported(cfg)
    if lines:
        raise NotImplementedError(
            "zerotrain does not implement these config settings yet:\n"
            + "\n".join(f"  - {line}" for line in lines)
            + "\nRemove them or set them to their defaults (docs/config.md lists every key)."
        )


def _value(cfg: ZeroTrainConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part)
    return node


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
