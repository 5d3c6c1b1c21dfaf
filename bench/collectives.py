"""Which gloo primitive to use for ZeRO's all-gather and reduce-scatter: time and memory.

    python bench/collectives.py [--world 2] [--mib 25,100] [--reps 7]

For each buffer size, in the same processes and interleaved (order rotated every round), times
the ways to all-gather a flat fp32 buffer from 1/N shards and to reduce-scatter it:

- ``all_gather`` into a list of views of the output, ``all_gather_into_tensor``;
- in place: this rank's shard already in its slice, the others zeroed, ``all_reduce`` (sum);
- ``reduce_scatter`` of a list of views, ``reduce_scatter_tensor``;
- in place: ``all_reduce`` of the buffer, keep this rank's slice;
- zerotrain's gloo forms (``zerotrain.comm.collectives``): ``isend``/``irecv`` of each shard
  straight into the output, and of each peer's rows, summed into this rank's slice.

Memory: each op's peak RSS growth over the RSS before it (VmHWM reset with /proc/self/clear_refs),
i.e. the temporaries the backend allocates per call. Reports medians over ``--reps`` rounds
(the slowest rank's time per round); ratios are to the in-place all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rank(sizes_mib: list[int], reps: int):
    import torch
    import torch.distributed as dist

    from zerotrain.comm import collectives
    from zerotrain.comm.distributed import init_distributed
    from zerotrain.memory_release import configure_allocator

    os.environ["ZEROTRAIN_GLOO_COLLECTIVES"] = "send_recv"
    init_distributed()
    configure_allocator()  # what a zerotrain process runs with
    world, rank = dist.get_world_size(), dist.get_rank()
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    results = {}
    for mib in sizes_mib:
        numel = mib * 2**20 // 4 // world * world
        n = numel // world
        out = torch.randn(numel)
        shard = torch.randn(n)
        flat = torch.randn(numel)
        rows = lambda t: list(t.view(world, -1).unbind(0))  # noqa: E731

        def ag_list():
            dist.all_gather(rows(out), shard)

        def ag_tensor():
            all_gather_single(out, shard)

        def ag_in_place():
            out.narrow(0, rank * n, n).copy_(shard)
            out.narrow(0, 0, rank * n).zero_()
            out.narrow(0, (rank + 1) * n, numel - (rank + 1) * n).zero_()
            dist.all_reduce(out)

        def rs_list():
            dist.reduce_scatter(shard, rows(flat))

        def rs_tensor():
            reduce_scatter_single(shard, flat)

        def rs_in_place():
            dist.all_reduce(flat)
            shard.copy_(flat.narrow(0, rank * n, n))

        scratch = torch.empty(n * collectives.reduce_scatter_scratch_rows())

        def ag_p2p():  # zerotrain's gloo form
            collectives.all_gather_into(out, shard)

        def rs_p2p():
            collectives.reduce_scatter_into(shard, flat, scratch=scratch)

        ops = {
            "all_gather (list)": ag_list,
            "all_gather_into_tensor": ag_tensor,
            "all-gather as in-place all_reduce": ag_in_place,
            "reduce_scatter (list)": rs_list,
            "reduce_scatter_tensor": rs_tensor,
            "reduce-scatter as in-place all_reduce": rs_in_place,
            "all-gather by send/recv": ag_p2p,
            "reduce-scatter by send/recv": rs_p2p,
        }
        times = {k: [] for k in ops}
        growth = {k: [] for k in ops}
        names = list(ops)
        for r in range(reps + 1):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                dist.barrier()
                before = _status_kib("VmRSS")
                _reset_peak()
                t0 = time.perf_counter()
                ops[name]()
                elapsed = time.perf_counter() - t0
                peak = _status_kib("VmHWM")
                slowest = torch.tensor([elapsed])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if r:  # round 0 warms up gloo's buffers
                    times[name].append(slowest.item())
                    growth[name].append((peak - before) / 1024)
        results[mib] = {k: {"ms": 1e3 * statistics.median(times[k]), "rss_growth_mib": max(growth[k])} for k in ops}
    dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mib", default="25,100", help="buffer sizes in MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    from zerotrain.testing import run_on_ranks

    sizes = [int(s) for s in args.mib.split(",")]
    res = run_on_ranks(_rank, args.world, args=(sizes, args.reps), timeout=1800, env={"OMP_NUM_THREADS": "1"})[0]
    print(
        f"gloo, {args.world} ranks, median of {args.reps} rounds (slowest rank), "
        "peak RSS growth per call (max over rounds, rank 0)"
    )
    for mib, ops in res.items():
        print(f"\n{mib} MiB fp32 buffer\n")
        print("| op | ms | / in-place all_reduce | RSS growth MiB |")
        print("|---|---|---|---|")
        for name, r in ops.items():
            base = ops[
                "all-gather as in-place all_reduce" if "gather" in name else "reduce-scatter as in-place all_reduce"
            ]["ms"]
            print(f"| {name} | {r['ms']:.1f} | {r['ms'] / base:.2f} | {r['rss_growth_mib']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
