"""16-bit stage 3 keeps no 16-bit shard beside the fp32 master: gathers cast the master.

The 16-bit shard of a resharded unit is, after every step and load, the master rounded, so
keeping it costs 2 bytes per shard element for nothing (105 MiB a rank on the bf16 GPT-2 110M).
Deriving it must change nothing: the weights after several steps (SGD with momentum and AdamW,
gradient accumulation, clipping) are bit-identical to a run that keeps the shard, the gathered
parameters are the masters rounded, a checkpoint round-trips, and memory_breakdown's
``parameters`` no longer counts the shards.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import make_model, train_steps
from zerotrain.testing import run_on_ranks

STEPS = 3


def _model_and_optimizer(optimizer: str, seed: int = 0):
    model = make_model(seed=seed)
    model.blocks[0].attn.qkv.weight.requires_grad_(False)  # a frozen unit has no master to cast
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (
        torch.optim.SGD(params, lr=0.05, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.AdamW(params, lr=2e-3, weight_decay=0.1, eps=1e-6)
    )
    return model, opt


def _train(optimizer: str, derive: bool, ckpt_dir: str | None = None) -> dict:
    import zerotrain
    from zerotrain.zero.partition import FlatParamUnit

    if not derive:  # the shard kept, as before: the reference run
        FlatParamUnit.derive_shard_from_master = lambda self: None
    model, opt = _model_and_optimizer(optimizer)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000},
    }
    engine, *_ = zerotrain.initialize(model=model, optimizer=opt, config=cfg)
    units = engine._zero.units
    out = {
        "derived": [u.derived for u in units],
        "trained": [u.trained for u in units],
        "shard_bytes": sum(u.layout.shard_numel * 2 for u in units if u.trained),
    }
    out["losses"] = train_steps(engine, STEPS)
    out["masters"] = [m.detach().clone() for m in engine._zero.masters]
    out["memory"] = engine.memory_breakdown()
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        out["gathered"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["rounded"] = [u.shard_values().clone() for u in units]
    if ckpt_dir is not None:
        engine.save_checkpoint(ckpt_dir, tag="t")
        out["continued_live"] = train_steps(engine, 1)
        fresh, fresh_opt = _model_and_optimizer(optimizer, seed=5)
        engine.destroy()
        loaded, *_ = zerotrain.initialize(model=fresh, optimizer=fresh_opt, config=cfg)
        loaded.load_checkpoint(ckpt_dir, tag="t")
        out["loaded_masters"] = [m.detach().clone() for m in loaded._zero.masters]
        with zerotrain.zero.GatheredParameters(list(fresh.parameters())):
            out["loaded_gathered"] = {n: p.detach().clone() for n, p in fresh.named_parameters()}
        out["continued"] = train_steps(loaded, 1)
        loaded.destroy()
    else:
        engine.destroy()
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_bf16_stage3_derives_shards_from_masters_and_trains_bit_identically(optimizer, tmp_path):
    derived = run_on_ranks(_train, 2, args=(optimizer, True, str(tmp_path)))
    kept = run_on_ranks(_train, 2, args=(optimizer, False))
    for d, k in zip(derived, kept):
        # Every trained unit derives its shard; the frozen one has no master and keeps it.
        assert d["derived"] == d["trained"] and not all(d["trained"])
        assert not any(k["derived"])
        assert d["losses"] == k["losses"]
        assert len(d["masters"]) == len(k["masters"])
        for a, b in zip(d["masters"], k["masters"]):
            assert torch.equal(a, b)
        for name, value in k["gathered"].items():
            assert torch.equal(d["gathered"][name], value), name
        for a, b in zip(d["rounded"], k["rounded"]):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b)
        # The shards are not kept: 2 bytes per trained shard element fewer (nothing is gathered
        # between steps, so "parameters" is the kept shards only).
        assert k["memory"]["parameters"] - d["memory"]["parameters"] == d["shard_bytes"] > 0
        # A checkpoint written from derived shards loads them back exactly and trains on.
        for a, b in zip(d["loaded_masters"], d["masters"]):
            assert torch.equal(a, b)
        for name, value in d["gathered"].items():
            assert torch.equal(d["loaded_gathered"][name], value), name
        assert d["continued"] == d["continued_live"]  # the optimizer state came back too
