"""accelerate on zerotrain: seed 003's script shape through accelerate's own DeepSpeed code.

- `accelerate launch --config_file cfg.yaml` with seed 003's first YAML (the plugin fields:
  zero_stage 2, gradient_clipping, offload devices none, mixed_precision fp16), started as
  `python -m zerotrain.hf accelerate launch ...`: the real launcher, 2 processes.
- seed 003's second form (`deepspeed_config_file` with optimizer/scheduler sections and "auto"
  values, ZeRO-3, zero3_init_flag) in one 2-rank group, with `DummyOptim`/`DummyScheduler`.

Both are compared with the same training in plain PyTorch (tests/hf/accelerate_script.py).

- seed 003's flow as a user runs it (tests/hf/accelerate_flows.py) through the real `accelerate
  launch`, 2 processes, at ZeRO-3 with optimizer and parameter offload to the CPU,
  `zero3_init_flag` (`from_pretrained` / `from_config` partitioned while "auto" values are still
  unfilled), a torch AdamW and transformers' linear schedule, in fp32 and bf16 (plugin YAML) and
  fp16 (`deepspeed_config_file` YAML with seed 003's "auto" values): each step's learning rate
  (read from the engine's optimizer) equals the plain run's, and the final weights match a plain
  single-process fp32 run of the same steps (issue 29 items 1-3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.hf import accelerate_flows  # noqa: E402
from tests.hf.accelerate_script import config_file_form, plain_reference  # noqa: E402
from zerotrain.comm.distributed import free_port  # noqa: E402
from zerotrain.testing import run_on_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

SEED003_PLUGIN_YAML = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
fsdp_config: {}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
use_cpu: false
"""

# Seed 003's zero3_offload_config_accelerate.json with offload off (not implemented yet) and fp32.
SEED003_ZERO3_FILE = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "sub_group_size": 1e9,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 1,
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_accelerate_launch_with_seed003_plugin_yaml(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(SEED003_PLUGIN_YAML)
    command = [
        sys.executable,
        "-m",
        "zerotrain.hf",
        "accelerate",
        "launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(free_port()),
        str(ROOT / "tests/hf/accelerate_script.py"),
        str(ROOT),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=240, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(lines[0][len("RESULT ") :])
    assert (result["engine"], result["stage"], result["world"]) == ("zerotrain.engine.engine", 2, 2)
    # fp16 compute (10-bit mantissa) against fp32: the losses agree to ~1e-4 relative.
    assert result["losses"] == pytest.approx(plain_reference("linear"), rel=1e-3)


def test_accelerate_deepspeed_config_file_form_with_dummy_optimizer_and_scheduler(tmp_path):
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(SEED003_ZERO3_FILE))
    ranks = run_on_ranks(config_file_form, world_size=2, args=(str(path),), timeout=180)
    result = ranks[0]
    assert result["stage"] == 3 and result["lr_scheduler"] == "WarmupDecayLR"
    raw = result["raw"]
    # "auto" filled by accelerate from DummyOptim / DummyScheduler / the dataloader / the model.
    assert raw["optimizer"]["params"] == {"lr": 3e-3, "weight_decay": 0.01}
    assert raw["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-3,
        "warmup_num_steps": 1,
        "total_num_steps": 2,
    }
    assert (raw["train_micro_batch_size_per_gpu"], raw["train_batch_size"], raw["gradient_clipping"]) == (2, 4, 1.0)
    assert raw["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert result["losses"] == pytest.approx(plain_reference("WarmupDecayLR"), rel=1e-5)


def _offload_plugin_yaml(mixed_precision: str) -> str:
    """Seed 003's plugin YAML at ZeRO-3 with both offloads and zero3_init_flag."""
    return (
        SEED003_PLUGIN_YAML.replace("zero_stage: 2", "zero_stage: 3")
        .replace("offload_optimizer_device: none", "offload_optimizer_device: cpu")
        .replace("offload_param_device: none", "offload_param_device: cpu")
        .replace("zero3_init_flag: false", "zero3_init_flag: true")
        .replace("mixed_precision: fp16", f"mixed_precision: {mixed_precision}")
    )


# Seed 003's zero3_offload_config_accelerate.json without its optimizer/scheduler sections (the
# script brings a torch AdamW and schedule): fp16, offload to the CPU, "auto" values.
SEED003_OFFLOAD_FILE = {
    **{k: v for k, v in SEED003_ZERO3_FILE.items() if k not in ("optimizer", "scheduler")},
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        **SEED003_ZERO3_FILE["zero_optimization"],
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
    },
}

# accelerate refuses `mixed_precision` next to `deepspeed_config_file` (the file decides).
CONFIG_FILE_YAML = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: {path}
  zero3_init_flag: true
distributed_type: DEEPSPEED
machine_rank: 0
num_machines: 1
num_processes: 2
use_cpu: false
"""


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from tests.hf.hf_workloads import make_model

    folder = tmp_path_factory.mktemp("tiny_gpt2")
    make_model(seed=0).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def flows_reference(saved_model):
    from transformers import AutoModelForCausalLM

    reference = accelerate_flows.plain_reference(str(saved_model))
    reference["initial"] = AutoModelForCausalLM.from_pretrained(saved_model).state_dict()
    return reference


@pytest.mark.parametrize("form", ["plugin-fp32", "plugin-bf16", "config-file-fp16"])
def test_accelerate_launch_zero3_offload_flow_matches_plain_pytorch(form, tmp_path, saved_model, flows_reference):
    config = tmp_path / "cfg.yaml"
    if form.startswith("plugin"):
        config.write_text(_offload_plugin_yaml({"fp32": '"no"', "bf16": "bf16"}[form.split("-")[1]]))
    else:
        (tmp_path / "zero3.json").write_text(json.dumps(SEED003_OFFLOAD_FILE))
        config.write_text(CONFIG_FILE_YAML.format(path=tmp_path / "zero3.json"))
    out = tmp_path / "result.json"
    command = [
        sys.executable,
        "-m",
        "zerotrain.hf",
        "accelerate",
        "launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(free_port()),
        str(ROOT / "tests/hf/accelerate_flows.py"),
        str(ROOT),
        str(saved_model),
        str(out),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(out.read_text())
    dtype = {"plugin-fp32": "torch.float32", "plugin-bf16": "torch.bfloat16", "config-file-fp16": "torch.float16"}[form]
    assert (result["stage"], result["world"], result["optimizer"], result["param_dtype"]) == (
        3,
        2,
        "DeepSpeedCPUAdam",
        dtype,
    )
    assert result["from_config_local_numel"] == 0  # built partitioned, "auto" values unfilled
    zero = result["config"]["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    # The scheduler accelerate steps reaches the optimizer: every step's lr is the plain run's
    # (0 in warm-up, then 3e-3, 2e-3, 1e-3), in both parameter groups.
    assert result["lrs"] == flows_reference["lrs"]
    assert [lr[0] for lr in result["lrs"]] == pytest.approx([0.0, 3e-3, 2e-3, 1e-3], abs=1e-12)
    initial, plain = flows_reference["initial"], flows_reference["weights"]
    assert set(result["weights"]) == set(plain)
    weights = {k: torch.tensor(v).reshape(plain[k].shape) for k, v in result["weights"].items()}
    if form == "plugin-fp32":
        # Same fp32 math; only the order of the two ranks' gradient sums differs (observed 2e-6).
        assert result["losses"] == pytest.approx(flows_reference["losses"], rel=1e-5)
        for key, value in weights.items():
            torch.testing.assert_close(value, plain[key], rtol=1e-4, atol=2e-5, msg=key)
    else:
        # 16-bit compute and 16-bit module weights: losses to rel 1e-3 and the weight update
        # (final - initial) within 15% of the plain run's update (observed 4.6% bf16, 1.6% fp16).
        # Training nothing (issue 29 item 1) is a 100% error.
        assert result["losses"] == pytest.approx(flows_reference["losses"], rel=1e-3)
        error = sum(((weights[k] - initial[k]) - (plain[k] - initial[k])).norm() ** 2 for k in plain)
        update = sum((plain[k] - initial[k]).norm() ** 2 for k in plain)
        assert (error / update).sqrt() < 0.15
