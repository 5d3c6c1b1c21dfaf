"""Issue 33's per-step host breakdown for bench/gpt2_110m.py: from a cProfile of rank 0
(``BENCH_CPROFILE``), what each part of the library's host work costs a step."""

from __future__ import annotations

# Each part: the profiled functions it counts, as (file suffix, or "~" for built-ins; function name).
HOST_WORK = {
    "collectives": [
        ("zerotrain/comm/collectives.py", n)
        for n in ("all_gather_into", "reduce_scatter_into", "all_reduce", "broadcast")
    ]
    + [
        ("torch/distributed/distributed_c10d.py", n)
        for n in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
    ],
    "gloo sends+recvs": [
        ("~", "<built-in method torch._C._distributed_c10d.send>"),
        ("~", "<built-in method torch._C._distributed_c10d.recv>"),
    ],
    "waits": [
        ("~", "<built-in method torch._C._distributed_c10d.wait>"),
        ("~", "<method 'wait' of 'torch._C._distributed_c10d.Work' objects>"),
    ],
    "stage-3 hooks": [
        ("zerotrain/zero/stage3.py", n)
        for n in ("_pre_forward", "_post_forward", "_pre_backward", "_post_backward", "on_access")
    ],
    "gradient hooks": [
        ("zerotrain/zero/gradient_buckets.py", "_on_grad_ready"),
        ("zerotrain/zero/stage0.py", "_on_grad_ready"),
    ],
    "narrow/view": [
        ("~", "<method 'narrow' of 'torch._C.TensorBase' objects>"),
        ("~", "<method 'view' of 'torch._C.TensorBase' objects>"),
    ],
    "malloc_trim": [("zerotrain/memory_release.py", "release_freed_memory")],
}


def host_work(stats, steps: int) -> dict:
    """{part: (calls per step, own seconds per step, cumulative seconds per step)} of HOST_WORK."""
    out = {}
    for part, names in HOST_WORK.items():
        calls = own = cum = 0.0
        for (path, _, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
            if any(func == n and (path == f or path.endswith(f)) for f, n in names):
                calls, own, cum = calls + ncalls, own + tottime, cum + cumtime
        out[part] = (calls / steps, own / steps, cum / steps)
    return out


def describe_host_work(per_system: dict) -> None:
    """Print each profiled system's breakdown (systems without a profile are left out)."""
    profiled = {k: parts for k, parts in per_system.items() if parts}
    if not profiled:
        return
    print("\nhost work per step (BENCH_CPROFILE, rank 0; calls / own ms / cumulative ms):")
    for k, parts in profiled.items():
        print(
            f"  {k}: "
            + "; ".join(f"{part} {c:.0f} / {o * 1e3:.1f} / {cu * 1e3:.1f}" for part, (c, o, cu) in parts.items())
        )
