"""The tables ``bench/gpt2_110m.py`` prints for one run: step, peak and CPU time against DDP,
memory by phase and category, and the forward/backward/step gaps."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

MIB = 2**20


def report(runs: dict[str, list[list[dict]]], args, label) -> None:
    """The tables of one run; ``label(key)`` names a system."""
    med = statistics.median
    rows = {}
    for k, reps in runs.items():
        peak = med([max(r["peak_rss_mib"] for r in recs) for recs in reps])
        step = med(
            [med([max(r["step_s"][i] for r in recs) for i in range(1, len(recs[0]["step_s"]))]) for recs in reps]
        )
        cpu = med([med([max(r["cpu_s"][i] for r in recs) for i in range(1, len(recs[0]["cpu_s"]))]) for recs in reps])
        recs = reps[0]
        rss_steps = [max(r["rss_mib"][i] for r in recs) for i in range(len(recs[0]["rss_mib"]))]
        live = max((r["peak_live_bytes"] or 0) for r in recs) / MIB
        rows[k] = {
            "label": label(k) + f" [{recs[0].get('allocator', '?')}]",
            "peak_rss_mib": peak,
            "step_s": step,
            "cpu_s": cpu,
            "peak_by_rank": [r["peak_rss_mib"] for r in recs],
            "rss_steps_mib": rss_steps,
            "losses": recs[0]["losses"],
            "live_mib": live,
            "rss_at_mib": recs[0]["rss_at_mib"],
            "memory_breakdown": recs[0]["memory_breakdown"],
            "params": recs[0]["params"],
            "peak_device_mib": med([max(r.get("peak_device_mib") or 0 for r in recs) for recs in reps]),
        }
    base = rows.get("ddp")
    P = next(iter(rows.values()))["params"]
    where = f"{args.nproc} CUDA device(s), NCCL" if args.device == "cuda" else f"{args.nproc} gloo ranks"
    print(
        f"\nHF GPT-2 {P / 1e6:.1f}M parameters, micro-batch {args.micro} x seq {args.seq} per "
        f"rank, {where}, OMP_NUM_THREADS=1, AdamW lr 1e-4 wd 0, no clipping; "
        f"{args.steps} steps, {args.repeats} launch(es) per system; peak = VmHWM, max over "
        "ranks; step = median of steps 2.., slower rank\n"
    )
    print(
        "| system | peak RSS MiB | / DDP | step s | / DDP | CPU s per step | / DDP | "
        "live MiB (engine) | peak - live | RSS after steps 1..N (max rank) | step-1 loss | "
        "last loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows.values():
        rr = f"{r['peak_rss_mib'] / base['peak_rss_mib']:.2f}" if base else "-"
        sr = f"{r['step_s'] / base['step_s']:.2f}" if base else "-"
        cr = f"{r['cpu_s'] / base['cpu_s']:.2f}" if base else "-"
        live = f"{r['live_mib']:.0f}" if r["live_mib"] else "-"
        gap = f"{r['peak_rss_mib'] - r['live_mib']:.0f}" if r["live_mib"] else "-"
        steps = " ".join(f"{x:.0f}" for x in r["rss_steps_mib"])
        print(
            f"| {r['label']} | {r['peak_rss_mib']:.0f} | {rr} | {r['step_s']:.2f} | {sr} | "
            f"{r['cpu_s']:.2f} | {cr} | "
            f"{live} | {gap} | {steps} | {r['losses'][0]:.5f} | {r['losses'][-1]:.5f} |"
        )
    if args.device == "cuda":
        print("\n| system | peak device MiB (max_memory_allocated, max rank) | / DDP | step ms | / DDP |")
        print("|---|---|---|---|---|")
        for r in rows.values():
            dr = f"{r['peak_device_mib'] / base['peak_device_mib']:.2f}" if base else "-"
            sr = f"{r['step_s'] / base['step_s']:.2f}" if base else "-"
            print(f"| {r['label']} | {r['peak_device_mib']:.0f} | {dr} | {r['step_s'] * 1e3:.1f} | {sr} |")
    if base:
        print(
            "\nstep-1 loss difference vs DDP: "
            + ", ".join(f"{k} {abs(r['losses'][0] - base['losses'][0]):.2e}" for k, r in rows.items() if k != "ddp")
        )
    print(
        "\nforward / backward / optimizer step s (median of steps 2.., rank 0): "
        + "; ".join(
            f"{k} " + " / ".join(f"{med([ph[j] for ph in reps[0][0]['phase_s'][1:]]):.2f}" for j in range(3))
            for k, reps in runs.items()
        )
    )
    from host_work import describe_host_work

    describe_host_work({k: reps[0][0].get("host_per_step") for k, reps in runs.items()})
    print(
        "\ngarbage collector s per step, generations 0 / 1 / 2 (mean of steps 2.., rank 0): "
        + "; ".join(
            f"{k} " + " / ".join(f"{statistics.mean([g[j] for g in reps[0][0]['gc_s'][1:]]):.3f}" for j in range(3))
            for k, reps in runs.items()
        )
    )
    print(
        "\npage faults in forward / backward / optimizer step (median of steps 2.., rank 0): "
        + "; ".join(
            f"{k} " + " / ".join(f"{med([ph[j] for ph in reps[0][0]['phase_faults'][1:]]):.0f}" for j in range(3))
            for k, reps in runs.items()
        )
    )
    print(
        "\npage faults / system CPU s per step (median of steps 2.., rank 0): "
        + "; ".join(
            f"{k} {med([f[0] for f in reps[0][0]['faults'][1:]]):.0f} / "
            f"{med([f[1] for f in reps[0][0]['faults'][1:]]):.2f}"
            for k, reps in runs.items()
        )
    )
    print(
        "\nRSS (MiB, rank 0) after imports / model built / initialize: "
        + "; ".join(
            f"{k} {r['rss_at_mib']['imports']:.0f}/{r['rss_at_mib']['model']:.0f}/{r['rss_at_mib']['initialized']:.0f}"
            for k, r in rows.items()
        )
    )
    for k, r in rows.items():
        if r["memory_breakdown"]:
            mb = {n: round(v / MIB, 1) for n, v in r["memory_breakdown"].items() if isinstance(v, (int, float))}
            print(f"memory_breakdown MiB {k}: {mb}")
    for k, reps in runs.items():
        phases = reps[0][0]["rss_peak_by_phase_mib"]
        in_use = reps[0][0].get("malloc_in_use_at_phase_peak_mib") or {}
        if phases:
            phases = {p: v for p, v in phases.items()}
            fmt = lambda p, v: f"{p} {v:.0f}" + (f" ({in_use[p]:.0f} in use)" if p in in_use else "")  # noqa: E731
            later = {p: v for p, v in phases.items() if p.split()[0].isdigit() and int(p.split()[0]) >= 2}
            top = sorted(later.items(), key=lambda kv: -kv[1])[:8]
            print(f"RSS peak by phase, rank 0, steps >= 2, {k}: " + "; ".join(fmt(p, v) for p, v in top))
            step1 = [(p, v) for p, v in phases.items() if not p.split()[0].isdigit() or p.startswith("1 ")]
            print("  start and step 1: " + "; ".join(fmt(p, v) for p, v in step1))
            rows[k]["rss_peak_by_phase_mib"] = phases
            rows[k]["malloc_in_use_at_phase_peak_mib"] = in_use
    print_gap_breakdown(runs, label)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def print_gap_breakdown(runs, label) -> None:
    """Where peak RSS goes, from rank 0's samples: the moment of the highest sampled RSS in
    steps >= 2, split by what malloc had handed out then (needs --rss-sample-ms)."""
    lines = []
    for k, reps in runs.items():
        r = reps[0][0]
        phases, in_use = r.get("rss_peak_by_phase_mib"), r.get("malloc_in_use_at_phase_peak_mib")
        if not phases or not in_use:
            continue
        later = {p: v for p, v in phases.items() if p.split()[0].isdigit() and int(p.split()[0]) >= 2}
        peak_phase = max(later, key=later.get)
        step = int(peak_phase.split()[0])
        imports_rss, imports_heap = r["rss_at_mib"]["imports"], r["malloc_in_use_mib"]["imports"]
        at_rest = r["malloc_in_use_mib"][f"after step {step - 1}"]
        live = (r["peak_live_bytes"] or 0) / MIB
        transient = in_use[peak_phase] - at_rest
        retained = later[peak_phase] - in_use[peak_phase] - (imports_rss - imports_heap)
        lines.append(
            f"| {label(k)} | {later[peak_phase]:.0f} ({peak_phase}) | "
            f"{imports_rss - imports_heap:.0f} | {imports_heap:.0f} | "
            f"{at_rest - imports_heap:.0f} | {transient:.0f} | {retained:.0f} | {live:.0f} |"
        )
    if lines:
        print(
            "\nPeak RSS split (rank 0, highest sampled phase of steps >= 2; MiB): not malloc = "
            "RSS - malloc in use after imports (library code and data); import heap = malloc in "
            "use after imports; at rest = malloc in use after the previous step minus import "
            "heap (engine states, buffers, Python objects); transient = malloc in use at the "
            "peak minus at rest (activations, full-size gradients and gathered parameters, "
            "autograd temporaries); retained = RSS - malloc in use - not malloc (freed memory "
            "glibc had not returned)\n"
        )
        print(
            "| system | peak sampled RSS (phase) | not malloc | import heap | at rest | transient "
            "| retained | engine live (peak) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(lines))
