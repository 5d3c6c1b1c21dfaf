"""zero.Init, GatheredParameters and save_16bit_model (ZeRO-3 user APIs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.testing import RankFailed, run_on_ranks

WIDTH, DEPTH = 1024, 24  # 25.2M parameters: 100 MB in fp32, enough to see in peak RSS


def _mlp():
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _peak_rss() -> int:
    """This process's peak resident bytes (VmHWM; unlike ru_maxrss it is not inherited from
    the parent process)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    return _peak_rss()


def _build_and_train(use_init: bool):
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    torch.manual_seed(0)
    before = _reset_peak_rss()
    if use_init:
        with zerotrain.zero.Init():
            model = _mlp()
    else:
        model = _mlp()
    built = _peak_rss()
    full_bytes = 4 * sum(layer.in_features * layer.out_features + layer.out_features
                         for layer in model if isinstance(layer, torch.nn.Linear))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3}}
    engine, *_ = zerotrain.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randn(2, WIDTH, generator=g)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"growth": built - before, "full_bytes": full_bytes, "losses": losses,
            "held": engine.memory_breakdown()["parameters"]}


def test_init_never_materialises_the_full_model_and_trains():
    with_init = run_on_ranks(_build_and_train, 2, args=(True,))
    plain = run_on_ranks(_build_and_train, 2, args=(False,))
    full = plain[0]["full_bytes"]
    for r in plain:
        assert r["growth"] > 0.9 * full  # without Init every rank builds all 100 MB
    for r, p in zip(with_init, plain):
        # With Init a rank holds half the model (its shards) plus one layer at a time: it must
        # save at least 30% of the model against the plain build (theory: 46%). Compared with
        # the plain run rather than absolutely, because both pay the same copy-on-write growth
        # of the interpreter pages a forked rank touches.
        assert r["growth"] < p["growth"] - 0.3 * full, (r["growth"], p["growth"], full)
        assert r["held"] <= full / 2 + 4 * 4 * DEPTH * 2
    # Same seed, constructor-only initialisation: the same model, so the same training.
    for a, b in zip(with_init, plain):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)


def _save_and_reload(tmp: str, precision: dict | None, gather_flag: bool = True):
    import torch.distributed as dist

    import zerotrain

    model = make_model()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 100,
            "stage3_gather_16bit_weights_on_model_save": gather_flag}
    engine, *_ = zerotrain.initialize(model=model, config=adamw_config(2, zero_optimization=zero,
                                                                       **(precision or {})))
    data = global_batches(3, 4)
    for step in range(3):
        batch = data[step, dist.get_rank() * 2:dist.get_rank() * 2 + 2]
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()
    engine.save_16bit_model(tmp, "model.safetensors")
    engine.eval()
    with torch.no_grad():
        logits = engine(data[0, :2]).logits
    return logits


@pytest.mark.parametrize("precision", [None, {"bf16": {"enabled": True}}], ids=["fp32", "bf16"])
def test_save_16bit_model_loads_into_a_plain_model(tmp_path, precision):
    from safetensors.torch import load_file

    logits = run_on_ranks(_save_and_reload, 2, args=(str(tmp_path), precision))[0]
    state = load_file(tmp_path / "model.safetensors")
    fresh = make_model(seed=123)
    dtype = torch.bfloat16 if precision else torch.float32
    assert {t.dtype for t in state.values()} == {dtype}
    fresh.to(dtype).load_state_dict(state)  # strict: every key, tied ones included
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(global_batches(3, 4)[0, :2]).logits, logits)


def test_save_16bit_model_without_the_gather_flag_says_which_key(tmp_path):
    with pytest.raises(RankFailed, match="stage3_gather_16bit_weights_on_model_save"):
        run_on_ranks(_save_and_reload, 2, args=(str(tmp_path), None, False))


def _modify_on_rank0(precision):
    import torch.distributed as dist

    import zerotrain

    model = make_model()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 100}
    engine, *_ = zerotrain.initialize(model=model, config=adamw_config(2, zero_optimization=zero,
                                                                       **(precision or {})))
    weight = model.blocks[0].mlp[0].weight
    with zerotrain.zero.GatheredParameters(weight, modifier_rank=0):
        if dist.get_rank() == 0:
            weight.data.fill_(0.25)
    with zerotrain.zero.GatheredParameters([weight]):
        seen = weight.detach().float().clone()
    unit = weight._zerotrain_unit
    master = unit.master.detach().clone() if unit.master is not None else unit.shard.detach().float()
    return seen, master, weight.numel()


@pytest.mark.parametrize("precision", [None, {"bf16": {"enabled": True}}], ids=["fp32", "bf16"])
def test_gathered_parameters_scatters_changes_from_modifier_rank(precision):
    for seen, master, numel in run_on_ranks(_modify_on_rank0, 2, args=(precision,)):
        assert seen.shape == (128, 32) and torch.all(seen == 0.25)  # every rank sees rank 0's edit
        # This rank's fp32 master / shard carries the new values too (the weight fills the unit's
        # first 4096 elements; the shard is the first or second half of the padded unit).
        assert master.numel() > 0 and torch.any(master == 0.25)
