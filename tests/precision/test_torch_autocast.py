"""The ``torch_autocast`` section: fp32 parameters, the engine's forward under torch.autocast.

Compared with a single-process reference on an fp32 model under ``torch.autocast("cpu", dtype)``:
each rank's step-0 loss bit-identical to the reference's on the same rows, and the weights after
a few steps bit-identical to the reference's, whose gradient is the two ranks' (computed on
their rows, halved and summed, as the reduction does) at every ZeRO stage.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import LR, global_batches, make_model
from zerotrain.config import ConfigError, load_config
from zerotrain.testing import run_on_ranks

STEPS = 3
MICRO = 2
WORLD = 2
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}
BF16 = {"enabled": True, "dtype": "bfloat16"}
FP16 = {"enabled": True, "dtype": "float16"}


def _config(stage: int, autocast: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": ADAMW,
        "zero_optimization": {"stage": stage},
        "torch_autocast": autocast,
    }


def _train_engines(runs):
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank = dist.get_rank()
    data = global_batches(STEPS, MICRO * WORLD)
    out = []
    for stage, autocast in runs:
        model = make_model()
        engine, _, _, _ = zerotrain.initialize(model=model, config=_config(stage, autocast))
        losses = []
        for step in range(STEPS):
            batch = data[step, rank * MICRO : (rank + 1) * MICRO]
            logits = engine(batch).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
            losses.append(loss.detach().clone())
            engine.backward(loss)
            engine.step()
        out.append(
            {
                "losses": losses,
                "logits_dtype": logits.dtype,
                "state": {n: v.clone() for n, v in engine.module_state_dict().items()},
                "param_dtypes": {p.dtype for p in model.parameters()},
                "accessors": (
                    engine.torch_autocast_enabled(),
                    engine.torch_autocast_dtype(),
                    engine.torch_autocast_lower_precision_safe_modules(),
                ),
                "loss_scale": engine.loss_scale,
                "skipped": engine.skipped_steps,
            }
        )
        engine.destroy()
    return out


def _reference(dtype: torch.dtype, scale: float = 1.0, low_precision: bool = False):
    """fp32 model and fused AdamW (what the config's "AdamW" builds), forward under autocast;
    returns each rank's loss per step and the final weights. ``low_precision``: the gradients of
    nn.Linear parameters (DeepSpeed's default lower-precision-safe modules; the tied output
    layer's weight too) are reduced in ``dtype``, as ZeRO 1-3 reduce them."""
    model = make_model()
    safe = {id(p) for m in model.modules() if type(m) is torch.nn.Linear for p in m.parameters(recurse=False)}
    assert safe and len(safe) < len(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW["params"], fused=True)
    data = global_batches(STEPS, MICRO * WORLD)
    params = list(model.parameters())
    losses = []
    for step in range(STEPS):
        per_rank, step_losses = [], []
        for rank in range(WORLD):
            batch = data[step, rank * MICRO : (rank + 1) * MICRO]
            with torch.autocast("cpu", dtype=dtype):
                logits = model(batch).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
            (loss * scale if scale != 1.0 else loss).backward()
            step_losses.append(loss.detach())
            per_rank.append([p.grad / WORLD for p in params])
            opt.zero_grad()
        for p, *grads in zip(params, *per_rank):
            if low_precision and id(p) in safe:  # each halved gradient rounded, summed in dtype
                p.grad = (grads[0].to(dtype) + grads[1].to(dtype)).float()
            else:
                p.grad = grads[0] + grads[1]
            if scale != 1.0:
                p.grad.mul_(1.0 / scale)
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
    return losses, {n: v.clone() for n, v in model.state_dict().items()}


NO_SAFE = {**BF16, "lower_precision_safe_modules": []}
RUNS = [(0, BF16), (1, BF16), (2, BF16), (3, BF16), (0, FP16), (2, FP16), (2, NO_SAFE)]


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_train_engines, WORLD, args=(RUNS,))


@pytest.mark.parametrize(
    "run", range(len(RUNS)), ids=[f"stage{s}-{a['dtype']}{'-no-safe' if a is NO_SAFE else ''}" for s, a in RUNS]
)
def test_losses_and_weights_equal_autocast_reference(results, run):
    stage, autocast = RUNS[run]
    dtype = torch.float16 if autocast is FP16 else torch.bfloat16
    # fp16 autocast scales the loss by GradScaler's initial 2**16 (a power of two: exact). Stage
    # 0 reduces every gradient in fp32 (as DeepSpeed); stages 1-3 nn.Linear's in the autocast dtype.
    want_losses, want = _reference(
        dtype, scale=2.0**16 if dtype == torch.float16 else 1.0, low_precision=stage > 0 and autocast is not NO_SAFE
    )
    for rank, r in enumerate(results):
        got = r[run]
        assert got["logits_dtype"] == dtype  # the forward ran under autocast
        assert got["param_dtypes"] == {torch.float32}
        assert got["skipped"] == 0
        for step in range(STEPS):
            assert torch.equal(got["losses"][step], want_losses[step][rank]), (rank, step)
    got = results[0][run]["state"]
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name}: max diff {(got[name] - value).abs().max()}"
    start = make_model().state_dict()
    assert any(not torch.equal(start[n], v) for n, v in want.items())


def test_accessors(results):
    bf16, fp16 = results[0][0], results[0][5]
    assert bf16["accessors"] == (
        True,
        torch.bfloat16,
        [
            "torch.nn.modules.linear.Linear",
            "torch.nn.modules.conv.Conv1d",
            "torch.nn.modules.conv.Conv2d",
            "torch.nn.modules.conv.Conv3d",
        ],
    )
    assert bf16["loss_scale"] == 1.0
    assert fp16["accessors"][:2] == (True, torch.float16)
    assert fp16["loss_scale"] == 2.0**16


@pytest.mark.parametrize("other", ["bf16", "fp16"])
def test_refused_with_16bit_parameters(other):
    with pytest.raises(ConfigError, match=rf"torch_autocast\.enabled and {other}\.enabled"):
        load_config({"train_batch_size": 2, "torch_autocast": BF16, other: {"enabled": True}})


def test_bad_dtype_and_module_name_name_the_key(in_process_rank):
    with pytest.raises(ConfigError, match=r"torch_autocast\.dtype"):
        load_config({"train_batch_size": 2, "torch_autocast": {"enabled": True, "dtype": "fp32"}})
    import zerotrain

    cfg = {
        "train_batch_size": 1,
        "optimizer": ADAMW,
        "torch_autocast": {**BF16, "lower_precision_safe_modules": ["torch.nn.NoSuchLayer"]},
    }
    with pytest.raises(ValueError, match=r"torch_autocast\.lower_precision_safe_modules: 'torch\.nn\.NoSuchLayer'"):
        zerotrain.initialize(model=make_model(), config=cfg)


def test_default_dtype_is_the_devices():
    cfg = load_config({"train_batch_size": 2, "torch_autocast": {"enabled": True}})
    from zerotrain.precision import PrecisionPolicy

    assert PrecisionPolicy.from_config(cfg, torch.device("cpu")).autocast_dtype == torch.bfloat16
