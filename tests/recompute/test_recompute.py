"""Activation recompute (zerotrain.recompute, DeepSpeed's ``deepspeed.checkpointing``) in one
process: options, errors, gradients and RNG replay."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import zerotrain.recompute as ckpt
from zerotrain.accelerator import get_accelerator
from zerotrain.config import ConfigError
from zerotrain.recompute import recompute as ckpt_impl
from zerotrain.recompute import settings


@pytest.fixture(autouse=True)
def fresh():
    settings._unconfigure_for_tests()
    ckpt.reset_profile_totals()
    ckpt.get_cuda_rng_tracker().reset()
    yield
    settings._unconfigure_for_tests()
    ckpt.get_cuda_rng_tracker().reset()


class Block(torch.nn.Module):
    def __init__(self, width=16, tracked_dropout=False):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(0.3)
        self.tracked_dropout = tracked_dropout

    def forward(self, x, scale=None):
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.tracked_dropout:
            with ckpt.get_cuda_rng_tracker().fork():
                h = self.drop(h)
        else:
            h = self.drop(h)
        out = x + self.fc2(h)
        return out * scale if scale is not None else out


def _grads(blocks, x, wrap):
    x = x.clone().requires_grad_(True)
    h = x
    for block in blocks:
        h = wrap(block, h)
    (h.square().mean()).backward()
    grads = [p.grad.clone() for b in blocks for p in b.parameters()] + [x.grad.clone()]
    for b in blocks:
        b.zero_grad(set_to_none=True)
    return grads


def _plain(block, h):
    return block(h)


@pytest.mark.parametrize("function", [ckpt.checkpoint, ckpt.non_reentrant_checkpoint])
@pytest.mark.parametrize("tracked", [False, True])
def test_gradients_equal_uncheckpointed_with_dropout_replayed(function, tracked):
    torch.manual_seed(0)
    blocks = [Block(tracked_dropout=tracked) for _ in range(3)]
    x = torch.randn(4, 8, 16)
    ckpt.model_parallel_cuda_manual_seed(1234)
    cpu, tracker = torch.get_rng_state(), ckpt.get_cuda_rng_tracker().get_states()
    expected = _grads(blocks, x, _plain)
    torch.set_rng_state(cpu)
    ckpt.get_cuda_rng_tracker().set_states(tracker)
    got = _grads(blocks, x, lambda b, h: function(b, h))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert ckpt.profile_totals()["recompute_calls"] >= 3  # it did recompute


def test_tracker_states_are_what_recomputation_replays():
    """Without restoring the tracker the recomputed dropout mask differs: the test can fail."""
    torch.manual_seed(0)
    block = Block(tracked_dropout=True)
    x = torch.randn(2, 4, 16, requires_grad=True)
    ckpt.model_parallel_cuda_manual_seed(7)
    out = ckpt.checkpoint(block, x)
    ckpt.get_cuda_rng_tracker().add("other", 99)  # a state added after the forward ...
    with ckpt.get_cuda_rng_tracker().fork():  # ... and the model-parallel state moved on
        torch.rand(10)
    states_before_backward = ckpt.get_cuda_rng_tracker().get_states()
    out.sum().backward()
    # Backward put the outside states back (a recomputation must not advance them).
    after = ckpt.get_cuda_rng_tracker().get_states()
    assert after.keys() == states_before_backward.keys()
    for name in after:
        assert torch.equal(after[name], states_before_backward[name])


def test_keyword_tensor_arguments_take_part_in_autograd():
    torch.manual_seed(0)
    block = Block()
    block.drop.p = 0.0
    x = torch.randn(2, 4, 16, requires_grad=True)
    scale = torch.tensor(3.0, requires_grad=True)
    ckpt.checkpoint(block, x, scale=scale).sum().backward()
    expected = torch.autograd.grad(block(x, scale=scale).sum(), scale)[0]
    torch.testing.assert_close(scale.grad, expected)


def test_profile_logs_and_sums_recompute_time():
    ckpt.configure(None, profile=True)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zerotrain").addHandler(handler)
    try:
        block = Block()
        x = torch.randn(2, 4, 16, requires_grad=True)
        ckpt.checkpoint(block, x).sum().backward()
    finally:
        logging.getLogger("zerotrain").removeHandler(handler)
    totals = ckpt.profile_totals()
    assert totals["forward_calls"] == totals["recompute_calls"] == 1
    assert totals["recompute_seconds"] > 0 and totals["forward_seconds"] > 0
    messages = [r.getMessage() for r in records]
    assert any(m.startswith("zerotrain.checkpointing: recompute of Block took") for m in messages), messages


def test_synchronize_at_each_boundary(monkeypatch):
    calls = []
    monkeypatch.setattr(type(get_accelerator()), "synchronize", lambda self, index=None: calls.append(1))
    block, x = Block(), torch.randn(2, 4, 16, requires_grad=True)
    ckpt.checkpoint(block, x).sum().backward()
    assert calls == []
    ckpt.configure(synchronize=True)
    ckpt.checkpoint(block, x).sum().backward()
    assert len(calls) == 4  # before/after the forward, before/after the recomputation


@pytest.mark.parametrize("function", [ckpt.checkpoint, ckpt.non_reentrant_checkpoint])
def test_checkpoint_in_cpu_moves_exactly_the_saved_inputs(monkeypatch, function):
    """On an accelerator the region's inputs go to the host and come back; on the CPU the
    same hooks run with every tensor treated as off-host, so the test sees what is moved."""
    moved = []
    real_to_host = ckpt_impl._to_host

    def tracking_to_host(tensor):
        moved.append(tuple(tensor.shape))
        return real_to_host(tensor)

    block = Block()
    block.drop.p = 0.0
    x = torch.randn(2, 4, 16)
    expected = _grads([block], x, _plain)
    ckpt.configure(checkpoint_in_cpu=True)
    monkeypatch.setattr(ckpt_impl, "_on_host", lambda tensor: False)
    monkeypatch.setattr(ckpt_impl, "_to_host", tracking_to_host)
    got = _grads([block], x, lambda b, h: function(b, h))
    monkeypatch.undo()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    # Only the input (2 x 4 x 16 fp32) was saved under the hooks, not the 4x wider activations.
    assert ckpt.profile_totals()["inputs_to_host_bytes"] == 2 * 4 * 16 * 4
    assert moved == [(2, 4, 16)]


def test_checkpoint_in_cpu_leaves_host_tensors_in_place():
    ckpt.configure(checkpoint_in_cpu=True)
    x = torch.randn(2, 4, 16, requires_grad=True)
    ckpt.checkpoint(Block(), x).sum().backward()
    assert ckpt.profile_totals()["inputs_to_host_bytes"] == 0 and x.grad is not None


def test_configure_reads_the_config_section_and_arguments_override(tmp_path):
    section = {
        "partition_activations": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 4,
        "cpu_checkpointing": True,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": section}))
    assert not ckpt.is_configured()
    for source in (str(path), {"activation_checkpointing": section}):
        ckpt.configure(None, deepspeed_config=source)
        s = settings.current()
        assert ckpt.is_configured()
        assert (
            s.partition_activations,
            s.contiguous_checkpointing,
            s.num_checkpoints,
            s.checkpoint_in_cpu,
            s.synchronize,
            s.profile,
        ) == (True, True, 4, True, True, True)
    ckpt.configure(None, deepspeed_config=str(path), checkpoint_in_cpu=False, profile=False)
    assert not settings.current().checkpoint_in_cpu and not settings.current().profile
    assert settings.current().synchronize
    ckpt.configure(num_checkpoints=12)  # seed 002's call: no mpu argument, defaults otherwise
    s = settings.current()
    assert s.num_checkpoints == 12 and not s.checkpoint_in_cpu and not s.partition_activations
    ckpt.reset()  # DeepSpeed's buffer reset: the options stay
    assert settings.current() == s
    ckpt.set_num_layers(3)
    ckpt.partition_activations_in_checkpoint(True)
    assert (settings.current().num_checkpoints, settings.current().partition_activations) == (3, True)


class _Mpu:
    def __init__(self, size):
        self.size = size

    def get_model_parallel_world_size(self):
        return self.size

    def get_model_parallel_rank(self):
        return 1


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"contiguous_checkpointing": True, "num_checkpoints": 2}, ValueError, "needs partition_activations"),
        ({"contiguous_checkpointing": True, "partition_activations": True}, ValueError, "needs num_checkpoints"),
        ({"num_checkpoints": 0}, ValueError, "num_checkpoints must be a positive integer"),
        ({"mpu_": _Mpu(2), "partition_activations": True}, NotImplementedError, "get_model_parallel_world_size() is 2"),
        (
            {"deepspeed_config": {"activation_checkpointing": {"profile": "often"}}},
            ConfigError,
            "activation_checkpointing.profile",
        ),
        (
            {"deepspeed_config": {"activation_checkpointing": {"cpu_checkpoint": True}}},
            ConfigError,
            "cpu_checkpointing",
        ),
    ],
)
def test_configure_errors_name_the_option(kwargs, error, words):
    with pytest.raises(error) as info:
        ckpt.configure(**kwargs)
    assert words in str(info.value), str(info.value)


def test_mpu_of_one_model_parallel_rank_and_rng_tracker():
    ckpt.configure(_Mpu(1), partition_activations=True)  # no model parallelism: accepted, no effect
    ckpt.model_parallel_cuda_manual_seed(10)  # the mpu's rank (1) offsets the model-parallel seed
    tracker = ckpt.get_cuda_rng_tracker()
    assert set(tracker.get_states()) == {ckpt.MODEL_PARALLEL_RNG_TRACKER_NAME}
    with tracker.fork():
        forked = torch.rand(3)
    torch.manual_seed(10 + 2718 + 1)
    assert torch.equal(forked, torch.rand(3))
    with pytest.raises(ValueError, match="already"):
        tracker.add(ckpt.MODEL_PARALLEL_RNG_TRACKER_NAME, 5)
    with pytest.raises(KeyError, match="no state named 'missing'"):
        with tracker.fork("missing"):
            pass
