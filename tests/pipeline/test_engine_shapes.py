"""Input shapes that change between batches (``PipelineModule(dynamic_shape=True)``,
``engine.reset_activation_shape()``) against one process on the same (B, T, H) micro-batches.

torch's pipeline stages infer what crosses stages once; the engine rebuilds them when the first
stage's input shapes change. Checked at P=2 (and P=2 x D=2 for dynamic shapes), 1F1B and GPipe:
- ``dynamic_shape=True``, T = 3, 5, 5, 2, 4 over five batches: every weight within 1e-6 of the
  reference after every step, the returned losses equal to the reference's, and the stages
  rebuilt exactly at the three changes;
- without it: a changed T raises one line naming ``dynamic_shape`` on every stage (weights
  untouched, the batch is dropped); after ``reset_activation_shape()`` on every stage the same
  shapes train on the reference trajectory; ``eval_batch`` with another micro-batch size after
  a reset matches the reference's loss;
- micro-batches of different shapes within one batch raise on every stage, naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.testing import run_on_ranks

H, MICRO, M, LR = 6, 2, 4, 0.1
DYNAMIC_T = [3, 5, 5, 2, 4]


def _layers() -> list:
    torch.manual_seed(0)
    return [nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H), nn.Linear(H, H)]


def _batch(seed: int, t: int, dp: int, micro: int = MICRO) -> list:
    """``[data rank][micro-batch] -> (inputs, labels)``, inputs (micro, t, H)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(micro, t, H, generator=g), torch.randn(micro, t, H, generator=g)) for _ in range(M)]
        for _ in range(dp)
    ]


def _optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


class _Reference:
    def __init__(self):
        layers = _layers()
        self.model = nn.Sequential(*layers)
        self.names = {f"{i}.{n}": p for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
        self.opt = _optimizer(self.model.parameters())

    def step(self, batch) -> float:
        total = 0.0
        for rank in batch:
            for x, y in rank:
                loss = nn.functional.mse_loss(self.model(x), y)
                (loss / (M * len(batch))).backward()
                total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad()
        return total / (M * len(batch))

    def weights(self) -> dict:
        return {n: p.detach().clone() for n, p in self.names.items()}


def _engine(dynamic: bool, schedule: str, micro: int = MICRO):
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    model = PipelineModule(
        _layers(), num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform", dynamic_shape=dynamic
    )
    dp = model.mpu().get_data_parallel_world_size()
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": M,
        "train_batch_size": micro * M * dp,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 1},
        "pipeline": {"schedule": schedule},
    }
    engine, *_ = zerotrain.initialize(model=model, optimizer=_optimizer, config=config)
    return engine, dp


def _snapshot(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _dynamic(schedules: list) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for schedule in schedules:
        engine, dp = _engine(True, schedule)
        rank = engine.topology.data_rank
        losses, weights, rebuilds = [], [], []
        for step, t in enumerate(DYNAMIC_T):
            losses.append(float(engine.train_batch(iter(_batch(step, t, dp)[rank]))))
            weights.append(_snapshot(engine))
            rebuilds.append(engine._runner.shapes.rebuilds)
        out[schedule] = {"losses": losses, "weights": weights, "rebuilds": rebuilds}
        engine.destroy()
    return out


def _check_dynamic(results: list, dp: int) -> None:
    for schedule in results[0]:
        ref = _Reference()
        for step, t in enumerate(DYNAMIC_T):
            want_loss = ref.step(_batch(step, t, dp))
            want = ref.weights()
            for rank, res in enumerate(results):
                got = res[schedule]
                assert got["losses"][step] == pytest.approx(want_loss, rel=1e-6), (schedule, rank, step)
                for name, value in got["weights"][step].items():
                    err = float((value - want[name]).norm() / want[name].norm())
                    assert err <= 1e-6, (schedule, rank, step, name, err)
        for res in results:
            assert res[schedule]["rebuilds"] == [0, 1, 1, 2, 3]


def test_dynamic_shape_two_stages():
    _check_dynamic(run_on_ranks(_dynamic, world_size=2, args=(["1f1b", "gpipe"],), timeout=600), dp=1)


def test_dynamic_shape_two_stages_two_replicas():
    _check_dynamic(run_on_ranks(_dynamic, world_size=4, args=(["1f1b"],), timeout=600), dp=2)


def _static() -> dict:
    import zerotrain

    zerotrain.init_distributed()
    engine, dp = _engine(False, "1f1b")
    rank = engine.topology.data_rank
    out = {"first": engine.is_first_stage()}
    engine.train_batch(iter(_batch(0, 3, dp)[rank]))
    out["after_0"] = _snapshot(engine)
    try:
        engine.train_batch(iter(_batch(1, 5, dp)[rank]))
        out["changed"] = None
    except ValueError as error:
        out["changed"] = str(error)
    out["after_changed"] = _snapshot(engine)
    mixed = _batch(2, 3, dp)[rank]
    mixed[2] = (torch.randn(MICRO, 4, H), torch.randn(MICRO, 4, H))
    try:
        engine.train_batch(iter(mixed))
        out["mixed"] = None
    except ValueError as error:
        out["mixed"] = str(error)
    engine.reset_activation_shape()
    engine.train_batch(iter(_batch(1, 5, dp)[rank]))  # the dropped batch, now accepted
    out["after_reset"] = _snapshot(engine)
    engine.train_batch(iter(_batch(3, 5, dp)[rank]))  # the same shapes: no reset needed
    out["after_same"] = _snapshot(engine)
    engine.reset_activation_shape()  # evaluation with another micro-batch size (DeepSpeed #3045)
    out["eval"] = float(engine.eval_batch(iter(_batch(4, 2, dp, micro=3)[rank])))
    out["rebuilds"] = engine._runner.shapes.rebuilds
    engine.destroy()
    return out


def test_changed_shape_without_dynamic_shape_raises_then_reset_activation_shape():
    results = run_on_ranks(_static, world_size=2, timeout=600)
    ref = _Reference()
    ref.step(_batch(0, 3, 1))
    after_0 = ref.weights()
    ref.step(_batch(1, 5, 1))
    after_reset = ref.weights()
    ref.step(_batch(3, 5, 1))
    after_same = ref.weights()
    with torch.no_grad():
        want_eval = float(
            torch.stack([nn.functional.mse_loss(ref.model(x), y) for x, y in _batch(4, 2, 1, 3)[0]]).mean()
        )
    for res in results:
        changed = res["changed"]
        assert changed is not None and "\n" not in changed and "dynamic_shape=True" in changed, changed
        assert "reset_activation_shape()" in changed
        if res["first"]:
            assert "were [2, 3, 6] float32, now [2, 5, 6] float32" in changed, changed
        mixed = res["mixed"]
        assert mixed is not None and "\n" not in mixed and mixed.startswith("pipeline micro-batch 2 has other"), mixed
        for name, value in res["after_changed"].items():
            assert torch.equal(value, res["after_0"][name])  # the refused batches changed nothing
        for snapshot, want in (
            (res["after_0"], after_0),
            (res["after_reset"], after_reset),
            (res["after_same"], after_same),
        ):
            for name, value in snapshot.items():
                torch.testing.assert_close(value, want[name], rtol=1e-6, atol=0)
        assert res["eval"] == pytest.approx(want_eval, rel=1e-6)
        assert res["rebuilds"] == 2
