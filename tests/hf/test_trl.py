"""TRL's trainers on zerotrain, through their real entry points, against the same runs on DDP.

tests/hf/trl_flows.py trains SFT, DPO (with a reference model), KTO (with a reference model) and
GRPO (beta 0.1: a reference model, generation with ``ds3_gather_for_generation`` left at its
default) one after another in one 2-rank launch, on a tiny GPT-2 and a character tokenizer built in
memory, 3 optimizer steps of 2 x 2 x 2 samples each; SFT and GRPO with AdamW, DPO and KTO with SGD.

- DDP: ``torchrun`` with ``use_cpu=True`` (the Trainer's DDP over gloo through accelerate), all four,
  first in the launch that then runs the JSON-config trainers below;
- at ZeRO-2 and at ZeRO-3, each trainer once, half of them with each kind of config:
  transformers' docs' config (every value it leaves to the Trainer "auto"), given as
  ``TrainingArguments(deepspeed=PATH)`` under ``python -m zerotrain.hf torchrun``, and TRL's own
  ``accelerate_configs/zeroN.yaml`` (8 processes -> 2, bf16 -> "no") under
  ``python -m zerotrain.hf accelerate launch --config_file``.

Every logged number (losses, rewards, margins, KL, log-probs, entropies, gradient norms) equals
DDP's to rel 1e-4 (observed <= 3e-7), and so do the trained weights: each parameter's norm to rel
1e-6 and, with SGD, its sum to 1e-5 of its norm (observed 6e-7). AdamW's sums are not compared: its
update of a parameter whose gradient is rounding noise (GPT-2's key bias, which softmax ignores) is
+-lr whatever the noise.

The docs' configs are used without their ``offload_optimizer``/``offload_param``: under optimizer
offload accelerate replaces a torch SGD by DeepSpeedCPUAdam (as it does for DeepSpeed), so SGD runs
would compare Adam with SGD; offload with the Trainer is tests/hf/test_trainer.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from zerotrain.comm.distributed import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/hf/trl_flows.py"
TRAINERS = "sft,dpo,kto,grpo"
ZERO_JSON = {
    2: ROOT / "tests/hf/fixtures/hf_docs_zero2_auto.json",
    3: ROOT / "tests/hf/fixtures/hf_docs_zero3_auto.json",
}


def _trl_yaml(name: str) -> str:
    import trl

    text = (Path(trl.__file__).parent / "accelerate_configs" / name).read_text()
    lines = [
        (
            "num_processes: 2"
            if line.startswith("num_processes:")
            else "mixed_precision: 'no'"
            if line.startswith("mixed_precision:")
            else line
        )
        for line in text.splitlines()
    ]
    assert "num_processes: 2" in lines and "mixed_precision: 'no'" in lines
    return "\n".join(lines) + "\n"


def _run(command: list[str], cwd: Path, count: int) -> list[dict]:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=420, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    results = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(results) == count, done.stdout[-3000:] + done.stderr[-6000:]
    return results


# Each stage with both configs, each config at both stages, every trainer at both stages. A
# launch's start costs as much as two trainers, so launches are few: the DDP runs and both
# stages' JSON-config runs share one `python -m zerotrain.hf torchrun` launch (DDP first, before
# any DeepSpeed config exists in the process; the Trainer's DDP never touches `deepspeed`), and
# each accelerate YAML (its stage is the launch's) has its own.
JSON_RUNS = {2: "sft,dpo", 3: "kto,grpo"}
YAML_RUNS = {2: "kto,grpo", 3: "sft,dpo"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    model_dir = root / "init"
    # In this process (it has transformers already): no interpreter start for two files.
    from tests.hf import trl_flows

    with torch.random.fork_rng():
        trl_flows.save_initial_model(str(model_dir))
    kinds = TRAINERS.split(",") + [k for stage in (2, 3) for k in JSON_RUNS[stage].split(",")]
    backends = ["ddp"] * 4 + [str(ZERO_JSON[stage]) for stage in (2, 3) for _ in JSON_RUNS[stage].split(",")]
    command = [
        sys.executable,
        "-m",
        "zerotrain.hf",
        "torchrun",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        ",".join(kinds),
        str(root / "torchrun"),
        str(model_dir),
        ",".join(backends),
    ]
    out = {}
    for result in _run(command, root, len(kinds)):
        if result["stage"] is None:
            assert result["trainer"] not in out.setdefault("ddp", {}), result["trainer"]
            out["ddp"][result["trainer"]] = result
        else:
            out[(result["stage"], result["trainer"])] = {**result, "form": "json"}
    for stage, trainers in YAML_RUNS.items():  # TRL's own accelerate file, through accelerate launch
        config = root / f"zero{stage}.yaml"
        config.write_text(_trl_yaml(f"zero{stage}.yaml"))
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
            str(SCRIPT),
            trainers,
            str(root / f"z{stage}yaml"),
            str(model_dir),
        ]
        for result in _run(command, root, len(trainers.split(","))):
            assert result["stage"] == stage and (stage, result["trainer"]) not in out, result
            out[(stage, result["trainer"])] = {**result, "form": "yaml"}
    assert len(out["ddp"]) == 4 and len(out) == 1 + 8
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_trl_trainers_match_ddp(runs, stage):
    forms = {runs[(stage, trainer)]["form"] for trainer in TRAINERS.split(",")}
    assert forms == {"json", "yaml"}
    for trainer in TRAINERS.split(","):
        want, got = runs["ddp"][trainer], runs[(stage, trainer)]
        assert want["engine"] == "torch.nn.parallel.distributed" and want["world"] == 2
        assert (got["engine"], got["stage"], got["world"]) == ("zerotrain.engine.engine", stage, 2)
        assert len(want["logs"]) == len(got["logs"]) == 3, trainer
        compared = 0
        for step, (expected, logged) in enumerate(zip(want["logs"], got["logs"])):
            for key, value in expected.items():
                if key == "step_time":
                    continue
                assert logged[key] == pytest.approx(value, rel=1e-4, abs=1e-7), (trainer, step, key)
                compared += 1
        assert compared >= 3 * 8, trainer  # loss, grad_norm, rewards/KL/logps ... at each step
        if trainer == "grpo":
            assert all("kl" in entry and "reward" in entry for entry in got["logs"])
        norms, sums = want["weights"][0::2], want["weights"][1::2]
        for index, (norm, total) in enumerate(zip(norms, sums)):
            assert got["weights"][2 * index] == pytest.approx(norm, rel=1e-6), (trainer, index)
            if want["optim"] == "sgd":
                assert abs(got["weights"][2 * index + 1] - total) <= 1e-5 * norm, (trainer, index)
