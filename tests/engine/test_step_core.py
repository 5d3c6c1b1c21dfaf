"""The step core (engine/step_core.py): the training state through forward, backward, no_sync and
step, what each step() did, the misuse it refuses (with the messages engine.step/no_sync always
gave), and that the data-parallel and the pipeline engine hold the one core type.

One spawned process (one rank) runs every engine check; the core's own rules run in this process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.engine.step_core import StepCore, StepOutcome, StepSettings, TrainingState
from zerotrain.testing import run_on_ranks

FP16 = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 8,
    "loss_scale_window": 4,
    "hysteresis": 2,
    "min_loss_scale": 16,
}


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _data_parallel_states() -> dict:
    import zerotrain

    out: dict = {}
    model = make_model()
    engine, opt, _, _ = zerotrain.initialize(model=model, config=adamw_config(2, gas=2, fp16=FP16))
    seen: list = []
    model.register_forward_pre_hook(lambda *_: seen.append(("forward", engine.training_state)))
    opt.register_step_pre_hook(lambda *_: seen.append(("optimizer.step", engine.training_state)))
    out["initial"] = (engine.training_state, engine.step_outcome, engine.was_step_applied())
    batch = global_batches(1, 2)[0]

    def backward(loss, plain: bool = False):
        loss.register_hook(lambda g: seen.append(("backward", engine.training_state)) or g)
        if plain:
            engine.scale(loss).backward()
        else:
            engine.backward(loss)

    # micro-step 1 of 2: inside no_sync, then a step that only counts it
    with engine.no_sync():
        out["in_no_sync"] = engine.training_state
        backward(engine(batch, labels=batch).loss)
        out["after_backward_in_no_sync"] = engine.training_state
    out["after_no_sync"] = engine.training_state
    engine.step()
    out["after_accumulating_step"] = (
        engine.step_outcome,
        engine.was_step_applied(),
        engine.micro_steps,
        engine.global_steps,
    )
    # micro-step 2 of 2: a backward the engine did not start, then the boundary step
    before = _weights(model)
    backward(engine(batch, labels=batch).loss, plain=True)
    out["after_plain_backward"] = engine.training_state
    engine.step()
    out["after_boundary_step"] = (
        engine.step_outcome,
        engine.was_step_applied(),
        engine.micro_steps,
        engine.global_steps,
        engine.training_state,
    )
    out["moved"] = not torch.equal(before, _weights(model))
    # an overflow at the boundary: skipped, nothing moves
    engine.set_gradient_accumulation_boundary(True)
    before = _weights(model)
    backward(engine(batch, labels=batch).loss * float("inf"))
    engine.step()
    out["after_overflow_step"] = (
        engine.step_outcome,
        engine.was_step_applied(),
        engine.skipped_steps,
        torch.equal(before, _weights(model)),
        opt.overflow,
    )
    out["seen"] = seen
    # misuse: same messages as before the core; the state comes back to IDLE
    errors = []
    try:
        with engine.no_sync():
            engine.step()
    except RuntimeError as error:
        errors.append(str(error))
    try:
        with engine.no_sync(), engine.no_sync():
            pass
    except RuntimeError as error:
        errors.append(str(error))
    out["errors"], out["after_errors"] = errors, engine.training_state
    # the counters are the core's: the engine's attributes read and write them
    engine.global_steps = 7
    out["counters_shared"] = engine._core.global_steps == 7 and engine.global_steps == 7
    out["core_type"] = type(engine._core)
    engine.destroy()
    return out


def _pipeline_states() -> dict:
    import zerotrain
    from zerotrain.engine.engine import ZeroTrainEngine
    from zerotrain.pipeline import PipelineError, PipelineModule

    torch.manual_seed(0)
    module = PipelineModule([nn.Linear(4, 4), nn.Linear(4, 4)], num_stages=1, loss_fn=nn.functional.mse_loss)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, opt, _, _ = zerotrain.initialize(model=module, config=cfg)
    seen: list = []
    opt.register_step_pre_hook(lambda *_: seen.append(engine.training_state))
    out = {
        "core_type": type(engine._core),
        "is_engine": isinstance(engine, ZeroTrainEngine),
        "initial": (engine.training_state, engine.step_outcome),
    }
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)) for _ in range(2)]
    before = _weights(module)
    engine.train_batch(iter(data))
    out["after_train_batch"] = (
        engine.training_state,
        engine.step_outcome,
        engine.was_step_applied(),
        engine.micro_steps,
        engine.global_steps,
        engine.global_samples,
    )
    out["moved"] = not torch.equal(before, _weights(module))
    out["seen"] = seen
    refused = []
    for call in (lambda: engine(data[0][0]), lambda: engine.backward(torch.ones(())), engine.step):
        try:
            call()
        except PipelineError as error:
            refused.append(str(error))
    out["refused"] = refused
    engine.destroy()
    return out


def _both_engines() -> dict:
    import zerotrain

    zerotrain.init_distributed()
    return {"data_parallel": _data_parallel_states(), "pipeline": _pipeline_states()}


@pytest.fixture(scope="module")
def engines() -> dict:
    return run_on_ranks(_both_engines, 1)[0]


def test_states_through_forward_backward_no_sync_and_step(engines):
    got = engines["data_parallel"]
    S = TrainingState
    assert got["initial"] == (S.IDLE, StepOutcome.NONE, False)
    assert got["in_no_sync"] is S.NO_SYNC
    assert got["after_backward_in_no_sync"] is S.NO_SYNC  # back to the state between passes
    assert got["after_no_sync"] is S.IDLE
    assert got["after_accumulating_step"] == (StepOutcome.ACCUMULATED, False, 1, 0)
    assert got["after_plain_backward"] is S.IDLE
    assert got["after_boundary_step"] == (StepOutcome.APPLIED, True, 2, 1, S.IDLE)
    assert got["moved"]
    # three forwards, three backwards (explicit, loss.backward() through the outputs, explicit),
    # one optimizer step: each saw its own phase
    assert got["seen"] == [
        ("forward", S.FORWARD),
        ("backward", S.BACKWARD),
        ("forward", S.FORWARD),
        ("backward", S.BACKWARD),
        ("optimizer.step", S.STEPPING),
        ("forward", S.FORWARD),
        ("backward", S.BACKWARD),
    ]


def test_overflow_is_a_skipped_step(engines):
    outcome, applied, skipped, unchanged, overflow = engines["data_parallel"]["after_overflow_step"]
    assert (outcome, applied, skipped, unchanged, overflow) == (StepOutcome.SKIPPED, False, 1, True, True)


def test_misuse_keeps_its_messages(engines):
    got = engines["data_parallel"]
    assert got["errors"] == [
        (
            "engine.step() was called inside engine.no_sync(): gradients there are not reduced across ranks; "
            "leave the no_sync() block before stepping"
        ),
        "engine.no_sync() is not re-entrant",
    ]
    assert got["after_errors"] is TrainingState.IDLE
    assert got["counters_shared"]


def test_both_engines_hold_the_one_core(engines):
    dp, pipe = engines["data_parallel"], engines["pipeline"]
    assert dp["core_type"] is StepCore and pipe["core_type"] is StepCore
    assert pipe["is_engine"]  # DeepSpeed's PipelineEngine is a DeepSpeedEngine
    assert pipe["initial"] == (TrainingState.IDLE, StepOutcome.NONE)
    # one train_batch: 2 micro-steps, 1 global step of 4 samples, applied through the core
    assert pipe["after_train_batch"] == (TrainingState.IDLE, StepOutcome.APPLIED, True, 2, 1, 4)
    assert pipe["moved"] and pipe["seen"] == [TrainingState.STEPPING]
    assert pipe["refused"] == ["Only train_batch() is accessible in pipeline mode."] * 3


class _Scaler:
    loss_scale = 8.0


def _bare_core(accumulation: int) -> StepCore:
    settings = StepSettings(
        gradient_clipping=0.0,
        steps_per_print=None,
        train_batch_size=4 * accumulation,
        micro_batch_size=4,
        accumulation_steps=accumulation,
    )
    return StepCore(
        _bare_core,
        settings,
        zero=None,
        loss_scaler=_Scaler(),
        check_overflow=False,
        optimizer_surface=None,
        timers=None,
        monitor=None,
        topology=None,
    )


def test_core_rules_without_an_engine():
    core = _bare_core(accumulation=4)
    # boundary every 4th micro-step until overridden; the factor is the loss scale over 4
    assert [core.is_boundary() or core.count_micro_steps() for _ in range(4)] == [None, None, None, True]
    core.boundary_override = False
    assert not core.is_boundary()
    assert core.backward_factor() == 2.0 and core.backward_factor(loss_scaled=True) == 0.25
    assert core.backward_factor(scale_wrt_gas=False) == 8.0
    # a phase ends with its block, also when the block raises; phases are the passes only
    with pytest.raises(KeyError), core.phase(TrainingState.FORWARD):
        assert core.state is TrainingState.FORWARD
        raise KeyError
    assert core.state is TrainingState.IDLE
    with pytest.raises(ValueError, match="phase"), core.phase(TrainingState.NO_SYNC):
        pass
    core.begin_phase(TrainingState.BACKWARD)
    with core.no_sync():
        assert core.state is TrainingState.BACKWARD and core.in_no_sync
        core.end_phase(TrainingState.BACKWARD)
        assert core.state is TrainingState.NO_SYNC
    core.resize(32, 8, 1)
    assert (core.train_batch_size, core.accumulation_steps, core.backward_factor()) == (32, 1, 8.0)
