"""One rank of the GPT benchmark workload, under `zerotrain launch` or `torchrun`.

    --mode ddp        torch DistributedDataParallel + torch.optim.AdamW (the baseline)
    --mode zerotrain  zerotrain.initialize with --stage N

Writes a JSON line per rank to --out: losses, per-step seconds, peak RSS, RSS after each step,
and seconds from the launcher's start (env BENCH_T0) to the end of the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import psutil
import torch
import torch.distributed as dist

from zerotrain.models import GPT, GPTConfig

PRESETS = {
    # ~17M parameters: the size the foundation issue measured DeepSpeed at.
    "gpt17m": dict(vocab_size=50257, n_positions=256, n_embd=256, n_layer=5, n_head=8),
    "tiny": dict(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2),
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "zerotrain"], required=True)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--preset", default="gpt17m", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def build(args, model):
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
           "zero_optimization": {"stage": args.stage}}
    if args.mode == "zerotrain":
        import zerotrain

        engine, _, _, _ = zerotrain.initialize(model=model, config=cfg)

        def train_step(batch):
            loss = engine(batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            return loss
        return train_step
    dist.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.0)

    def train_step(batch):
        loss = ddp(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return train_step


def main():
    args = parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PRESETS[args.preset]))
    train_step = build(args, model)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    vocab = PRESETS[args.preset]["vocab_size"]
    losses, times, rss = [], [], []
    first_step_at = None
    for _ in range(args.steps):
        batch = torch.randint(0, vocab, (args.micro, args.seq), generator=g)
        t = time.perf_counter()
        loss = train_step(batch)
        times.append(time.perf_counter() - t)
        if first_step_at is None:
            first_step_at = time.time() - float(os.environ.get("BENCH_T0", time.time()))
        losses.append(loss.item())
        rss.append(rss_mib())
    record = {"mode": args.mode, "stage": args.stage, "rank": rank, "world": world,
              "losses": losses, "step_s": times, "rss_mib": rss, "first_step_s": first_step_at,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "params": sum(p.numel() for p in model.parameters())}
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
