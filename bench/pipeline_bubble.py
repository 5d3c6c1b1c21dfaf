"""Seed 001's comparison: naive model parallelism against pipelining, on a BERT-like encoder.

    python bench/pipeline_bubble.py [--stages 2,4] [--micro-batches 1,4,8] [--steps 6] [--warmup 2]
                                    [--batch 16] [--timeline-dir DIR]

A BERT-like encoder (token + position embedding, ``--layers`` ``nn.TransformerEncoderLayer``s of
``--hidden`` width, a vocabulary head with cross-entropy; random init) split into P stages
(``PipelineModule(partition_method="type:TransformerEncoderLayer")``: the encoder layers evenly),
P gloo processes on this machine. Every configuration trains the same global batch of
``--batch`` sequences per step: M=1 is naive model parallelism (GPipe with one micro-batch: one
stage works at a time), M=4 and M=8 are pipelining (DeepSpeed's 1F1B) with micro-batches of
batch/M. With ``"pipeline": {"timeline": true}`` each step reports every stage's busy (forward
+ backward compute) and idle time; printed: the time per step, samples/s, the ideal bubble
(P-1)/(M+P-1) and the measured idle share per stage (mean over the measured steps).
``--timeline-dir``: the last step's timeline per configuration as JSON and SVG
(``python -m zerotrain.pipeline.timeline FILE.json --out FILE.png`` draws a PNG).

Idle time includes the communication and the waiting for other stages; on a machine with fewer
cores than processes the stages also wait for a core, which shows as idle and as longer compute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# The encoder's first and last layers (random init, no per-layer seed) are pipeline_vs_deepspeed.py's.
from pipeline_vs_deepspeed import Embed, Head, loss_fn  # noqa: E402


def _layers(args) -> list:
    from zerotrain.pipeline import LayerSpec

    return (
        [LayerSpec(Embed, args.vocab, args.hidden, args.seq)]
        + [
            LayerSpec(
                nn.TransformerEncoderLayer,
                args.hidden,
                args.heads,
                4 * args.hidden,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
            )
            for _ in range(args.layers)
        ]
        + [LayerSpec(Head, args.vocab, args.hidden)]
    )


def _run(args, pipe: int, m: int) -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    zerotrain.init_distributed()
    torch.manual_seed(0)
    model = PipelineModule(
        _layers(args), num_stages=pipe, loss_fn=loss_fn, partition_method="type:TransformerEncoderLayer"
    )
    config = {
        "train_micro_batch_size_per_gpu": args.batch // m,
        "gradient_accumulation_steps": m,
        "train_batch_size": args.batch,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "pipeline": {"schedule": "gpipe" if m < pipe else "1f1b", "timeline": True},
    }
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    micro = args.batch // m

    def batch():
        ids = torch.randint(0, args.vocab, (micro, args.seq), generator=g)
        return ids, ids

    times, shares, busy = [], [], []
    for step in range(args.warmup + args.steps):
        data = iter([batch() for _ in range(m)])
        start = time.perf_counter()
        engine.train_batch(data)
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            bubble = engine.pipeline_bubble()
            times.append(elapsed)
            # not computing (seed 001's idle): the idle share plus the p2p transfers' share
            shares.append([s["idle_share"] + s["comm_share"] for s in bubble["stages"]])
            busy.append([s["busy"] for s in bubble["stages"]])
    out = {"stage": engine.stage_id, "times": times, "shares": shares, "busy": busy}
    if args.timeline_dir and engine.is_first_stage():
        os.makedirs(args.timeline_dir, exist_ok=True)
        path = os.path.join(args.timeline_dir, f"p{pipe}_m{m}.json")
        engine.save_pipeline_timeline(path)
        from zerotrain.pipeline.timeline import load_timeline, write_svg

        write_svg(load_timeline(path), path[:-5] + ".svg")
    engine.destroy()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--micro-batches", default="1,4,8")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (seed 001: 16)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--timeline-dir", default="")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)
    from zerotrain.pipeline.timeline import ideal_bubble
    from zerotrain.testing import run_on_ranks

    print(
        f"BERT-like encoder: {args.layers} x TransformerEncoderLayer(hidden {args.hidden}, {args.heads} heads, "
        f"ffn {4 * args.hidden}), seq {args.seq}, vocab {args.vocab}; batch {args.batch} per step; "
        f"{args.steps} measured steps after {args.warmup}; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'P':>2} {'M':>2} {'schedule':>8} {'s/step':>8} {'samples/s':>9} {'ideal':>6}  measured idle share per stage"
    )
    rows = []
    for pipe in (int(p) for p in args.stages.split(",")):
        for m in (int(x) for x in args.micro_batches.split(",")):
            if args.batch % m:
                raise SystemExit(f"--batch {args.batch} is not a multiple of M={m}")
            results = run_on_ranks(_run, world_size=pipe, args=(args, pipe, m), timeout=1800, comm_timeout=300)
            first = next(r for r in results if r["stage"] == 0)
            # The step's time is the slowest stage's (train_batch returns when every stage is done).
            per_step = [max(r["times"][i] for r in results) for i in range(args.steps)]
            step = statistics.median(per_step)
            shares = [statistics.mean(s[i] for s in first["shares"]) for i in range(pipe)]
            row = {
                "P": pipe,
                "M": m,
                "schedule": "gpipe" if m < pipe else "1f1b",
                "s_per_step": step,
                "samples_per_s": args.batch / step,
                "ideal": ideal_bubble(pipe, m),
                "idle_share": shares,
                "busy_s": [statistics.mean(b[i] for b in first["busy"]) for i in range(pipe)],
                "load": os.getloadavg()[0],
            }
            rows.append(row)
            print(
                f"{pipe:>2} {m:>2} {row['schedule']:>8} {step:>8.3f} {row['samples_per_s']:>9.1f} "
                f"{row['ideal']:>6.1%}  " + " ".join(f"{s:.1%}" for s in shares),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
