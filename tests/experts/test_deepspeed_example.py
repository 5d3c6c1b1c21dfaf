"""DeepSpeedExamples ``training/cifar/cifar10_deepspeed.py --moe`` on CPU, through zerotrain's
launcher on 2 gloo ranks with ``--ep-world-size 2``, with only its deepspeed imports changed
(deepspeed_example/cpu_harness.py changes them as it loads the script: tests/deepspeed_examples.py).

The script is DeepSpeedExamples' code and is not stored here: the run tests need it at
``$CIFAR10_DEEPSPEED_SCRIPT``, ``$DEEPSPEED_EXAMPLES/training/cifar/`` or next to the harness
(tests/deepspeed_examples.py, CIFAR10_MOE), and skip without it. The harness gives a
synthetic CIFAR-10 (cpu_shim/torchvision) and seeds torch before the script (which seeds nothing).

The run must equal one process training the same network with every expert local (ep_size 1):
each rank's 8 images gated on their own (the capacity is per rank), the ranks' losses averaged,
the config's AdamW (DeepSpeed's "Adam"), WarmupLR (log warm-up from 0) and clipping at 1.0, the
gate noise (RSample, random token selection) drawn from the same seeded generator as each rank.
Against DeepSpeed 0.19.8 itself (not installed in CI): deepspeed_example/compare_with_deepspeed.py,
numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.deepspeed_examples import CIFAR10_MOE, git_blob_id, import_changed, shim_import

EXAMPLE = Path(__file__).resolve().parent / "deepspeed_example"
SEED, PER_RANK, SAMPLES = 1234, 8, 320  # 20 steps of 16 images
SCRIPT = CIFAR10_MOE.find(beside=str(EXAMPLE))
needs_script = pytest.mark.skipif(SCRIPT is None, reason=CIFAR10_MOE.missing())


@needs_script
def test_script_is_deepspeed_examples_and_only_its_imports_change():
    assert git_blob_id(SCRIPT) == CIFAR10_MOE.blob, f"{SCRIPT} is not DeepSpeedExamples' {CIFAR10_MOE.path}"
    theirs = open(SCRIPT).read().split("\n")
    ours = import_changed(open(SCRIPT).read()).split("\n")
    assert len(ours) == len(theirs)
    assert [(a, b) for a, b in zip(theirs, ours) if a != b] == [
        ("import deepspeed", "import zerotrain as deepspeed"),
        ("from deepspeed.accelerator import get_accelerator", "from zerotrain.accelerator import get_accelerator"),
        (
            "from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer",
            "from zerotrain.moe.utils import split_params_into_different_moe_groups_for_optimizer",
        ),
    ]


class _Net(nn.Module):
    """The example's network (LeNet, then one MoE layer per ``num_experts`` entry sharing one
    Linear(84, 84) expert, then Linear(84, 10)), built in the script's order, every expert local."""

    def __init__(self, num_experts, k, noisy_gate_policy, residual):
        super().__init__()
        from zerotrain.moe.layer import MoE

        self.conv1, self.pool, self.conv2 = nn.Conv2d(3, 6, 5), nn.MaxPool2d(2, 2), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2 = nn.Linear(400, 120), nn.Linear(120, 84)
        fc3 = nn.Linear(84, 84)
        self.moe_layer_list = nn.ModuleList(
            [
                MoE(
                    84,
                    fc3,
                    n,
                    ep_size=1,
                    use_residual=residual,
                    k=k,
                    min_capacity=0,
                    noisy_gate_policy=noisy_gate_policy,
                )
                for n in num_experts
            ]
        )
        self.fc4 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc2(F.relu(self.fc1(x.flatten(1)))))
        for moe in self.moe_layer_list:
            x = moe(x)[0]
        return self.fc4(x)


def _reference(num_experts, k, noisy_gate_policy, residual):
    (CIFAR10,) = shim_import(str(EXAMPLE / "cpu_shim"), "torchvision.datasets", "CIFAR10")
    os.environ["EXAMPLE_SAMPLES"] = str(SAMPLES)
    data = CIFAR10(train=True)
    torch.manual_seed(SEED)
    net = _Net(num_experts, k, noisy_gate_policy, residual)
    samplers = [torch.utils.data.DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0) for r in (0, 1)]
    order = [list(s) for s in samplers]
    iter(torch.utils.data.DataLoader(data, batch_size=PER_RANK, sampler=samplers[0]))  # its base-seed draw
    opt = torch.optim.AdamW(net.parameters(), lr=0.0, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    losses = [[], []]
    for step in range(len(order[0]) // PER_RANK):
        # WarmupLR (log, 0 -> 1e-3 over 1000 steps): the first two steps run at 0
        for group in opt.param_groups:
            group["lr"] = 1e-3 * math.log(step) / math.log(1000) if step > 1 else 0.0
        rng = torch.get_rng_state()
        total = 0.0
        for r in (0, 1):  # each rank draws its gate noise from the same generator state
            torch.set_rng_state(rng)
            idx = order[r][step * PER_RANK : (step + 1) * PER_RANK]
            loss = F.cross_entropy(net(data.data[idx]), data.targets[idx])
            losses[r].append(float(loss.detach()))
            total = total + loss / 2
        total.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses, net.state_dict()


def _expert_key(name: str, rank: int, num_experts: list) -> str:
    """A rank's local expert name -> the one-process name (global id = rank * local + local id)."""
    parts = name.split(".")
    if "deepspeed_experts" not in parts:
        return name
    at = parts.index("deepspeed_experts")
    layer = int(parts[1])
    local = num_experts[layer] // 2
    parts[at + 1] = str(rank * local + int(parts[at + 1]))
    return ".".join(parts)


def _launch(tmp_path, args) -> list:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "EXAMPLE_RECORD_DIR": str(tmp_path),
        "EXAMPLE_ENGINE": "zerotrain",
        "EXAMPLE_SAMPLES": str(SAMPLES),
        "EXAMPLE_SEED": str(SEED),
    }
    cmd = [
        sys.executable,
        "-m",
        "zerotrain.launcher.cli",
        "launch",
        "--nproc",
        "2",
        "cpu_harness.py",
        SCRIPT,
        "--moe",
        "--ep-world-size",
        "2",
        "--moe-param-group",
        "--dtype",
        "fp32",
        "-e",
        "1",
        *args,
    ]
    done = subprocess.run(cmd, cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [
        (json.loads((tmp_path / f"rank{r}.json").read_text()), torch.load(tmp_path / f"rank{r}.pt", weights_only=True))
        for r in (0, 1)
    ]


@needs_script
@pytest.mark.parametrize("variant", ["run_ds_moe", "prmoe_top2_stage2"])
def test_example_with_two_expert_ranks_trains_like_one_process(tmp_path, variant):
    if variant == "run_ds_moe":  # DeepSpeedExamples' run_ds_moe.sh flags
        num_experts, k, policy, residual = [2], 1, "RSample", False
        args = ["--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample"]
    else:  # PR-MoE (run_ds_prmoe.sh's experts) with top-2, ZeRO-2
        num_experts, k, policy, residual = [2, 4], 2, None, True
        args = ["--num-experts", "2", "4", "--mlp-type", "residual", "--top-k", "2", "--stage", "2"]
    ranks = _launch(tmp_path, args)
    ref_losses, ref_state = _reference(num_experts, k, policy, residual)
    for r, (record, state) in enumerate(ranks):
        assert len(record["losses"]) == SAMPLES // 16
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref_losses[r]), rtol=1e-5, atol=0)
        mapped = {_expert_key(name, r, num_experts): value for name, value in state.items()}
        for name, value in mapped.items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-6, msg=name)
    assert sum(ref_losses[0][-5:]) < sum(ref_losses[0][:5]), ref_losses[0]  # it trains
