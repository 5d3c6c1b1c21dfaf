"""OneCycle and LRRangeTest against closed-form formulas."""

import logging
import math

import pytest
import torch

from zerotrain.optim import LRRangeTest, OneCycle


@pytest.fixture
def warnings_log(caplog, monkeypatch):
    """caplog that also sees the "zerotrain" logger, which does not propagate to the root."""
    monkeypatch.setattr(logging.getLogger("zerotrain"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="zerotrain")
    return caplog


def make_adam(groups=2, betas=(0.9, 0.999)):
    param_groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.Adam(param_groups, lr=0.5, betas=betas)


def step_all(scheduler, count):
    """(lrs, betas) of every group after each of ``count`` step() calls (iterations 0..count-1)."""
    out = []
    for _ in range(count):
        scheduler.step()
        groups = scheduler.optimizer.param_groups
        assert scheduler.get_last_lr() == [g["lr"] for g in groups]
        out.append(([g["lr"] for g in groups], [g.get("betas") for g in groups]))
    return out


def cycle_fraction(it, up, down, up_stairs=0, down_stairs=0):
    """0 at the cycle's low point, 1 at its peak, for batch b = it + 1 within the first cycle."""
    b = it + 1
    if b <= up:
        fraction, stairs, length = b / up, up_stairs, up
        done = b
    else:
        fraction, stairs, length = (up + down - b) / down, down_stairs, down
        done = up + down - b
    if stairs:
        stair_length = length // stairs
        return (done // stair_length) / stairs
    return fraction


def expected_one_cycle(it, lo, hi, mlo, mhi, up, down, lr_rate=0.0, mom_rate=0.0, decay_size=0, **stairs):
    total = up + down
    if it < total:
        f = cycle_fraction(it, up, down, **stairs)
        return lo + (hi - lo) * f, mhi - (mhi - mlo) * f
    d = it - total + 1
    lr = lo / (1 + lr_rate * d / decay_size) if decay_size and lr_rate else lo
    mom = mhi * (1 + mom_rate * d / decay_size) if decay_size and mom_rate else mhi
    return lr, mom


CHECKPOINTS = (0, 1, 2, 3, 4, 6, 9, 10, 11, 15, 30)


@pytest.mark.parametrize("up, down", [(4, 4), (4, 6)])
def test_one_cycle_per_group_lr_and_momentum(up, down):
    optimizer = make_adam()
    lows, highs, mlows, mhighs = [0.01, 0.02], [0.1, 0.4], [0.8, 0.85], [0.9, 0.95]
    scheduler = OneCycle(
        optimizer,
        lows,
        highs,
        decay_lr_rate=0.5,
        cycle_first_step_size=up,
        cycle_second_step_size=down,
        decay_step_size=2,
        cycle_min_mom=mlows,
        cycle_max_mom=mhighs,
        decay_mom_rate=0.1,
    )
    # DeepSpeed's constructor writes the low lr and the *low* momentum, with beta2 forced to 0.99.
    assert [g["lr"] for g in optimizer.param_groups] == lows == scheduler.get_last_lr()
    assert [g["betas"] for g in optimizer.param_groups] == [(0.8, 0.99), (0.85, 0.99)]
    seq = step_all(scheduler, 31)
    for it in CHECKPOINTS:
        for g in range(2):
            lr, mom = expected_one_cycle(it, lows[g], highs[g], mlows[g], mhighs[g], up, down, 0.5, 0.1, 2)
            assert seq[it][0][g] == pytest.approx(lr, rel=1e-12), (it, g)
            assert seq[it][1][g] == pytest.approx((mom, 0.99), rel=1e-12), (it, g)
    assert seq[up - 1][0] == pytest.approx(highs)  # peak at b = up
    assert seq[up + down - 1][0] == pytest.approx(lows)  # back to the low point at the end


def test_one_cycle_without_decay_holds_the_low_point():
    scheduler = OneCycle(make_adam(1), 0.01, 0.1, cycle_first_step_size=3, decay_lr_rate=0.5)
    seq = step_all(scheduler, 12)
    assert seq[11][0] == [0.01]  # decay_step_size=0 disables decay
    assert seq[11][1] == [(0.9, 0.99)]


@pytest.mark.parametrize("up, down, up_stairs, down_stairs", [(4, 4, 2, None), (4, 6, 2, 3), (6, 6, 3, 0)])
def test_one_cycle_stairs(up, down, up_stairs, down_stairs):
    scheduler = OneCycle(
        make_adam(1),
        0.0,
        1.0,
        cycle_first_step_size=up,
        cycle_second_step_size=down,
        cycle_first_stair_count=up_stairs,
        cycle_second_stair_count=down_stairs,
    )
    seq = step_all(scheduler, up + down)
    down_stairs = up_stairs if down_stairs is None else down_stairs
    for it in range(up + down):
        want, _ = expected_one_cycle(it, 0.0, 1.0, 0.8, 0.9, up, down, up_stairs=up_stairs, down_stairs=down_stairs)
        assert seq[it][0][0] == pytest.approx(want, abs=1e-12), it
    assert seq[up - 1][0] == [1.0]  # the peak is an exact stair, not floored one stair down


def test_one_cycle_sgd_keeps_momentum_and_warns(warnings_log):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5, momentum=0.7)
    scheduler = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=2)
    assert "cycle_momentum is disabled" in warnings_log.text
    assert scheduler.get_mom() is None
    step_all(scheduler, 5)
    assert optimizer.param_groups[0]["momentum"] == 0.7
    assert "betas" not in optimizer.param_groups[0]


def test_one_cycle_momentum_off_keeps_betas():
    optimizer = make_adam(1)
    scheduler = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=2, cycle_momentum=False)
    step_all(scheduler, 3)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)


def test_one_cycle_validates_step_sizes_and_group_lists():
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(make_adam(), 0.01, 0.1, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="cycle_second_step_size"):
        OneCycle(make_adam(), 0.01, 0.1, cycle_second_step_size=-1)
    with pytest.raises(ValueError, match="cycle_max_lr"):
        OneCycle(make_adam(), 0.01, [0.1, 0.2, 0.3])


def test_one_cycle_state_dict_round_trip():
    def build():
        return OneCycle(
            make_adam(),
            [0.01, 0.02],
            0.1,
            decay_lr_rate=0.3,
            cycle_first_step_size=3,
            cycle_second_step_size=5,
            decay_step_size=2,
            decay_mom_rate=0.05,
        )

    full = step_all(build(), 20)
    first = build()
    step_all(first, 6)
    resumed = build()
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == {"last_batch_iteration": 5}
    assert step_all(resumed, 14) == full[6:]


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_matches_formula(staircase):
    optimizer = make_adam()
    lows = [1e-3, 2e-3]
    scheduler = LRRangeTest(
        optimizer,
        lr_range_test_min_lr=lows,
        lr_range_test_step_size=4,
        lr_range_test_step_rate=0.5,
        lr_range_test_staircase=staircase,
    )
    assert [g["lr"] for g in optimizer.param_groups] == lows
    assert scheduler.get_last_lr() == lows
    seq = step_all(scheduler, 20)
    for it in (0, 1, 2, 3, 4, 7, 8, 19):
        units = (it + 1) // 4 if staircase else (it + 1) / 4
        assert seq[it][0] == pytest.approx([lr * (1 + 0.5 * units) for lr in lows], rel=1e-12), it
    if staircase:
        assert seq[2][0] == lows  # flat until the first whole step
    assert seq[3][0] == pytest.approx([lr * 1.5 for lr in lows])


def test_lr_range_test_defaults_and_resume():
    scheduler = LRRangeTest(make_adam(1))
    assert (scheduler.min_lrs, scheduler.step_size, scheduler.step_rate, scheduler.staircase) == (
        [1e-3],
        2000,
        1.0,
        False,
    )
    with pytest.raises(ValueError, match="lr_range_test_step_size"):
        LRRangeTest(make_adam(1), lr_range_test_step_size=0)

    full = step_all(LRRangeTest(make_adam(), lr_range_test_step_size=3), 10)
    first = LRRangeTest(make_adam(), lr_range_test_step_size=3)
    step_all(first, 4)
    resumed = LRRangeTest(make_adam(), lr_range_test_step_size=3)
    resumed.load_state_dict(first.state_dict())
    assert step_all(resumed, 6) == full[4:]


def test_one_cycle_decay_is_continuous():
    # DeepSpeed divides by decay_step_size without flooring, so the decay moves every step.
    scheduler = OneCycle(
        make_adam(1), 0.01, 0.1, decay_lr_rate=1.0, cycle_first_step_size=1, cycle_second_step_size=1, decay_step_size=4
    )
    seq = step_all(scheduler, 5)
    assert [row[0][0] for row in seq[2:]] == pytest.approx([0.01 / (1 + d / 4) for d in (1, 2, 3)])
    assert not math.isclose(seq[2][0][0], seq[3][0][0])
