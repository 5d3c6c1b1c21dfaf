"""Run a function on N local gloo ranks and collect what each returns.

Used by zerotrain's own tests and benchmarks, and usable for testing user code::

    def check(scale):
        from zerotrain import comm
        comm.init_distributed()
        t = torch.ones(1) * scale
        comm.all_reduce(t)
        return t.item()

    assert run_on_ranks(check, world_size=2, args=(3,)) == [6.0, 6.0]

``fn`` must be picklable (defined at module level). Each rank runs in a fresh process
with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set, one intra-op thread, and a short
collective timeout, so a bug fails instead of hanging. An exception on any rank is re-raised
here with that rank's traceback; the other ranks are then stopped.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any

from zerotrain.comm.distributed import free_port


class RankFailed(RuntimeError):
    """A rank raised or died; the message names the rank and carries its traceback."""


def _rank_main(fn, rank, world_size, port, args, kwargs, env, results):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        value = fn(*args, **kwargs)
        # Plain pickle bytes: torch's queue reducers would share tensors through file
        # descriptors that vanish when this process exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including SystemExit from user code
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _context():
    """Ranks start from a fork server that has already imported torch and zerotrain, so each
    rank starts in milliseconds instead of re-importing torch. The server never runs torch ops
    (no thread pools exist when it forks), which keeps forking safe. ``torch._dynamo`` too: the
    first optimizer a rank builds imports it (~1 CPU-s a rank); importing it starts no thread."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zerotrain.engine", "zerotrain.zero"])
    return ctx


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 180.0,
    comm_timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results ordered by rank."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    rank_env = {"OMP_NUM_THREADS": "1", "ZEROTRAIN_COMM_TIMEOUT": str(comm_timeout)}
    rank_env.update(env or {})
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, r, world_size, port, args, kwargs or {}, rank_env, results), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)


def _collect(procs, results, world_size, timeout) -> list[Any]:
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    while len(out) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and p.exitcode not in (0, None)]
            if dead:
                r = dead[0]
                raise RankFailed(f"rank {r} died with exit code {procs[r].exitcode}") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f} s") from None
            continue
        if not ok:
            raise RankFailed(f"rank {rank} raised:\n{value}")
        out[rank] = pickle.loads(value)
    return [out[r] for r in range(world_size)]
