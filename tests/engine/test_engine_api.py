"""Engine bookkeeping and API: boundaries, no_sync, misuse errors, accessors, dataloader."""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.testing import RankFailed, run_on_ranks

NO_SYNC_STEPS = 2
NO_SYNC_SGD = {"lr": 0.05, "momentum": 0.9}


def _no_sync_optimizer(name: str) -> dict:
    # SGD moves the weights by the gradient itself: a gradient off by a factor (accumulation
    # steps, ranks, a micro-batch counted twice or dropped) shows in the weights. Adam's first
    # update is about lr * sign(g) and hides such factors, so it is the second case, not the only one.
    return {"type": "SGD", "params": NO_SYNC_SGD} if name == "sgd" else adamw_config(2)["optimizer"]


def _no_sync_reference(optimizer: str) -> torch.Tensor:
    """Single-process fp32: each step on the whole 12-row global batch."""
    model = make_model()
    params = _no_sync_optimizer(optimizer)["params"]
    opt = (
        torch.optim.SGD(model.parameters(), **params)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), **params)
    )
    data = global_batches(NO_SYNC_STEPS, 12)
    for step in range(NO_SYNC_STEPS):
        model(data[step], labels=data[step]).loss.backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _no_sync_equals_accumulation(stage: int):
    """Per step, two micro-batches under no_sync plus one synced backward (gas 1), and gas 3
    without no_sync; both for SGD and AdamW. Returns the final weights of each."""
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank = dist.get_rank()
    data = global_batches(NO_SYNC_STEPS, 12)
    out = {}
    for optimizer in ("sgd", "adamw"):
        for use_no_sync in (True, False):
            model = make_model()
            cfg = adamw_config(2, gas=1 if use_no_sync else 3, zero_optimization={"stage": stage})
            cfg["optimizer"] = _no_sync_optimizer(optimizer)
            engine, _, _, _ = zerotrain.initialize(model=model, config=cfg)
            for step in range(NO_SYNC_STEPS):
                for m in range(3):
                    batch = data[step, (m * 2 + rank) * 2 : (m * 2 + rank) * 2 + 2]
                    loss = engine(batch, labels=batch).loss
                    if use_no_sync and m < 2:
                        with engine.no_sync():
                            engine.backward(loss / 3)
                    elif use_no_sync:
                        engine.backward(loss / 3)
                        engine.step()
                    else:
                        engine.backward(loss)
                        engine.step()
            assert engine.global_steps == NO_SYNC_STEPS
            out[(optimizer, use_no_sync)] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_no_sync_accumulates_then_reduces(stage):
    # DeepSpeed asserts no_sync away under ZeRO 2/3, which broke HF gradient accumulation; here
    # it works at every stage (stage 2 holds full local gradients until the synced backward).
    # Both ways of accumulating must equal plain PyTorch on the whole global batch.
    references = {opt: _no_sync_reference(opt) for opt in ("sgd", "adamw")}
    init = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])
    for rank, got in enumerate(run_on_ranks(_no_sync_equals_accumulation, 2, args=(stage,))):
        for (optimizer, use_no_sync), weights in got.items():
            want = references[optimizer]
            assert not torch.equal(want, init)  # the reference moved: the comparison means something
            torch.testing.assert_close(
                weights, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {optimizer} no_sync={use_no_sync}: {m}"
            )


def _misuse(kind: str):
    import zerotrain

    model = make_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=adamw_config(2))
    batch = global_batches(1, 2)[0]
    loss = engine(batch, labels=batch).loss
    if kind == "raw_backward":  # a forward that bypasses the engine: its backward is not seen
        engine.module(batch, labels=batch).loss.backward()
    elif kind == "step_in_no_sync":
        with engine.no_sync():
            engine.backward(loss)
            engine.step()
    elif kind == "nested_no_sync":
        with engine.no_sync():
            with engine.no_sync():
                pass


@pytest.mark.parametrize(
    "kind, message",
    [
        ("raw_backward", "run the forward as engine(...)"),
        ("step_in_no_sync", "inside engine.no_sync()"),
        ("nested_no_sync", "not re-entrant"),
    ],
)
def test_misuse_gives_clear_error(kind, message):
    with pytest.raises(RankFailed, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_on_ranks(_misuse, 1, args=(kind,))


def _bookkeeping():
    import zerotrain

    model = make_model()
    cfg = adamw_config(
        2,
        gas=2,
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
    )
    engine, opt, loader, sched = zerotrain.initialize(model=model, config=cfg)
    record = []
    data = global_batches(6, 2)
    for i in range(6):
        boundary = engine.is_gradient_accumulation_boundary()
        engine.backward(engine(data[i], labels=data[i]).loss)
        engine.step()
        record.append((boundary, engine.was_step_applied(), engine.global_steps, engine.get_lr()[0]))
    engine.set_gradient_accumulation_boundary(True)
    forced = engine.is_gradient_accumulation_boundary()
    return {
        "record": record,
        "forced": forced,
        "stage": engine.zero_optimization_stage(),
        "tbs": engine.train_batch_size(),
        "loader": loader,
        "opt_is_engine_opt": opt is engine.optimizer,
        "sched_is_engine_sched": sched is engine.lr_scheduler,
        "world": engine.dp_world_size,
        "rank": engine.global_rank,
        "device": str(engine.device),
        "module_attr": engine.config is not None and engine.wte is model.wte,
    }


def test_bookkeeping_and_accessors():
    results = run_on_ranks(_bookkeeping, 2)
    r0 = results[0]
    booleans = [(b, applied) for b, applied, _, _ in r0["record"]]
    assert booleans == [(False, False), (True, True)] * 3
    assert [g for _, _, g, _ in r0["record"]] == [0, 1, 1, 2, 2, 3]
    # DeepSpeed's linear WarmupLR over 4 steps from 0 to 0.01: after k scheduler steps the
    # iteration is k - 1, so the lr is 0.01 * (k - 1) / 4.
    lrs = [lr for _, applied, _, lr in r0["record"] if applied]
    assert lrs == pytest.approx([0.0, 0.0025, 0.005])
    assert r0["forced"] is True
    assert r0["stage"] == 0 and r0["tbs"] == 8 and r0["loader"] is None
    assert r0["opt_is_engine_opt"] and r0["sched_is_engine_sched"]
    assert [r["rank"] for r in results] == [0, 1] and r0["world"] == 2
    assert r0["device"] == "cpu" and r0["module_attr"]


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return i


def _collate(items):
    return torch.tensor(items) * 100


def _dataloader():
    import zerotrain

    model = make_model()
    _, _, loader, _ = zerotrain.initialize(
        model=model, config=adamw_config(2), training_data=_Squares(), collate_fn=_collate
    )
    epochs = [[b.tolist() for b in loader] for _ in range(2)]
    return epochs, len(loader)


def test_training_data_gives_sharded_micro_batches():
    (e0, n0), (e1, n1) = run_on_ranks(_dataloader, 2)
    assert n0 == n1 == 3
    for epoch in range(2):
        seen = [x for b in e0[epoch] + e1[epoch] for x in b]
        assert sorted(seen) == [i * 100 for i in range(10)]  # disjoint, complete, collated
        assert all(len(b) <= 2 for b in e0[epoch])
    assert e0[0] != e0[1]  # reshuffled each epoch
