"""Stage 3's divergence check (identity headers in every gather and reduce-scatter) against no
check, in the same two processes: what the check costs per step.

    zerotrain launch --nproc 2 bench/stage3_divergence_check.py --steps 30 --out /tmp/check.jsonl
    python bench/stage3_divergence_check.py --summarize /tmp/check.jsonl   # every launch pooled

Two stage-3 engines train their own copy of the GPT workload's model (same init, same batches):
one built with the check (the default), one with ``ZEROTRAIN_CHECK_COLLECTIVES=0`` (read when
the engine is built). They step in turn, the order alternating every round, the ranks meeting at
a barrier before each step (outside the timed region), as ``gpt_workload.py --interleave`` does.
Rank 0 prints, for the step's wall time and its CPU time (the process's, every thread), the
median of each and of the per-round ratios (check / no check); every rank appends its record
to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpt_workload import PRESETS, build  # noqa: E402
from zerotrain.models import GPT, GPTConfig  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt17m", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=24, help="steps of each engine")
    p.add_argument("--skip", type=int, default=2, help="leading steps left out of the medians")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--out")
    p.add_argument(
        "--summarize",
        nargs="+",
        metavar="JSONL",
        help="no run: pool the per-round ratios of every launch recorded in these files",
    )
    p.add_argument(
        "--gather-reps",
        type=int,
        default=200,
        help="also time this many all-gathers with and without an identity, per size",
    )
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def time_gathers(reps: int) -> dict:
    """Microseconds per all-gather (issued and waited at once), with and without an identity
    header, for a small and a unit-sized shard: the check's cost per collective."""
    from zerotrain.comm import collectives

    identity = collectives.Identity((1, 0, 0, 0), lambda codes: RuntimeError(str(codes)))
    rank, out = dist.get_rank(), {}
    for n in (128, 131072):
        flat = torch.zeros(2 * n)
        best = {}
        for _ in range(3):
            for key, ident in (("identity", identity), ("plain", None)):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    collectives.all_gather_into(flat, flat.narrow(0, rank * n, n), async_op=True, identity=ident).wait()
                us = (time.perf_counter() - t0) / reps * 1e6
                best[key] = min(best.get(key, us), us)
        out[n] = best
    return out


def summarize(paths, skip: int) -> None:
    """The per-round ratios (check / no check) of every launch's rank-0 record, pooled."""
    for figure in ("step_s", "cpu_s"):
        ratios, check, plain, launches = [], [], [], 0
        for path in paths:
            for line in open(path):
                record = json.loads(line)
                if record["rank"] != 0 or figure not in record["systems"]["check"]:
                    continue
                launches += 1
                a = record["systems"]["check"][figure][skip:]
                b = record["systems"]["no_check"][figure][skip:]
                ratios += [x / y for x, y in zip(a, b)]
                check += a
                plain += b
        if ratios:
            geo = math.exp(statistics.mean(math.log(r) for r in ratios))
            print(
                f"{figure}: {launches} launches, {len(ratios)} rounds; median of per-round "
                f"ratios {statistics.median(ratios):.4f}, geometric mean {geo:.4f}, ratio of "
                f"medians {statistics.median(check) / statistics.median(plain):.4f} "
                f"({statistics.median(check):.3f} s / {statistics.median(plain):.3f} s)"
            )


def main():
    args = parse_args()
    if args.summarize:
        return summarize(args.summarize, args.skip)
    if not args.out:
        raise SystemExit("--out FILE is required (the file each rank appends its record to)")
    systems = {}
    for key, env in (("check", None), ("no_check", "0")):
        if env is None:
            os.environ.pop("ZEROTRAIN_CHECK_COLLECTIVES", None)
        else:
            os.environ["ZEROTRAIN_CHECK_COLLECTIVES"] = env
        torch.manual_seed(0)
        model = GPT(GPTConfig(**PRESETS[args.preset]))
        systems[key] = build(args, model, "zerotrain", args.stage, False)
    os.environ.pop("ZEROTRAIN_CHECK_COLLECTIVES", None)
    rank = dist.get_rank()
    vocab = PRESETS[args.preset]["vocab_size"]
    gens = {k: torch.Generator().manual_seed(100 + rank) for k in systems}
    out = {k: {"losses": [], "step_s": [], "cpu_s": []} for k in systems}
    keys = list(systems)
    for i in range(args.steps):
        for key in keys if i % 2 == 0 else keys[::-1]:
            step, rec = systems[key], out[key]
            batch = torch.randint(0, vocab, (args.micro, args.seq), generator=gens[key])
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            loss = step.forward(batch)
            step.backward(loss)
            step.update()
            rec["step_s"].append(time.perf_counter() - t0)
            rec["cpu_s"].append(time.process_time() - c0)  # this process, every thread
            rec["losses"].append(loss.item())
    summary = {}
    for figure in ("step_s", "cpu_s"):
        check, plain = (out[k][figure][args.skip :] for k in ("check", "no_check"))
        summary[figure] = {
            "check_median": statistics.median(check),
            "no_check_median": statistics.median(plain),
            "ratio_of_medians": statistics.median(check) / statistics.median(plain),
            "median_of_ratios": statistics.median(a / b for a, b in zip(check, plain)),
        }
    same_losses = out["check"]["losses"] == out["no_check"]["losses"]
    summary["gather_us"] = time_gathers(args.gather_reps) if args.gather_reps else None
    with open(args.out, "a") as f:
        f.write(
            json.dumps(
                {
                    "rank": rank,
                    "preset": args.preset,
                    "stage": args.stage,
                    "systems": out,
                    "summary": summary,
                    "identical_losses": same_losses,
                }
            )
            + "\n"
        )
    if rank == 0:
        print(json.dumps({**summary, "identical_losses": same_losses}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
