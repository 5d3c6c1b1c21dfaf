"""Side-by-side: zerotrain ZeRO stage 0 vs torch DDP, same GPT workload, 2 gloo ranks, one run.

    python bench/stage0_vs_ddp.py [--repeats 3] [--steps 8] [--preset gpt17m]

Each repeat launches DDP with `torchrun` and zerotrain with `zerotrain launch`, alternating, and
reports median step time (steps after the first), peak RSS per rank, and launch-to-first-step
time, with zerotrain/DDP ratios. Ratios, not absolute seconds: the machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMANDS = {
    "ddp": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "zerotrain": [sys.executable, "-m", "zerotrain.launcher.cli", "launch", "--nproc", "2"],
}


def run_once(system: str, args, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_T0": repr(time.time())}
    cmd = COMMANDS[system] + [str(HERE / "gpt_workload.py"), "--mode", system, "--stage", "0",
                              "--preset", args.preset, "--steps", str(args.steps), "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in out.read_text().splitlines()]


def summarize(records: list[dict]) -> dict:
    steps = [s for r in records for s in r["step_s"][1:]]
    return {
        "step_s": statistics.median(steps),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in records),
        "first_step_s": max(r["first_step_s"] for r in records),
        "final_loss": records[0]["losses"][-1],
        "params": records[0]["params"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--preset", default="gpt17m")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"ddp": [], "zerotrain": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for system in ("ddp", "zerotrain"):
                out = Path(tmp) / f"{system}-{i}.jsonl"
                runs[system].append(summarize(run_once(system, args, out)))
    med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}
    d, z = med["ddp"], med["zerotrain"]
    print(f"GPT {d['params'] / 1e6:.1f}M params, 2 gloo ranks, OMP_NUM_THREADS=1, "
          f"{args.steps} steps x {args.repeats} repeats (medians)")
    print(f"| system | step s | peak RSS MiB (max rank) | launch→first step s | final loss |")
    print(f"|---|---|---|---|---|")
    for name, m in (("torch DDP", d), ("zerotrain stage 0", z)):
        print(f"| {name} | {m['step_s']:.3f} | {m['peak_rss_mib']:.0f} | {m['first_step_s']:.2f} "
              f"| {m['final_loss']:.4f} |")
    print(f"ratios zerotrain/DDP: step time {z['step_s'] / d['step_s']:.3f}, peak RSS "
          f"{z['peak_rss_mib'] / d['peak_rss_mib']:.3f}, start-up {z['first_step_s'] / d['first_step_s']:.3f}")


if __name__ == "__main__":
    main()
