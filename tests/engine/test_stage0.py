"""Stage 0 (data parallel) reproduces single-process training."""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import (
    adamw_config,
    assert_close_trajectory,
    engine_trajectory,
    global_batches,
    make_model,
    reference_trajectory,
)
from zerotrain.testing import run_on_ranks

STEPS = 20


def test_two_ranks_match_single_process_double_batch():
    micro = 2
    results = run_on_ranks(engine_trajectory, 2, args=(adamw_config(micro), STEPS))
    ref = reference_trajectory(STEPS, global_batch=2 * micro)
    for r in results:
        assert_close_trajectory(r["losses"], ref["losses"])
    # Ranks hold identical weights after training, equal to the reference's.
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), name
        # Adam normalises tiny gradients to ~lr-sized steps, so parameters near zero may differ
        # by a small fraction of one step (lr 1e-3) from rounding in the reduction.
        torch.testing.assert_close(p, ref["params"][name], rtol=1e-4, atol=1e-5)
    assert results[0]["global_steps"] == STEPS
    assert results[0]["global_samples"] == STEPS * 2 * micro


def test_accumulation_matches_larger_micro_batch():
    # micro 2 x GA 2 == micro 4 x GA 1, on 2 ranks.
    ga = run_on_ranks(engine_trajectory, 2, args=(adamw_config(2, gas=2), 8))
    ref = reference_trajectory(8, global_batch=8)
    assert_close_trajectory(ga[0]["losses"], ref["losses"])
    assert ga[0]["micro_steps"] == 16 and ga[0]["global_steps"] == 8


def test_small_buckets_and_no_overlap_give_same_result():
    # Many small buckets (launched during backward) and a single end-of-backward launch must
    # both reproduce the reference: bucketing is an implementation detail.
    ref = reference_trajectory(5, global_batch=4)
    for zero in ({"stage": 0, "reduce_bucket_size": 500}, {"stage": 0, "overlap_comm": False}):
        cfg = adamw_config(2, zero_optimization=zero)
        results = run_on_ranks(engine_trajectory, 2, args=(cfg, 5))
        assert_close_trajectory(results[0]["losses"], ref["losses"])


def test_clipping_matches_torch_clip_grad_norm():
    clip = 0.05  # small enough that every step clips
    results = run_on_ranks(engine_trajectory, 1, args=(adamw_config(4, clip=clip), 6))
    ref = reference_trajectory(6, global_batch=4, clip=clip)
    assert ref["norms"][-1] > clip
    assert_close_trajectory(results[0]["losses"], ref["losses"])
    for name, p in results[0]["params"].items():
        torch.testing.assert_close(p, ref["params"][name], rtol=1e-5, atol=1e-6)
    assert results[0]["grad_norm"] == pytest.approx(ref["norms"][-1], rel=1e-5)


def test_gradient_clipping_defaults_to_one():
    cfg = adamw_config(2)
    del cfg["gradient_clipping"]
    results = run_on_ranks(engine_trajectory, 2, args=(cfg, 4))
    ref = reference_trajectory(4, global_batch=4, clip=1.0)
    assert_close_trajectory(results[0]["losses"], ref["losses"])
    assert results[0]["grad_norm"] == pytest.approx(ref["norms"][-1], rel=1e-4)


def _memory_after_step():
    import zerotrain

    model = make_model()
    engine, opt, _, _ = zerotrain.initialize(model=model, config=adamw_config(2))
    batch = global_batches(1, 2)[0]
    engine.backward(engine(batch, labels=batch).loss)
    engine.step()
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    return engine.memory_breakdown(), n_params, n_tensors


def test_memory_breakdown_counts_held_tensors():
    (mem, n_params, n_tensors), _ = run_on_ranks(_memory_after_step, 2)
    assert mem["parameters"] == 4 * n_params
    assert mem["gradients"] == 4 * n_params  # flat buckets, no padding at stage 0
    # AdamW: exp_avg + exp_avg_sq (fp32) per element, plus one fp32 step counter per tensor.
    assert mem["optimizer_state"] == 8 * n_params + 4 * n_tensors
    assert mem["communication_buffers"] == 0
