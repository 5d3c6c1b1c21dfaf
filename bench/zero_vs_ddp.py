"""Side-by-side: torch DDP, torch ZeroRedundancyOptimizer, zerotrain ZeRO 0/1/2 and DeepSpeed
ZeRO 0/1/2 (when importable) on the same GPT workload, 2 gloo ranks, one run.

    python bench/zero_vs_ddp.py [--zerotrain-rev HEAD] [--repeats 2] [--steps 5]
                                [--interleave-steps 8] [--skip 2] [--preset gpt17m]
                                [--systems ddp,ddp_fused,zero_redundancy,zt0,zt1,zt2,ds0,ds1,ds2]
                                [--deepspeed-python /tmp/dsvenv/bin/python] [--json out.json]

Two kinds of measurement, both on every rank of `bench/gpt_workload.py`:

1. *Own launches* (memory and start-up): each system is launched on its own, --repeats times,
   in an order rotated by one position per repeat. torch systems and DeepSpeed are launched
   with `torchrun` (DeepSpeed reads RANK/LOCAL_RANK from its environment), zerotrain with
   `zerotrain launch`. Recorded: peak RSS per rank (ru_maxrss), RSS after each start-up phase
   and after each step, launch-to-first-step seconds, and the losses.
2. *Interleaved* (step time): one launch holds every system side by side in the same two
   processes — each on its own copy of the model, same init and batches — and runs one step of
   each in turn (order rotated every round, a barrier before each step), so every system sees
   the same background load. The step-time ratio to DDP is taken within each round, then the
   median over rounds; process CPU seconds per step (all threads) are reported beside wall time.

The machine is shared and noisy: read ratios, not absolute seconds.

Two DDP baselines: `ddp` (torch.optim.AdamW as constructed by default, the for-loop kernel on
CPU) is the one the goals name; `ddp_fused` uses AdamW(fused=True), the kernel zerotrain picks by
itself on CPU, so its ratio isolates the data-parallel machinery from the optimizer kernel.

Memory: the saving in peak RSS against DDP is compared with the theoretical saving per rank,
(optimizer 8P + gradient 4P bytes) * (1 - 1/N) for stage-2-like systems and 8P * (1 - 1/N) for
optimizer-only sharding (stage 1, ZeroRedundancyOptimizer).

DeepSpeed is looked up in --deepspeed-python (default: $DEEPSPEED_PYTHON, else this
interpreter, else /tmp/dsvenv/bin/python); install it in a separate virtualenv so it never
touches the project's environment:

    python -m venv /tmp/dsvenv --system-site-packages && /tmp/dsvenv/bin/pip install deepspeed==0.19.8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "gpt_workload.py"
NPROC = 2


@dataclass(frozen=True)
class System:
    key: str
    label: str
    mode: str
    stage: int
    launcher: str  # "torchrun" | "zerotrain" | "deepspeed" (torchrun under the DeepSpeed python)
    sharded: str = ""  # "" | "opt" (optimizer state) | "opt+grad"
    fused: bool = False  # ddp / zero_redundancy: AdamW(fused=True)
    own: bool = True  # also launched on its own (memory, start-up); else interleaved run only


SYSTEMS = [
    System("ddp", "torch DDP", "ddp", 0, "torchrun"),
    System("ddp_fused", "torch DDP, AdamW(fused=True)", "ddp", 0, "torchrun", fused=True, own=False),
    System("zero_redundancy", "torch ZeroRedundancyOptimizer + DDP", "zero_redundancy", 0, "torchrun", "opt"),
    System("zt0", "zerotrain stage 0", "zerotrain", 0, "zerotrain"),
    System("zt1", "zerotrain stage 1", "zerotrain", 1, "zerotrain", "opt"),
    System("zt2", "zerotrain stage 2", "zerotrain", 2, "zerotrain", "opt+grad"),
    System("ds0", "DeepSpeed stage 0", "deepspeed", 0, "deepspeed"),
    System("ds1", "DeepSpeed stage 1", "deepspeed", 1, "deepspeed", "opt"),
    System("ds2", "DeepSpeed stage 2", "deepspeed", 2, "deepspeed", "opt+grad"),
]
BY_KEY = {s.key: s for s in SYSTEMS}
MIB = 2**20


# -- launching ----------------------------------------------------------------------------
def deepspeed_python(explicit: str | None) -> tuple[str | None, str]:
    """An interpreter that imports deepspeed, and deepspeed's version (or why not)."""
    candidates = (
        [explicit] if explicit else [os.environ.get("DEEPSPEED_PYTHON"), sys.executable, "/tmp/dsvenv/bin/python"]
    )
    for py in filter(None, candidates):
        if not Path(py).exists():
            continue
        probe = subprocess.run(
            [py, "-c", "import deepspeed; print(deepspeed.__version__)"],
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0:
            return py, probe.stdout.strip().splitlines()[-1]
    return None, "deepspeed is not importable (see the module docstring to install it)"


def torchrun(python: str) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC)]


def command(system: System, ds_python: str | None) -> list[str]:
    if system.launcher == "torchrun":
        return torchrun(sys.executable)
    if system.launcher == "deepspeed":
        return torchrun(ds_python)
    return [sys.executable, "-m", "zerotrain.launcher.cli", "launch", "--nproc", str(NPROC)]


def launch(cmd: list[str], args, out: Path, label: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    if args.zerotrain_src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.zerotrain_src, env.get("PYTHONPATH")]))
    env["BENCH_T0"] = repr(time.time())
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=args.timeout
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise RuntimeError(f"{label} exited {proc.returncode}:\n{tail}")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    if len(records) != NPROC:
        raise RuntimeError(f"{label}: expected {NPROC} records, got {len(records)}")
    return sorted(records, key=lambda r: r["rank"])


def workload_args(args, steps, preset=None, seq=None) -> list[str]:
    return [
        "--preset",
        preset or args.preset,
        "--steps",
        str(steps),
        "--micro",
        str(args.micro),
        "--seq",
        str(seq or args.seq),
    ]


def run_own(system: System, args, ds_python, out: Path, steps: int, **shape) -> list[dict]:
    cmd = command(system, ds_python) + [
        str(WORKLOAD),
        "--mode",
        system.mode,
        "--stage",
        str(system.stage),
        *workload_args(args, steps, **shape),
        "--out",
        str(out),
    ]
    if system.fused:
        cmd.append("--fused")
    return launch(cmd, args, out, system.label)


def run_interleaved(systems: list[System], args, ds_python, out: Path) -> list[dict]:
    python = ds_python if any(s.launcher == "deepspeed" for s in systems) else sys.executable
    spec = ",".join(f"{s.key}:{s.mode}:{s.stage}:{'fused' if s.fused else 'plain'}" for s in systems)
    cmd = torchrun(python) + [
        str(WORKLOAD),
        "--interleave",
        spec,
        *workload_args(args, args.interleave_steps),
        "--out",
        str(out),
    ]
    return launch(cmd, args, out, "interleaved run")


# -- summaries ----------------------------------------------------------------------------
def median(xs):
    return statistics.median(xs) if xs else float("nan")


def quartiles(xs) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize_own(records: list[dict], skip: int) -> dict:
    steps = len(records[0]["step_s"])
    slowest = [max(r["step_s"][i] for r in records) for i in range(min(skip, steps - 1), steps)]
    return {
        "step_s": median(slowest),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in records),
        "peak_rss_by_rank": [r["peak_rss_mib"] for r in records],
        "rss_torch_mib": max(r["rss_at_mib"]["torch"] for r in records),
        "rss_model_mib": max(r["rss_at_mib"]["model"] for r in records),
        "rss_init_mib": max(r["rss_at_mib"]["initialized"] for r in records),
        "rss_step1_mib": max(r["rss_mib"][0] for r in records),
        "rss_last_mib": max(r["rss_mib"][-1] for r in records),
        "heap_retained_last_mib": max((r["malloc_mib"][-1] or {}).get("heap_free_retained", 0) for r in records),
        "first_step_s": max(r["first_step_s"] for r in records),
        **{f"t_{k}_s": max(r["t_at_s"][k] for r in records) for k in ("python", "torch", "model", "initialized")},
        "losses": records[0]["losses"],
        "params": records[0]["params"],
        "memory_breakdown": records[0].get("memory_breakdown"),
    }


def summarize_interleaved(records: list[dict], skip: int) -> dict[str, dict]:
    """Per system: per-round wall / CPU seconds (slowest rank) and the phase split."""
    keys = records[0]["order"]
    steps = len(records[0]["systems"][keys[0]]["step_s"])
    rounds = range(min(skip, steps - 1), steps)
    out = {}
    for k in keys:
        per = [r["systems"][k] for r in records]
        out[k] = {
            "step_s": [max(p["step_s"][i] for p in per) for i in rounds],
            "cpu_s": [max(p["cpu_s"][i] for p in per) for i in rounds],
            "phase_s": [[max(p["phase_s"][i][j] for p in per) for i in rounds] for j in range(3)],
            "losses": per[0]["losses"],
        }
    return out


# -- reporting ----------------------------------------------------------------------------
def fmt_ratio(xs: list[float]) -> str:
    lo, hi = quartiles(xs)
    return f"{median(xs):.3f} [{lo:.2f}, {hi:.2f}]"


def report(own: dict[str, list[dict]], inter: dict[str, dict] | None, args, meta: dict) -> dict:
    keys = [k for k in own if own[k]]
    ikeys = list(inter) if inter else []
    fused = "ddp_fused" in ikeys
    fields = (
        "step_s",
        "peak_rss_mib",
        "rss_torch_mib",
        "rss_model_mib",
        "rss_init_mib",
        "rss_step1_mib",
        "rss_last_mib",
        "heap_retained_last_mib",
        "first_step_s",
        "t_python_s",
        "t_torch_s",
        "t_model_s",
        "t_initialized_s",
    )
    med = {k: {f: median([r[f] for r in own[k]]) for f in fields} for k in keys}
    P = own["ddp"][0]["params"] if keys else None
    summary: dict = {"meta": meta, "params": P, "systems": {}}
    for k in dict.fromkeys(ikeys + keys):
        summary["systems"][k] = {"label": BY_KEY[k].label}
    for k in keys:
        summary["systems"][k].update(med[k], memory_breakdown=own[k][0]["memory_breakdown"])

    def paired_own(k, f, base="ddp"):
        return [a[f] / b[f] for a, b in zip(own.get(k, []), own.get(base, []))]

    print(
        f"\nGPT workload {args.preset} (micro-batch {args.micro} x seq {args.seq} per rank), "
        f"{NPROC} gloo ranks, OMP_NUM_THREADS=1, AdamW lr 1e-4 wd 0, no clipping, fp32"
        + (f"; {P:,} parameters" if P else "")
    )
    print(
        f"zerotrain {meta['zerotrain']}; torch {meta['torch']}; DeepSpeed {meta['deepspeed']}; "
        f"Python {meta['python']}; {meta['cpus']} CPUs"
    )

    # Step time.
    if inter:
        n_rounds = len(inter["ddp"]["step_s"])
        print(
            f"\n### Step time: all systems interleaved in one launch ({args.interleave_steps} "
            f"rounds, first {min(args.skip, args.interleave_steps - 1)} excluded: "
            f"{n_rounds} steps per system)\n"
        )
        print(
            "Ratios are taken within each round, then median [quartiles] over rounds. "
            "`CPU` = process CPU seconds per step, all threads.\n"
        )
        head = "| system | step s | step / DDP |" + (" step / DDP fused |" if fused else "")
        head += " CPU s | CPU / DDP | fwd / bwd / opt s | own launches: step / DDP |"
        print(head)
        print("|---" * (head.count("|") - 1) + "|")
        for k in ikeys:
            it, base = inter[k], inter["ddp"]
            r = [a / b for a, b in zip(it["step_s"], base["step_s"])]
            c = [a / b for a, b in zip(it["cpu_s"], base["cpu_s"])]
            entry = summary["systems"][k]
            own_r = paired_own(k, "step_s")
            entry.update(
                step_s=median(it["step_s"]),
                cpu_s=median(it["cpu_s"]),
                step_ratio=median(r),
                step_ratio_q=quartiles(r),
                cpu_ratio=median(c),
                phase_s=[median(x) for x in it["phase_s"]],
                own_step_ratio=median(own_r) if own_r else None,
            )
            row = f"| {BY_KEY[k].label} | {median(it['step_s']):.3f} | {fmt_ratio(r)} |"
            if fused:
                rf = [a / b for a, b in zip(it["step_s"], inter["ddp_fused"]["step_s"])]
                entry.update(step_ratio_fused=median(rf))
                row += f" {fmt_ratio(rf)} |"
            ph = " / ".join(f"{median(x):.3f}" for x in it["phase_s"])
            row += f" {median(it['cpu_s']):.3f} | {median(c):.3f} | {ph} | " + (
                f"{median(own_r):.3f} |" if own_r else "– |"
            )
            print(row)
        worst = max(abs(a - b) for k in ikeys for a, b in zip(inter[k]["losses"], inter["ddp"]["losses"]))
        print(
            f"\nLosses in the interleaved run: largest difference to DDP's over "
            f"{args.interleave_steps} steps {worst:.1e}."
        )

    if not keys:
        return _goals(summary, fused)
    theory = {"opt": 8 * P * (1 - 1 / NPROC) / MIB, "opt+grad": 12 * P * (1 - 1 / NPROC) / MIB}
    summary["theoretical_saving_mib"] = theory
    repeats = len(own["ddp"])

    # Memory and start-up.
    print(f"\n### Peak memory and start-up: one launch per system ({repeats} repeats of {args.steps} steps, medians)\n")
    print("| system | peak RSS MiB (rank 0/1) | RSS / DDP | launch→end of step 1 s | / DDP | step-1 loss |")
    print("|---|---|---|---|---|---|")
    for k in keys:
        m = med[k]
        ranks = "/".join(f"{median([r['peak_rss_by_rank'][i] for r in own[k]]):.0f}" for i in range(NPROC))
        start = paired_own(k, "first_step_s")
        summary["systems"][k].update(
            rss_ratio=m["peak_rss_mib"] / med["ddp"]["peak_rss_mib"], startup_ratio=median(start), startup_ratios=start
        )
        print(
            f"| {BY_KEY[k].label} | {m['peak_rss_mib']:.0f} ({ranks}) | "
            f"{m['peak_rss_mib'] / med['ddp']['peak_rss_mib']:.3f} | "
            f"{m['first_step_s']:.1f} | {median(start):.2f} | {own[k][0]['losses'][0]:.6f} |"
        )

    print(
        "\nStart-up: seconds from the launch command to each point on the slower rank "
        "(medians): the rank's interpreter running the script, `import torch` done, model "
        "built, initialize() done, end of step 1\n"
    )
    print("| system | script starts | torch imported | model built | initialized | step 1 done |")
    print("|---|---|---|---|---|---|")
    for k in keys:
        m = med[k]
        print(
            f"| {BY_KEY[k].label} | {m['t_python_s']:.1f} | {m['t_torch_s']:.1f} | "
            f"{m['t_model_s']:.1f} | {m['t_initialized_s']:.1f} | {m['first_step_s']:.1f} |"
        )

    print(
        "\nWhere the memory is: RSS in MiB (larger rank, medians) after `import torch`, after "
        "building the model, after initialize, after step 1, after the last step, glibc's "
        "free-but-retained heap after the last step, and the peak\n"
    )
    print("| system | torch imported | model built | initialized | step 1 | last step | heap retained | peak |")
    print("|---|---|---|---|---|---|---|---|")
    for k in keys:
        m = med[k]
        print(
            f"| {BY_KEY[k].label} | {m['rss_torch_mib']:.0f} | {m['rss_model_mib']:.0f} | "
            f"{m['rss_init_mib']:.0f} | {m['rss_step1_mib']:.0f} | {m['rss_last_mib']:.0f} | "
            f"{m['heap_retained_last_mib']:.0f} | {m['peak_rss_mib']:.0f} |"
        )
    breakdowns = {
        k: summary["systems"][k]["memory_breakdown"] for k in keys if summary["systems"][k]["memory_breakdown"]
    }
    if breakdowns:
        print("\nzerotrain `engine.memory_breakdown()` after the last step, rank 0, MiB\n")
        cats = list(next(iter(breakdowns.values())))
        print("| system | " + " | ".join(c.replace("_", " ") for c in cats) + " |")
        print("|---" * (len(cats) + 1) + "|")
        for k, b in breakdowns.items():
            print(f"| {BY_KEY[k].label} | " + " | ".join(f"{b.get(c, 0) / MIB:.1f}" for c in cats) + " |")

    print(
        f"\nSaving in peak RSS per rank against DDP vs theory (P = {P:,}, N = {NPROC}: "
        f"optimizer-only {theory['opt']:.1f} MiB, optimizer+gradients "
        f"{theory['opt+grad']:.1f} MiB)\n"
    )
    print("| system | shards | theoretical saving MiB | achieved (DDP peak - peak) MiB | fraction |")
    print("|---|---|---|---|---|")
    for k in keys:
        s = BY_KEY[k]
        if not s.sharded:
            continue
        achieved = med["ddp"]["peak_rss_mib"] - med[k]["peak_rss_mib"]
        frac = achieved / theory[s.sharded]
        summary["systems"][k].update(
            theoretical_saving_mib=theory[s.sharded], achieved_saving_mib=achieved, saving_fraction=frac
        )
        what = "optimizer state" if s.sharded == "opt" else "optimizer state + gradients"
        print(f"| {s.label} | {what} | {theory[s.sharded]:.1f} | {achieved:.1f} | {frac:.2f} |")

    # Same computation everywhere.
    first = {k: own[k][0]["losses"][0] for k in keys}
    last = {k: own[k][0]["losses"][-1] for k in keys}
    spread = max(first.values()) - min(first.values())
    print(
        f"\nStep-1 loss (rank 0): {first['ddp']:.6f} for every system, spread {spread:.1e} "
        f"({'same init and data everywhere' if spread < 1e-5 else 'MISMATCH'}); step-"
        f"{args.steps} loss spread {max(last.values()) - min(last.values()):.1e}."
    )
    summary["losses_step1"] = first
    return _goals(summary, fused)


def _goals(summary: dict, fused: bool) -> dict:
    z = summary["systems"]
    goals = []

    def goal(name, k, field, target, ok):
        if k in z and z[k].get(field) is not None:
            alt = z[k].get(field + "_fused")
            goals.append((name, z[k][field], alt, target, ok(z[k][field])))

    goal("stage 0 step time within 5% of DDP", "zt0", "step_ratio", "<= 1.05", lambda v: v <= 1.05)
    goal(
        "stage 0 launch-to-first-step no slower than torchrun + DDP",
        "zt0",
        "startup_ratio",
        "<= 1.00",
        lambda v: v <= 1.0,
    )
    goal("stage 1 step time within 10% of DDP", "zt1", "step_ratio", "<= 1.10", lambda v: v <= 1.10)
    goal("stage 2 step time within 10% of DDP", "zt2", "step_ratio", "<= 1.10", lambda v: v <= 1.10)
    goal("stage 2 peak RSS saving >= 70% of theory", "zt2", "saving_fraction", ">= 0.70", lambda v: v >= 0.70)
    print("\n### Goals\n")
    print("| goal | measured vs DDP |" + (" vs DDP fused |" if fused else "") + " target | met |")
    print("|---|---|" + ("---|" if fused else "") + "---|---|")
    for name, value, alt, target, ok in goals:
        extra = (f" {alt:.3f} |" if alt is not None else " – |") if fused else ""
        print(f"| {name} | {value:.3f} |{extra} {target} | {'yes' if ok else 'NO'} |")
    summary["goals"] = [dict(goal=n, measured=v, measured_vs_fused=a, target=t, met=ok) for n, v, a, t, ok in goals]
    return summary


def git_describe(src: Path) -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True, text=True
        ).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown revision"


def export_revision(rev: str) -> tuple[tempfile.TemporaryDirectory, str, str]:
    """``git archive`` of src/ at ``rev`` into a temporary directory."""
    repo = HERE.parent
    sha = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    tmp = tempfile.TemporaryDirectory(prefix=f"zerotrain-{sha}-")
    archive = subprocess.run(["git", "-C", str(repo), "archive", sha, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp.name], input=archive, check=True)
    return tmp, str(Path(tmp.name) / "src"), sha


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="own launches per system")
    p.add_argument("--steps", type=int, default=4, help="steps per own launch")
    p.add_argument(
        "--interleave-steps", type=int, default=8, help="rounds of the interleaved step-time launch (0: skip it)"
    )
    p.add_argument("--skip", type=int, default=2, help="leading steps left out of step times")
    p.add_argument("--preset", default="gpt17m")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--systems", default=",".join(s.key for s in SYSTEMS))
    p.add_argument("--deepspeed-python", default=None)
    p.add_argument(
        "--zerotrain-src", default=None, help="put this src/ directory first on PYTHONPATH (e.g. a patched copy)"
    )
    p.add_argument(
        "--zerotrain-rev",
        default=None,
        help="measure this git revision (e.g. HEAD): its src/ is exported to a "
        "temporary directory, so uncommitted work in the tree is not measured",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed tiny DeepSpeed launch (DeepSpeed builds a JIT op on "
        "its first run on a machine; this keeps that out of its start-up time)",
    )
    p.add_argument("--json", default=None, help="also write every record here")
    args = p.parse_args(argv)

    wanted = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in BY_KEY]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {[s.key for s in SYSTEMS]}")
    if "ddp" not in wanted:
        wanted.insert(0, "ddp")  # everything is a ratio to DDP
    wanted = [s.key for s in SYSTEMS if s.key in wanted]
    ds_python, ds_version = (None, "not requested")
    if any(BY_KEY[k].launcher == "deepspeed" for k in wanted):
        ds_python, ds_version = deepspeed_python(args.deepspeed_python)
        if ds_python is None:
            print(f"skipping DeepSpeed: {ds_version}", file=sys.stderr)
            wanted = [k for k in wanted if BY_KEY[k].launcher != "deepspeed"]
    systems = [BY_KEY[k] for k in wanted]

    import torch

    import zerotrain

    snapshot = None
    if args.zerotrain_rev:
        snapshot, args.zerotrain_src, sha = export_revision(args.zerotrain_rev)
        where = f"commit {sha} (git archive of src/)"
    else:
        src = Path(args.zerotrain_src) if args.zerotrain_src else Path(zerotrain.__file__).resolve().parents[1]
        where = f"{src} @ {git_describe(src)}"
    meta = {
        "zerotrain": where,
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    started = time.time()
    own: dict[str, list[dict]] = {s.key: [] for s in systems}
    raw: dict = {s.key: [] for s in systems}
    inter = None

    def progress(msg):
        print(f"[{time.time() - started:5.0f} s] {msg}", file=sys.stderr, flush=True)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            if not args.no_warmup:
                ds = [x for x in systems if x.launcher == "deepspeed"]
                if ds:
                    run_own(ds[0], args, ds_python, Path(tmp) / "warmup.jsonl", steps=1, preset="tiny", seq=32)
                    progress("DeepSpeed warm-up launch done")
            if args.interleave_steps > 0:
                records = run_interleaved(systems, args, ds_python, Path(tmp) / "interleaved.jsonl")
                raw["interleaved"] = records
                inter = summarize_interleaved(records, args.skip)
                progress(
                    "interleaved step-time launch: "
                    + ", ".join(f"{k} {median(v['step_s']):.3f} s" for k, v in inter.items())
                )
            alone = [s for s in systems if s.own]
            for i in range(args.repeats):
                order = alone[i % len(alone) :] + alone[: i % len(alone)]
                for s in order:
                    records = run_own(s, args, ds_python, Path(tmp) / f"{s.key}-{i}.jsonl", steps=args.steps)
                    raw[s.key].append(records)
                    own[s.key].append(summarize_own(records, args.skip))
                    r = own[s.key][-1]
                    progress(
                        f"repeat {i + 1}/{args.repeats} {s.label}: step "
                        f"{r['step_s']:.3f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
                        f"launch→step 1 {r['first_step_s']:.1f} s"
                    )
    finally:
        if snapshot is not None:
            snapshot.cleanup()
    summary = report(own, inter, args, meta)
    print(f"\n(wall time of the benchmark: {time.time() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"summary": summary, "own": own, "interleaved": inter, "raw": raw}, indent=1)
        )
    return summary


if __name__ == "__main__":
    main()
