"""Filling "auto": fill_auto (explicit dotted keys) and fill_from_training_args (HF Trainer mapping)."""

import copy
import json

import pytest
import torch

from zerotrain.config import ConfigError, fill_auto, fill_from_training_args, load_config

AUTO_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 0,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "param_persistence_threshold": "auto",
    },
}

ALL_ARGS = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=1e-4,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_epsilon=1e-6,
    weight_decay=0.1,
    max_grad_norm=0.7,
    warmup_steps=10,
    num_training_steps=500,
    hidden_size=64,
    fp16=False,
    bf16=False,
)


def test_fill_from_training_args_fills_everything():
    filled = fill_from_training_args(AUTO_CONFIG, world_size=3, **ALL_ARGS)
    assert (
        filled["train_batch_size"],
        filled["train_micro_batch_size_per_gpu"],
        filled["gradient_accumulation_steps"],
    ) == (24, 4, 2)
    assert filled["gradient_clipping"] == 0.7
    assert filled["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert filled["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 1e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 500,
    }
    assert filled["fp16"]["enabled"] is False and filled["bf16"]["enabled"] is False
    zero = filled["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"], zero["param_persistence_threshold"]) == (
        4096,
        int(0.9 * 4096),
        640,
    )
    cfg = load_config(filled, world_size=3)
    assert cfg.zero_optimization.prefetch_bucket_size == 3686


def test_fill_from_training_args_does_not_mutate_input():
    before = copy.deepcopy(AUTO_CONFIG)
    fill_from_training_args(AUTO_CONFIG, world_size=1, **ALL_ARGS)
    assert AUTO_CONFIG == before


def test_missing_argument_leaves_auto_for_load_config_to_report():
    args = {**ALL_ARGS, "hidden_size": None}
    filled = fill_from_training_args(AUTO_CONFIG, world_size=1, **args)
    assert filled["zero_optimization"]["reduce_bucket_size"] == "auto"
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size is 'auto'"):
        load_config(filled)


def test_batch_uses_config_values_when_arguments_are_missing():
    filled = fill_from_training_args(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
        world_size=2,
    )
    assert filled["train_batch_size"] == 12


def test_mismatches_are_collected_into_one_error():
    config = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999]}},
        "fp16": {"enabled": "true"},
    }
    with pytest.raises(ConfigError) as info:
        fill_from_training_args(
            config,
            world_size=2,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
            max_grad_norm=0.5,
            learning_rate=1e-3,
            adam_beta1=0.9,
            adam_beta2=0.98,
            fp16=False,
        )
    message = str(info.value)
    assert "ds train_micro_batch_size_per_gpu=2 vs per_device_train_batch_size=4" in message
    assert "ds gradient_clipping=1.0 vs max_grad_norm=0.5" in message
    assert "ds optimizer.params.betas=[0.9, 0.999] vs adam_beta1+adam_beta2=[0.9, 0.98]" in message
    assert 'ds fp16.enabled="true" vs fp16=false' in message
    assert "optimizer.params.lr" not in message  # agrees
    assert '"auto"' in message
    assert "ds train_batch_size=16 vs world_size*micro_batch*accumulation_steps (2*4*1)=8" in message
    assert len(info.value.problems) == 5


def test_agreeing_values_pass_and_string_booleans_match():
    config = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": "true"}, "gradient_clipping": 1.0}
    filled = fill_from_training_args(config, world_size=1, per_device_train_batch_size=2, fp16=True, max_grad_norm=1.0)
    assert filled == config


def test_fill_only_keys_never_mismatch():
    config = {
        "train_batch_size": 4,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-7}},
        "zero_optimization": {"reduce_bucket_size": 123},
    }
    filled = fill_from_training_args(config, world_size=1, hidden_size=1024)
    assert filled == config


def test_bfloat16_spelling_is_filled():
    filled = fill_from_training_args({"train_batch_size": 4, "bfloat16": {"enabled": "auto"}}, world_size=1, bf16=True)
    assert filled["bfloat16"]["enabled"] is True


@pytest.mark.parametrize("world_size", [0, -2, 1.0])
def test_world_size_is_checked(world_size):
    with pytest.raises(ValueError, match="world_size"):
        fill_from_training_args({"train_batch_size": 4}, world_size=world_size)


def test_fill_auto_replaces_only_auto(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "gradient_clipping": 2.0,
                "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
            }
        )
    )
    filled = fill_auto(
        path,
        {
            "train_batch_size": 8,
            "gradient_clipping": 0.1,
            "optimizer.params.lr": 3e-5,
            "optimizer.params.eps": 1e-8,
            "scheduler.params.lr": 1.0,
        },
    )
    assert filled == {
        "train_batch_size": 8,
        "gradient_clipping": 2.0,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-5}},
    }
    assert load_config(filled).optimizer.params["lr"] == 3e-5


def test_fill_auto_understands_both_stage3_spellings():
    config = {"zero_optimization": {"stage3_prefetch_bucket_size": "auto", "max_live_parameters": "auto"}}
    filled = fill_auto(
        config, {"zero_optimization.prefetch_bucket_size": 10, "zero_optimization.stage3_max_live_parameters": 20}
    )
    assert filled["zero_optimization"] == {"stage3_prefetch_bucket_size": 10, "max_live_parameters": 20}
    assert config["zero_optimization"]["max_live_parameters"] == "auto"


def test_auto_inside_unimplemented_sections_is_not_an_error():
    cfg = load_config({"train_batch_size": 4, "expert_parallel": {"enabled": False, "top_k": "auto"}})
    assert cfg.expert_parallel == {"enabled": False, "top_k": "auto"}


def _gpt2(dtype=None):
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=48, n_head=2, vocab_size=64, n_positions=16)
    )
    return model.to(dtype) if dtype is not None else model


def test_unfilled_auto_resolves_from_the_model_and_defaults():
    from zerotrain.config.auto import resolve_unfilled_auto

    resolved, lines = resolve_unfilled_auto(AUTO_CONFIG, _gpt2(torch.bfloat16))
    zero = resolved["zero_optimization"]
    # transformers' rules from the hidden size (48), the precision from the parameters' dtype
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"], zero["param_persistence_threshold"]) == (
        48 * 48,
        int(0.9 * 48 * 48),
        480,
    )
    assert resolved["bf16"] == {"enabled": True} and resolved["fp16"] == {"enabled": False}
    # everything else takes its default: dropped, as DeepSpeed drops an "auto" nobody filled
    assert "gradient_clipping" not in resolved and "train_batch_size" not in resolved
    assert resolved["optimizer"]["params"] == {} and resolved["scheduler"]["params"] == {}
    assert len(lines) == 17 and any("reduce_bucket_size=2304 (from the model)" in line for line in lines)
    assert AUTO_CONFIG["zero_optimization"]["reduce_bucket_size"] == "auto"  # the input is not modified
    # without a hidden size the bucket sizes take their defaults too; fp32 parameters: no 16-bit
    plain, _ = resolve_unfilled_auto(AUTO_CONFIG, torch.nn.Linear(4, 4))
    assert "reduce_bucket_size" not in plain["zero_optimization"]
    assert plain["bf16"] == {"enabled": False} and plain["fp16"] == {"enabled": False}


def test_top_level_dotted_keys_fill_the_nested_auto():
    from zerotrain.config.auto import resolve_unfilled_auto

    config = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 7},
        "zero_optimization.reduce_bucket_size": 1024.0,
        "zero_optimization.stage3_prefetch_bucket_size": 9,
    }
    resolved, _ = resolve_unfilled_auto(config)
    assert resolved == {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1024, "stage3_prefetch_bucket_size": 7}}
    # TRL's reference model: its unrounded 0.9*H*H gives way to the model's int(0.9*H*H)
    trl = {
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
        "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 48 * 48,
    }
    resolved, _ = resolve_unfilled_auto(trl, _gpt2())
    assert resolved["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 48 * 48) == 2073


def test_initialize_resolves_unfilled_auto_and_keeps_the_batch_error(in_process_rank, caplog):
    import zerotrain

    model = _gpt2()
    config = {
        **AUTO_CONFIG,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    del config["scheduler"]
    with caplog.at_level("INFO", logger="zerotrain"):
        engine, optimizer, _, _ = zerotrain.initialize(model=model, config=config)
    zero = engine.config.zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        48 * 48,
        int(0.9 * 48 * 48),
        480,
    )
    assert engine.train_batch_size() == 2 and engine.gradient_clipping() == 1.0  # DeepSpeed's default
    assert optimizer.param_groups[0]["lr"] == 1e-3  # torch AdamW's own default
    assert any('"auto" values nobody filled' in r.getMessage() for r in caplog.records)
    engine.destroy()
    # batch sizes nobody filled cannot be derived: the batch rule's error names them
    with pytest.raises(ConfigError, match="train_batch_size"):
        zerotrain.initialize(model=model, config={**AUTO_CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def test_config_reads_like_deepspeeds_dict():
    # DeepSpeed's engine.config is the config dict: transformers calls .get, OpenRLHF subscripts it
    cfg = load_config(
        {"train_batch_size": 4, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    )
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg.get("zero_optimization")["stage"] == 2 and "zero_optimization" in cfg and "fp16" not in cfg
    with pytest.raises(KeyError):
        cfg["fp16"]
