"""16-bit training steps the fp32 masters a chunk at a time, with the same result as one step.

The fp32 copies of the gradients exist for one chunk at a time (the step's peak on the bf16
110M GPT-2). Stepping in chunks must change nothing: the weights after several steps are
bit-identical to those of an optimizer that steps everything in one call (a subclass that
overrides ``step``, which the core does not chunk), for SGD with momentum and for AdamW, at
stages 1-3, with clipping (the scale is applied per chunk).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import make_model, train_steps
from zerotrain.testing import run_on_ranks

STEPS = 4
MICRO = 2


class _WholeAdamW(torch.optim.AdamW):
    def step(self, closure=None):  # overridden: the core steps it in one call
        return super().step(closure)


class _WholeSGD(torch.optim.SGD):
    def step(self, closure=None):
        return super().step(closure)


def _train(stage: int, optimizer: str, whole: bool) -> dict:
    import zerotrain

    model = make_model()
    params = list(model.parameters())
    if optimizer == "sgd":
        cls = _WholeSGD if whole else torch.optim.SGD
        opt = cls(params, lr=0.05, momentum=0.9)
    else:
        cls = _WholeAdamW if whole else torch.optim.AdamW
        opt = cls(params, lr=2e-3, weight_decay=0.1, eps=1e-6)
    calls, step = [], opt.step

    def counted_step(*args, **kwargs):  # on the instance, as an LR scheduler wraps it
        calls.append(1)
        return step(*args, **kwargs)

    opt.step = counted_step
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": whole,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000},
    }
    engine, *_ = zerotrain.initialize(model=model, optimizer=opt, config=cfg)
    train_steps(engine, STEPS)
    masters = [m.detach().clone() for m in engine._zero.masters]
    chunks = len(engine._zero._step_chunks(opt))
    engine.destroy()
    return {"masters": masters, "calls": len(calls), "chunks": chunks}


def _compare(stage: int) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    return {(opt, whole): _train(stage, opt, whole) for opt in ("sgd", "adamw") for whole in (False, True)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_chunked_step_equals_one_step(stage):
    for result in run_on_ranks(_compare, world_size=2, args=(stage,), timeout=300):
        for opt in ("sgd", "adamw"):
            chunked, whole = result[(opt, False)], result[(opt, True)]
            assert chunked["chunks"] > 1, "the tiny model should step in several chunks"
            assert chunked["calls"] == STEPS * chunked["chunks"]
            assert whole["chunks"] == 1 and whole["calls"] == STEPS
            for a, b in zip(chunked["masters"], whole["masters"]):
                assert torch.equal(a, b), f"stage {stage} {opt}: chunked step differs"
