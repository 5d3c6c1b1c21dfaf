"""Defaults match DeepSpeed 0.19; aliases, deprecated keys and lenient JSON values are accepted."""

import copy
import sys
import warnings

import pytest

from zerotrain.config import ZeroTrainConfig, load_config

MINIMAL = {"train_micro_batch_size_per_gpu": 1}

DEFAULTS = [
    ("gradient_clipping", 1.0),
    ("steps_per_print", None),
    ("wall_clock_breakdown", False),
    ("memory_breakdown", False),
    ("prescale_gradients", False),
    ("gradient_predivide_factor", 1.0),
    ("communication_data_type", None),
    ("dataloader_drop_last", False),
    ("zero_allow_untested_optimizer", False),
    ("zero_force_ds_cpu_optimizer", True),
    ("optimizer", None),
    ("scheduler", None),
    ("fp16.enabled", False),
    ("fp16.auto_cast", False),
    ("fp16.loss_scale", 0.0),
    ("fp16.initial_scale_power", 16),
    ("fp16.loss_scale_window", 1000),
    ("fp16.hysteresis", 2),
    ("fp16.consecutive_hysteresis", False),
    ("fp16.min_loss_scale", 1),
    ("fp16.fp16_master_weights_and_grads", False),
    ("fp16.raise_error_at_min_scale", False),
    ("bf16.enabled", False),
    ("bf16.immediate_grad_update", False),
    ("zero_optimization.stage", 0),
    ("zero_optimization.contiguous_gradients", True),
    ("zero_optimization.reduce_scatter", True),
    ("zero_optimization.reduce_bucket_size", 500_000_000),
    ("zero_optimization.use_multi_rank_bucket_allreduce", True),
    ("zero_optimization.allgather_partitions", True),
    ("zero_optimization.allgather_bucket_size", 500_000_000),
    ("zero_optimization.overlap_comm", None),
    ("zero_optimization.load_from_fp32_weights", True),
    ("zero_optimization.elastic_checkpoint", False),
    ("zero_optimization.offload_optimizer", None),
    ("zero_optimization.offload_param", None),
    ("zero_optimization.sub_group_size", 1_000_000_000),
    ("zero_optimization.ignore_unused_parameters", True),
    ("zero_optimization.legacy_stage1", False),
    ("zero_optimization.round_robin_gradients", False),
    ("zero_optimization.zero_hpz_partition_size", 1),
    ("zero_optimization.zero_quantized_weights", False),
    ("zero_optimization.zero_quantized_nontrainable_weights", False),
    ("zero_optimization.zero_quantized_gradients", False),
    ("zero_optimization.zeropp_loco_param", None),
    ("zero_optimization.mics_shard_size", -1),
    ("zero_optimization.mics_hierarchical_params_gather", False),
    ("zero_optimization.memory_efficient_linear", True),
    ("zero_optimization.pipeline_loading_checkpoint", False),
    ("zero_optimization.override_module_apply", True),
    ("zero_optimization.log_trace_cache_warnings", False),
    ("zero_optimization.prefetch_bucket_size", 50_000_000),
    ("zero_optimization.param_persistence_threshold", 100_000),
    ("zero_optimization.model_persistence_threshold", sys.maxsize),
    ("zero_optimization.max_live_parameters", 1_000_000_000),
    ("zero_optimization.max_reuse_distance", 1_000_000_000),
    ("zero_optimization.gather_16bit_weights_on_model_save", False),
    ("zero_optimization.module_granularity_threshold", 0),
    ("zero_optimization.use_all_reduce_for_fetch_params", False),
    ("comms_logger.enabled", False),
    ("comms_logger.verbose", False),
    ("comms_logger.prof_all", True),
    ("comms_logger.prof_ops", []),
    ("comms_logger.debug", False),
    ("activation_checkpointing.partition_activations", False),
    ("activation_checkpointing.contiguous_memory_optimization", False),
    ("activation_checkpointing.cpu_checkpointing", False),
    ("activation_checkpointing.number_checkpoints", None),
    ("activation_checkpointing.synchronize_checkpoint_boundary", False),
    ("activation_checkpointing.profile", False),
    ("tensorboard.enabled", False),
    ("tensorboard.output_path", ""),
    ("tensorboard.job_name", "DeepSpeedJobName"),
    ("csv_monitor.enabled", False),
    ("csv_monitor.job_name", "DeepSpeedJobName"),
    ("wandb.enabled", False),
    ("wandb.group", None),
    ("wandb.team", None),
    ("wandb.project", "deepspeed"),
    ("comet.enabled", False),
    ("comet.samples_log_interval", 100),
    ("comet.project", None),
    ("comet.online", None),
    ("comet.mode", None),
    ("mlflow.enabled", False),
    ("mlflow.tracking_uri", None),
    ("flops_profiler.enabled", False),
    ("flops_profiler.recompute_fwd_factor", 0.0),
    ("flops_profiler.profile_step", 1),
    ("flops_profiler.module_depth", -1),
    ("flops_profiler.top_modules", 1),
    ("flops_profiler.detailed", True),
    ("flops_profiler.output_file", None),
    ("flops_profiler.peak_tflops", None),
    ("checkpoint.tag_validation", "Warn"),
    ("checkpoint.load_universal", False),
    ("checkpoint.use_node_local_storage", False),
    ("checkpoint.parallel_write.pipeline_stage", False),
]


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("key, expected", DEFAULTS, ids=[key for key, _ in DEFAULTS])
def test_default(key, expected):
    assert _get(load_config(MINIMAL), key) == expected


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_optimizer_defaults(device):
    offload = {"device": device, "nvme_path": "/local_nvme"}
    zero = load_config({**MINIMAL, "zero_optimization": {"offload_optimizer": offload}}).zero_optimization
    opt = zero.offload_optimizer
    assert (opt.device, opt.buffer_count, opt.pin_memory, opt.fast_init, opt.ratio) == (device, 4, False, False, 1.0)
    assert zero.offload_optimizer_device == device and zero.offload_param_device == "none"


def test_offload_param_defaults():
    zero = load_config({**MINIMAL, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    param = zero.zero_optimization.offload_param
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu, param.pin_memory) == (5, 10**8, 10**9, False)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_effective_overlap_comm(stage):
    # zerotrain overlaps at every stage unless told not to (DeepSpeed: stage 3 only; docs/config.md).
    zero = load_config({**MINIMAL, "zero_optimization": {"stage": stage}}).zero_optimization
    assert zero.overlap_comm is None and zero.effective_overlap_comm is True
    for given in (True, False):
        zero = load_config({**MINIMAL, "zero_optimization": {"stage": stage, "overlap_comm": given}})
        assert zero.zero_optimization.effective_overlap_comm is given


@pytest.mark.parametrize(
    "prefixed, name",
    [
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
        ("stage3_param_persistence_threshold", "param_persistence_threshold"),
        ("stage3_model_persistence_threshold", "model_persistence_threshold"),
        ("stage3_max_live_parameters", "max_live_parameters"),
        ("stage3_max_reuse_distance", "max_reuse_distance"),
        ("stage3_module_granularity_threshold", "module_granularity_threshold"),
    ],
)
def test_stage3_aliases_both_spellings(prefixed, name):
    for spelling in (prefixed, name):
        zero = load_config({**MINIMAL, "zero_optimization": {spelling: 1234}}).zero_optimization
        assert getattr(zero, name) == 1234


def test_stage3_alias_error_uses_the_spelling_given():
    with pytest.raises(ValueError, match="zero_optimization.stage3_max_live_parameters: expected an integer"):
        load_config({**MINIMAL, "zero_optimization": {"stage3_max_live_parameters": "many"}})


def test_gather_16bit_both_spellings():
    for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"):
        assert load_config(
            {**MINIMAL, "zero_optimization": {key: True}}
        ).zero_optimization.gather_16bit_weights_on_model_save


def test_bfloat16_alias():
    assert load_config({**MINIMAL, "bfloat16": {"enabled": True}}).bf16.enabled


def test_legacy_boolean_zero():
    with pytest.warns(DeprecationWarning):
        cfg = load_config({**MINIMAL, "zero_optimization": True, "allgather_size": 1000})
    assert cfg.zero_optimization.stage == 1 and cfg.zero_optimization.allgather_bucket_size == 1000
    with pytest.warns(DeprecationWarning):
        assert load_config({**MINIMAL, "zero_optimization": False}).zero_optimization.stage == 0


@pytest.mark.parametrize("old, attr", [("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")])
def test_deprecated_cpu_offload(old, attr):
    with pytest.warns(DeprecationWarning, match=old):
        zero = load_config({**MINIMAL, "zero_optimization": {"stage": 3, old: True}}).zero_optimization
    assert getattr(zero, attr).device == "cpu"


def test_deprecated_cpu_offload_false_changes_nothing():
    with pytest.warns(DeprecationWarning):
        zero = load_config({**MINIMAL, "zero_optimization": {"cpu_offload": False}}).zero_optimization
    assert zero.offload_optimizer is None


def test_deprecated_gather_fp16_name():
    with pytest.warns(DeprecationWarning, match="stage3_gather_16bit_weights_on_model_save"):
        zero = load_config({**MINIMAL, "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert zero.zero_optimization.gather_16bit_weights_on_model_save is True


def test_string_booleans_and_float_ints():
    cfg = load_config(
        {
            "train_batch_size": 1e3,
            "fp16": {"enabled": "false", "auto_cast": "true"},
            "zero_optimization": {"reduce_bucket_size": 2e8, "overlap_comm": "True"},
        }
    )
    assert cfg.train_batch_size == 1000 and isinstance(cfg.train_batch_size, int)
    assert cfg.fp16.enabled is False and cfg.fp16.auto_cast is True
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert cfg.zero_optimization.overlap_comm is True


def test_case_insensitive_enums():
    cfg = load_config({**MINIMAL, "communication_data_type": "BF16", "checkpoint": {"tag_validation": "FAIL"}})
    assert cfg.communication_data_type == "bf16" and cfg.checkpoint.tag_validation == "Fail"


def test_steps_per_print_infinity_means_never():
    assert load_config({**MINIMAL, "steps_per_print": float("inf")}).steps_per_print is None


def test_optimizer_params_are_free_form():
    params = {"lr": 1e-3, "betas": [0.9, 0.95], "torch_adam": True, "anything": {"nested": 1}}
    cfg = load_config({**MINIMAL, "optimizer": {"type": "Lamb", "params": params}})
    assert cfg.optimizer.params == params and cfg.optimizer.legacy_fusion is False


def test_caller_dict_is_not_mutated():
    config = {"train_batch_size": 8, "zero_optimization": True, "bfloat16": {"enabled": False}}
    before = copy.deepcopy(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cfg = load_config(config, world_size=2)
    assert config == before
    assert cfg.raw == before and cfg.raw is not config


def test_direct_model_validation_resolves_batch():
    cfg = ZeroTrainConfig.model_validate({"train_batch_size": 8}, context={"world_size": 4})
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 1)


def test_load_config_accepts_a_config_object():
    cfg = load_config({"train_batch_size": 8}, world_size=2)
    assert load_config(cfg, world_size=4).train_micro_batch_size_per_gpu == 2


def test_mlflow_section():
    cfg = load_config(
        {
            **MINIMAL,
            "mlflow": {
                "enabled": False,
                "tracking_uri": "file:/tmp/mlruns",
                "experiment_name": "exp",
                "run_name": "r1",
            },
        }
    )
    mlflow = cfg.mlflow
    assert (mlflow.tracking_uri, mlflow.experiment_name, mlflow.run_name) == ("file:/tmp/mlruns", "exp", "r1")
