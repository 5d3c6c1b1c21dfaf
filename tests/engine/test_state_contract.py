"""The training state contract (docs/engine.md): the fp32 master is the truth; weights loaded or
edited outside the optimizer stick at every stage and precision; destroy() hands back a plain
module; engines without an optimizer; parameters outside the optimizer; rank-dependent branches
at stage 3."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from tests.engine.workloads import global_batches, make_model
from zerotrain.testing import run_on_ranks

STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16")
LR = 0.1


def _config(stage: int, precision: str, lr: float = LR, momentum: float = 0.0, **zero) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": momentum}},
        "zero_optimization": {"stage": stage, **zero},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _step(engine, batch):
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = batch[2 * rank : 2 * rank + 2]
    loss = engine(mine, labels=mine).loss
    engine.backward(loss)
    engine.step()


def _whole(engine) -> dict:
    """Every rank: the whole weights (stage 3 gathers on rank 0; others get {})."""
    return {k: v.float().clone() for k, v in engine.module_state_dict().items()}


def _loads_and_edits(stage: int, precision: str) -> dict:
    """load_state_dict, then an EMA-style in-place edit, each followed by a step."""
    import zerotrain

    zerotrain.init_distributed()
    data = global_batches(3, 4)
    model = make_model(seed=0)
    engine, *_ = zerotrain.initialize(model=model, config=_config(stage, precision))
    _step(engine, data[0])
    loaded = make_model(seed=5).state_dict()
    engine.load_state_dict(loaded)
    after_load = _whole(engine)
    _step(engine, data[1])
    after_load_step = _whole(engine)
    # An EMA-like edit through the parameters (every rank, between steps). At stage 3 the
    # partitioned ones need GatheredParameters; modifier_rank broadcasts rank 0's edit.
    params = list(engine.module.parameters())
    with zerotrain.zero.GatheredParameters(params, modifier_rank=0):
        with torch.no_grad():
            for p in params:
                p.mul_(0.5)
    after_edit = _whole(engine)
    _step(engine, data[2])
    out = {
        "after_load": after_load,
        "after_load_step": after_load_step,
        "after_edit": after_edit,
        "final": _whole(engine),
    }
    engine.destroy()
    return out


def _reference_loads_and_edits() -> dict:
    data = global_batches(3, 4)
    model = make_model(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(batch):
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()

    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    step(data[1])
    after_load_step = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    step(data[2])
    return {
        "after_load": loaded,
        "after_load_step": after_load_step,
        "final": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _relative(got: dict, want: dict) -> float:
    names = [n for n in want if n in got]
    assert names, "nothing to compare"
    diff = torch.cat([(got[n] - want[n]).flatten() for n in names]).norm()
    return float(diff / torch.cat([want[n].flatten() for n in names]).norm())


def _loads_and_edits_every_stage(precision: str) -> dict:
    return {stage: _loads_and_edits(stage, precision) for stage in STAGES}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_loaded_and_edited_weights_stick(precision):
    ref = _reference_loads_and_edits()
    results = run_on_ranks(_loads_and_edits_every_stage, 2, args=(precision,), timeout=300)[0]
    for stage in STAGES:
        got = results[stage]
        # 16-bit weights: loading rounds once, every later comparison is against an fp32 run.
        tol = 1e-5 if precision == "fp32" else 1e-2
        assert _relative(got["after_load"], ref["after_load"]) <= (0 if precision == "fp32" else 4e-3)
        assert _relative(got["after_load_step"], ref["after_load_step"]) <= tol, (stage, precision)
        halved = {k: v * 0.5 for k, v in got["after_load_step"].items()}
        assert _relative(got["after_edit"], halved) <= 1e-6, (stage, precision)
        # The step after the edit continues from the edited weights (before the fix it continued
        # from the fp32 masters of the unedited ones: ~100% off).
        assert _relative(got["final"], ref["final"]) <= tol, (stage, precision)


# -- persistent parameters under GatheredParameters at stage 3 --------------------------------
def _modifier_rank_on_persistent(precision: str) -> dict:
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    model = make_model(seed=0)
    # Default persistence threshold: LayerNorm weights stay whole on every rank.
    engine, *_ = zerotrain.initialize(model=model, config=_config(3, precision, lr=0.0))
    ln, big = model.blocks[0].ln_1.weight, model.wte.weight
    with zerotrain.zero.GatheredParameters([ln, big], modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                ln.fill_(2.0)
                big[0].fill_(3.0)
    seen = {"ln": ln.detach().float().clone()}
    batch = global_batches(1, 4)[0]
    _step(engine, batch)  # lr 0: the step must keep the edited values (masters took them)
    seen["ln_after_step"] = ln.detach().float().clone()
    with zerotrain.zero.GatheredParameters([big]):
        seen["big_row"] = big[0].detach().float().clone()
    return seen


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gathered_parameters_broadcasts_persistent_parameters(precision):
    for seen in run_on_ranks(_modifier_rank_on_persistent, 2, args=(precision,)):
        assert torch.all(seen["ln"] == 2.0)
        assert torch.all(seen["ln_after_step"] == 2.0)
        assert torch.all(seen["big_row"] == 3.0)


# -- destroy, engines without optimizer, several engines -------------------------------------
def _destroy_and_reuse() -> dict:
    import zerotrain

    zerotrain.init_distributed()
    data = global_batches(4, 4)
    model = make_model(seed=0)
    classes_before = {type(m): type(m).__init__ for m in model.modules()}
    engine, *_ = zerotrain.initialize(model=model, config=_config(3, "fp32", stage3_param_persistence_threshold=0))
    _step(engine, data[0])
    from zerotrain.runtime.zero.partition_parameters import ZeroParamStatus

    weight = model.wte.weight  # DeepSpeed's read-outs, which scripts test before gathering
    ds = {
        "status": weight.ds_status,
        "shape": tuple(weight.ds_shape),
        "numel": weight.ds_numel,
        "ids": len({p.ds_id for p in model.parameters()}),
        "tensor": weight.ds_tensor.numel(),
        "partition_numel": weight.partition_numel(),
    }  # DeepSpeed's method (Lightning's summary)
    with zerotrain.zero.GatheredParameters([weight]):
        ds["status_gathered"] = weight.ds_status
    ds["status_after"] = weight.ds_status
    assert ds["status"] is ZeroParamStatus.NOT_AVAILABLE
    assert ds["status_gathered"] is ZeroParamStatus.AVAILABLE
    assert ds["status_after"] is ZeroParamStatus.NOT_AVAILABLE
    assert ds["shape"] == tuple(make_model().wte.weight.shape) and ds["numel"] == weight.ds_numel
    assert ds["ids"] == len(list(model.parameters())) and 0 < ds["tensor"] <= ds["numel"]
    assert ds["partition_numel"] == ds["tensor"]
    before = engine.module_state_dict()
    engine.destroy()
    out = {
        "plain_dicts": all(type(m._parameters) is dict for m in model.modules()),
        "no_attrs": not any(
            k.startswith(("_zerotrain", "ds_")) or k == "partition_numel" for p in model.parameters() for k in vars(p)
        ),
        "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "before": before,
        "inits_restored": all(type(m).__init__ is classes_before[type(m)] for m in model.modules()),
        "no_hooks": all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()),
    }
    with torch.no_grad():
        out["eval_loss"] = float(model(data[1][:2], labels=data[1][:2]).loss)
    # A second engine (stage 2) takes the returned module and trains it.
    engine2, *_ = zerotrain.initialize(model=model, config=_config(2, "fp32"))
    for b in data[1:]:
        _step(engine2, b)
    out["trained"] = float(engine2(data[0][:2], labels=data[0][:2]).loss)
    engine2.destroy()
    return out


def test_destroy_returns_a_plain_module_that_a_new_engine_trains():
    ref = make_model(seed=0)
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    per_rank = run_on_ranks(_destroy_and_reuse, 2)
    for out in per_rank:
        assert out["plain_dicts"] and out["no_attrs"] and out["inits_restored"] and out["no_hooks"]
        assert out["shapes"] == shapes
        assert torch.isfinite(torch.tensor(out["eval_loss"])) and torch.isfinite(torch.tensor(out["trained"]))
        for k, v in per_rank[0]["before"].items():  # the weights it trained, whole on every rank
            assert torch.equal(out["state"][k], v), k


def _policy_and_reference() -> dict:
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    data = global_batches(1, 4).repeat(5, 1, 1)  # one batch, five steps: the loss must fall
    policy_model, ref_model = make_model(seed=0), make_model(seed=0)
    ref_init = {k: v.clone() for k, v in ref_model.state_dict().items()}
    policy, *_ = zerotrain.initialize(
        model=policy_model, config=_config(3, "fp32", stage3_param_persistence_threshold=0)
    )
    ref_cfg = _config(3, "fp32", stage3_param_persistence_threshold=0)
    del ref_cfg["optimizer"]
    reference, *_ = zerotrain.initialize(model=ref_model, config=ref_cfg)
    rank = dist.get_rank()
    losses = []
    for batch in data:
        mine = batch[2 * rank : 2 * rank + 2]
        with torch.no_grad():
            ref_logits = reference(mine).logits
        out = policy(mine, labels=mine)
        kl = (
            (out.logits.log_softmax(-1).exp() * (out.logits.log_softmax(-1) - ref_logits.log_softmax(-1)))
            .sum(-1)
            .mean()
        )
        loss = out.loss + 0.1 * kl
        policy.backward(loss)
        policy.step()
        losses.append(float(loss))
    held = reference.memory_breakdown()["parameters"]
    ref_state = reference.module_state_dict()
    try:
        reference.step()
        stepped = "no error"
    except RuntimeError as error:
        stepped = str(error)
    policy.destroy()
    reference.destroy()
    return {"losses": losses, "held": held, "ref_state": ref_state, "ref_init": ref_init, "stepped": stepped}


def test_stage3_engine_without_optimizer_beside_a_trained_one():
    per_rank = run_on_ranks(_policy_and_reference, 2)
    full = sum(p.numel() * 4 for p in make_model(seed=0).parameters())
    for out in per_rank:
        assert out["losses"][-1] < out["losses"][0]
        assert out["held"] < 0.6 * full  # the frozen reference stays partitioned
        assert "no optimizer" in out["stepped"]
    for k, v in per_rank[0]["ref_state"].items():
        assert torch.equal(v, per_rank[0]["ref_init"][k]), k


# -- parameters outside the optimizer, add_param_group, untested optimizers -------------------
def _outside_optimizer(stage: int, precision: str) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    model = make_model(seed=0)
    skipped = model.ln_f.bias  # trainable, but no optimizer group holds it
    params = [p for p in model.parameters() if p is not skipped]
    engine, opt, *_ = zerotrain.initialize(
        model=model, model_parameters=params, config=_config(stage, precision, lr=0.0)
    )
    data = global_batches(2, 4)
    grads = []
    for batch in data[:1].repeat(2, 1, 1):  # the same batch twice, weights fixed (lr 0)
        import torch.distributed as dist

        mine = batch[2 * dist.get_rank() : 2 * dist.get_rank() + 2]
        engine.backward(engine(mine, labels=mine).loss)
        grads.append(skipped.grad.detach().float().clone())
        engine.step()
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        added = "no error"
    except RuntimeError as error:
        added = str(error)
    engine.destroy()
    return {"grads": grads, "added": added}


def _outside_optimizer_every_case() -> dict:
    return {case: _outside_optimizer(*case) for case in itertools.product(STAGES, PRECISIONS)}


def test_parameters_outside_the_optimizer_are_averaged_and_zeroed():
    model = make_model(seed=0)
    batch = global_batches(2, 4)[0]
    model(batch, labels=batch).loss.backward()
    want = model.ln_f.bias.grad
    results = run_on_ranks(_outside_optimizer_every_case, 2, timeout=300)
    for stage, precision in itertools.product(STAGES, PRECISIONS):
        per_rank = [r[(stage, precision)] for r in results]
        tol = 1e-5 if precision == "fp32" else 2e-2
        for out in per_rank:
            for g in out["grads"]:  # the global-batch gradient, both windows (zeroed between)
                err = float((g - want).norm() / want.norm())
                assert err <= tol, (stage, precision, err)
            assert "add_param_group" in out["added"] or stage == 0 and precision == "fp32", out["added"]


def _untested_optimizer(allow: bool) -> str:
    import zerotrain

    class TrustRatio(torch.optim.Optimizer):  # an unknown class: maybe not elementwise
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self):
            pass

    zerotrain.init_distributed()
    model = make_model(seed=0)
    cfg = _config(2, "fp32")
    del cfg["optimizer"]
    cfg["zero_allow_untested_optimizer"] = allow
    try:
        engine, *_ = zerotrain.initialize(model=model, optimizer=TrustRatio(model.parameters()), config=cfg)
        engine.destroy()
        return "accepted"
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return str(error)


def _untested_optimizer_both() -> dict:
    return {allow: _untested_optimizer(allow) for allow in (False, True)}


def test_untested_optimizer_refused_unless_allowed():
    results = run_on_ranks(_untested_optimizer_both, 2)[0]
    assert "zero_allow_untested_optimizer" in results[False] and "TrustRatio" in results[False]
    assert results[True] == "accepted"


# -- rank-dependent control flow at stage 3 ---------------------------------------------------
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(64, 64)  # partitioned
        self.outer = nn.Linear(64, 64)  # partitioned
        self.extra = nn.Linear(64, 64)  # used on rank 0 only
        self.tail = nn.Linear(64, 8)

    def forward(self, x, branch: bool):
        h = torch.tanh(self.inner(x))
        if branch:
            h = h + self.extra(h)
        return self.tail(torch.tanh(self.outer(h)))


def _branch_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 4, 64, generator=g)


def _train_branchy(threshold: int) -> dict:
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    model = Branchy()
    cfg = _config(3, "fp32", stage3_param_persistence_threshold=threshold)
    engine, *_ = zerotrain.initialize(model=model, config=cfg)
    rank = dist.get_rank()
    for batch in _branch_data():
        out = engine(batch[2 * rank : 2 * rank + 2], branch=rank == 0)
        engine.backward(out.square().mean())
        engine.step()
    state = engine.module_state_dict()
    engine.destroy()
    return state


def test_stage3_rank_dependent_branch_reduces_in_agreed_order():
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in _branch_data():
        loss = 0.5 * (model(batch[:2], True).square().mean() + model(batch[2:], False).square().mean())
        loss.backward()
        opt.step()
        opt.zero_grad()
    # extra (4160 elements) stays whole below the threshold, so no gather depends on the
    # branch; the others are partitioned, so their reduce-scatters must line up on both ranks.
    got = run_on_ranks(_train_branchy, 2, args=(4200,))[0]
    for name, want in model.state_dict().items():
        err = float((got[name] - want).norm() / want.norm())
        assert err <= 1e-5, (name, err)


# -- ignore_unused_parameters: false ----------------------------------------------------------
def _unused_parameter(stage: int, ignore: bool) -> str:
    import zerotrain

    zerotrain.init_distributed()
    model = make_model(seed=0)
    model.unused = nn.Linear(3, 3)  # trainable, never called in forward
    cfg = _config(stage, "fp32", ignore_unused_parameters=ignore, stage3_param_persistence_threshold=0)
    engine, *_ = zerotrain.initialize(model=model, config=cfg)
    try:
        _step(engine, global_batches(1, 4)[0])
        return "trained"
    except RuntimeError as error:
        return str(error)
    finally:
        engine.destroy()


def _unused_parameter_cases() -> dict:
    cases = [(1, False), (2, False), (3, False), (2, True)]
    return {case: _unused_parameter(*case) for case in cases}


def test_ignore_unused_parameters_false_names_the_unused_ones():
    results = run_on_ranks(_unused_parameter_cases, 2)[0]
    for stage in (1, 2, 3):
        refused = results[(stage, False)]
        assert "unused.weight" in refused and "ignore_unused_parameters" in refused, refused
    assert results[(2, True)] == "trained"


# -- optimizer state by parameter name --------------------------------------------------------
def _named_state(stage: int) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    model = make_model(seed=0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, opt, *_ = zerotrain.initialize(model=model, config=cfg)
    for batch in global_batches(2, 4):
        _step(engine, batch)
    named = engine._zero.named_optimizer_state(opt)
    out = {
        name: [(start, {k: v.clone() for k, v in s.items() if torch.is_tensor(v) and v.dim()}) for start, s in pieces]
        for name, pieces in named.items()
    }
    engine.destroy()
    return out


def _named_state_both() -> dict:
    return {stage: _named_state(stage) for stage in (1, 3)}


def test_optimizer_state_addressable_by_parameter_name():
    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for batch in global_batches(2, 4):
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    want = {n: opt.state[p] for n, p in model.named_parameters()}
    both = run_on_ranks(_named_state_both, 2)
    for stage in (1, 3):
        per_rank = [r[stage] for r in both]
        for name, ref in want.items():
            whole = {k: torch.full((ref[k].numel(),), float("nan")) for k in ("exp_avg", "exp_avg_sq")}
            for rank_state in per_rank:
                for start, sliced in rank_state.get(name, []):
                    for k in whole:
                        whole[k][start : start + sliced[k].numel()] = sliced[k]
            for k in whole:  # every element covered by exactly the rank that owns it
                assert torch.allclose(whole[k], ref[k].flatten(), rtol=1e-4, atol=1e-7), (stage, name, k)


def test_diverging_ranks_named_with_collective_check():
    """A *partitioned* module run on rank 0 only is a genuine divergence: with
    ZEROTRAIN_CHECK_COLLECTIVES=1 every rank fails at the first disagreeing unit collective,
    naming what each rank was about to gather; the agreed branch above still trains under it."""
    env = {"ZEROTRAIN_CHECK_COLLECTIVES": "1"}
    with pytest.raises(Exception) as failure:  # noqa: PT011 - RankFailed carries the message
        run_on_ranks(_train_branchy, 2, args=(0,), env=env, timeout=120)
    message = str(failure.value)
    assert "ranks diverged" in message and "extra.weight" in message, message
    assert run_on_ranks(_train_branchy, 2, args=(4200,), env=env)[0]  # no false alarm


# -- stage 3, a module split over two optimizer groups ---------------------------------------
def _grouped_stage3() -> dict:
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    model = make_model(seed=0)
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    cfg = _config(3, "fp32", stage3_param_persistence_threshold=0)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=groups, config=cfg)
    for batch in global_batches(3, 4):
        _step(engine, batch)
    state = engine.module_state_dict()
    engine.destroy()
    return state if dist.get_rank() == 0 else {}


def test_stage3_units_of_one_module_gathered_in_the_same_order_on_every_rank():
    """A Linear whose weight and bias sit in different optimizer groups is two units of one
    module; backward gathered them in set (id) order, which differs between ranks: a collective
    mismatch. The check names any disagreement; the weights must match the reference."""
    model = make_model(seed=0)
    opt = torch.optim.SGD(
        [
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2]},
        ],
        lr=LR,
    )
    for batch in global_batches(3, 4):
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    got = run_on_ranks(_grouped_stage3, 2, env={"ZEROTRAIN_CHECK_COLLECTIVES": "1"})[0]
    assert _relative(got, {k: v for k, v in model.state_dict().items() if k in got}) <= 1e-5
