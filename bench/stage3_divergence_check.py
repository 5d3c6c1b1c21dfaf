"""Stage 3's divergence check (identity headers in every gather and reduce-scatter) against no
check, in the same two processes: what the check costs per step.

    zerotrain launch --nproc 2 bench/stage3_divergence_check.py --steps 24 --out /tmp/check.jsonl

Two stage-3 engines train their own copy of the GPT workload's model (same init, same batches):
one built with the check (the default), one with ``ZEROTRAIN_CHECK_COLLECTIVES=0`` (read when
the engine is built). They step in turn, the order alternating every round, the ranks meeting at
a barrier before each step (outside the timed region), as ``gpt_workload.py --interleave`` does.
Rank 0 prints the median step time of each and the median of the per-round ratios; every rank
appends its record to --out.
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def main():
    args = parse_args()
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
    out = {k: {"losses": [], "step_s": []} for k in systems}
    keys = list(systems)
    for i in range(args.steps):
        for key in (keys if i % 2 == 0 else keys[::-1]):
            step, rec = systems[key], out[key]
            batch = torch.randint(0, vocab, (args.micro, args.seq), generator=gens[key])
            dist.barrier()
            t0 = time.perf_counter()
            loss = step.forward(batch)
            step.backward(loss)
            step.update()
            rec["step_s"].append(time.perf_counter() - t0)
            rec["losses"].append(loss.item())
    check, plain = (out[k]["step_s"][args.skip:] for k in ("check", "no_check"))
    summary = {"check_median_s": statistics.median(check),
               "no_check_median_s": statistics.median(plain),
               "median_of_ratios": statistics.median(a / b for a, b in zip(check, plain))}
    summary["ratio_of_medians"] = summary["check_median_s"] / summary["no_check_median_s"]
    same_losses = out["check"]["losses"] == out["no_check"]["losses"]
    with open(args.out, "a") as f:
        f.write(json.dumps({"rank": rank, "preset": args.preset, "stage": args.stage,
                            "systems": out, "summary": summary,
                            "identical_losses": same_losses}) + "\n")
    if rank == 0:
        print(json.dumps({**summary, "identical_losses": same_losses}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
