"""Table of bad configs: each must fail with a clear message naming the offending key.

RANGE_CASES (issue 29 item 12): numbers outside their meaningful range once trained silently wrong
or failed naming nothing (`betas: [0.9]` gave IndexError, `initial_scale_power: 1000` skipped every
step, `train_batch_size: 1e18` accumulated 2.5e17 micro-batches per step). Each must give one line
starting with the field, through `load_config`, a JSON file, and `zerotrain.initialize`.
"""

import json
import math
import warnings

import pytest
import torch

import zerotrain
from zerotrain.config import ConfigError, load_config
from zerotrain.config.ranges import MAX_BATCH, MAX_GRAD_ACCUM

BATCH = {"train_batch_size": 8}


def _with(**sections):
    return {**BATCH, **sections}


BAD_CONFIGS = [
    # (id, config, world_size, exception, message substring)
    (
        "unknown-top-strict",
        _with(zero_optimisation={"stage": 0}, strict=True),
        1,
        ConfigError,
        "unknown config key 'zero_optimisation'; did you mean 'zero_optimization'?",
    ),
    (
        "unknown-zero",
        _with(zero_optimization={"stgae": 0}),
        1,
        ConfigError,
        "unknown config key 'zero_optimization.stgae'; did you mean 'stage'?",
    ),
    (
        "unknown-offload",
        _with(zero_optimization={"offload_optimizer": {"devcie": "cpu"}}),
        1,
        ConfigError,
        "unknown config key 'zero_optimization.offload_optimizer.devcie'; did you mean 'device'?",
    ),
    (
        "unknown-stage3-alias",
        _with(zero_optimization={"stage3_prefetch_bucket_sise": 10}),
        1,
        ConfigError,
        "did you mean 'stage3_prefetch_bucket_size'?",
    ),
    (
        "unknown-fp16",
        _with(fp16={"enabled": False, "loss_scale_windows": 10}),
        1,
        ConfigError,
        "unknown config key 'fp16.loss_scale_windows'; did you mean 'loss_scale_window'?",
    ),
    (
        "unknown-bfloat16",
        _with(bfloat16={"enabeld": True}),
        1,
        ConfigError,
        "unknown config key 'bfloat16.enabeld'; did you mean 'enabled'?",
    ),
    (
        "unknown-optimizer",
        _with(optimizer={"type": "Adam", "param": {}}),
        1,
        ConfigError,
        "unknown config key 'optimizer.param'; did you mean 'params'?",
    ),
    (
        "unknown-no-match",
        _with(tensorboard={"xyz": 1}),
        1,
        ConfigError,
        "unknown config key 'tensorboard.xyz'; valid keys under 'tensorboard': enabled, job_name, output_path",
    ),
    (
        "stage-string",
        _with(zero_optimization={"stage": "fast"}),
        1,
        ConfigError,
        "zero_optimization.stage: expected an integer, got 'fast' (str)",
    ),
    (
        "stage-range",
        _with(zero_optimization={"stage": 4}),
        1,
        ConfigError,
        "zero_optimization.stage: must be 0, 1, 2 or 3, got 4",
    ),
    (
        "bucket-string",
        _with(zero_optimization={"reduce_bucket_size": "big"}),
        1,
        ConfigError,
        "zero_optimization.reduce_bucket_size: expected an integer, got 'big'",
    ),
    (
        "bucket-fraction",
        _with(zero_optimization={"sub_group_size": 1.5}),
        1,
        ConfigError,
        "zero_optimization.sub_group_size: expected a whole number, got 1.5",
    ),
    (
        "bucket-negative",
        _with(zero_optimization={"allgather_bucket_size": -1}),
        1,
        ConfigError,
        "zero_optimization.allgather_bucket_size: must be >= 0, got -1",
    ),
    (
        "clipping-string",
        _with(gradient_clipping="fast"),
        1,
        ConfigError,
        "gradient_clipping: expected a number, got 'fast' (str)",
    ),
    ("clipping-bool", _with(gradient_clipping=True), 1, ConfigError, "gradient_clipping: expected a number, got True"),
    ("clipping-negative", _with(gradient_clipping=-1.0), 1, ConfigError, "gradient_clipping: must be >= 0"),
    (
        "bool-garbage",
        _with(fp16={"enabled": "maybe"}),
        1,
        ConfigError,
        "fp16.enabled: expected a boolean (true/false), got 'maybe'",
    ),
    ("section-not-object", _with(fp16=True), 1, ConfigError, "fp16: expected an object"),
    (
        "prof-ops-type",
        _with(comms_logger={"prof_ops": [1]}),
        1,
        ConfigError,
        "comms_logger.prof_ops[0]: expected a string, got 1",
    ),
    (
        "offload-device",
        _with(zero_optimization={"offload_optimizer": {"device": "gpu"}}),
        1,
        ConfigError,
        "zero_optimization.offload_optimizer.device: expected one of 'none', 'cpu' or 'nvme', got 'gpu'",
    ),
    (
        "offload-param-device",
        _with(zero_optimization={"offload_param": {"device": "disk"}}),
        1,
        ConfigError,
        "zero_optimization.offload_param.device: expected one of",
    ),
    (
        "nvme-no-path",
        _with(zero_optimization={"offload_optimizer": {"device": "nvme"}}),
        1,
        ConfigError,
        "zero_optimization.offload_optimizer: device 'nvme' needs 'nvme_path'",
    ),
    (
        "partial-offload-stage",
        _with(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
        1,
        ConfigError,
        "offload_optimizer.ratio < 1 (partial offload) needs stage 3",
    ),
    (
        "both-spellings",
        _with(zero_optimization={"stage3_max_live_parameters": 1, "max_live_parameters": 2}),
        1,
        ConfigError,
        "both 'stage3_max_live_parameters' and 'max_live_parameters' are given",
    ),
    (
        "bf16-both-spellings",
        _with(bf16={"enabled": False}, bfloat16={"enabled": False}),
        1,
        ConfigError,
        "both 'bfloat16' and 'bf16' are given",
    ),
    (
        "deprecated-and-new",
        _with(zero_optimization={"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}),
        1,
        ConfigError,
        "'cpu_offload' (deprecated) and 'offload_optimizer' cannot both be given",
    ),
    (
        "fp16-and-bf16",
        _with(fp16={"enabled": True}, bf16={"enabled": "true"}),
        1,
        ValueError,
        "fp16 and bf16 cannot both be enabled",
    ),
    (
        "dynamic-window-zero",
        _with(fp16={"enabled": True, "loss_scale_window": 0}),
        1,
        ConfigError,
        "fp16.loss_scale_window: must be >= 1",
    ),
    (
        "max-grad-norm",
        _with(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}),
        1,
        ConfigError,
        "optimizer.params: max_grad_norm is not allowed here",
    ),
    ("optimizer-no-type", _with(optimizer={"params": {"lr": 1e-3}}), 1, ConfigError, "'optimizer.type' is required"),
    (
        "auto-nested",
        _with(optimizer={"type": "AdamW", "params": {"lr": "auto"}}),
        1,
        ConfigError,
        "optimizer.params.lr is 'auto'",
    ),
    ("auto-points-to-fill", _with(gradient_clipping="auto"), 1, ConfigError, "fill_from_training_args"),
    (
        "auto-stage3-key",
        _with(zero_optimization={"stage3_prefetch_bucket_size": "auto"}),
        1,
        ConfigError,
        "zero_optimization.stage3_prefetch_bucket_size is 'auto'",
    ),
    (
        "auto-batch",
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2},
        1,
        ConfigError,
        "train_batch_size is 'auto'",
    ),
    (
        "batch-inconsistent",
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
        2,
        ConfigError,
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 * world_size 2 = 16",
    ),
    ("batch-missing", {}, 1, ConfigError, "either train_batch_size or train_micro_batch_size_per_gpu"),
    ("batch-only-gas", {"gradient_accumulation_steps": 4}, 1, ConfigError, "gradient_accumulation_steps alone"),
    (
        "batch-not-divisible",
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
        2,
        ConfigError,
        "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 * world_size 2 = 8",
    ),
    (
        "batch-tb-world",
        {"train_batch_size": 6},
        4,
        ConfigError,
        "cannot derive train_micro_batch_size_per_gpu: train_batch_size 6 is not divisible by world_size 4;",
    ),
    ("batch-negative", {"train_batch_size": -8}, 1, ConfigError, "train_batch_size: must be > 0, got -8"),
    (
        "batch-zero",
        {"train_micro_batch_size_per_gpu": 0},
        1,
        ConfigError,
        "train_micro_batch_size_per_gpu: must be > 0",
    ),
    ("batch-string", {"train_batch_size": "lots"}, 1, ConfigError, "train_batch_size: expected an integer, got 'lots'"),
    (
        "comm-dtype",
        _with(communication_data_type="int8"),
        1,
        ConfigError,
        "communication_data_type: expected one of 'fp32', 'fp16' or 'bf16', got 'int8'",
    ),
    (
        "tag-validation",
        _with(checkpoint={"tag_validation": "Sometimes"}),
        1,
        ConfigError,
        "checkpoint.tag_validation: expected one of 'Warn', 'Ignore' or 'Fail'",
    ),
    ("strict-garbage", _with(strict="maybe"), 1, ConfigError, "strict: expected a boolean"),
    ("steps-per-print-zero", _with(steps_per_print=0), 1, ConfigError, "steps_per_print: must be > 0"),
    (
        "several-at-once",
        _with(foo=1, zero_optimization={"stage": "x"}, strict=True),
        1,
        ConfigError,
        "invalid config:\n  - ",
    ),
]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "config, world_size, exc, message", [case[1:] for case in BAD_CONFIGS], ids=[case[0] for case in BAD_CONFIGS]
)
def test_bad_config(config, world_size, exc, message):
    with pytest.raises(exc) as info:
        load_config(config, world_size=world_size)
    assert message in str(info.value)


def test_table_is_big_enough():
    assert len(BAD_CONFIGS) >= 25


def test_config_error_is_value_error_and_lists_problems():
    with pytest.raises(ConfigError) as info:
        load_config(_with(foo=1, bar=2, strict="true"))
    assert isinstance(info.value, ValueError)
    assert len(info.value.problems) == 2


@pytest.mark.parametrize(
    "source, message",
    [
        (42, "config must be a dict or a path"),
        ("/nonexistent/ds_config.json", "config file not found: /nonexistent/ds_config.json"),
    ],
)
def test_bad_sources(source, message):
    with pytest.raises(ConfigError, match=message):
        load_config(source)


def test_bad_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match=r"is not valid JSON: .* line 1"):
        load_config(path)


def test_duplicate_json_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(path)


def test_json_must_be_object(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_config(path)


# --- numeric ranges (issue 29 item 12) ---


def _opt(**params):
    return {**BATCH, "optimizer": {"type": "AdamW", "params": params}}


def _sched(type_="WarmupLR", **params):
    return {
        **BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": type_, "params": params},
    }


def _fp16(**keys):
    return {**BATCH, "fp16": {"enabled": True, **keys}}


# (id, config, world_size, the field the message must start with, what else it must say)
RANGE_CASES = [
    ("betas-one", _opt(betas=[0.9]), 1, "optimizer.params.betas", "exactly two numbers in [0, 1)"),
    ("betas-three", _opt(betas=[0.9, 0.99, 0.999]), 1, "optimizer.params.betas", "exactly two numbers"),
    ("betas-one-or-more", _opt(betas=[0.9, 1.0]), 1, "optimizer.params.betas", "got [0.9, 1.0]"),
    ("betas-negative", _opt(betas=[-0.1, 0.999]), 1, "optimizer.params.betas", "in [0, 1)"),
    ("betas-number", _opt(betas=0.9), 1, "optimizer.params.betas", "e.g. [0.9, 0.999]"),
    ("betas-string", _opt(betas=["0.9", "0.99"]), 1, "optimizer.params.betas", "two numbers"),
    (
        "betas-torch-adam",
        {**BATCH, "optimizer": {"type": "Adam", "params": {"torch_adam": True, "betas": [0.9]}}},
        1,
        "optimizer.params.betas",
        "exactly two numbers",
    ),
    ("eps-zero", _opt(eps=0), 1, "optimizer.params.eps", "must be a number > 0"),
    ("eps-negative", _opt(eps=-1e-8), 1, "optimizer.params.eps", "> 0"),
    ("eps-nan", _opt(eps=math.nan), 1, "optimizer.params.eps", "> 0"),
    ("lr-negative", _opt(lr=-1e-3), 1, "optimizer.params.lr", "must be a number >= 0"),
    ("lr-inf", _opt(lr=math.inf), 1, "optimizer.params.lr", ">= 0"),
    ("lr-bool", _opt(lr=True), 1, "optimizer.params.lr", "a number"),
    ("weight-decay-negative", _opt(weight_decay=-0.01), 1, "optimizer.params.weight_decay", ">= 0"),
    (
        "momentum-negative",
        {**BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": -0.9}}},
        1,
        "optimizer.params.momentum",
        ">= 0",
    ),
    ("warmup-max-lr-negative", _sched(warmup_max_lr=-1e-3), 1, "scheduler.params.warmup_max_lr", "(a learning rate)"),
    (
        "cosine-ratio-negative",
        _sched("WarmupCosineLR", total_num_steps=100, warmup_min_ratio=-1),
        1,
        "scheduler.params.warmup_min_ratio",
        ">= 0",
    ),
    (
        "cycle-lr-nan",
        _sched("OneCycle", cycle_min_lr=math.nan, cycle_max_lr=0.1),
        1,
        "scheduler.params.cycle_min_lr",
        ">= 0",
    ),
    (
        "steplr-step-size-zero",
        _sched("StepLR", step_size=0),
        1,
        "scheduler.params.step_size",
        "whole number of steps >= 1",
    ),
    ("cosine-t-max-zero", _sched("CosineAnnealingLR", T_max=0), 1, "scheduler.params.T_max", ">= 1"),
    ("steplr-step-size-fraction", _sched("StepLR", step_size=2.5), 1, "scheduler.params.step_size", "got 2.5"),
    ("scale-power-1000", _fp16(initial_scale_power=1000), 1, "fp16.initial_scale_power", "must be from 0 to 32"),
    ("scale-power-33", _fp16(initial_scale_power=33), 1, "fp16.initial_scale_power", "DeepSpeed's default is 16"),
    ("scale-power-negative", _fp16(initial_scale_power=-1), 1, "fp16.initial_scale_power", "from 0 to 32"),
    ("scale-power-float-huge", _fp16(initial_scale_power=1e30), 1, "fp16.initial_scale_power", "from 0 to 32"),
    ("static-scale-huge", _fp16(loss_scale=2.0**40), 1, "fp16.loss_scale", "from 0 to 4294967296"),
    ("static-scale-inf", _fp16(loss_scale=math.inf), 1, "fp16.loss_scale", "from 0 to"),
    ("window-zero-fp16-off", {**BATCH, "fp16": {"loss_scale_window": 0}}, 1, "fp16.loss_scale_window", "must be >= 1"),
    ("hysteresis-zero", _fp16(hysteresis=0), 1, "fp16.hysteresis", "must be >= 1"),
    ("min-scale-zero", _fp16(min_loss_scale=0), 1, "fp16.min_loss_scale", "must be > 0"),
    ("min-scale-negative-static", _fp16(loss_scale=128, min_loss_scale=-1), 1, "fp16.min_loss_scale", "> 0"),
    (
        "batch-1e18",
        {"train_batch_size": 1e18, "train_micro_batch_size_per_gpu": 4},
        1,
        "train_batch_size",
        f"must be from 1 to {MAX_BATCH}",
    ),
    ("batch-1e30", {"train_batch_size": 1e30}, 1, "train_batch_size", f"from 1 to {MAX_BATCH}"),
    ("batch-fraction", {"train_batch_size": 8.5}, 1, "train_batch_size", "expected a whole number"),
    ("batch-inf", {"train_batch_size": math.inf}, 1, "train_batch_size", "finite"),
    (
        "micro-huge",
        {"train_micro_batch_size_per_gpu": 2**40},
        1,
        "train_micro_batch_size_per_gpu",
        f"from 1 to {MAX_BATCH}",
    ),
    (
        "gas-huge",
        {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 10**6},
        1,
        "gradient_accumulation_steps",
        f"must be from 1 to {MAX_GRAD_ACCUM}",
    ),
    (
        "gas-derived-huge",
        {"train_batch_size": 2**20, "train_micro_batch_size_per_gpu": 1},
        2,
        "gradient_accumulation_steps 524288 (= train_batch_size 1048576 / (train_micro_batch_size_per_gpu 1 * "
        "world_size 2))",
        "lower train_batch_size or raise train_micro_batch_size_per_gpu",
    ),
    (
        "batch-derived-huge",
        {"train_micro_batch_size_per_gpu": 2**30, "gradient_accumulation_steps": 4},
        1,
        "train_batch_size 4294967296",
        f"is above {MAX_BATCH} samples",
    ),
    ("predivide-nan", {**BATCH, "gradient_predivide_factor": math.nan}, 1, "gradient_predivide_factor", ""),
    (
        "recompute-negative",
        {**BATCH, "flops_profiler": {"recompute_fwd_factor": -1}},
        1,
        "flops_profiler.recompute_fwd_factor",
        ">= 0",
    ),
    ("peak-zero", {**BATCH, "flops_profiler": {"peak_tflops": 0}}, 1, "flops_profiler.peak_tflops", "> 0"),
    ("comet-mode", {**BATCH, "comet": {"mode": "sometimes"}}, 1, "comet.mode", "get_or_create"),
    ("comet-interval", {**BATCH, "comet": {"samples_log_interval": -1}}, 1, "comet.samples_log_interval", ">= 0"),
]

IDS = [case[0] for case in RANGE_CASES]
CASES = [case[1:] for case in RANGE_CASES]


def _check_message(exc, field, fragment):
    message = str(exc)
    assert isinstance(exc, ConfigError) and isinstance(exc, ValueError)
    assert "\n" not in message, message
    assert message.startswith(field), message
    assert fragment in message, message


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("config, world_size, field, fragment", CASES, ids=IDS)
def test_out_of_range_through_load_config(config, world_size, field, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    _check_message(info.value, field, fragment)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "config, world_size, field, fragment",
    [case for case in CASES if case[1] == 1],
    ids=[i for i, c in zip(IDS, CASES) if c[1] == 1],
)
def test_out_of_range_through_a_json_file(tmp_path, config, world_size, field, fragment):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))  # NaN/Infinity are written as Python's json reads them
    with pytest.raises(ConfigError) as info:
        load_config(str(path), world_size=world_size)
    _check_message(info.value, field, fragment)


def test_the_issues_three_configs_through_initialize(in_process_rank):
    # The exact reports: each used to be accepted (or raise IndexError) inside zerotrain.initialize.
    for config, field in [
        (_opt(betas=[0.9]), "optimizer.params.betas"),
        (_fp16(initial_scale_power=1000), "fp16.initial_scale_power"),
        ({"train_batch_size": 1e18, "train_micro_batch_size_per_gpu": 4}, "train_batch_size"),
    ]:
        model = torch.nn.Linear(4, 2)
        with pytest.raises(ConfigError) as info:
            zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
        _check_message(info.value, field, "")


def test_integral_floats_are_integers_and_bounds_are_inclusive(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(
        '{"train_batch_size": 8.0, "gradient_accumulation_steps": 2e0, '
        '"fp16": {"enabled": true, "initial_scale_power": 32, "loss_scale_window": 1, "hysteresis": 1}}'
    )
    cfg = load_config(str(path), world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 2, 2)
    assert all(
        type(v) is int for v in (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.fp16.initial_scale_power)
    )
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": MAX_GRAD_ACCUM,
            "fp16": {"enabled": True, "initial_scale_power": 0, "loss_scale": 2.0**32},
        }
    )
    assert cfg.gradient_accumulation_steps == MAX_GRAD_ACCUM and cfg.train_batch_size == MAX_GRAD_ACCUM
    assert load_config({"train_batch_size": MAX_BATCH}).train_micro_batch_size_per_gpu == MAX_BATCH


def test_valid_optimizer_and_scheduler_values_still_pass():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(
            {
                **_opt(lr=0.0, betas=[0.0, 0.999], eps=1e-8, weight_decay=0.0),
                "scheduler": {
                    "type": "WarmupLR",
                    "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
                },
            }
        )
    assert cfg.optimizer.params["betas"] == [0.0, 0.999]
    for type_, params in (
        ("StepLR", {"step_size": 1}),
        ("StepLR", {"step_size": 30.0}),
        ("CosineAnnealingLR", {"T_max": 1}),
    ):
        assert load_config(_sched(type_, **params)).scheduler.params == params
    # A dict config built in code may hold numpy scalars (np.mean returns np.float64).
    import numpy

    cfg = load_config(_opt(lr=numpy.float32(1e-3), betas=[numpy.float64(0.9), numpy.float32(0.99)]))
    assert float(cfg.optimizer.params["lr"]) == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match=r"^optimizer\.params\.lr: must be a number >= 0, got np\.True_$"):
        load_config(_opt(lr=numpy.bool_(True)))
    # Adafactor's eps is a pair with None allowed: torch checks it, not the config.
    load_config({**BATCH, "optimizer": {"type": "Adafactor", "params": {"eps": [None, 1e-3]}}})
    # Per-group learning-rate lists (torch's CyclicLR base_lr) are checked element by element.
    load_config(_sched("CyclicLR", base_lr=[0.001, 0.002], max_lr=0.1))
    with pytest.raises(ConfigError, match=r"^scheduler\.params\.base_lr: .*got \[0\.001, -0\.002\]$"):
        load_config(_sched("CyclicLR", base_lr=[0.001, -0.002], max_lr=0.1))
