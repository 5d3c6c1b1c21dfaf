"""DeepSpeedExamples ``training/pipeline_parallelism/train.py -p 2`` on CPU, through zerotrain's
launcher, with only its deepspeed imports changed (tests/pipeline/deepspeed_example/train.py).

The CPU harness (deepspeed_example/cpu_harness.py) stubs ``torch.cuda.set_device``, gives
torchvision's AlexNet and a synthetic CIFAR-10 of 64x64 images, and records the losses
``train_batch`` returned and each stage's weights. The run (2 gloo ranks, P=2, 4 micro-batches
of 4, DeepSpeedExamples' Adam at lr 1e-4, 10 steps) must equal one process
training the same AlexNet on the same images in the same order: losses and weights within 1e-5
relative. The dropout masks agree too: both draw them from the same seeded generator (stage 0
holds both dropouts, and its process draws exactly what one process does).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parent / "deepspeed_example"
STEPS, MICRO, M, SEED = 10, 4, 4, 1138


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config() -> dict:
    return json.loads((EXAMPLE / "ds_config.json").read_text())


def test_stored_example_differs_from_deepspeeds_only_in_its_imports():
    ours = (EXAMPLE / "train.py").read_text().splitlines()
    theirs = (EXAMPLE / "train_deepspeed.py").read_text().splitlines()
    # Past the header (source, license, what changed), line for line.
    start = next(i for i, line in enumerate(ours) if not line.startswith("#"))
    assert start == next(i for i, line in enumerate(theirs) if not line.startswith("#")) + 1
    changed = [(a, b) for a, b in zip(ours[start:], theirs[start - 1:]) if a != b]
    assert len(ours) - start == len(theirs) - start + 1
    assert changed == [("import zerotrain as deepspeed", "import deepspeed"),
                       ("from zerotrain.pipe import PipelineModule", "from deepspeed.pipe import PipelineModule"),
                       ("from zerotrain.utils import RepeatingLoader", "from deepspeed.utils import RepeatingLoader")]


def _reference(samples: int) -> dict:
    """One process: the script's seeding, torchvision's AlexNet, the images in order, the
    config's Adam (DeepSpeed's "Adam": decoupled weight decay, here 0) and clipping (1.0)."""
    sys.path.insert(0, str(EXAMPLE / "cpu_shim"))
    try:
        from torchvision.datasets import CIFAR10
        from torchvision.models import AlexNet
    finally:
        sys.path.remove(str(EXAMPLE / "cpu_shim"))
    from zerotrain.runtime.utils import set_random_seed

    os.environ["EXAMPLE_SAMPLES"] = str(samples)
    torch.manual_seed(SEED)
    set_random_seed(SEED)
    net = AlexNet(num_classes=10)
    layers = [*net.features, net.avgpool, lambda x: torch.flatten(x, 1), *net.classifier]
    loader = torch.utils.data.DataLoader(CIFAR10(), batch_size=MICRO, shuffle=False)
    batches = iter(loader)  # the engine's loader draws its base seed here too
    params = _config()["optimizer"]["params"]
    opt = torch.optim.AdamW(net.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
                            weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(M):
            x, y = next(batches)
            for layer in layers:
                x = layer(x)
            loss = torch.nn.functional.cross_entropy(x, y)
            (loss / M).backward()
            total += float(loss.detach())
        losses.append(total / M)
        torch.nn.utils.clip_grad_norm_(net.parameters(), _config().get("gradient_clipping", 1.0))
        opt.step()
        opt.zero_grad()
    weights = {f"{idx}.{name}": p.detach().clone() for idx, layer in enumerate(layers)
               if isinstance(layer, torch.nn.Module) for name, p in layer.named_parameters()}
    return {"losses": losses, "weights": weights}


def test_example_trains_two_stages_like_one_process(tmp_path):
    config = _config()
    assert config["train_batch_size"] == MICRO * M and config["train_micro_batch_size_per_gpu"] == MICRO
    samples = MICRO * M * STEPS
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXAMPLE_RECORD_DIR": str(tmp_path),
           "EXAMPLE_ENGINE": "zerotrain", "EXAMPLE_SAMPLES": str(samples)}
    cmd = [sys.executable, "-m", "zerotrain.launcher.cli", "launch", "--nproc", "2", "--master_port",
           str(_free_port()), "cpu_harness.py", "train.py", "--deepspeed_config", "ds_config.json", "-p", "2",
           "--steps", str(STEPS), "--backend", "gloo"]
    done = subprocess.run(cmd, cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["stage"] for r in records] == [0, 1]
    ref = _reference(samples)
    for record in records:  # every stage returns the batch's loss
        assert len(record["losses"]) == STEPS
        for step, (got, want) in enumerate(zip(record["losses"], ref["losses"])):
            assert abs(got - want) <= 1e-5 * abs(want), (step, record["losses"], ref["losses"])
    first, last = sum(ref["losses"][:3]) / 3, sum(ref["losses"][-3:]) / 3
    assert last < first - 0.1, ref["losses"]  # it trains
    weights = {}
    for r in (0, 1):
        weights.update(torch.load(tmp_path / f"rank{r}.pt", weights_only=True))
    assert sorted(weights) == sorted(ref["weights"])
    for name, want in ref["weights"].items():
        err = float((weights[name] - want).norm() / want.norm())
        assert err <= 1e-5, (name, err)
