"""ProgressiveLayerDrop (DeepSpeed's class), SwitchableBlocks' probabilities, draws and
arithmetic, the config section's errors and the DeepSpeed import path; no process group."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.pld.models import WIDTH, Block
from tests.pld.test_pld_engine import THETA
from zerotrain.config import ConfigError, check_supported, load_config
from zerotrain.pld import ProgressiveLayerDrop, SwitchableBlocks, keep_probabilities
from zerotrain.pld.engine import PLDCheckpointState


def test_progressive_layer_drop_matches_deepspeed():
    from zerotrain.runtime.progressive_layer_drop import ProgressiveLayerDrop as DeepSpeedPath

    assert DeepSpeedPath is ProgressiveLayerDrop
    pld = ProgressiveLayerDrop()
    assert (pld.theta, pld.gamma, pld.get_theta()) == (0.5, 0.001, 1.0)
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    pld = ProgressiveLayerDrop(theta=0.5, gamma=0.1)
    for step, expected in enumerate(THETA):
        pld.update_state(step)
        assert pld.get_theta() == expected and isinstance(pld.get_theta(), np.float64)
    with pytest.raises(ValueError, match="progressive_layer_drop.theta must be > 0 and <= 1"):
        ProgressiveLayerDrop(theta=0.0)
    with pytest.raises(ValueError, match="progressive_layer_drop.gamma must be a finite number >= 0"):
        ProgressiveLayerDrop(gamma=-0.1)


def _component(steps):
    schedule = ProgressiveLayerDrop(theta=0.5, gamma=0.1)
    return schedule, PLDCheckpointState(schedule, lambda: steps)


def test_restore_without_saved_theta_recomputes_it_from_the_step():
    schedule, state = _component(7)  # a checkpoint written without theta (DeepSpeed's never has it)
    state.load_absent()
    assert schedule.get_theta() == THETA[6]
    state.load_state_dict({"current_theta": 0.75})
    assert schedule.get_theta() == 0.75
    assert state.state_dict() == {"current_theta": 0.75}
    schedule, state = _component(0)
    state.load_absent()
    assert schedule.get_theta() == 1.0


def test_config_section_defaults_and_errors():
    cfg = load_config({"train_batch_size": 8, "progressive_layer_drop": {"enabled": True}})
    check_supported(cfg)
    section = cfg.progressive_layer_drop
    assert (section.enabled, section.theta, section.gamma) == (True, 1.0, 0.001)  # DeepSpeed's constants
    assert load_config({"train_batch_size": 8}).progressive_layer_drop.enabled is False
    for bad, field in (
        ({"theta": 0}, "progressive_layer_drop.theta"),
        ({"theta": 1.5}, "progressive_layer_drop.theta"),
        ({"gamma": -1}, "progressive_layer_drop.gamma"),
        ({"theta": True}, "progressive_layer_drop.theta"),
        ({"enabled": "yes please"}, "progressive_layer_drop.enabled"),
        ({"thetta": 0.5}, "progressive_layer_drop.thetta"),
    ):
        with pytest.raises(ConfigError) as info:
            load_config({"train_batch_size": 8, "progressive_layer_drop": {"enabled": True, **bad}})
        message = str(info.value)
        assert field in message and "\n" not in message.strip(), message


def test_keep_probabilities_follow_the_paper():
    # p_l = 1 - (l / L)(1 - theta), l = 1..L: the last block kept with probability theta
    assert keep_probabilities(0.5, 4) == [0.875, 0.75, 0.625, 0.5]
    assert keep_probabilities(1.0, 3) == [1.0, 1.0, 1.0]
    stack = SwitchableBlocks([nn.Identity() for _ in range(4)], seed=3)
    step = [0]
    stack.bind(lambda: step[0])
    kept = []
    for step[0] in range(4000):
        kept.append(stack.draw(0.5))
    frequency = np.mean(np.array(kept, dtype=float), axis=0)
    np.testing.assert_allclose(frequency, [0.875, 0.75, 0.625, 0.5], atol=0.03)
    step[0] = 17
    assert stack.draw(0.5) == kept[17]  # a function of (seed, index, step) only
    other = SwitchableBlocks([nn.Identity() for _ in range(4)], seed=4)
    other.bind(lambda: step[0])
    assert [other.draw(0.5) for step[0] in range(50)] != kept[:50]


def _plain(blocks, h):
    for block in blocks:
        h = block(h)
    return h


class _TupleBlock(Block):
    def forward(self, x):
        return (super().forward(x), "attention weights")


def test_switchable_blocks_arithmetic():
    torch.manual_seed(0)
    stack = SwitchableBlocks([Block() for _ in range(3)] + [_TupleBlock()])
    stack.bind(lambda: 11)
    x = torch.randn(5, WIDTH)
    plain = _plain([lambda h, b=b: b(h)[0] if isinstance(b, _TupleBlock) else b(h) for b in stack], x)
    # No theta, theta 1.0, or eval mode: every block, exactly a plain loop.
    assert torch.equal(stack(x), plain)
    assert torch.equal(stack(x, pld_theta=1.0, progressive_layer_drop=True), plain)
    stack.eval()
    assert torch.equal(stack(x, pld_theta=0.3), plain)
    stack.train()
    # theta 0.3: the drawn blocks only, each residual branch scaled by 1 / p_l.
    kept = stack.draw(0.3)
    assert not all(kept)
    expected = x
    for block, keep, p in zip(stack, kept, keep_probabilities(0.3, 4)):
        if keep:
            out = block(expected)
            out = out[0] if isinstance(out, tuple) else out
            expected = expected + (out - expected) / p
    assert torch.equal(stack(x, pld_theta=0.3), expected)
    assert stack.last_kept == kept
    # State-dict keys are the ModuleList's.
    assert set(stack.state_dict()) == set(nn.ModuleList(list(stack)).state_dict())


def test_unbound_stack_counts_its_training_passes():
    stack = SwitchableBlocks([nn.Identity() for _ in range(6)])
    x = torch.zeros(1)
    decisions = []
    for _ in range(5):
        stack(x, pld_theta=0.2)
        decisions.append(stack.last_kept)
    twin = SwitchableBlocks([nn.Identity() for _ in range(6)])
    step = [0]
    twin.bind(lambda: step[0])
    assert decisions == [twin.draw(0.2) for step[0] in range(5)]
    stack.eval()
    stack(x, pld_theta=0.2)
    assert stack.training_passes == 5  # eval passes draw nothing
