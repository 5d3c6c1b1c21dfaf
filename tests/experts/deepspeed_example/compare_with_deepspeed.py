"""Runs DeepSpeedExamples' cifar10_deepspeed.py through cpu_harness.py under zerotrain (only its
imports changed, ``zerotrain launch``) and under DeepSpeed (unchanged, DeepSpeed's torchrun,
``DS_ACCELERATOR=cpu``), each ``--repeats`` times per variant, and prints a markdown table: the
largest loss and weight differences between DeepSpeed's own runs (its run-to-run noise) and
between zerotrain and DeepSpeed. docs/benchmarks.md has the command and the table.

    python tests/experts/deepspeed_example/compare_with_deepspeed.py --ds-python /tmp/dsvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_harness import find_script  # noqa: E402

COMMON = ["--moe", "--ep-world-size", "2", "--moe-param-group", "--dtype", "fp32", "-e", "1", "--log-interval", "10"]
VARIANTS = {  # DeepSpeedExamples' run_ds_moe.sh (top-1, RSample), its PR-MoE, and top-2
    "run_ds_moe (E=2, top-1, RSample), stage 0": [
        "--num-experts",
        "2",
        "--top-k",
        "1",
        "--noisy-gate-policy",
        "RSample",
        "--stage",
        "0",
    ],
    "run_ds_moe, stage 2": ["--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample", "--stage", "2"],
    "PR-MoE (E=2 4, residual), stage 1": [
        "--num-experts",
        "2",
        "4",
        "--mlp-type",
        "residual",
        "--top-k",
        "1",
        "--stage",
        "1",
    ],
    "E=4, top-2, stage 0": ["--num-experts", "4", "--top-k", "2", "--stage", "0"],
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(engine: str, script: str, args: list, ds_python: str, samples: int, clipping: str) -> dict:
    out = tempfile.mkdtemp(prefix=f"cifar-{engine}-")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "EXAMPLE_ENGINE": engine,
        "EXAMPLE_RECORD_DIR": out,
        "EXAMPLE_SAMPLES": str(samples),
    }
    if clipping:
        env["EXAMPLE_GRADIENT_CLIPPING"] = clipping
    if engine == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        torchrun = os.path.join(os.path.dirname(ds_python), "torchrun")
        cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(_port())]
    else:
        cmd = [sys.executable, "-m", "zerotrain.launcher.cli", "launch", "--nproc", "2", "--master_port", str(_port())]
    cmd += ["cpu_harness.py", script, *args]
    done = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in (0, 1)]
    weights = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]
    return {
        "losses": torch.tensor([r["losses"] for r in ranks], dtype=torch.float64),
        "initial": [r["initial"] for r in ranks],
        "weights": weights,
        "norms": [r["norms"] for r in ranks],
    }


def _diff(a: dict, b: dict) -> tuple[float, float]:
    loss = float((a["losses"] - b["losses"]).abs().max())
    weight = max(
        float((wa[k].double() - wb[k].double()).abs().max()) for wa, wb in zip(a["weights"], b["weights"]) for k in wa
    )
    return loss, weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds-python", default="/tmp/dsvenv/bin/python")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=640, help="synthetic training images (16 a step)")
    opts = parser.parse_args()
    script = find_script()
    if script is None:
        raise SystemExit("no cifar10_deepspeed.py: set CIFAR10_DEEPSPEED_SCRIPT or DEEPSPEED_EXAMPLES")
    print(
        "| variant | clipping | steps | loss first -> last (DeepSpeed, rank 0) | DeepSpeed vs DeepSpeed: loss, "
        "weights | zerotrain vs DeepSpeed: loss, weights | first loss that differs by > 1e-6: the step before, "
        "its norm DeepSpeed / zerotrain "
        "| same initial weights |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, extra in VARIANTS.items():
        for clipping in ("", "0"):
            args = COMMON + extra
            runs = {
                e: [_run(e, script, args, opts.ds_python, opts.samples, clipping) for _ in range(opts.repeats)]
                for e in ("deepspeed", "zerotrain")
            }
            ds, zt = runs["deepspeed"], runs["zerotrain"]
            noise = [max(_diff(ds[0], other)[i] for other in ds[1:]) for i in (0, 1)]
            versus = [max(_diff(d, z)[i] for d in ds for z in zt) for i in (0, 1)]
            same_init = all(r["initial"] == ds[0]["initial"] for r in ds + zt)
            losses = ds[0]["losses"][0]
            # more than fp32 rounding (the ranks sum gradients in another order: 1-2 ulp)
            differs = ((ds[0]["losses"] - zt[0]["losses"]).abs() > 1e-6).any(0).nonzero()
            first = "none"
            if len(differs):
                # the loss of step s shows the update of step s - 1
                s = int(differs[0]) - 1
                norms = [run["norms"][0][s] if len(run["norms"][0]) > s else float("nan") for run in (ds[0], zt[0])]
                first = f"{s}: {norms[0]:.4f} / {norms[1]:.4f}"
            print(
                f"| {name} | {clipping or '1.0 (script)'} | {losses.numel()} | {losses[0]:.4f} -> {losses[-1]:.4f} "
                f"| {noise[0]:.1e}, {noise[1]:.1e} | {versus[0]:.1e}, {versus[1]:.1e} | {first} | {same_init} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
