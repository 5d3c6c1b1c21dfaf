"""torch's Adam kernels on this machine's CPU: which one zerotrain's FusedAdam should pick.

    OMP_NUM_THREADS=1 python bench/adam_kernels.py [--numel 20e6] [--tensors 40] [--reps 15]

Times one ``torch.optim.AdamW`` step over ``--numel`` fp32 parameters split into ``--tensors``
tensors (a small transformer's shapes) with ``fused=True``, ``foreach=True`` and the per-tensor
loop (``foreach=False``), interleaved, after two warm-up steps; then zerotrain's ``FusedAdam``
(what it picks) and its ``bias_correction=False`` path. Prints the median ms per step and the
parameter bytes processed per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zerotrain.ops.adam import FusedAdam


def _params(numel: int, tensors: int) -> list[torch.Tensor]:
    each = numel // tensors
    out = []
    for _ in range(tensors):
        p = torch.randn(each, requires_grad=True)
        p.grad = torch.randn(each)
        out.append(p)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=20e6)
    parser.add_argument("--tensors", type=int, default=40)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    numel = int(args.numel)
    makers = {
        "torch fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "torch for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
        "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3),
        "FusedAdam bias_correction=False": lambda ps: FusedAdam(ps, lr=1e-3, bias_correction=False),
    }
    optimizers = {name: make(_params(numel, args.tensors)) for name, make in makers.items()}
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for rep in range(args.reps + 2):
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            if rep >= 2:
                times[name].append(time.perf_counter() - start)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {numel / 1e6:.0f}M fp32 "
        f"params in {args.tensors} tensors, median of {args.reps} steps"
    )
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"  {name:34s} {ms:8.1f} ms/step  {numel * 4 / (ms / 1e3) / 1e9:6.2f} GB/s of params")


if __name__ == "__main__":
    main()
