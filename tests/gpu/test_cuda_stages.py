"""Stages 0-3 x fp32/bf16 on a CUDA device, against the single-process fp32 reference.

CI has no GPU: these skip there and run where one is at hand (``pytest -m gpu``). One process
on one device with NCCL (world size 1: every collective still runs, through NCCL), and, with two
or more devices, two ranks. Every stage x fp32/bf16/fp16 x accumulation 1/3 x SGD (clipping
1.0)/AdamW; the checks are the combination suite's (tests/engine/test_combinations.py): fp32
final weights equal the reference's (1e-4 relative: the reference runs on the CPU), 16-bit
updates of the reference's size and direction, no overflow-skipped steps; and the training
state really lives on the device."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.engine.test_combinations import ACCUMULATION, MICRO, OPTIMIZERS, PRECISIONS, STEPS, _check, _config
from tests.engine.workloads import global_batches, make_model, train_steps
from zerotrain.testing import run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

COMBOS = list(itertools.product((0, 1, 2, 3), PRECISIONS, ACCUMULATION, OPTIMIZERS))


def _train_on_device(combos) -> dict:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.accelerator import get_accelerator

    zerotrain.init_distributed()
    device = torch.device(get_accelerator().current_device_name())
    out = {}
    for stage, precision, gas, optimizer in combos:
        model = make_model()
        engine, *_ = zerotrain.initialize(
            model=model, model_parameters=model.parameters(), config=_config(stage, precision, gas, optimizer)
        )
        assert engine.device.type == device.type
        train_steps(engine, STEPS)
        devices = {p.device.type for p in engine.module.parameters()}
        devices |= {
            t.device.type
            for s in engine.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        }
        state = engine.module_state_dict()
        out[(stage, precision, gas, optimizer)] = {
            "params": {n: v.float().cpu() for n, v in state.items()},
            "devices": devices,
            "skipped": engine.skipped_steps,
            "dist_backend": dist.get_backend(),
        }
        engine.destroy()
    return out


def _assert_matches(results: dict, world: int) -> None:
    failures = []
    for stage in (0, 1, 2, 3):
        per_stage = {(p, g, o): r for (s, p, g, o), r in results.items() if s == stage}
        failures += _check(per_stage, stage, world=world, fp32_rtol=1e-4)
    for combo, r in results.items():
        if r["devices"] != {"cuda"}:
            failures.append(f"{combo}: training state on {sorted(r['devices'])}, expected cuda")
    assert not failures, "\n".join(failures)


def test_one_device_nccl():
    (results,) = run_on_ranks(_train_on_device, world_size=1, args=(COMBOS,), timeout=900)
    assert {r["dist_backend"] for r in results.values()} == {"nccl"}
    _assert_matches(results, world=1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_devices_nccl():
    per_rank = run_on_ranks(_train_on_device, world_size=2, args=(COMBOS,), timeout=900)
    for combo, r in per_rank[1].items():  # stage 3 gathers the state dict on rank 0 only
        for name, value in r["params"].items():
            assert torch.equal(value, per_rank[0][combo]["params"][name]), (combo, name)
    _assert_matches(per_rank[0], world=2)


def _shard_placement(offload: bool) -> dict:
    """bf16 stage 3 on the device: where each trained unit's shard and master live, and the
    final weights (the same whether the 16-bit shard is derived or kept)."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.accelerator import get_accelerator

    zerotrain.init_distributed()
    device = torch.device(get_accelerator().current_device_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(3, "bf16", 1, "adamw")
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    model = make_model()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = global_batches(STEPS, MICRO * world).to(device)
    for step in range(STEPS):
        batch = data[step, rank * MICRO : (rank + 1) * MICRO]
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()
    trained = [u for u in engine._zero.units if u.trained and u.resharded]
    out = {
        "derived": {u.derived for u in trained},
        "master_devices": {u.master.device.type for u in trained},
        "shard_devices": {u.shard.device.type for u in trained if not u.derived},
        "params": {n: v.float().cpu() for n, v in engine.module_state_dict().items()},
    }
    engine.destroy()
    return out


def test_bf16_stage3_derives_shards_on_device_and_keeps_them_under_optimizer_offload():
    (on_device,) = run_on_ranks(_shard_placement, world_size=1, args=(False,), timeout=900)
    (offloaded,) = run_on_ranks(_shard_placement, world_size=1, args=(True,), timeout=900)
    # Masters on the device: the 16-bit shards are cast from them at each gather.
    assert on_device["derived"] == {True} and on_device["master_devices"] == {"cuda"}
    # Masters on the host: the device keeps its 16-bit shards (no fp32 over the bus).
    assert offloaded["derived"] == {False} and offloaded["master_devices"] == {"cpu"}
    assert offloaded["shard_devices"] == {"cuda"}
    for name, value in on_device["params"].items():
        torch.testing.assert_close(offloaded["params"][name], value, rtol=1e-2, atol=1e-3)
