"""ZeRO stage 3 computes what stage 0 computes while each rank holds 1/N of the parameters."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.engine.workloads import adamw_config, assert_close_trajectory, global_batches, make_model
from zerotrain.testing import run_on_ranks

STEPS = 20


class ExternalUse(torch.nn.Module):
    """A module whose forward reads another module's parameter (not one of its own)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.mix = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        x = torch.tanh(self.mix(x) + F.linear(x, self.head.weight.t()[:32, :32]))
        logits = F.linear(x, self.embed.weight)  # tied read of embed.weight outside embed
        logits = logits + self.head(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


class Branchy(torch.nn.Module):
    """Runs its layers in a different order on every other call: prefetch must re-record."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.head = torch.nn.Linear(32, 64)
        self.calls = 0

    def forward(self, input_ids, labels=None):
        self.calls += 1
        x = self.embed(input_ids)
        for layer in self.layers if self.calls % 2 else reversed(self.layers):
            x = torch.tanh(layer(x))
        logits = self.head(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


def _make(variant: str):
    if variant in ("external", "branchy"):
        torch.manual_seed(0)
        return ExternalUse() if variant == "external" else Branchy()
    kwargs = {
        "plain": {},
        "repeat": {"block_repeats": 2},
        "reentrant": {"activation_checkpointing": "reentrant"},
        "non_reentrant": {"activation_checkpointing": "non_reentrant"},
    }[variant]
    return make_model(**kwargs)


def _zero3(stage: int, **extra) -> dict:
    zero = {
        "stage": stage,
        "stage3_param_persistence_threshold": 100,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    zero.update(extra)
    return zero


def _train(
    variant: str, stages=(0, 3), steps: int = STEPS, zero_extra: dict | None = None, precision: dict | None = None
):
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        model = _make(variant)
        cfg = adamw_config(2, zero_optimization=_zero3(stage, **(zero_extra or {})), **(precision or {}))
        engine, _, _, _ = zerotrain.initialize(model=model, config=cfg)
        data = global_batches(steps, 2 * world)
        losses, gathered_between_steps = [], []
        for step in range(steps):
            batch = data[step, rank * 2 : rank * 2 + 2]
            loss = engine(batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            gathered_between_steps.append(engine.memory_breakdown().get("gathered_parameters", 0))
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        engine.eval()
        with torch.no_grad():
            probe = data[0, :2]
            eval_logits = engine(probe, labels=probe).logits.float()
        out[stage] = {
            "losses": losses,
            "state": engine.module_state_dict(),
            "memory": engine.memory_breakdown(),
            "eval_logits": eval_logits,
            "gathered_between_steps": gathered_between_steps,
            "units": [(u.numel, u.resharded, u.layout.padded_numel) for u in getattr(engine._zero, "units", [])],
        }
        engine.destroy()
    return out


@pytest.mark.parametrize("variant", ["plain", "repeat", "reentrant", "non_reentrant", "external"])
def test_stage3_reproduces_stage0_on_two_ranks(variant):
    results = run_on_ranks(_train, 2, args=(variant,))
    for r in results:
        assert_close_trajectory(r[3]["losses"], r[0]["losses"])
        torch.testing.assert_close(r[3]["eval_logits"], r[0]["eval_logits"], rtol=1e-5, atol=1e-6)
    # The consolidated stage-3 weights (gathered to rank 0) equal stage 0's.
    state0, state3 = results[0][0]["state"], results[0][3]["state"]
    assert state0.keys() == state3.keys()
    for name in state0:
        torch.testing.assert_close(state3[name], state0[name], rtol=1e-5, atol=1e-6)


def test_prefetch_follows_a_model_that_changes_path():
    extra = {"stage3_prefetch_bucket_size": 2500}
    for r in run_on_ranks(_train, 2, args=("branchy",), kwargs={"steps": 8, "zero_extra": extra}):
        assert_close_trajectory(r[3]["losses"], r[0]["losses"])


def test_stage3_four_ranks_with_prefetch_and_live_limit():
    extra = {"stage3_prefetch_bucket_size": 3000, "stage3_max_live_parameters": 6000}
    results = run_on_ranks(_train, 4, args=("plain",), kwargs={"steps": 8, "zero_extra": extra})
    for r in results:
        assert_close_trajectory(r[3]["losses"], r[0]["losses"])
        mem = r[3]["memory"]
        largest = max(padded for _, resharded, padded in r[3]["units"] if resharded)
        # Prefetch never goes past max_live; a demanded unit may add one more unit on top.
        assert mem["peak_gathered_parameters"] <= 4 * (6000 + largest)
        assert set(r[3]["gathered_between_steps"]) == {0}


def _shard_elements(units, world):
    return sum(math.ceil(n / (world * 4)) * 4 for n, resharded, _ in units if resharded)


@pytest.mark.parametrize("world", [2, 4])
def test_between_steps_each_rank_holds_its_shard(world):
    r = run_on_ranks(_train, world, args=("plain",), kwargs={"steps": 2, "stages": (3,)})[0][3]
    p = sum(t.numel() for name, t in r["state"].items() if name != "lm_head.weight")  # tied
    partitioned = sum(n for n, resharded, _ in r["units"] if resharded)
    persistent = [padded for n, resharded, padded in r["units"] if not resharded]
    shard = _shard_elements(r["units"], world)
    # The partitioned part: ceil(P_partitioned / N) plus at most 3 alignment elements per unit.
    assert math.ceil(partitioned / world) <= shard <= math.ceil(partitioned / world) + 3 * len(r["units"])
    assert partitioned + sum(n for n, resharded, _ in r["units"] if not resharded) == p
    # Small units (< stage3_param_persistence_threshold elements) stay whole (padded).
    assert r["memory"]["parameters"] == 4 * (shard + sum(persistent))
    assert r["memory"]["gathered_parameters"] == 0
    # Gradients of every unit, partitioned or not, are kept only as this rank's shard.
    assert r["memory"]["gradients"] == 4 * sum(padded // world for _, _, padded in r["units"])


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_stage3_16bit_follows_fp32(kind):
    precision = (
        {"bf16": {"enabled": True}} if kind == "bf16" else {"fp16": {"enabled": True, "initial_scale_power": 10}}
    )
    fp32 = run_on_ranks(_train, 2, args=("plain",), kwargs={"stages": (0,), "steps": 30})[0][0]
    low = run_on_ranks(_train, 2, args=("plain",), kwargs={"stages": (3,), "steps": 30, "precision": precision})[0][3]
    gap = max(abs(a - b) / b for a, b in zip(low["losses"], fp32["losses"]))
    assert gap <= (0.02 if kind == "bf16" else 0.005), gap
    assert low["memory"]["master_parameters"] > 0
