"""zerotrain.comm.collectives: the gloo in-place forms give exactly the results of the
collectives they stand for, with the shard aliased into the buffer or separate, sync or async."""

from __future__ import annotations

import torch

from zerotrain.testing import run_on_ranks


def _collectives():
    import torch.distributed as dist

    from zerotrain.comm import collectives
    from zerotrain.comm.distributed import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 5
    out = {}
    # all-gather from a separate shard, into a buffer holding garbage
    shard = torch.arange(n, dtype=torch.float32) + 100 * rank
    full = torch.full((n * world,), float("nan"))
    collectives.all_gather_into(full, shard)
    out["gather_separate"] = full.clone()
    # all-gather with the shard aliased to this rank's slice, async
    full = torch.full((n * world,), -7.0)
    mine = full.narrow(0, rank * n, n)
    mine.copy_(torch.arange(n, dtype=torch.float32) + 100 * rank)
    collectives.all_gather_into(full, mine, async_op=True).wait()
    out["gather_aliased"] = full.clone()
    # reduce-scatter into a separate output: async, the copy happens at wait()
    flat = torch.arange(n * world, dtype=torch.float32) * (rank + 1)
    target = torch.zeros(n)
    work = collectives.reduce_scatter_into(target, flat, async_op=True)
    work.wait()
    out["scatter_separate"] = target.clone()
    # reduce-scatter into this rank's slice of the input, sync
    flat = torch.arange(n * world, dtype=torch.float32) * (rank + 1)
    mine = flat.narrow(0, rank * n, n)
    collectives.reduce_scatter_into(mine, flat)
    out["scatter_aliased"] = mine.clone()
    out["rank"], out["world"] = rank, world
    return out


def test_gloo_in_place_collectives_match_their_definitions():
    for r in run_on_ranks(_collectives, 4):
        world, rank, n = r["world"], r["rank"], 5
        gathered = torch.cat([torch.arange(n, dtype=torch.float32) + 100 * q for q in range(world)])
        assert torch.equal(r["gather_separate"], gathered)
        assert torch.equal(r["gather_aliased"], gathered)
        total = torch.arange(n * world, dtype=torch.float32) * sum(q + 1 for q in range(world))
        expected = total.narrow(0, rank * n, n)
        assert torch.equal(r["scatter_separate"], expected)
        assert torch.equal(r["scatter_aliased"], expected)
