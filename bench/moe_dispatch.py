"""One MoE layer, forward + backward: zerotrain's dispatch by route indices against DeepSpeed
0.19.8's (and its pre-0.19 one-hot einsums), and zerotrain's dropless mode against capacity 1.25.

    python bench/moe_dispatch.py [--rounds 3] [--steps 10] [--warmup 2] [--tokens 4096] [--hidden 256]
        [--ffn 512] [--experts 8] [--k 2] [--capacity-factor 1.25] [--skew 0] [--ranks 2] [--ds-venv /tmp/dsvenv]

Every case is one launch of ``--ranks`` gloo processes (``torchrun --nproc_per_node R``,
``OMP_NUM_THREADS=1``), ``MoE(hidden, expert, num_experts, ep_size=R, k, capacity_factor, min_capacity=4)``
with the expert ``Linear(hidden, ffn) -> ReLU -> Linear(ffn, hidden)`` (``num_experts / R`` of them
per rank; ``--ranks 1`` is one process, ``ep_size`` 1: no all-to-all, the least noisy comparison),
``--tokens`` tokens of width ``--hidden`` per rank (standard normal; ``--skew s`` moves each by s
along expert 0's gate row so routing is imbalanced and the capacity drops routes), loss
``mean(out^2) + 0.01 l_aux``:

- ``ds_einsum``: DeepSpeed's layer with the one-hot einsum dispatch that DeepSpeed used before
  0.19 (reference/moe_pld.md 1.3): the gate's dense ``combine_weights[S,E,C]`` and
  ``dispatch_mask`` (DeepSpeed 0.19.8's own gate, ``sparse_routes=False``),
  ``einsum("sec,sm->ecm")`` in, DeepSpeed's all-to-all and experts, ``einsum("sec,ecm->sm")`` out
  (``_einsum_forward`` below, written here from that formula);
- ``ds_capacity``: DeepSpeed 0.19.8 as installed (``--ds-venv``, ``DS_ACCELERATOR=cpu``; zerotrain
  is not installed there, so this file imports only torch at module level), ``drop_tokens=True``.
  Note: 0.19.8's ``MOELayer`` no longer uses the einsums: it dispatches by route slots
  (``_sparse_encode``/``_sparse_decode``, an index gather), as zerotrain does;
- ``zt_capacity``: zerotrain, the same arguments (the same capacity-padded all-to-all);
- ``zt_dropless``: zerotrain, ``drop_tokens=False``: only routed tokens travel (uneven all-to-all).

A round launches every case once, in that order, so the machine's drift falls on every case
alike; ratios are taken within a round. Measured per launch: after ``--warmup`` steps and a
barrier, ``--steps`` forward+backward steps, a barrier; tokens/s = steps x tokens x R ranks / the
slowest rank's time; also the CPU time per step of the busiest rank (``time.process_time``: one
thread per process, so less sensitive than wall time to other processes taking the cores).
Peak memory: one more step (not timed) under a dispatch mode that adds up the
bytes of every tensor storage torch's operators allocate and frees them when the storage dies
(activations, dispatch buffers, gradients, communication buffers; not the weights or the input,
which exist before the step): the largest sum during the step, the largest over the ranks.
Also printed: the routes the capacity dropped (the dropless case drops none) and the loss.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = Path(__file__).resolve()
CASES = ("ds_einsum", "ds_capacity", "zt_capacity", "zt_dropless")


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by storages that operators allocated while the mode was on.
    An output sharing an input's storage (a view, an in-place op) is not a new allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.owned: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.owned.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self.owned:
                continue
            self.owned.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def _einsum_forward(layer, *input):
    """DeepSpeed's ``MOELayer.forward`` before 0.19 (no tensor parallelism, no Tutel): the dense
    gate output and the one-hot einsums, O(S * E * C) memory."""
    from deepspeed.moe.sharded_moe import _AllToAll

    d_model = input[0].shape[-1]
    x = input[0].reshape(-1, d_model)
    layer.l_aux, combine_weights, dispatch_mask, layer.exp_counts = layer.gate(x, input[1] if len(input) > 1 else None)
    dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(x), x)
    if layer.ep_size > 1:
        dispatched = _AllToAll.apply(layer.ep_group, dispatched)
    dispatched = dispatched.reshape(layer.ep_size, layer.num_local_experts, -1, d_model)
    expert_output = layer.experts(dispatched).reshape(layer.ep_size * layer.num_local_experts, -1, d_model)
    if layer.ep_size > 1:
        expert_output = _AllToAll.apply(layer.ep_group, expert_output)
    combined = torch.einsum("sec,ecm->sm", combine_weights.type_as(x), expert_output)
    return combined.reshape(input[0].shape)


def _worker(opts) -> None:
    import torch.distributed as dist

    lib, mode = opts.case.split("_")
    if lib == "ds":
        import deepspeed
        from deepspeed.moe.layer import MoE

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import zerotrain
        from zerotrain.moe.layer import MoE

        zerotrain.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])  # the launcher's; this bench has one group
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(opts.hidden, opts.ffn), nn.ReLU(), nn.Linear(opts.ffn, opts.hidden))
    moe = MoE(
        opts.hidden,
        expert,
        num_experts=opts.experts,
        ep_size=opts.ranks,
        k=opts.k,
        capacity_factor=opts.capacity_factor,
        eval_capacity_factor=opts.capacity_factor,
        min_capacity=4,
        drop_tokens=mode != "dropless",
    )
    moe.set_deepspeed_parallelism()
    if opts.case == "ds_einsum":
        moe.deepspeed_moe.forward = lambda *inp, **kw: _einsum_forward(moe.deepspeed_moe, *inp)
    x = torch.randn(opts.tokens, opts.hidden, generator=torch.Generator().manual_seed(100 + rank))
    if opts.skew:  # tokens leaning towards expert 0's gate row: the capacity drops routes
        row = moe.deepspeed_moe.gate.wg.weight[0].detach()
        x += opts.skew * row / row.norm()
    x.requires_grad_(True)
    # the capacity each expert gets with drops (top-2 and top-k: k x capacity_factor)
    factor = opts.capacity_factor * (opts.k if opts.k > 1 else 1)
    capacity = max(-(-opts.tokens * factor // opts.experts), 4)
    record = {}

    def step() -> None:
        out, l_aux, counts = moe(x)
        loss = out.square().mean() + 0.01 * l_aux
        loss.backward()
        moe.zero_grad(set_to_none=True)
        x.grad = None
        record["loss"] = float(loss.detach())
        kept = counts.clamp(max=capacity) if mode != "dropless" else counts
        record["dropped"] = float(1 - kept.sum() / counts.sum())

    for _ in range(opts.warmup):
        step()
    dist.barrier()
    began, cpu_began = time.perf_counter(), time.process_time()
    for _ in range(opts.steps):
        step()
    cpu = torch.tensor(time.process_time() - cpu_began)
    dist.barrier()
    took = torch.tensor(time.perf_counter() - began)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    tracker = LiveBytes()
    with tracker:
        step()
    numbers = torch.tensor([float(tracker.peak), record["dropped"], record["loss"]], dtype=torch.float64)
    every = [torch.zeros_like(numbers) for _ in range(opts.ranks)]
    dist.all_gather(every, numbers)
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "tokens_per_s": opts.steps * opts.tokens * opts.ranks / float(took),
                    "cpu_ms_per_step": 1000 * float(cpu) / opts.steps,
                    "peak_mib": max(float(e[0]) for e in every) / 2**20,
                    "dropped": statistics.mean(float(e[1]) for e in every),
                    "loss": [float(e[2]) for e in every],
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(case: str, opts, passthrough: list) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if case.startswith("ds"):
        env["DS_ACCELERATOR"] = "cpu"
        torchrun = [os.path.join(opts.ds_venv, "bin", "torchrun")]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
    cmd = torchrun + [
        "--nproc_per_node",
        str(opts.ranks),
        "--master_port",
        str(_port()),
        str(HERE),
        "--worker",
        "--case",
        case,
        *passthrough,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{case} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="shift every token by this much along expert 0's gate row (imbalanced routing)",
    )
    parser.add_argument(
        "--ranks", type=int, default=2, choices=(1, 2), help="processes per launch, also the ep_size (1: no all-to-all)"
    )
    parser.add_argument("--ds-venv", default="/tmp/dsvenv")
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        _worker(opts)
        return
    cases = [c for c in opts.only.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"--only: unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    passthrough = [
        f"--{name.replace('_', '-')}={getattr(opts, name)}"
        for name in ("steps", "warmup", "tokens", "hidden", "ffn", "experts", "k", "capacity_factor", "skew", "ranks")
    ]
    print(f"load average before: {os.getloadavg()}", flush=True)
    results = {case: [] for case in cases}
    for r in range(opts.rounds):
        for case in cases:
            results[case].append(_launch(case, opts, passthrough))
            res = results[case][-1]
            print(
                f"round {r} {case}: {res['tokens_per_s']:.0f} tokens/s, {res['cpu_ms_per_step']:.1f} CPU ms/step, "
                f"peak {res['peak_mib']:.1f} MiB, dropped {100 * res['dropped']:.1f}%, loss {res['loss']}",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()}")
    print("\n| case | tokens/s (median of rounds) | CPU ms/step (median) | peak MiB (per rank, max) | routes dropped |")
    print("|---|---|---|---|---|")
    for case, runs in results.items():
        print(
            f"| {case} | {statistics.median(x['tokens_per_s'] for x in runs):.0f} | "
            f"{statistics.median(x['cpu_ms_per_step'] for x in runs):.1f} | "
            f"{statistics.median(x['peak_mib'] for x in runs):.1f} | {100 * runs[0]['dropped']:.1f}% |"
        )
    pairs = [
        ("zt_capacity", "ds_einsum"),
        ("zt_capacity", "ds_capacity"),
        ("zt_dropless", "zt_capacity"),
        ("ds_capacity", "ds_einsum"),
    ]
    print("\n| ratio | tokens/s (median of per-round ratios) | CPU time per step | peak memory |")
    print("|---|---|---|---|")
    for a, b in pairs:
        if a in results and b in results:
            speed = statistics.median(x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(results[a], results[b]))
            cpu = statistics.median(x["cpu_ms_per_step"] / y["cpu_ms_per_step"] for x, y in zip(results[a], results[b]))
            memory = statistics.median(x["peak_mib"] / y["peak_mib"] for x, y in zip(results[a], results[b]))
            print(f"| {a} / {b} | {speed:.2f}x | {cpu:.2f}x | {memory:.2f}x |")


if __name__ == "__main__":
    main()
