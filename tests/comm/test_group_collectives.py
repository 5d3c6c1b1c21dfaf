"""``Collectives``, one object per process group: its sequence numbers and hooks are the group's,
a codec installed on it is applied (exact bf16-rounded results, payload bytes), and the comms
logger sees the experts' all-to-alls (counted, with their bytes, for a capacity-padded and a
dropless MoE layer's forward and backward). One spawned group of 2 ranks runs every check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.comm.codec import CastCodec
from zerotrain.testing import run_on_ranks

HIDDEN, EXPERTS, TOKENS = 6, 4, 8


class _CountingBf16(CastCodec):
    """bf16 on the wire, counting its calls."""

    def __init__(self):
        super().__init__(torch.bfloat16)
        self.encoded = self.decoded = 0

    def encode(self, values):
        self.encoded += 1
        return super().encode(values)

    def decode(self, payload, out):
        self.decoded += 1
        super().decode(payload, out)


def _values(rank: int, n: int) -> torch.Tensor:
    """fp32 values bf16 does not hold exactly."""
    return torch.arange(n, dtype=torch.float32) / 3 + 1.0 / 7 + 10 * rank


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _objects_and_hooks(out: dict) -> None:
    import torch.distributed as dist

    from zerotrain import comm
    from zerotrain.comm import ByteCounter, Collectives
    from zerotrain.comm.collectives import last_seq

    pair = dist.new_group([0, 1])
    out["one_object"] = (
        Collectives.of(pair) is Collectives.of(pair)
        and Collectives.of(None) is Collectives.of(dist.GroupMember.WORLD)
        and Collectives.of(pair) is not Collectives.of(None)
    )
    world_seq, pair_seq = last_seq(None), last_seq(pair)
    comm.all_reduce(torch.ones(2), group=pair)
    comm.barrier(pair)
    out["seq_steps"] = (last_seq(None) - world_seq, last_seq(pair) - pair_seq)

    counter = ByteCounter()
    Collectives.of(pair).add_hook(counter)
    summed = torch.ones(5)
    comm.all_reduce(summed, group=pair)
    comm.all_reduce(torch.ones(5))  # the world's object: not this group's hook
    comm.all_gather_into(torch.empty(8), torch.ones(4), group=pair)
    comm.reduce_scatter_into(torch.empty(3), torch.ones(6), group=pair, async_op=True).wait()
    Collectives.of(pair).remove_hook(counter)
    comm.all_reduce(torch.ones(5), group=pair)
    out["counted"] = counter.counts
    out["summed"] = summed.tolist()


def _codec(out: dict, form: str) -> None:
    import os

    import torch.distributed as dist

    from zerotrain import comm
    from zerotrain.comm import ByteCounter, Collectives

    os.environ["ZEROTRAIN_GLOO_COLLECTIVES"] = form
    rank, world, n = dist.get_rank(), dist.get_world_size(), 5
    world_comm = Collectives.of(None)
    codec, counter = _CountingBf16(), ByteCounter()
    world_comm.codec = codec
    world_comm.add_hook(counter)
    try:
        gathered = torch.full((world * n,), float("nan"))
        comm.all_gather_into(gathered, _values(rank, n))
        aliased = torch.full((world * n,), float("nan"))
        aliased.narrow(0, rank * n, n).copy_(_values(rank, n) + 1)
        comm.all_gather_into(aliased, aliased.narrow(0, rank * n, n), async_op=True).wait()
        scattered = torch.empty(n)
        flat = torch.cat([_values(rank, n) * (q + 2) for q in range(world)])
        comm.reduce_scatter_into(scattered, flat, async_op=True).wait()
    finally:
        world_comm.codec = None
        world_comm.remove_hook(counter)
    plain = torch.empty(world * n)
    comm.all_gather_into(plain, _values(rank, n))
    expected_scatter = torch.zeros(n)
    for q in range(world):
        expected_scatter = expected_scatter + _bf16(_values(q, n) * (rank + 2))
    out[form] = {
        "gather": torch.equal(gathered, torch.cat([_bf16(_values(q, n)) for q in range(world)])),
        "aliased": torch.equal(aliased, torch.cat([_bf16(_values(q, n) + 1) for q in range(world)])),
        "scatter": torch.equal(scattered, expected_scatter),
        "plain_is_exact": torch.equal(plain, torch.cat([_values(q, n) for q in range(world)])),
        "calls": (codec.encoded, codec.decoded),
        "bytes": {op: counter.bytes(op) for op in counter.counts},
    }


def _moe_all_to_alls(out: dict) -> None:
    import torch.distributed as dist

    from zerotrain import comm
    from zerotrain.comm import comms_logger
    from zerotrain.comm.collectives import last_seq
    from zerotrain.experts.layer import MoE

    rank = dist.get_rank()
    for drop_tokens in (True, False):
        torch.manual_seed(0)
        moe = MoE(
            HIDDEN,
            nn.Sequential(nn.Linear(HIDDEN, 10), nn.ReLU(), nn.Linear(10, HIDDEN)),
            num_experts=EXPERTS,
            ep_size=2,
            k=2,
            min_capacity=0,
            capacity_factor=1.0,
            drop_tokens=drop_tokens,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        moe.set_deepspeed_parallelism()
        group = moe.deepspeed_moe.ep_group
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
        comm.configure(enabled=True, prof_all=True)
        comms_logger.reset()
        seq = last_seq(group)
        try:
            y, l_aux, _ = moe(x)
            (y.square().sum() + l_aux).backward()
        finally:
            comm.configure(enabled=False)
        ops = comms_logger.summary()["ops"]
        out["dropless" if not drop_tokens else "capacity"] = {
            "all_to_all": {size: row["count"] for size, row in ops.get("all_to_all_single", {}).items()},
            "all_gather": {size: row["count"] for size, row in ops.get("all_gather_into_tensor", {}).items()},
            "other_ops": sorted(set(ops) - {"all_to_all_single", "all_gather_into_tensor"}),
            "capacity": moe.deepspeed_moe.capacity,
            "seq_steps": last_seq(group) - seq,
            "x_grad": x.grad is not None and bool(x.grad.abs().sum() > 0),
        }


def _checks():
    from zerotrain.comm.distributed import init_distributed

    init_distributed()
    out: dict = {}
    _objects_and_hooks(out)
    for form in ("send_recv", "all_reduce"):
        _codec(out, form)
    _moe_all_to_alls(out)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_checks, 2)


def test_one_object_per_group_with_its_own_numbers_and_hooks(ranks):
    for out in ranks:
        assert out["one_object"]
        assert out["seq_steps"] == (0, 2)
        # the pair's hook saw the pair's three collectives, each with its whole buffer's bytes
        assert out["counted"] == {
            "all_reduce": [1, 20],
            "all_gather_into_tensor": [1, 32],
            "reduce_scatter_tensor": [1, 24],
        }
        assert out["summed"] == [2.0] * 5


@pytest.mark.parametrize("form", ["send_recv", "all_reduce"])
def test_a_codec_on_a_groups_object_is_applied(ranks, form):
    for out in ranks:
        got = out[form]
        assert got["gather"] and got["aliased"] and got["scatter"], got
        assert got["plain_is_exact"]  # codec removed: values travel as they are again
        # each gather encodes its shard once and decodes both ranks' payloads; the
        # reduce-scatter encodes both ranks' rows and decodes both payloads it received
        assert got["calls"] == (1 + 1 + 2, 2 + 2 + 2)
        # what travelled: bf16 payloads, half the fp32 bytes
        assert got["bytes"] == {"all_gather_into_tensor": 2 * (2 * 5 * 2), "reduce_scatter_tensor": 2 * 5 * 2}


def test_comms_logger_counts_the_experts_all_to_alls(ranks):
    for out in ranks:
        cap = out["capacity"]["capacity"]
        # capacity-padded: dispatch and combine in forward, their reverses in backward, each
        # the whole [experts, capacity, hidden] fp32 buffer; one all-gather agrees on capacity
        assert out["capacity"]["all_to_all"] == {4 * EXPERTS * int(cap) * HIDDEN: 4}
        assert out["capacity"]["all_gather"] == {2 * 2 * 8: 1}
        assert out["capacity"]["other_ops"] == []
        assert out["capacity"]["seq_steps"] == 5 and out["capacity"]["x_grad"]
        dropless = out["dropless"]
        # dropless: the count table (int64 per expert), the rows out and back in forward, and
        # both reversed in backward: five all-to-alls numbered in the expert group
        assert sum(dropless["all_to_all"].values()) == 5 and dropless["seq_steps"] == 5
        assert dropless["all_to_all"].get(8 * EXPERTS, 0) >= 1
        assert dropless["all_gather"] == {} and dropless["other_ops"] == [] and dropless["x_grad"]
    # every route's row leaves its rank once and comes back once, in forward and in backward:
    # over both ranks the row bytes are 4 x (routes) x hidden x 4 bytes (k = 2 routes a token)
    rows = sum(size * count for out in ranks for size, count in out["dropless"]["all_to_all"].items()) - 2 * 8 * EXPERTS
    assert rows == 4 * (2 * TOKENS * 2) * HIDDEN * 4
