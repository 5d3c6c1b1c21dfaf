"""DeepSpeedExamples ``training/pipeline_parallelism/train.py -p 2`` on CPU, through zerotrain's
launcher, with only its deepspeed imports changed (deepspeed_example/cpu_harness.py changes them as
it loads the script: tests/deepspeed_examples.py).

The script is DeepSpeedExamples' code and is not stored here: the run tests need it at
``$PIPELINE_DEEPSPEED_SCRIPT`` or ``$DEEPSPEED_EXAMPLES/training/pipeline_parallelism/train.py``
(tests/deepspeed_examples.py, PIPELINE), and skip without it. The CPU harness stubs
``torch.cuda.set_device``, gives torchvision's AlexNet and a synthetic CIFAR-10 of 64x64 images,
and records the losses ``train_batch`` returned and each stage's weights. The run (2 gloo ranks,
P=2, 4 micro-batches of 4, CONFIG's Adam at lr 1e-4, 10 steps) must equal one process training
the same AlexNet on the same images in the same order: losses and weights within 1e-5
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

import pytest
import torch

from tests.deepspeed_examples import PIPELINE, git_blob_id, import_changed, shim_import

EXAMPLE = Path(__file__).resolve().parent / "deepspeed_example"
STEPS, MICRO, M, SEED = 10, 4, 4, 1138
SCRIPT = PIPELINE.find()
needs_script = pytest.mark.skipif(SCRIPT is None, reason=PIPELINE.missing())
# This test's config: the keys and values of DeepSpeedExamples' training/pipeline_parallelism/ds_config.json,
# with a smaller batch (4 micro-batches of 4; theirs: 32 of 8), lr 1e-4 (theirs 1e-3) and a log line every
# step (theirs every 10). docs/benchmarks.md's DeepSpeed comparison runs this config too.
CONFIG = {
    "train_batch_size": MICRO * M,
    "train_micro_batch_size_per_gpu": MICRO,
    "optimizer": {"type": "Adam", "params": {"lr": 0.0001, "betas": [0.9, 0.999], "eps": 1e-8}},
    "steps_per_print": 1,
    "wall_clock_breakdown": False,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_script
def test_script_is_deepspeed_examples_and_only_its_imports_change():
    assert git_blob_id(SCRIPT) == PIPELINE.blob, f"{SCRIPT} is not DeepSpeedExamples' {PIPELINE.path}"
    theirs = open(SCRIPT).read().split("\n")
    ours = import_changed(open(SCRIPT).read()).split("\n")
    assert len(ours) == len(theirs)
    assert [(a, b) for a, b in zip(theirs, ours) if a != b] == [
        ("import deepspeed", "import zerotrain as deepspeed"),
        ("from deepspeed.pipe import PipelineModule", "from zerotrain.pipe import PipelineModule"),
        ("from deepspeed.utils import RepeatingLoader", "from zerotrain.utils import RepeatingLoader"),
    ]


def _reference(samples: int) -> dict:
    """One process: the script's seeding, torchvision's AlexNet, the images in order, the
    config's Adam (DeepSpeed's "Adam": decoupled weight decay, here 0) and clipping (1.0)."""
    (CIFAR10,) = shim_import(str(EXAMPLE / "cpu_shim"), "torchvision.datasets", "CIFAR10")
    (AlexNet,) = shim_import(str(EXAMPLE / "cpu_shim"), "torchvision.models", "AlexNet")
    from zerotrain.runtime.utils import set_random_seed

    os.environ["EXAMPLE_SAMPLES"] = str(samples)
    torch.manual_seed(SEED)
    set_random_seed(SEED)
    net = AlexNet(num_classes=10)
    layers = [*net.features, net.avgpool, lambda x: torch.flatten(x, 1), *net.classifier]
    loader = torch.utils.data.DataLoader(CIFAR10(), batch_size=MICRO, shuffle=False)
    batches = iter(loader)  # the engine's loader draws its base seed here too
    params = CONFIG["optimizer"]["params"]
    opt = torch.optim.AdamW(
        net.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"], weight_decay=0.0
    )
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
        torch.nn.utils.clip_grad_norm_(net.parameters(), CONFIG.get("gradient_clipping", 1.0))
        opt.step()
        opt.zero_grad()
    weights = {
        f"{idx}.{name}": p.detach().clone()
        for idx, layer in enumerate(layers)
        if isinstance(layer, torch.nn.Module)
        for name, p in layer.named_parameters()
    }
    return {"losses": losses, "weights": weights}


@needs_script
def test_example_trains_two_stages_like_one_process(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    samples = MICRO * M * STEPS
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "EXAMPLE_RECORD_DIR": str(tmp_path),
        "EXAMPLE_ENGINE": "zerotrain",
        "EXAMPLE_SAMPLES": str(samples),
    }
    cmd = [
        sys.executable,
        "-m",
        "zerotrain.launcher.cli",
        "launch",
        "--nproc",
        "2",
        "--master_port",
        str(_free_port()),
        "cpu_harness.py",
        SCRIPT,
        "--deepspeed_config",
        str(config),
        "-p",
        "2",
        "--steps",
        str(STEPS),
        "--backend",
        "gloo",
    ]
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
