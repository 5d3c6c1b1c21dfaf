"""One rank of the GPT benchmark workload, under `zerotrain launch` or `torchrun`.

    --mode ddp              torch DistributedDataParallel + torch.optim.AdamW (the baseline;
                            --fused: AdamW(fused=True), the kernel zerotrain picks on CPU)
    --mode zero_redundancy  torch ZeroRedundancyOptimizer(AdamW) + DistributedDataParallel
    --mode zerotrain        zerotrain.initialize with --stage N
    --mode deepspeed        deepspeed.initialize with --stage N (DeepSpeed must be importable;
                            run with DS_ACCELERATOR=cpu under torchrun)

Every mode trains the same model from the same initial weights (torch.manual_seed(0)) on the
same token batches (one seeded generator per rank), with AdamW lr 1e-4, weight decay 0, no
gradient clipping, fp32 — so the step-1 loss is identical everywhere and later losses agree to
rounding.

Appends one JSON line per rank to --out: losses, per-step seconds (and forward / backward /
optimizer-step split), peak RSS (ru_maxrss), RSS after each phase of start-up and after each
step, seconds from the launcher's start (env BENCH_T0) to the end of the first step, and for
zerotrain its ``engine.memory_breakdown()``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

from rss_sampler import RssSampler, mallinfo_mib, rss_mib

RSS_AT: dict[str, float] = {}
T_AT: dict[str, float] = {}  # seconds since the launcher started (env BENCH_T0)


def since_launch() -> float:
    return time.time() - float(os.environ.get("BENCH_T0", time.time()))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


RSS_AT["python"] = rss_mib()
T_AT["python"] = since_launch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from zerotrain.models import GPT, GPTConfig  # noqa: E402

RSS_AT["torch"] = rss_mib()
T_AT["torch"] = since_launch()

PRESETS = {
    # ~17M parameters: the size the foundation issue measured DeepSpeed at.
    "gpt17m": dict(vocab_size=50257, n_positions=256, n_embd=256, n_layer=5, n_head=8),
    "tiny": dict(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2),
}
MODES = ["ddp", "zero_redundancy", "zerotrain", "deepspeed"]
LR, WEIGHT_DECAY = 1e-4, 0.0


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=MODES)
    p.add_argument(
        "--interleave",
        default=None,
        metavar="KEY:MODE:STAGE:fused|plain,...",
        help="run these systems side by side in these processes (step time only)",
    )
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--preset", default="gpt17m", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--fused",
        action="store_true",
        help="ddp / zero_redundancy: torch.optim.AdamW(fused=True) instead of the default",
    )
    p.add_argument(
        "--rss-sample-ms",
        type=float,
        default=0.0,
        help="sample RSS in a thread every N ms and record the peak per phase "
        "(diagnosis only: the sampling thread perturbs step times)",
    )
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def ds_config(args, stage: int) -> dict:
    """The one config both zerotrain and DeepSpeed get (DeepSpeed 0.19.8 semantics)."""
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }


class Step:
    """forward / backward / optimizer step of one system, timed separately."""

    def __init__(self, forward, backward, update, extra=None):
        self.forward, self.backward, self.update = forward, backward, update
        self.extra = extra or (lambda: {})


def build(args, model, mode: str, stage: int, fused: bool) -> Step:
    if mode in ("zerotrain", "deepspeed"):
        if mode == "zerotrain":
            import zerotrain as lib
        else:
            import deepspeed as lib
        engine, _, _, _ = lib.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(args, stage)
        )

        def extra():
            if mode == "zerotrain":
                return {"memory_breakdown": engine.memory_breakdown()}
            return {}

        return Step(lambda b: engine(b, labels=b).loss, engine.backward, engine.step, extra)

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    kernel = {"fused": True} if fused else {}
    if mode == "ddp":
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **kernel)
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, **kernel
        )

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Step(lambda b: ddp(b, labels=b).loss, lambda loss: loss.backward(), update)


def interleave(args) -> None:
    """Every system of --interleave in the same two processes, one step each in turn.

    Step-time comparison under identical background load: each system trains its own copy of
    the model (same init, same batches); the order rotates every round, and the ranks meet at
    a barrier (outside the timed region) before each step. Memory is not measured here (all the
    systems share one process): run one system per launch for that."""
    specs = [spec.split(":") for spec in args.interleave.split(",")]
    systems = {}
    for key, mode, stage, fused in specs:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**PRESETS[args.preset]))
        systems[key] = build(args, model, mode, int(stage), fused == "fused")
    rank = dist.get_rank()
    vocab = PRESETS[args.preset]["vocab_size"]
    gens = {k: torch.Generator().manual_seed(100 + rank) for k in systems}
    out = {k: {"losses": [], "step_s": [], "cpu_s": [], "phase_s": []} for k in systems}
    keys = list(systems)
    for i in range(args.steps):
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
            step, rec = systems[key], out[key]
            batch = torch.randint(0, vocab, (args.micro, args.seq), generator=gens[key])
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            loss = step.forward(batch)
            t1 = time.perf_counter()
            step.backward(loss)
            t2 = time.perf_counter()
            step.update()
            t3, c3 = time.perf_counter(), time.process_time()
            rec["step_s"].append(t3 - t0)
            rec["cpu_s"].append(c3 - c0)
            rec["phase_s"].append([t1 - t0, t2 - t1, t3 - t2])
            rec["losses"].append(loss.item())
    with open(args.out, "a") as f:
        f.write(
            json.dumps(
                {"mode": "interleave", "rank": rank, "world": dist.get_world_size(), "order": keys, "systems": out}
            )
            + "\n"
        )
    dist.barrier()
    dist.destroy_process_group()


def main():
    args = parse_args()
    if args.interleave:
        return interleave(args)
    sampler = RssSampler(args.rss_sample_ms / 1000) if args.rss_sample_ms > 0 else None
    mark = sampler.phase if sampler else (lambda label: None)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PRESETS[args.preset]))
    n_params = sum(p.numel() for p in model.parameters())
    RSS_AT["model"] = rss_mib()
    T_AT["model"] = since_launch()
    mark("initialize")
    step = build(args, model, args.mode, args.stage, args.fused)
    RSS_AT["initialized"] = rss_mib()
    T_AT["initialized"] = since_launch()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    vocab = PRESETS[args.preset]["vocab_size"]
    losses, times, phases, rss, heap = [], [], [], [], []
    first_step_at = None
    for i in range(args.steps):
        batch = torch.randint(0, vocab, (args.micro, args.seq), generator=g)
        t0 = time.perf_counter()
        mark(f"{i + 1}:forward")
        loss = step.forward(batch)
        t1 = time.perf_counter()
        mark(f"{i + 1}:backward")
        step.backward(loss)
        t2 = time.perf_counter()
        mark(f"{i + 1}:update")
        step.update()
        t3 = time.perf_counter()
        mark(f"{i + 1}:between")
        times.append(t3 - t0)
        phases.append([t1 - t0, t2 - t1, t3 - t2])
        if first_step_at is None:
            first_step_at = since_launch()
        losses.append(loss.item())
        rss.append(rss_mib())
        heap.append(mallinfo_mib())
    record = {
        "mode": args.mode,
        "stage": args.stage,
        "fused": args.fused,
        "rank": rank,
        "world": world,
        "preset": args.preset,
        "micro": args.micro,
        "seq": args.seq,
        "torch": torch.__version__,
        "losses": losses,
        "step_s": times,
        "phase_s": phases,
        "rss_mib": rss,
        "rss_at_mib": RSS_AT,
        "malloc_mib": heap,
        "rss_peak_by_phase_mib": sampler.stop() if sampler else None,
        "first_step_s": first_step_at,
        "t_at_s": T_AT,
        "peak_rss_mib": peak_rss_mib(),
        "params": n_params,
        **step.extra(),
    }
    if args.mode == "deepspeed":
        import deepspeed

        record["deepspeed"] = deepspeed.__version__
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
