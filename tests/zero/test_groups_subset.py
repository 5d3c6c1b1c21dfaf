"""zero.Init and GatheredParameters on data-parallel groups that are not the world.

One 4-rank job; ranks {0,1} and {2,3} form two groups (created by every rank in the same order)
that run the same steps side by side with different seeds. Each group's parameters must be
partitioned, gathered, broadcast (``modifier_rank`` is a rank *within the group*) and trained
over that group only, and equal a single-process reference; the other group must not leak in.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.testing import run_on_ranks

MICRO = 2  # per rank; 2 ranks a group
GROUP_SIZE = 2
SEEDS = (11, 23)  # build seed of group 0 / group 1 (group rank r seeds SEED + 1000 r)
NEST_SEEDS = (31, 47)
MIXED_SEEDS = (53, 71)
DATA_SEEDS = (5, 9)
MARK = (-2.0, 3.0)  # GatheredParameters(modifier_rank=1) multiplies fc2.weight by this
MIXED = {0: (2, "fp32"), 1: (3, "bf16")}  # group -> (stage, precision) of the side-by-side run


def _init_weights(module):
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.3)
        nn.init.normal_(module.bias, std=0.1)


class _Net(nn.Module):
    """Initialised after construction by the parent (``self.apply``), as models do."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(16, 4)
        self.apply(_init_weights)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _batches(group: int, steps: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(DATA_SEEDS[group])
    return torch.randn(steps, MICRO * GROUP_SIZE, 8, generator=g)


def _config(stage: int, precision: str = "fp32") -> dict:
    return {
        "train_batch_size": MICRO * GROUP_SIZE,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _state(module) -> dict:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _gathered_state(module) -> dict:
    from zerotrain.zero import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        return _state(module)


def _train(engine, group: int, grank: int, steps, dtype=torch.float32) -> None:
    data = _batches(group)
    for step in steps:
        x = data[step, grank * MICRO : (grank + 1) * MICRO].to(dtype)
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()


def _job() -> dict:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.zero import GatheredParameters, Init

    zerotrain.init_distributed()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = dist.get_rank() // 2
    g = groups[mine]
    grank = dist.get_rank(g)
    out = {"group": mine, "grank": grank}

    # 1. Built under Init over the group: the group's first rank's values, 1/2 per rank.
    torch.manual_seed(SEEDS[mine] + 1000 * grank)
    with Init(data_parallel_group=g):
        model = _Net()
    out["shard_numel"] = model.fc1.weight._zerotrain_shard.numel()
    out["built"] = _gathered_state(model)

    try:
        Init(data_parallel_group=groups[1 - mine])  # the other group's handle
        out["member_error"] = None
    except ValueError as e:
        out["member_error"] = str(e)

    # 2. modifier_rank=1 is group rank 1 (global rank 1 or 3).
    with GatheredParameters(model.fc2.weight, modifier_rank=1):
        if grank == 1:
            model.fc2.weight.data.mul_(MARK[mine])
    out["marked"] = _gathered_state(model)
    try:
        GatheredParameters(model.fc2.weight, modifier_rank=2)  # the world has a rank 2
        out["range_error"] = None
    except ValueError as e:
        out["range_error"] = str(e)

    # 3. Another Init over the world after the first, with one over the group nested in it;
    #    a placeholder partitioned over the group is edited inside the world context.
    torch.manual_seed(NEST_SEEDS[mine] + 1000 * grank)
    with Init():
        world_lin = nn.Linear(4, 8)
        with Init(data_parallel_group=g):
            group_lin = nn.Linear(8, 4)
        after = nn.Linear(4, 4)
        model.fc1.bias.data.add_(1.0)
    out["nest_shards"] = [p._zerotrain_shard.numel() for p in (world_lin.weight, group_lin.weight, after.weight)]
    with GatheredParameters([*world_lin.parameters(), *group_lin.parameters(), *after.parameters()]):
        out["nested"] = {"world_lin": _state(world_lin), "group_lin": _state(group_lin), "after": _state(after)}

    # 4. Stage 3 on the group: 2 SGD steps, an edit by group rank 1, a third step.
    engine, *_ = zerotrain.initialize(model=model, config=_config(3), data_parallel_group=g)
    _train(engine, mine, grank, range(2))
    out["trained2"] = _gathered_state(engine.module)
    with GatheredParameters(engine.module.fc1.weight, modifier_rank=1):
        if grank == 1:
            with torch.no_grad():
                engine.module.fc1.weight.mul_(0.5)
    out["edited"] = _gathered_state(engine.module)
    _train(engine, mine, grank, range(2, 3))
    out["trained3"] = _gathered_state(engine.module)
    engine.destroy()

    # 5. Side by side: group 0 stage 2 fp32, group 1 stage 3 bf16, both built under Init.
    stage, precision = MIXED[mine]
    cfg = _config(stage, precision)
    torch.manual_seed(MIXED_SEEDS[mine] + 1000 * grank)
    with Init(data_parallel_group=g, config_dict_or_path=cfg):
        model2 = _Net()
    engine2, *_ = zerotrain.initialize(model=model2, config=cfg, data_parallel_group=g)
    _train(engine2, mine, grank, range(2), dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    out["mixed"] = _gathered_state(engine2.module)
    engine2.destroy()

    # 6. An engine over other ranks than zero.Init's group is refused, naming both.
    with Init(data_parallel_group=g):
        model3 = nn.Linear(4, 4)
    try:
        zerotrain.initialize(
            model=model3,
            config={
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_optimization": {"stage": 3},
            },
        )
        out["mismatch_error"] = None
    except ValueError as e:
        out["mismatch_error"] = str(e)

    # 7. Whole parameters (fp32 stage 0 has no units; stage 2 fp32 keeps them whole): modifier_rank
    #    is group rank 1 and the broadcast stays inside the group.
    out["whole"] = {}
    for stage in (0, 2):
        torch.manual_seed(MIXED_SEEDS[mine] + 1000 * grank + stage)
        engine3, *_ = zerotrain.initialize(model=_Net(), config=_config(stage), data_parallel_group=g)
        before = _state(engine3.module)
        with GatheredParameters(engine3.module.fc2.weight, modifier_rank=1):
            if grank == 1:
                engine3.module.fc2.weight.data.mul_(MARK[mine])
        out["whole"][stage] = (before, _state(engine3.module))
        engine3.destroy()
    return out


# -- single-process references -----------------------------------------------------------------
def _reference_model(group: int) -> nn.Module:
    torch.manual_seed(SEEDS[group])
    return _Net()


def _reference_step(model: nn.Module, x: torch.Tensor, lr: float = 0.1) -> None:
    model.zero_grad()
    model(x).square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(lr * p.grad)


def _reference_trained(group: int, edit: bool) -> dict:
    model = _reference_model(group)
    with torch.no_grad():
        model.fc2.weight.mul_(MARK[group])
        model.fc1.bias.add_(1.0)
    data = _batches(group)
    for step in range(2):
        _reference_step(model, data[step])
    if edit:
        with torch.no_grad():
            model.fc1.weight.mul_(0.5)
        _reference_step(model, data[2])
    return _state(model)


def _assert_equal(got: dict, want: dict, what: str, rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys(), what
    for name, w in want.items():
        err = float((got[name] - w).norm() / w.norm())
        assert err <= rtol, f"{what}: {name} differs (relative error {err:.2e})"


@pytest.fixture(scope="module")
def per_rank():
    return run_on_ranks(_job, world_size=4, timeout=600, comm_timeout=90)


def test_init_on_a_group_partitions_over_it_and_takes_its_first_rank(per_rank):
    for out in per_rank:
        assert out["shard_numel"] == 16 * 8 // GROUP_SIZE, out["grank"]
        _assert_equal(
            out["built"],
            _state(_reference_model(out["group"])),
            f"group {out['group']} rank {out['grank']} built",
            rtol=0.0,
        )
        assert "zero.Init(data_parallel_group=...): this process is not in the group" in out["member_error"], out[
            "member_error"
        ]


def test_modifier_rank_is_a_rank_of_the_group(per_rank):
    for out in per_rank:
        want = _state(_reference_model(out["group"]))
        want["fc2.weight"] = want["fc2.weight"] * MARK[out["group"]]
        _assert_equal(out["marked"], want, f"group {out['group']} rank {out['grank']} marked", rtol=0.0)
        assert "modifier_rank=2" in out["range_error"] and "0..1" in out["range_error"]


def test_init_contexts_over_different_groups_nest_and_follow_each_other(per_rank):
    torch.manual_seed(NEST_SEEDS[0])  # the world's values come from global rank 0 (group 0)
    world_lin, _, after = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 4)
    for out in per_rank:
        torch.manual_seed(NEST_SEEDS[out["group"]])
        _, group_lin, _ = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 4)
        # world: 4 shards of 32 / 16 elements; the nested group's: 2 of 32
        assert out["nest_shards"] == [8, 16, 4]
        for key, ref in (("world_lin", world_lin), ("group_lin", group_lin), ("after", after)):
            _assert_equal(out["nested"][key], _state(ref), key, rtol=0.0)


def test_stage3_on_a_group_trains_like_one_process(per_rank):
    for out in per_rank:
        what = f"group {out['group']} rank {out['grank']}"
        _assert_equal(out["trained2"], _reference_trained(out["group"], edit=False), what)
        edited = dict(out["trained2"], **{"fc1.weight": out["trained2"]["fc1.weight"] * 0.5})
        _assert_equal(out["edited"], edited, what + " edited by group rank 1")
        _assert_equal(out["trained3"], _reference_trained(out["group"], edit=True), what)


def test_stage2_fp32_and_stage3_bf16_side_by_side(per_rank):
    for out in per_rank:
        group = out["group"]
        torch.manual_seed(MIXED_SEEDS[group])
        model = _Net()
        init = _state(model)
        data = _batches(group)
        for step in range(2):
            _reference_step(model, data[step])
        want = _state(model)
        got = out["mixed"]
        if MIXED[group][1] == "fp32":
            _assert_equal(got, want, f"stage 2 fp32 rank {out['grank']}")
        else:  # bf16 (built in bf16): the update must follow the fp32 reference's closely
            start = {n: v.bfloat16().float() for n, v in init.items()}
            update = torch.cat([(got[n] - start[n]).flatten() for n in want])
            ref = torch.cat([(want[n] - init[n]).flatten() for n in want])
            assert 0.9 <= float(update.norm() / ref.norm()) <= 1.1
            assert float(nn.functional.cosine_similarity(update, ref, dim=0)) > 0.99
    for first, second in ((0, 1), (2, 3)):  # every member of a group holds the same weights
        _assert_equal(per_rank[second]["mixed"], per_rank[first]["mixed"], "group members", rtol=0.0)


def test_whole_parameters_take_the_group_ranks_edit(per_rank):
    for stage in (0, 2):
        for first, second in ((0, 1), (2, 3)):
            before, after = per_rank[first]["whole"][stage]
            group = per_rank[first]["group"]
            want = dict(before, **{"fc2.weight": before["fc2.weight"] * MARK[group]})
            for rank in (first, second):
                _assert_equal(per_rank[rank]["whole"][stage][1], want, f"stage {stage} rank {rank}", rtol=0.0)
    # the two groups started from different weights: a world-wide broadcast would have mixed them
    assert not torch.equal(per_rank[0]["whole"][0][0]["fc1.weight"], per_rank[2]["whole"][0][0]["fc1.weight"])


def test_an_engine_over_other_ranks_than_init_is_refused_naming_both(per_rank):
    for out in per_rank:
        ranks = [0, 1] if out["group"] == 0 else [2, 3]
        message = out["mismatch_error"]
        assert f"zero.Init over ranks {ranks}" in message, message
        assert "group is ranks [0, 1, 2, 3]" in message and "data_parallel_group" in message
