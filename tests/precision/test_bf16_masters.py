"""bf16 master weights and optimizer states (``bf16.bf16_master_weights_and_grads`` with
``bf16.bf16_optimizer_states``): the optimizer steps the bf16 shards and keeps bf16 moments.

Compared with a single-process reference doing the same bf16 arithmetic: torch AdamW/SGD on a
bf16 model (fused AdamW, as the config's "AdamW" builds), each rank's gradient computed on its
rows, averaged in bf16 as the reduction does
(each divided by 2, then summed); weights must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import LR, global_batches, make_model
from zerotrain.config import check_supported, load_config
from zerotrain.testing import run_on_ranks

STEPS = 4
MICRO = 2
WORLD = 2
BF16_MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


def _config(stage: int, bf16: dict, optimizer: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": optimizer,
        "zero_optimization": {"stage": stage},
        "bf16": bf16,
    }


def _state_bytes(opt) -> tuple[int, int]:
    """(bytes of every tensor in optimizer.state, bytes of the moments/momentum alone)."""
    tensors = [(k, v) for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)]
    total = sum(v.numel() * v.element_size() for _, v in tensors)
    moments = sum(v.numel() * v.element_size() for k, v in tensors if k != "step")
    return total, moments


def _train_engines(runs, checkpoint_dir=None):
    """On each rank: one engine per (stage, bf16 section, optimizer); weights, state, memory;
    then, with ``checkpoint_dir``, the checkpoint round trips of ``_resumes``."""
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank = dist.get_rank()
    data = global_batches(STEPS, MICRO * WORLD)
    out = []
    for stage, bf16, optimizer in runs:
        model = make_model()
        engine, opt, _, _ = zerotrain.initialize(model=model, config=_config(stage, bf16, optimizer))
        for step in range(STEPS):
            batch = data[step, rank * MICRO : (rank + 1) * MICRO]
            engine.backward(engine(batch, labels=batch).loss)
            engine.step()
        total, moments = _state_bytes(opt)
        out.append(
            {
                "state": {n: v.clone() for n, v in engine.module_state_dict().items()},
                "stepped_dtypes": {p.dtype for g in opt.param_groups for p in g["params"]},
                "state_dtypes": {k: v.dtype for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)},
                "state_bytes": total,
                "moment_bytes": moments,
                "memory": engine.memory_breakdown(),
                "accessors": (engine.bf16_master_weights_and_gradients(), engine.bf16_optimizer_states()),
                "skipped": engine.skipped_steps,
            }
        )
        engine.destroy()
    if checkpoint_dir is not None:
        out.append(_resumes(checkpoint_dir, data, rank))
    return out


def _resumes(path, data, rank) -> dict:
    """Save after 2 steps, take a third; a fresh engine loading the checkpoint takes the same
    third step: {stage: whether the weights are bit-identical, and the reloaded state's dtypes}."""
    import zerotrain

    def step(engine, s):
        batch = data[s, rank * MICRO : (rank + 1) * MICRO]
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()

    out = {}
    for stage in (1, 3):
        engine, _, _, _ = zerotrain.initialize(model=make_model(), config=_config(stage, BF16_MASTERS, ADAMW))
        step(engine, 0)
        step(engine, 1)
        engine.save_checkpoint(path, tag=f"stage{stage}")
        step(engine, 2)
        want = engine.module_state_dict()
        engine.destroy()
        engine, opt, _, _ = zerotrain.initialize(model=make_model(), config=_config(stage, BF16_MASTERS, ADAMW))
        engine.load_checkpoint(path, tag=f"stage{stage}")
        step(engine, 2)
        got = engine.module_state_dict()
        out[stage] = (
            all(torch.equal(got[n], v) for n, v in want.items()),
            {k: v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"},
        )
        engine.destroy()
    return out


def _reference(optimizer: dict) -> dict:
    """bf16 model, bf16 optimizer state; per step the two ranks' bf16 gradients halved and summed."""
    model = make_model().to(torch.bfloat16)
    # The config's "AdamW" is torch's fused AdamW (zerotrain.optim.factory picks fused kernels).
    fused = {"fused": True} if optimizer["type"] == "AdamW" else {}
    opt = getattr(torch.optim, optimizer["type"])(model.parameters(), **optimizer["params"], **fused)
    data = global_batches(STEPS, MICRO * WORLD)
    params = [p for p in model.parameters()]
    for step in range(STEPS):
        per_rank = []
        for rank in range(WORLD):
            batch = data[step, rank * MICRO : (rank + 1) * MICRO]
            model(batch, labels=batch).loss.backward()
            per_rank.append([p.grad / WORLD for p in params])
            opt.zero_grad()
        for p, *grads in zip(params, *per_rank):
            p.grad = grads[0] + grads[1]
        opt.step()
        opt.zero_grad()
    return {n: v.clone() for n, v in model.state_dict().items()}


RUNS = [
    (1, BF16_MASTERS, ADAMW),
    (2, BF16_MASTERS, ADAMW),
    (3, BF16_MASTERS, ADAMW),
    (2, BF16_MASTERS, SGD),
    (2, {"enabled": True}, ADAMW),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_train_engines, WORLD, args=(RUNS, str(tmp_path_factory.mktemp("ckpt"))))


@pytest.mark.parametrize("run", range(4), ids=["stage1-adamw", "stage2-adamw", "stage3-adamw", "stage2-sgd"])
def test_weights_equal_bf16_reference(results, run):
    want = _reference(RUNS[run][2])
    got = results[0][run]
    assert got["skipped"] == 0
    assert set(got["state"]) == set(want)
    for name, value in want.items():
        assert got["state"][name].dtype == torch.bfloat16
        assert torch.equal(got["state"][name], value), (
            f"{name}: max diff {(got['state'][name].float() - value.float()).abs().max()}"
        )
    start = make_model().to(torch.bfloat16).state_dict()
    assert any(not torch.equal(start[n], v) for n, v in want.items())  # the steps changed the weights


def test_stepped_tensors_and_state_are_bf16(results):
    for r in results:
        for run in range(3):
            got = r[run]
            assert got["stepped_dtypes"] == {torch.bfloat16}
            assert got["state_dtypes"]["exp_avg"] == torch.bfloat16
            assert got["state_dtypes"]["exp_avg_sq"] == torch.bfloat16
            assert got["accessors"] == (True, True)
        plain = r[4]
        assert plain["stepped_dtypes"] == {torch.float32}
        assert plain["accessors"] == (False, False)


def test_checkpoint_round_trip_keeps_bf16_state(results):
    for r in results:
        for stage, (same, dtypes) in r[len(RUNS)].items():
            assert same, f"stage {stage}: the reloaded engine's step differs"
            assert set(dtypes.values()) == {torch.bfloat16}


def test_state_bytes_half_of_plain_bf16(results):
    for r in results:
        masters, plain = r[1], r[4]  # both stage 2, AdamW
        # The moments are exactly half; torch's AdamW keeps an fp32 ``step`` per stepped tensor.
        assert masters["moment_bytes"] * 2 == plain["moment_bytes"]
        steps = masters["state_bytes"] - masters["moment_bytes"]
        assert steps == plain["state_bytes"] - plain["moment_bytes"]
        assert masters["memory"]["optimizer_state"] == masters["state_bytes"]
        assert plain["memory"]["optimizer_state"] - masters["memory"]["optimizer_state"] == masters["moment_bytes"]
        # No fp32 master copies: the saved 4 bytes per shard element.
        assert masters["memory"]["master_parameters"] == 0
        assert plain["memory"]["master_parameters"] == masters["moment_bytes"]


@pytest.mark.parametrize(
    "bf16, stage, offload, key",
    [
        ({"enabled": True, "bf16_master_weights_and_grads": True}, 2, None, "bf16.bf16_master_weights_and_grads"),
        ({"enabled": True, "bf16_optimizer_states": True}, 2, None, "bf16.bf16_optimizer_states"),
        (BF16_MASTERS, 0, None, "bf16.bf16_master_weights_and_grads"),
        (BF16_MASTERS, 2, "cpu", "bf16.bf16_master_weights_and_grads"),
        (
            {"enabled": False, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            2,
            None,
            "bf16.bf16_master_weights_and_grads",
        ),
    ],
)
def test_unsupported_combinations_name_the_key(bf16, stage, offload, key):
    cfg = _config(stage, bf16, ADAMW)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload}
    with pytest.raises(NotImplementedError, match=key.replace(".", r"\.")):
        check_supported(load_config(cfg))
