"""``zerotrain tune SCRIPT --config ds.json --memory-limit 20GiB``: short trial runs that find the
largest micro-batch each ZeRO stage fits under a per-rank memory limit, their samples/s, and the
fastest configuration, written as a ds_config.json.

Each trial launches the script with ``zerotrain launch`` through ``tune_runner`` (the trial's
config replaces the script's; the run stops after a warm-up step and ``--steps`` timed steps). A
trial fits when every rank finished and its peak (GPU: reserved memory; CPU: VmHWM, the process's
peak RSS) is within the limit; a trial that fails (e.g. CUDA out of memory) does not fit.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zerotrain.estimate.units import parse_bytes


@dataclass(frozen=True)
class Trial:
    stage: int
    micro_batch: int
    fits: bool
    peak_bytes: int | None = None
    samples_per_s: float | None = None
    error: str | None = None


def _add_options(parser: argparse.ArgumentParser, default=None) -> None:
    # default=argparse.SUPPRESS when re-parsing the script's part of the command line.
    def d(value):
        return value if default is None else default

    parser.add_argument("--config", default=d(None), metavar="DS_CONFIG", help="the ds_config.json to tune (required)")
    parser.add_argument(
        "--memory-limit",
        default=d(None),
        metavar="SIZE",
        help="per-rank peak memory allowed, e.g. 20GiB (GPU reserved memory, or RSS on CPU; required)",
    )
    parser.add_argument(
        "--nproc", "--num_gpus", dest="nproc", type=int, default=d(None), help="ranks per trial (default: launch's)"
    )
    parser.add_argument("--stages", default=d("0,1,2,3"), help="ZeRO stages to try (default 0,1,2,3)")
    parser.add_argument("--steps", type=int, default=d(3), help="timed optimizer steps per trial, after 1 warm-up")
    parser.add_argument("--max-micro-batch", type=int, default=d(64), help="largest micro-batch tried (default 64)")
    parser.add_argument("--trial-timeout", type=float, default=d(600.0), help="seconds per trial (default 600)")
    parser.add_argument(
        "--write-config",
        default=d("tuned_ds_config.json"),
        metavar="PATH",
        help="where the fastest fitting config is written (default tuned_ds_config.json)",
    )


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """Tune's flags may come before or after SCRIPT (``zerotrain tune train.py --config ds.json
    --memory-limit 20GiB``); other arguments go to the script, and everything after ``--`` too."""
    _add_options(parser)
    parser.add_argument("user_script", help="the training script (as for zerotrain launch)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's arguments")


def _split_script_args(args: argparse.Namespace) -> None:
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _add_options(own, default=argparse.SUPPRESS)
    rest = list(args.user_args)
    after = []
    if "--" in rest:
        i = rest.index("--")
        rest, after = rest[:i], rest[i + 1 :]
    found, script_args = own.parse_known_args(rest)
    vars(args).update(vars(found))
    args.user_args = script_args + after


def trial_config(base: dict, stage: int, micro: int) -> dict:
    cfg = copy.deepcopy(base)
    cfg.pop("train_batch_size", None)  # derived from micro-batch x accumulation x ranks
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["zero_optimization"] = {**dict(cfg.get("zero_optimization") or {}), "stage": stage}
    return cfg


def largest_fitting(run: Callable[[int], Trial], max_micro: int) -> tuple[Trial | None, list[Trial]]:
    """Double the micro-batch from 1 until a trial does not fit, then bisect: the largest
    micro-batch that fits (memory grows with the micro-batch) and every trial run."""
    trials: list[Trial] = []

    def attempt(m: int) -> Trial:
        t = run(m)
        trials.append(t)
        return t

    best, m = None, 1
    while m <= max_micro:
        t = attempt(m)
        if not t.fits:
            break
        best, m = t, m * 2
    if best is not None and m <= max_micro:  # bisect between best (fits) and m (does not)
        lo, hi = best.micro_batch, m
        while hi - lo > 1:
            mid = (lo + hi) // 2
            t = attempt(mid)
            lo, hi, best = (mid, hi, t) if t.fits else (lo, mid, best)
    return best, trials


def run_trial(args: argparse.Namespace, base: dict, stage: int, micro: int, limit: int, work: Path) -> Trial:
    out = work / f"s{stage}_m{micro}"
    out.mkdir()
    config_path = out / "ds_config.json"
    config_path.write_text(json.dumps(trial_config(base, stage, micro)))
    cmd = [sys.executable, "-m", "zerotrain.launcher.cli", "launch", "--rank0_only"]
    if args.nproc:
        cmd += ["--nproc", str(args.nproc)]
    cmd += ["--module", "zerotrain.estimate.tune_runner", args.user_script, *args.user_args]
    env = dict(
        os.environ,
        ZEROTRAIN_TUNE_CONFIG=str(config_path),
        ZEROTRAIN_TUNE_STEPS=str(args.steps),
        ZEROTRAIN_TUNE_OUT=str(out),
    )
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.trial_timeout)
    except subprocess.TimeoutExpired:
        return Trial(stage, micro, False, error=f"no result within {args.trial_timeout:.0f} s")
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or not results:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        why = "out of memory" if "out of memory" in (proc.stderr or "").lower() else tail[0][:200]
        if proc.returncode == 0:
            why = f"the script ended before {args.steps + 1} optimizer steps"
        return Trial(stage, micro, False, error=why)
    peak = max(r["peak_bytes"] for r in results)
    speed = min(r["samples_per_s"] for r in results)
    return Trial(
        stage, micro, peak <= limit, peak, speed, None if peak <= limit else f"peak {peak / 2**30:.2f} GiB > limit"
    )


def run_tune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from zerotrain.config.load import read_config

    _split_script_args(args)
    missing = [
        flag for flag, value in (("--config", args.config), ("--memory-limit", args.memory_limit)) if value is None
    ]
    if missing:
        parser.error(
            f"{' and '.join(missing)} required, e.g. zerotrain tune train.py --config ds.json --memory-limit 20GiB"
        )
    try:
        limit = parse_bytes(args.memory_limit, "--memory-limit")
        stages = [int(s) for s in args.stages.split(",")]
        base = read_config(args.config)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    if any(s not in (0, 1, 2, 3) for s in stages):
        parser.error(f"--stages: {args.stages!r}; use a comma-separated subset of 0,1,2,3")
    if args.steps < 1 or args.max_micro_batch < 1:
        parser.error("--steps and --max-micro-batch must be at least 1")
    if not os.path.isfile(args.user_script):
        parser.error(f"user_script: file {args.user_script!r} not found")
    best_per_stage: dict[int, Trial | None] = {}
    with tempfile.TemporaryDirectory(prefix="zerotrain-tune-") as tmp:
        for stage in stages:
            best, trials = largest_fitting(
                lambda m: run_trial(args, base, stage, m, limit, Path(tmp)), args.max_micro_batch
            )
            for t in trials:
                detail = (
                    f"peak {t.peak_bytes / 2**30:.3f} GiB, {t.samples_per_s:.1f} samples/s"
                    if t.peak_bytes is not None
                    else ""
                )
                print(
                    f"stage {t.stage} micro-batch {t.micro_batch:>4}: {'fits' if t.fits else 'no'}"
                    f"{' (' + detail + ')' if detail else ''}{' - ' + t.error if t.error else ''}",
                    flush=True,
                )
            best_per_stage[stage] = best
    print(f"\n{'stage':>5} | {'largest micro-batch':>19} | {'samples/s':>9} | peak per rank")
    for stage, t in best_per_stage.items():
        if t is None:
            print(f"{stage:>5} | {'none fits':>19} | {'-':>9} | -")
        else:
            print(f"{stage:>5} | {t.micro_batch:>19} | {t.samples_per_s:>9.1f} | {t.peak_bytes / 2**30:.3f} GiB")
    fitting = [t for t in best_per_stage.values() if t is not None]
    if not fitting:
        print(f"nothing fits in {args.memory_limit} per rank, even micro-batch 1; no config written")
        return 1
    fastest = max(fitting, key=lambda t: t.samples_per_s)
    config = trial_config(base, fastest.stage, fastest.micro_batch)
    Path(args.write_config).write_text(json.dumps(config, indent=2) + "\n")
    print(
        f"fastest that fits: stage {fastest.stage}, micro-batch {fastest.micro_batch} "
        f"({fastest.samples_per_s:.1f} samples/s); wrote {args.write_config}"
    )
    return 0
