"""WarmupLR, WarmupDecayLR and WarmupCosineLR against closed-form formulas."""

import logging
import math

import pytest
import torch

from zerotrain.optim import WarmupCosineLR, WarmupDecayLR, WarmupLR

GROUP_LRS = (0.1, 0.2)


@pytest.fixture
def warnings_log(caplog, monkeypatch):
    """caplog that also sees the "zerotrain" logger, which does not propagate to the root."""
    monkeypatch.setattr(logging.getLogger("zerotrain"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="zerotrain")
    return caplog


def make_optimizer(lrs=GROUP_LRS):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def lr_sequence(scheduler, count):
    """Group lrs after each of ``count`` step() calls, i.e. at iterations 0..count-1."""
    out = []
    for _ in range(count):
        scheduler.step()
        current = [group["lr"] for group in scheduler.optimizer.param_groups]
        assert scheduler.get_last_lr() == current
        out.append(current)
    return out


def warmup_share(it, n, kind):
    """Share of warmup done at iteration ``it``; ``n`` is already max(2, warmup_num_steps)."""
    if it >= n:
        return 1.0
    return math.log(1 + it) / math.log(n) if kind == "log" else it / n


def expected_warmup(it, low, high, n, kind):
    return low + (high - low) * warmup_share(it, n, kind)


def expected_decay(it, low, high, n, total, kind):
    if it < n:
        return expected_warmup(it, low, high, n, kind)
    gamma = max(0.0, (total - it) / max(1, total - n))
    return low + (high - low) * gamma


def expected_cosine_ratio(it, n, total, min_ratio, cos_min, kind):
    if it < n:
        return min_ratio + (1 - min_ratio) * warmup_share(it, n, kind)
    progress = min(1.0, (it - n + 1) / max(1, total - n))
    return cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress))


# Iterations of interest for warmup 10 and total 30: start, 1, mid warmup, warmup end,
# first post-warmup step, mid decay, end, beyond the end.
CHECKPOINTS = (0, 1, 5, 9, 10, 20, 29, 30, 35)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_matches_formula_per_group(kind):
    optimizer = make_optimizer()
    lows, highs = [0.0, 0.01], [1.0, 2.0]
    scheduler = WarmupLR(optimizer, warmup_min_lr=lows, warmup_max_lr=highs, warmup_num_steps=10, warmup_type=kind)
    assert [g["lr"] for g in optimizer.param_groups] == lows  # set at construction
    assert scheduler.get_last_lr() == lows
    seq = lr_sequence(scheduler, 40)
    for it in CHECKPOINTS:
        for g in range(2):
            assert seq[it][g] == pytest.approx(expected_warmup(it, lows[g], highs[g], 10, kind), rel=1e-12, abs=1e-15)
    # Log warmup reaches the peak at n - 1; linear only at n.
    assert (seq[9] == pytest.approx(highs)) == (kind == "log")
    assert seq[10] == pytest.approx(highs) and seq[35] == pytest.approx(highs)


def test_warmup_lr_defaults_max_lr_to_each_group_lr():
    scheduler = WarmupLR(make_optimizer(), warmup_num_steps=4, warmup_type="linear")
    assert scheduler.max_lrs == list(GROUP_LRS)
    assert lr_sequence(scheduler, 6)[5] == pytest.approx(list(GROUP_LRS))
    assert scheduler.min_lrs == [0.0, 0.0]


@pytest.mark.parametrize("steps", [0, 1])
def test_warmup_num_steps_below_two_count_as_two(steps):
    if steps == 0:
        with pytest.raises(ValueError, match="warmup_num_steps"):
            WarmupLR(make_optimizer(), warmup_num_steps=steps)
        return
    scheduler = WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=steps, warmup_type="linear")
    assert scheduler.warmup_num_steps == 2
    assert [row[0] for row in lr_sequence(scheduler, 3)] == pytest.approx([0.0, 0.5, 1.0])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_matches_formula(kind):
    lows, highs = [0.0, 0.01], [1.0, 2.0]
    scheduler = WarmupDecayLR(
        make_optimizer(),
        total_num_steps=30,
        warmup_min_lr=lows,
        warmup_max_lr=highs,
        warmup_num_steps=10,
        warmup_type=kind,
    )
    seq = lr_sequence(scheduler, 40)
    for it in CHECKPOINTS:
        for g in range(2):
            want = expected_decay(it, lows[g], highs[g], 10, 30, kind)
            assert seq[it][g] == pytest.approx(want, rel=1e-12, abs=1e-15), (it, g)
    assert seq[10] == pytest.approx(highs)
    assert seq[30] == pytest.approx(lows) and seq[35] == pytest.approx(lows)


def test_warmup_decay_lr_defaults_and_short_total(warnings_log):
    optimizer = make_optimizer()
    scheduler = WarmupDecayLR(optimizer, total_num_steps=5, warmup_num_steps=10, warmup_type="linear")
    assert "less than warmup_num_steps" in warnings_log.text
    assert scheduler.max_lrs == [0.001, 0.001]  # not the optimizer's lr, unlike WarmupLR
    seq = lr_sequence(scheduler, 12)
    # Past warmup the decay window is empty, so gamma = max(0, (5 - it) / 1) = 0.
    assert seq[10] == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_matches_formula(kind):
    optimizer = make_optimizer()
    scheduler = WarmupCosineLR(
        optimizer, total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=10, cos_min_ratio=0.05, warmup_type=kind
    )
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]  # ratio 0 before the first step
    seq = lr_sequence(scheduler, 40)
    for it in CHECKPOINTS:
        ratio = expected_cosine_ratio(it, 10, 30, 0.1, 0.05, kind)
        assert seq[it] == pytest.approx([lr * ratio for lr in GROUP_LRS], rel=1e-12), it
    assert seq[0] == pytest.approx([0.1 * lr for lr in GROUP_LRS])
    assert seq[29] == pytest.approx([0.05 * lr for lr in GROUP_LRS])
    assert seq[39] == pytest.approx([0.05 * lr for lr in GROUP_LRS])  # clamped, no rebound


def test_warmup_cosine_lr_total_equal_to_warmup_stays_at_floor():
    scheduler = WarmupCosineLR(make_optimizer(), total_num_steps=4, warmup_num_steps=4, warmup_type="linear")
    seq = lr_sequence(scheduler, 8)
    assert seq[4] == pytest.approx([1e-4 * lr for lr in GROUP_LRS])


@pytest.mark.parametrize(
    "cls, extra", [(WarmupLR, {}), (WarmupDecayLR, {"total_num_steps": 9}), (WarmupCosineLR, {"total_num_steps": 9})]
)
def test_invalid_warmup_type_names_the_parameter(cls, extra):
    with pytest.raises(ValueError, match="warmup_type"):
        cls(make_optimizer(), warmup_type="cosine", **extra)


def test_per_group_list_length_is_checked():
    with pytest.raises(ValueError, match="warmup_min_lr"):
        WarmupLR(make_optimizer(), warmup_min_lr=[0.0, 0.0, 0.0])


def make_schedulers(kind):
    return {
        "WarmupLR": lambda opt: WarmupLR(opt, 0.01, 1.0, 10, kind),
        "WarmupDecayLR": lambda opt: WarmupDecayLR(opt, 30, 0.01, 1.0, 10, kind),
        "WarmupCosineLR": lambda opt: WarmupCosineLR(opt, 30, 0.1, 10, 0.01, kind),
    }


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_state_dict_round_trip_resumes_sequence(name, kind):
    build = make_schedulers(kind)[name]
    reference = build(make_optimizer())
    full = lr_sequence(reference, 30)

    first = build(make_optimizer())
    lr_sequence(first, 12)
    state = first.state_dict()
    assert state == {"last_batch_iteration": 11}

    resumed = build(make_optimizer())
    resumed.load_state_dict(state)
    assert lr_sequence(resumed, 18) == full[12:]


def test_resumed_construction_leaves_lr_and_step_accepts_iteration():
    optimizer = make_optimizer()
    scheduler = WarmupLR(optimizer, 0.0, 1.0, 10, "linear", last_batch_iteration=4)
    assert [g["lr"] for g in optimizer.param_groups] == list(GROUP_LRS)
    with pytest.raises(RuntimeError, match="step"):
        scheduler.get_last_lr()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.5, 0.5])
    scheduler.step(8)
    assert scheduler.last_batch_iteration == 8 and scheduler.get_lr() == pytest.approx([0.8, 0.8])


def test_tensor_lr_is_updated_in_place():
    lr = torch.tensor(0.01)
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    scheduler = WarmupLR(optimizer, 0.0, 1.0, 4, "linear")
    scheduler.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.25)
    assert WarmupCosineLR(make_optimizer((0.5,)), 10).org_lrs == [0.5]


def test_accepts_wrapper_with_optimizer_attribute():
    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    optimizer = make_optimizer()
    scheduler = WarmupLR(Wrapper(optimizer), 0.0, 1.0, 4)
    assert scheduler.optimizer is optimizer
    with pytest.raises(TypeError):
        WarmupLR(object())
