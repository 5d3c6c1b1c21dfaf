"""check_supported: one table of settings that need features zerotrain has not landed yet."""

import pytest

from zerotrain.config import PENDING, check_supported, load_config, unsupported

BASE = {"train_batch_size": 8}

SUPPORTED = [
    {},
    {"zero_optimization": {"stage": 0, "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6}},
    {
        "gradient_clipping": 0.0,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10,
        "wall_clock_breakdown": True,
        "dataloader_drop_last": True,
    },
    {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupLR", "params": {}}},
    {"fp16": {"enabled": False, "loss_scale": 128}, "bf16": {"enabled": "false"}},
    {"zero_optimization": {"offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}},
    {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
            "offload_param": {"device": "cpu"},
        },
        "aio": {"block_size": 1048576},
    },
    {"zero_optimization": {"stage": 2, "cpu_offload": True}},
    {"tensorboard": {"enabled": False, "output_path": "/tmp/tb"}, "wandb": {"enabled": False}},
    {
        "amp": {"enabled": False, "opt_level": "O1"},
        "pipeline": {},
        "elasticity": {"enabled": "false"},
        "autotuning": {"enabled": False},
        "comet": {"enabled": False},
        "sparse_gradients": False,
        "data_types": {"grad_accum_dtype": "fp32"},
        "tensor_parallel": {"autotp_size": 1},
    },
    {"checkpoint": {"tag_validation": "warn"}, "gradient_predivide_factor": 1.0, "prescale_gradients": False},
    {"comms_logger": {"enabled": True, "verbose": True, "prof_all": False, "prof_ops": ["all_reduce"]}},
    {"tensorboard": {"enabled": True}, "csv_monitor": {"enabled": True}, "mlflow": {"enabled": True}},
    # Landed features: ZeRO 1/2, mixed precision and its dtype knobs.
    {"zero_optimization": {"stage": 1}},
    {"zero_optimization": {"stage": 2}},
    {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000}},
    {"fp16": {"enabled": True, "auto_cast": True}},
    {"bf16": {"enabled": True}},
    {"communication_data_type": "fp32"},
    {"data_types": {"grad_accum_dtype": "fp32"}},
    {"zero_optimization": {"stage": 1}, "communication_data_type": "bf16", "data_types": {"grad_accum_dtype": "bf16"}},
    {"bf16": {"enabled": True}, "communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}},
    # Keys DeepSpeed reads only at some stages have no effect at the others, as there.
    {"zero_optimization": {"stage": 0, "ignore_unused_parameters": False}},
    # implemented at stages 1-3: tests/engine/test_state_contract.py
    {"zero_optimization": {"stage": 2, "ignore_unused_parameters": False}},
    {
        "zero_optimization": {
            "stage": 2,
            "leaf_module": {"classes": "my.Block"},
            "override_module_apply": False,
            "stage3_model_persistence_threshold": 10,
            "log_trace_cache_warnings": True,
            "enable_sanity_checks": True,
        }
    },
    # Performance hints of DeepSpeed's implementation: accepted (docs/config.md says why).
    {
        "zero_optimization": {
            "stage": 3,
            "contiguous_gradients": False,
            "round_robin_gradients": True,
            "sub_group_size": 1000,
            "stage3_max_reuse_distance": 0,
            "allgather_partitions": False,
            "memory_efficient_linear": False,
        }
    },
    # stage-3 leaf modules (tests/zero/test_leaf_modules.py)
    {
        "zero_optimization": {
            "stage": 3,
            "stage3_module_granularity_threshold": 100,
            "leaf_module": {"classes": "my.Block", "names": ["h.0"], "name_suffixes": "moe"},
        }
    },
    {"strict": True},
    # zerotrain.recompute (deepspeed.checkpointing) reads the section (tests/recompute)
    {
        "activation_checkpointing": {
            "partition_activations": True,
            "contiguous_memory_optimization": True,
            "number_checkpoints": 4,
            "cpu_checkpointing": True,
            "synchronize_checkpoint_boundary": True,
            "profile": True,
        }
    },
]


@pytest.mark.parametrize("extra", SUPPORTED)
def test_supported_configs_pass(extra):
    check_supported(load_config({**BASE, **extra}))


UNSUPPORTED = [
    (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.offload_optimizer.device",
    ),  # stage 0
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
        "zero_optimization.offload_param.device='nvme'",
    ),
    ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size=8"),
    ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
    ({"zero_optimization": {"zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients"),
    ({"zero_optimization": {"mics_shard_size": 8}}, "zero_optimization.mics_shard_size=8"),
    ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage"),
    ({"memory_breakdown": True}, "memory_breakdown=True"),
    ({"prescale_gradients": True}, "prescale_gradients=True"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor=2.0"),
    ({"amp": {"enabled": True}}, "amp="),
    ({"elasticity": {"enabled": True}}, "elasticity="),
    ({"autotuning": {"enabled": True}}, "autotuning="),
    ({"compression_training": {"weight_quantization": {}}}, "compression_training="),
    ({"data_efficiency": {"enabled": True}}, "data_efficiency="),
    ({"curriculum_learning": {"enabled": True}}, "curriculum_learning="),
    ({"nebula": {"enabled": True}}, "nebula="),
    ({"hybrid_engine": {"enabled": True}}, "hybrid_engine="),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel="),
    ({"eigenvalue": {"enabled": True}}, "eigenvalue="),
    ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention="),
    ({"sparse_gradients": True}, "sparse_gradients=True"),
    ({"data_types": {"grad_accum_dtype": "int8"}}, "data_types="),
    ({"data_types": {"param_dtype": "bf16"}}, "data_types="),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
    ({"checkpoint": {"writer": {"type": "fast"}}}, "checkpoint.writer"),
    (
        {"zero_optimization": {"stage": 3, "stage3_model_persistence_threshold": 10}},
        "zero_optimization.model_persistence_threshold=10",
    ),
    ({"zero_optimization": {"stage": 3, "override_module_apply": False}}, "zero_optimization.override_module_apply"),
    ({"zero_optimization": {"stage": 1, "cpu_offload_param": True}}, "zero_optimization.offload_param.device='cpu'"),
    ({"checkpoint": {"checkpoint_serialization": False}}, "checkpoint.checkpoint_serialization=False"),
    ({"communication_data_type": "fp16"}, "communication_data_type='fp16'"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype='bf16'"),
]


@pytest.mark.parametrize("extra, key", UNSUPPORTED, ids=[key for _, key in UNSUPPORTED])
def test_unsupported_settings_raise_naming_the_key(extra, key):
    cfg = load_config({**BASE, **extra})
    with pytest.raises(NotImplementedError) as info:
        check_supported(cfg)
    assert key in str(info.value) and "needs " in str(info.value)


def test_every_problem_is_listed():
    cfg = load_config(
        {**BASE, "zero_optimization": {"legacy_stage1": True}, "sparse_gradients": True, "memory_breakdown": True}
    )
    lines = unsupported(cfg)
    assert [line.split("=")[0] for line in lines] == [
        "zero_optimization.legacy_stage1",
        "memory_breakdown",
        "sparse_gradients",
    ]


def test_table_rows_name_real_keys():
    cfg = load_config(BASE)
    for row in PENDING:
        node = cfg
        for part in row.key.split("."):
            if node is None:
                break
            node = getattr(node, part)  # AttributeError here means a row names a key the schema lacks
        assert row.feature
