"""Stage 3 merges units below ``stage3_param_persistence_threshold`` (zero/persistent.py): a step
issues one reduce-scatter and one all-gather per merged unit instead of one per small module,
and training is unchanged (weights = a single-process fp32 loop, SGD and AdamW)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import LR, global_batches, make_model
from zerotrain.testing import run_on_ranks

STEPS = 6
MICRO = 2
DEPTH = {"n_layer": 6}  # TINY, 6 blocks: 39 modules with parameters
# Its units: LayerNorms of 64 elements, attention/MLP Linears of 1056-4224, embeddings 512-2048.
THRESHOLDS = {"none": 0, "layernorms": 100, "all": 10**9}


def _optimizer(kind: str) -> dict:
    if kind == "sgd":
        return {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    return {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}


def _reference(kind: str, steps: int, world: int, clip: float) -> dict:
    model = make_model(**DEPTH)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if kind == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    )
    data = global_batches(steps, MICRO * world)
    norms = []
    for step in range(steps):
        model(data[step], labels=data[step]).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))))
        opt.step()
        opt.zero_grad()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms}


def _train(kind: str, threshold: int, clip: float, steps: int = STEPS, load_from=None, save_to=None):
    import torch.distributed as dist

    import zerotrain
    from zerotrain.comm import collectives

    zerotrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(**DEPTH)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": clip,
        "optimizer": _optimizer(kind),
        # No prefetch: the peak of gathered parameters shows how long units stay gathered.
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": threshold,
            "stage3_prefetch_bucket_size": 0,
        },
    }
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if load_from is not None:
        engine.load_checkpoint(load_from)
    group = engine.data_parallel_group
    data = global_batches(STEPS, MICRO * world)
    per_step, norms = [], []
    for step in range(engine.global_steps, engine.global_steps + steps):
        batch = data[step, rank * MICRO : (rank + 1) * MICRO]
        before = collectives.last_seq(group)
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()
        per_step.append(collectives.last_seq(group) - before)
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    if save_to is not None:
        engine.save_checkpoint(save_to)
    units = [(u.numel, u.resharded, u.trained) for u in engine.zero_stage_object.units]
    state = engine.module_state_dict()
    engine.destroy()
    peak = engine.memory_breakdown().get("peak_gathered_parameters", 0)
    return {"units": units, "per_step": per_step, "norms": norms, "state": state, "peak": peak}


def _assert_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(want) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_merged_persistent_units_train_like_one_process(kind):
    want = _reference(kind, STEPS, 2, clip=0.5)
    got = {name: run_on_ranks(_train, 2, args=(kind, threshold, 0.5)) for name, threshold in THRESHOLDS.items()}
    for _name, results in got.items():
        _assert_state(results[0]["state"], want["state"])
        for r in results:
            assert r["norms"] == pytest.approx(want["norms"], rel=1e-5)  # clipping active (norm > 0.5)
        assert min(want["norms"]) > 0.5
    none, layernorms, every = (got[n][0]["units"] for n in THRESHOLDS)
    total = sum(numel for numel, _, _ in none)
    assert all(resharded for _, resharded, _ in none) and len(none) > 30
    # The 13 LayerNorms (2 a block and the final one) are one unit, kept whole; the rest sharded.
    whole = [numel for numel, resharded, _ in layernorms if not resharded]
    assert whole == [13 * 64]
    assert sum(1 for _, resharded, _ in layernorms if resharded) == len(none) - 13
    # Everything under the threshold: whole units of at most an eighth of the model each (so
    # backward reduces them as it goes), holding every parameter.
    assert all(not resharded and trained for _, resharded, trained in every)
    assert sum(numel for numel, _, _ in every) == total
    assert 8 <= len(every) <= 10 and max(numel for numel, _, _ in every) <= total // 8
    # Collectives a step on the data group: per merged unit its reduce-scatter (in 1 or 2 chunks:
    # on gloo a staging slot of the largest unit's size also receives the peer's row) and its
    # all-gather after the step, and the norm's all-reduce (before the merge: one reduce-scatter
    # and one all-gather per module with parameters, ~80 a step).
    assert set(got["all"][0]["per_step"]) == {got["all"][0]["per_step"][0]}
    assert got["all"][0]["per_step"][0] <= 3 * len(every) + 1
    # Gathered units are released as backward reduces them: the merged unit, complete only when
    # the first block's LayerNorms are, does not hold back the units reduced before it.
    largest = max(numel for numel, _, _ in none)
    assert 0 < got["layernorms"][0]["peak"] <= got["none"][0]["peak"] <= 4 * 3 * largest


def test_checkpoint_moves_between_merged_and_sharded_units(tmp_path):
    # SGD with momentum: its state (the momentum buffer) is re-laid out with the units, and unlike
    # Adam it does not amplify fp32 summation-order noise in near-zero gradients.
    want = _reference("sgd", STEPS, 2, clip=0.0)
    run_on_ranks(_train, 2, args=("sgd", THRESHOLDS["none"], 0.0), kwargs={"steps": 3, "save_to": str(tmp_path / "a")})
    merged = run_on_ranks(
        _train,
        2,
        args=("sgd", THRESHOLDS["all"], 0.0),
        kwargs={"steps": 3, "load_from": str(tmp_path / "a"), "save_to": str(tmp_path / "b")},
    )
    _assert_state(merged[0]["state"], want["state"])
    back = run_on_ranks(
        _train, 2, args=("sgd", THRESHOLDS["layernorms"], 0.0), kwargs={"steps": 0, "load_from": str(tmp_path / "b")}
    )
    _assert_state(back[0]["state"], want["state"])
