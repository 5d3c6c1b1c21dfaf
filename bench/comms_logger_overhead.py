"""What the comms logger costs: GPT training steps with the logger off and on, 2 gloo ranks.

    python bench/comms_logger_overhead.py [--rounds 5] [--steps 10] [--preset small]

Both modes run in the same processes, alternating rounds (the logger is switched with
``zerotrain.comm.configure``), so machine noise hits both alike. Reports the median step time
of each mode, the overhead, the per-call cost of the timed wrapper itself, and what
the summary says: time waiting in collectives vs the sum of the (overlapping) op latencies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PRESETS = {
    "small": dict(vocab_size=2048, n_positions=128, n_embd=256, n_layer=4, n_head=4),  # ~4M params
    "tiny": dict(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2),
}


def _rank(preset: str, rounds: int, steps: int, micro: int, seq: int):
    import torch
    import torch.distributed as dist

    import zerotrain
    from zerotrain.comm import comms_logger
    from zerotrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**PRESETS[preset]))
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
    }
    engine, _, _, _ = zerotrain.initialize(model=model, config=cfg)
    vocab = PRESETS[preset]["vocab_size"]
    batch = torch.randint(0, vocab, (micro, seq), generator=torch.Generator().manual_seed(dist.get_rank()))

    def step():
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()

    for _ in range(3):
        step()
    times = {"off": [], "on": []}
    logged_wait = logged_wall = latency_sum = 0.0
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            zerotrain.comm.configure(enabled=mode == "on")
            comms_logger.reset()
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                times[mode].append(time.perf_counter() - t0)
            if mode == "on":
                s = comms_logger.summary()
                logged_wait += s["wait_ms"]
                logged_wall += s["wall_ms"]
                latency_sum += sum(row["total_latency_ms"] for sizes in s["ops"].values() for row in sizes.values())
    step_on_ms = statistics.median(times["on"]) * 1e3
    # per-call cost of the logger's hook itself, around a collective that does nothing
    from zerotrain.comm.hooks import Call

    zerotrain.comm.configure(enabled=True)
    noop = lambda *args: None  # noqa: E731
    t = torch.ones(1)
    best = {"bare": float("inf"), "wrapped": float("inf")}
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(20000):
            noop(t, None, None, False)
        best["bare"] = min(best["bare"], (time.perf_counter() - t0) / 20000 * 1e6)
        t0 = time.perf_counter()
        for _ in range(20000):
            comms_logger.run(Call("all_reduce", 4, None, 1, False), lambda: noop(t, None, None, False))
        best["wrapped"] = min(best["wrapped"], (time.perf_counter() - t0) / 20000 * 1e6)
    comms_logger.reset()
    zerotrain.comm.configure(enabled=False)
    return {
        "step_off_ms": statistics.median(times["off"]) * 1e3,
        "step_on_ms": step_on_ms,
        "wait_ms": logged_wait,
        "wall_ms": logged_wall,
        "latency_sum_ms": latency_sum,
        "wrapper_us": best["wrapped"] - best["bare"],
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    from zerotrain.testing import run_on_ranks

    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    results = run_on_ranks(_rank, 2, args=(args.preset, args.rounds, args.steps, args.micro, args.seq), timeout=1800)
    for rank, r in enumerate(results):
        overhead = 100 * (r["step_on_ms"] / r["step_off_ms"] - 1)
        print(
            f"rank {rank}: {r['params'] / 1e6:.1f}M params | step off {r['step_off_ms']:.1f} ms, "
            f"on {r['step_on_ms']:.1f} ms ({overhead:+.1f}%) | waiting in collectives "
            f"{100 * r['wait_ms'] / r['wall_ms']:.1f}% of wall; sum of op latencies "
            f"{100 * r['latency_sum_ms'] / r['wall_ms']:.1f}% of wall | wrapper {r['wrapper_us']:.2f} us per op"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
