"""zerotrain.comm.collectives: gloo's forms (send/recv, and the in-place all-reduce kept behind
``ZEROTRAIN_GLOO_COLLECTIVES=all_reduce``) give exactly the results of the collectives they stand
for, with the shard aliased into the buffer or separate, sync or async, on 2 and 4 ranks and in
a subgroup."""

from __future__ import annotations

import pytest
import torch

from zerotrain.testing import run_on_ranks


def _cases(group=None):
    import torch.distributed as dist

    from zerotrain.comm import collectives

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = 5
    out = {}
    # all-gather from a separate shard, into a buffer holding garbage
    shard = torch.arange(n, dtype=torch.float32) + 100 * rank
    full = torch.full((n * world,), float("nan"))
    collectives.all_gather_into(full, shard, group=group)
    out["gather_separate"] = full.clone()
    # all-gather with the shard aliased to this rank's slice, async, two in flight at once
    fulls = [torch.full((n * world,), -7.0) for _ in range(2)]
    works = []
    for k, f in enumerate(fulls):
        f.narrow(0, rank * n, n).copy_(torch.arange(n, dtype=torch.float32) + 100 * rank + k)
        works.append(collectives.all_gather_into(f, f.narrow(0, rank * n, n), group=group, async_op=True))
    for w in reversed(works):
        w.wait()
    out["gather_aliased"] = fulls[0].clone()
    out["gather_aliased_2"] = fulls[1].clone()
    # reduce-scatter into a separate output: async, the sum happens at wait()
    flat = torch.arange(n * world, dtype=torch.float32) * (rank + 1)
    target = torch.zeros(n)
    work = collectives.reduce_scatter_into(target, flat, group=group, async_op=True)
    work.wait()
    out["scatter_separate"] = target.clone()
    # reduce-scatter into this rank's slice of the input, sync, with caller-given scratch
    flat = torch.arange(n * world, dtype=torch.float32) * (rank + 1)
    mine = flat.narrow(0, rank * n, n)
    rows = collectives.reduce_scatter_scratch_rows(group)
    scratch = torch.full((max(rows, 1) * n,), float("nan"))
    collectives.reduce_scatter_into(mine, flat, group=group, scratch=scratch)
    out["scatter_aliased"] = mine.clone()
    out["scratch_rows"] = rows
    out["rank"], out["world"] = rank, world
    return out


def _collectives(form):
    import os

    import torch.distributed as dist

    from zerotrain.comm.distributed import init_distributed

    os.environ["ZEROTRAIN_GLOO_COLLECTIVES"] = form
    init_distributed()
    out = {"world": _cases()}
    # a subgroup of the odd ranks (group ranks differ from global ranks)
    odd = dist.new_group([r for r in range(dist.get_world_size()) if r % 2 == 1])
    if dist.get_rank() % 2 == 1:
        out["odd"] = _cases(odd)
    return out


def _check(r, form):
    world, rank, n = r["world"], r["rank"], 5
    gathered = torch.cat([torch.arange(n, dtype=torch.float32) + 100 * q for q in range(world)])
    assert torch.equal(r["gather_separate"], gathered)
    assert torch.equal(r["gather_aliased"], gathered)
    assert torch.equal(r["gather_aliased_2"], gathered + 1)
    total = torch.arange(n * world, dtype=torch.float32) * sum(q + 1 for q in range(world))
    expected = total.narrow(0, rank * n, n)
    assert torch.equal(r["scatter_separate"], expected)
    assert torch.equal(r["scatter_aliased"], expected)
    assert r["scratch_rows"] == (world - 1 if form == "send_recv" else 0)


@pytest.mark.parametrize("form", ["send_recv", "all_reduce"])
def test_gloo_collectives_match_their_definitions(form):
    for r in run_on_ranks(_collectives, 4, args=(form,)):
        _check(r["world"], form)
        if "odd" in r:
            _check(r["odd"], form)


def test_unknown_gloo_form_is_refused(monkeypatch):
    from zerotrain.comm import collectives

    monkeypatch.setenv("ZEROTRAIN_GLOO_COLLECTIVES", "ring")
    with pytest.raises(ValueError, match="ZEROTRAIN_GLOO_COLLECTIVES"):
        collectives.gloo_form()
