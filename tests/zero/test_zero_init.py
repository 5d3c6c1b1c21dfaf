"""zero.Init, GatheredParameters and save_16bit_model (ZeRO-3 user APIs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.config import ConfigError
from zerotrain.testing import RankFailed, run_on_ranks

WIDTH, DEPTH = 1024, 24  # 25.2M parameters: 100 MB in fp32, enough to see in peak RSS


def _init_linear(module):
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=WIDTH**-0.5)
        torch.nn.init.zeros_(module.bias)


class _MLP(torch.nn.Sequential):
    """Linear layers initialised afterwards by the parent (``self.apply``), as models do."""

    def __init__(self):
        layers = []
        for _ in range(DEPTH):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
        super().__init__(*layers)
        self.apply(_init_linear)


def _mlp():
    return _MLP()


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
    full_bytes = 4 * sum(
        layer.in_features * layer.out_features + layer.out_features
        for layer in model
        if isinstance(layer, torch.nn.Linear)
    )
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = zerotrain.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randn(2, WIDTH, generator=g)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "growth": built - before,
        "full_bytes": full_bytes,
        "losses": losses,
        "held": engine.memory_breakdown()["parameters"],
    }


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
    # Same seed: the same model (the parent's apply(init_fn) ran on whole weights), so the
    # same training.
    for a, b in zip(with_init, plain):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)


def _save_and_reload(tmp: str, precision: dict | None, gather_flag: bool = True):
    import torch.distributed as dist

    import zerotrain

    model = make_model()
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 100,
        "stage3_gather_16bit_weights_on_model_save": gather_flag,
    }
    engine, *_ = zerotrain.initialize(model=model, config=adamw_config(2, zero_optimization=zero, **(precision or {})))
    data = global_batches(3, 4)
    for step in range(3):
        batch = data[step, dist.get_rank() * 2 : dist.get_rank() * 2 + 2]
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
    engine, *_ = zerotrain.initialize(model=model, config=adamw_config(2, zero_optimization=zero, **(precision or {})))
    weight = model.blocks[0].mlp[0].weight
    with zerotrain.zero.GatheredParameters(weight, modifier_rank=0):
        if dist.get_rank() == 0:
            weight.data.fill_(0.25)
    with zerotrain.zero.GatheredParameters([weight]):
        seen = weight.detach().float().clone()
    unit = zerotrain.zero.registry.unit_of(weight)
    master = unit.master.detach().clone() if unit.master is not None else unit.shard.detach().float()
    return seen, master, weight.numel()


@pytest.mark.parametrize("precision", [None, {"bf16": {"enabled": True}}], ids=["fp32", "bf16"])
def test_gathered_parameters_scatters_changes_from_modifier_rank(precision):
    for seen, master, _numel in run_on_ranks(_modify_on_rank0, 2, args=(precision,)):
        assert seen.shape == (128, 32) and torch.all(seen == 0.25)  # every rank sees rank 0's edit
        # This rank's fp32 master / shard carries the new values too (the weight fills the unit's
        # first 4096 elements; the shard is the first or second half of the padded unit).
        assert master.numel() > 0 and torch.any(master == 0.25)


# -- post-construction initialisation, arguments, patching ------------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc.weight.data.normal_(0.0, 0.02)  # .data-style init of a child, in the constructor
        self.scale = torch.nn.Parameter(torch.randn(16))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.whole_at_once = 0
        self.apply(self._init)
        self.blocks[1].extra = torch.nn.Parameter(torch.randn(4, 4))  # added by the parent
        with torch.no_grad():
            self.head.weight.mul_(self.blocks[0].scale[0])  # depends on values set earlier
            self.blocks[2].fc.bias.copy_(self.blocks[0].norm.weight - 0.5)

    def _init(self, module):
        from zerotrain.zero.init import is_partitioned

        if isinstance(module, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(module.weight)
        elif isinstance(module, torch.nn.Embedding):
            # a shape query on a partitioned weight answers its real shape
            module.weight.data.normal_(0.0, module.weight.shape[1] ** -0.5)
        self.whole_at_once = max(
            self.whole_at_once, sum(not is_partitioned(p) for p in self.parameters() if p.numel() > 4)
        )


def _inner_init(self):
    torch.nn.Module.__init__(self)
    self.w = torch.nn.Parameter(torch.randn(6, 5))
    torch.nn.init.orthogonal_(self.w)


def _gathered(model) -> dict:
    import zerotrain

    state = {}
    for name, p in model.named_parameters():
        with zerotrain.zero.GatheredParameters(p):
            state[name] = p.detach().clone()
    return state


def _plain_trees_and_arguments(config_path: str):
    """Many checks in one process group: each returns a bool or a value compared by the test."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.zero.init import is_partitioned, restore_init_context, shutdown_init_context

    zerotrain.init_distributed()
    rank = dist.get_rank()
    out = {}
    classes = [torch.nn.Module, *torch.nn.Module.__subclasses__()]
    inits_before = {}
    stack = list(classes)
    while stack:
        cls = stack.pop()
        inits_before[cls] = cls.__dict__.get("__init__")
        stack.extend(cls.__subclasses__())

    def build(use_init: bool, seed: int):
        torch.manual_seed(seed)
        if not use_init:
            inner = type("Inner", (torch.nn.Module,), {"__init__": _inner_init})
            return _Net(), make_model(), inner()
        with zerotrain.zero.Init():
            # a class defined inside the context: wrapped while it lasts, restored after
            inner = type("Inner", (torch.nn.Module,), {"__init__": _inner_init})
            out["inner_wrapped"] = getattr(inner.__dict__["__init__"], "__zerotrain_init_wrapper__", False)
            net, gpt, inner_model = _Net(), make_model(), inner()
        out["inner_restored"] = inner.__dict__["__init__"] is _inner_init
        return net, gpt, inner_model

    plain = build(False, 0)
    # Rank 1's RNG differs: every rank must still get rank 0's model (its values are broadcast).
    zero_init = build(True, 1000 * rank)
    out["partitioned"] = all(is_partitioned(p) for m in zero_init for p in m.parameters())
    out["whole_at_once"] = zero_init[0].whole_at_once
    out["differ"] = [
        (i, n)
        for i, (a, b) in enumerate(zip(plain, zero_init))
        for n, v in _gathered(b).items()
        if not torch.equal(v, dict(a.named_parameters())[n])
    ]

    after = {}
    stack = [torch.nn.Module]
    while stack:
        cls = stack.pop()
        after[cls] = cls.__dict__.get("__init__")
        stack.extend(cls.__subclasses__())
    out["inits_restored"] = all(after[c] is f for c, f in inits_before.items())
    out["no_wrappers"] = not any(getattr(f, "__zerotrain_init_wrapper__", False) for f in after.values())
    out["init_subclass_restored"] = "__init_subclass__" not in torch.nn.Module.__dict__

    def shard_dtype(**kwargs):
        with zerotrain.zero.Init(**kwargs):
            layer = torch.nn.Linear(4, 4, dtype=torch.float64)
        return layer.weight._zerotrain_shard.dtype

    batch = {"train_micro_batch_size_per_gpu": 1}
    out["dtypes"] = [
        shard_dtype(config_dict_or_path={**batch, "bf16": {"enabled": True}}),
        shard_dtype(config={**batch, "fp16": {"enabled": True}}),
        shard_dtype(config_dict_or_path=config_path),  # a JSON file without 16-bit sections
        shard_dtype(config_dict_or_path={**batch, "bf16": {"enabled": True}}, dtype=torch.float32),
        shard_dtype(pin_memory=True),  # no offload: no effect, as in DeepSpeed
        shard_dtype(
            config_dict_or_path={
                **batch,
                "zero_optimization": {"stage": 3, "offload_param": {"device": "none", "pin_memory": True}},
            }
        ),
    ]

    # The module form partitions an already built model the same way (dtype included).
    torch.manual_seed(0)
    built = make_model()
    expected = {n: p.detach().to(torch.bfloat16) for n, p in built.named_parameters()}
    zerotrain.zero.Init(module=built, dtype=torch.bfloat16)
    out["module_form"] = all(is_partitioned(p) for p in built.parameters()) and all(
        torch.equal(v, expected[n]) for n, v in _gathered(built).items()
    )

    # Nested contexts share the outer one; a shut-down context builds normally until restored.
    with zerotrain.zero.Init():
        with zerotrain.zero.Init():
            nested = torch.nn.Linear(4, 4)
        after_inner = torch.nn.Linear(4, 4)
        shutdown_init_context()
        normal = torch.nn.Linear(4, 4)
        restore_init_context()
        restored = torch.nn.Linear(4, 4)
    out["nesting"] = [is_partitioned(m.weight) for m in (nested, after_inner, normal, restored)]

    # initialize inside the context (zerotrain's own code and modules pass through the context).
    ids = global_batches(1, 2)[0]
    reference = make_model()
    reference.ln_f.weight.data.fill_(1.5)
    with torch.no_grad():
        expected = reference(ids, labels=ids).loss.item()
    with zerotrain.zero.Init():
        model = make_model()
        model.ln_f.weight.data.fill_(1.5)  # leaves ln_f (kept whole by stage 3) gathered
        engine, *_ = zerotrain.initialize(
            model=model,
            config=adamw_config(2, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 100}),
        )
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    # The context's exit must leave the engine's parameters alone.
    out["initialize_inside"] = (loss.item(), expected, engine(ids, labels=ids).loss.item())
    return out


def test_init_runs_post_construction_init_and_restores_every_class(tmp_path):
    import json

    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps({"train_batch_size": 2}))
    for r in run_on_ranks(_plain_trees_and_arguments, 2, args=(str(config_path),)):
        assert r["partitioned"] and r["inner_wrapped"] and r["inner_restored"]
        assert r["differ"] == []  # apply(fn), .data.normal_(), later edits: as in a normal build
        assert r["whole_at_once"] <= 2  # one Linear (weight, bias) at a time, not the model
        assert r["inits_restored"] and r["no_wrappers"] and r["init_subclass_restored"]
        assert r["dtypes"] == [
            torch.bfloat16,
            torch.float16,
            torch.float32,
            torch.float32,
            torch.float64,
            torch.float32,
        ]
        assert r["module_form"]
        assert r["nesting"] == [True, True, False, True]
        first, expected, after_exit = r["initialize_inside"]
        assert first == pytest.approx(expected, rel=1e-6) and after_exit < first


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"remote_device": "disk", "pin_memory": True}, ValueError, "remote_device"),
        (
            {"config_dict_or_path": {"train_batch_size": 2, "zero_optimization": {"zero_quantized_weights": True}}},
            NotImplementedError,
            "zero_quantized_weights",
        ),
        (
            {"config_dict_or_path": {"train_batch_size": 2, "fp16": {"enabled": True}, "bf16": {"enabled": True}}},
            ConfigError,
            "fp16 and bf16",
        ),
        ({"config_dict_or_path": {}, "config": {}}, ValueError, "config_dict_or_path"),
        ({"dtype": torch.int8}, ValueError, "dtype"),
        ({"zero_quantized_weights": True}, NotImplementedError, "zero_quantized_weights"),
    ],
    ids=["remote_device", "quantized", "fp16+bf16", "both configs", "dtype", "unknown argument"],
)
def test_init_arguments_that_cannot_work_raise_naming_them(kwargs, error, match):
    import zerotrain

    # Raised before any process group is needed.
    with pytest.raises(error, match=match):
        zerotrain.zero.Init(enabled=False, **kwargs)
