"""Measured costs of checkpoints (figures in docs/checkpoint.md).

    python bench/checkpoint_costs.py save          # step-time cost of sync/async saves
    python bench/checkpoint_costs.py consolidate   # peak RSS of `zerotrain consolidate`

``save``: a 2-rank ZeRO-2 bf16 GPT (~14M parameters) trains; timed: a plain step, a
``save_checkpoint`` call, and the blocking part of ``save_checkpoint(async_save=True)`` (the host
snapshot) with the background write it leaves (waited for at once).
``consolidate``: a ~124M-parameter GPT-2-shaped model is saved (bf16, fp32 masters) on 1 rank,
then ``zerotrain consolidate`` runs in a child process whose peak RSS is read from
``getrusage(RUSAGE_CHILDREN)``.
"""

from __future__ import annotations

import json
import resource  # noqa: F401 (used in the child's code)
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from zerotrain.testing import run_on_ranks


def _engine(model_kwargs: dict, stage: int, micro: int = 4):
    import zerotrain
    from zerotrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**model_kwargs))
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _step(engine, vocab: int, seq: int) -> None:
    batch = torch.randint(0, vocab, (engine.train_micro_batch_size_per_gpu(), seq))
    engine.backward(engine(batch, labels=batch).loss)
    engine.step()


def save_costs(folder: str) -> dict:
    model = dict(vocab_size=8192, n_positions=128, n_embd=384, n_layer=6, n_head=6)
    engine = _engine(model, stage=2)
    for _ in range(3):
        _step(engine, 8192, 128)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    plain = [timed(lambda: _step(engine, 8192, 128)) for _ in range(6)]
    sync = [timed(lambda: engine.save_checkpoint(folder)) for _ in range(5)]
    blocking, background = [], []
    for _ in range(5):
        _step(engine, 8192, 128)
        blocking.append(timed(lambda: engine.save_checkpoint(folder, async_save=True)))
        background.append(timed(engine.wait_for_checkpoint))  # the write, had training not overlapped it
    n = sum(p.numel() for p in engine.module.parameters())
    size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file() and "global_step" in str(f.parent))
    return {
        "params": n,
        "plain_step_s": statistics.median(plain),
        "sync_save_s": statistics.median(sync),
        "async_save_blocking_s": statistics.median(blocking),
        "async_background_write_s": statistics.median(background),
        "checkpoint_bytes_per_tag": size // len(list(Path(folder).glob("global_step*"))),
    }


def make_large(folder: str) -> dict:
    model = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    engine = _engine(model, stage=1, micro=1)
    engine.save_checkpoint(folder)
    n = sum(p.numel() for p in engine.module.parameters())
    largest = max(p.numel() for p in engine.module.parameters())
    return {"params": n, "largest_param": largest}


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "save"
    with tempfile.TemporaryDirectory() as tmp:
        if what == "save":
            print(json.dumps(run_on_ranks(save_costs, 2, args=(tmp,), timeout=900)[0], indent=1))
            return
        info = run_on_ranks(make_large, 1, args=(tmp,), timeout=900)[0]
        out = Path(tmp) / "out"
        for fmt in (["--safe_serialization"], []):
            start = time.perf_counter()
            # the child reports its own peak RSS after the CLI ran (RUSAGE_SELF: that process only)
            code = (
                "import resource, sys, zerotrain.launcher.cli as c; "
                f"rc = c.main(['consolidate', {tmp!r}, {str(out)!r}, '--max_shard_size', '200MB', *{fmt!r}]); "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"
            )
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(done.stdout + done.stderr)
            peak = int(done.stdout.strip().splitlines()[-1])
            baseline = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import resource, torch, zerotrain.launcher.cli; "
                    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            print(
                json.dumps(
                    {
                        **info,
                        "format": "torch.save" if not fmt else "safetensors",
                        "fp32_model_MiB": info["params"] * 4 / 2**20,
                        "shard_MiB": 200e6 / 2**20,
                        "peak_rss_MiB": peak / 1024,
                        "python_torch_baseline_MiB": int(baseline) / 1024,
                        "seconds": time.perf_counter() - start,
                    },
                    indent=1,
                )
            )


if __name__ == "__main__":
    main()
