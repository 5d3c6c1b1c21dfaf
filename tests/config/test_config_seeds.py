"""Real-world DeepSpeed configs (tests/config/seeds/) parse unchanged once their "auto" values are filled.

Provenance: hf_trainer_zero3, zero3_7b_offload and standalone_zero2 come from a DeepSpeed tutorial
(HF Trainer ZeRO-3, 7B ZeRO-3 CPU offload, the `deepspeed.initialize` dict); accelerate_zero2 and
accelerate_zero3_offload from the accelerate DeepSpeed blog post (note `"enabled": "true"`);
fp16_block_minimal is another tutorial's fp16 block (`"enabled": "auto"`) in a minimal config.
"""

import json
from pathlib import Path

import pytest

from zerotrain.config import ConfigError, check_supported, fill_from_training_args, load_config

SEEDS = Path(__file__).parent / "seeds"


def _load(name, world_size, **training_args):
    filled = fill_from_training_args(SEEDS / name, world_size=world_size, **training_args)
    return load_config(filled, world_size=world_size)


def test_hf_trainer_zero3():
    cfg = _load(
        "hf_trainer_zero3.json",
        4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_grad_norm=0.5,
        hidden_size=4096,
        bf16=True,
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 2, 4)
    assert cfg.gradient_clipping == 0.5
    zero = cfg.zero_optimization
    assert zero.stage == 3 and zero.overlap_comm is True and zero.sub_group_size == 10**9
    assert zero.reduce_bucket_size == 4096 * 4096
    assert zero.prefetch_bucket_size == int(0.9 * 4096 * 4096)
    assert zero.param_persistence_threshold == 40960
    assert zero.max_live_parameters == zero.max_reuse_distance == 10**9
    assert zero.gather_16bit_weights_on_model_save is True
    assert cfg.bf16.enabled and cfg.steps_per_print == 100
    check_supported(cfg)  # ZeRO-3 + bf16: implemented


def test_zero3_7b_offload():
    cfg = _load("zero3_7b_offload.json", 8, hidden_size=4096)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 1, 8)
    zero = cfg.zero_optimization
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory
    assert zero.offload_param.device == "cpu" and zero.offload_param.buffer_count == 5
    assert zero.reduce_bucket_size == 4096 * 4096
    check_supported(cfg)  # every setting of the seed works, cpu offload of both included


def test_zero3_7b_offload_wrong_world_size_is_reported():
    with pytest.raises(ConfigError, match=r"ds train_batch_size=64 vs world_size\*micro_batch"):
        fill_from_training_args(SEEDS / "zero3_7b_offload.json", world_size=4, hidden_size=4096)


def test_standalone_dict():
    cfg = _load(
        "standalone_zero2.json",
        4,
        learning_rate=3e-5,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.01,
        bf16=True,
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 4, 2)
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params == {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    check_supported(cfg)  # ZeRO-2 with bf16: everything it asks for is implemented


def test_standalone_dict_needs_its_world_size():
    config = json.loads((SEEDS / "standalone_zero2.json").read_text())
    with pytest.raises(ConfigError, match="world_size 2 = 16"):
        load_config(config, world_size=2)


def test_accelerate_zero2():
    cfg = _load(
        "accelerate_zero2.json",
        2,
        per_device_train_batch_size=200,
        learning_rate=1e-6,
        weight_decay=0.0,
        warmup_steps=100,
        num_training_steps=50,
        max_grad_norm=1.0,
        fp16=True,
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (400, 200, 1)
    assert cfg.fp16.enabled is True  # written as the string "true"
    assert cfg.fp16.initial_scale_power == 15 and cfg.fp16.loss_scale == 0
    assert cfg.optimizer.params == {"lr": 1e-6, "weight_decay": 0.0, "torch_adam": True, "adam_w_mode": True}
    assert cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.scheduler.params == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 1e-6,
        "warmup_num_steps": 100,
        "total_num_steps": 50,
    }
    zero = cfg.zero_optimization
    assert zero.allgather_bucket_size == zero.reduce_bucket_size == 200_000_000
    assert cfg.steps_per_print == 2000
    check_supported(cfg)  # ZeRO-2 + fp16 dynamic loss scaling: implemented


def test_accelerate_zero3_offload():
    cfg = _load(
        "accelerate_zero3_offload.json",
        2,
        per_device_train_batch_size=16,
        learning_rate=5e-4,
        weight_decay=0.0,
        warmup_steps=0,
        num_training_steps=1000,
        max_grad_norm=1.0,
        fp16=True,
        hidden_size=1600,
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (32, 16)
    assert cfg.scheduler.params["warmup_num_steps"] == 1  # clamped like transformers does
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == 1600 * 1600
    assert zero.prefetch_bucket_size == int(0.9 * 1600 * 1600)
    assert zero.param_persistence_threshold == 16000
    check_supported(cfg)  # every setting of the seed works, cpu offload of both included


def test_fp16_block_enabled():
    cfg = _load("fp16_block_minimal.json", 2, per_device_train_batch_size=8, fp16=True)
    assert cfg.fp16.enabled and cfg.fp16.loss_scale_window == 1000 and cfg.fp16.min_loss_scale == 1
    assert cfg.train_batch_size == 16
    check_supported(cfg)


def test_fp16_block_disabled_is_supported():
    cfg = _load("fp16_block_minimal.json", 1, per_device_train_batch_size=8, fp16=False)
    assert cfg.fp16.enabled is False
    check_supported(cfg)


def test_unfilled_seed_names_every_auto_key():
    with pytest.raises(ConfigError) as info:
        load_config(SEEDS / "hf_trainer_zero3.json")
    message = str(info.value)
    for key in (
        "train_batch_size",
        "gradient_clipping",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.reduce_bucket_size",
    ):
        assert f"{key} is 'auto'" in message


def test_raw_keeps_the_filled_config():
    cfg = _load(
        "accelerate_zero2.json",
        2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.0,
        warmup_steps=10,
        num_training_steps=100,
        max_grad_norm=1.0,
        fp16=True,
    )
    assert cfg.raw["fp16"]["enabled"] == "true"
    assert cfg.raw["optimizer"]["params"]["lr"] == 1e-3
    assert cfg.raw["train_batch_size"] == 8
