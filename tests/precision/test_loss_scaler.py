"""DynamicLossScaler follows DeepSpeed's documented rules, checked against an independent model."""

from __future__ import annotations

import pytest

from zerotrain.precision import DynamicLossScaler, LossScaler


def reference_scales(overflows, init, window, hysteresis, min_scale, consecutive=False):
    """The documented rules, written out plainly: returns the scale in force at each step."""
    scale, tolerance, last_overflow, out = init, hysteresis, -1, []
    for it, overflow in enumerate(overflows):
        out.append(scale)
        if overflow:
            if tolerance > 1:
                tolerance -= 1
            else:
                scale = max(scale / 2, min_scale)
            last_overflow = it
        else:
            if consecutive:
                tolerance = hysteresis
            if (it - last_overflow) % window == 0:
                scale *= 2
                tolerance = hysteresis
    return out


PATTERNS = {
    "isolated": [i in (3, 11, 12, 20) for i in range(30)],
    "burst_to_min": [3 <= i < 15 for i in range(30)],
    "alternating": [i % 2 == 0 for i in range(30)],
    "clean": [False] * 30,
}


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_scale_sequence_matches_documented_rules(pattern, consecutive):
    overflows = PATTERNS[pattern]
    scaler = DynamicLossScaler(
        init_scale=2.0**6, scale_window=4, min_scale=2.0, hysteresis=2, consecutive_hysteresis=consecutive
    )
    got = []
    for overflow in overflows:
        got.append(scaler.loss_scale)
        scaler.update(overflow)
    assert got == reference_scales(overflows, 2.0**6, 4, 2, 2.0, consecutive)


def test_burst_reaches_min_scale_and_stays_there():
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=100, min_scale=2.0, hysteresis=1)
    for _ in range(10):
        scaler.update(True)
    assert scaler.loss_scale == 2.0


def test_at_min_scale_warns_and_keeps_going_unless_asked_to_raise(caplog):
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=2.0, hysteresis=1)
    import logging

    logging.getLogger("zerotrain").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="zerotrain"):
            scaler.update(True)
    finally:
        logging.getLogger("zerotrain").propagate = False
    assert "minimum loss scale" in caplog.text and "bf16" in caplog.text
    strict = DynamicLossScaler(init_scale=2.0, min_scale=2.0, hysteresis=1, raise_error_at_min_scale=True)
    with pytest.raises(FloatingPointError, match="bf16"):
        strict.update(True)


def test_state_round_trip_continues_the_sequence():
    a = DynamicLossScaler(init_scale=2.0**10, scale_window=3, hysteresis=2)
    for overflow in [False, True, False, False, True, True]:
        a.update(overflow)
    b = DynamicLossScaler(scale_window=3, hysteresis=2)  # settings come from the config
    b.load_state_dict(a.state_dict())
    for overflow in [False] * 7 + [True]:
        a.update(overflow)
        b.update(overflow)
        assert a.loss_scale == b.loss_scale


def test_static_scale_never_changes():
    scaler = LossScaler(128.0)
    scaler.update(True)
    scaler.update(False)
    assert scaler.loss_scale == 128.0
