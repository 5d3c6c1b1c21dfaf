"""Stage-3 leaf modules: a block's whole subtree is one unit, gathered once per use.

Training with leaves must compute what per-module units compute (same final weights as the
single-process fp32 reference, and as the per-module run), with fewer units and hooks; leaves
come from DeepSpeed's API (``set_z3_leaf_modules``), the config's ``leaf_module`` section and
``stage3_module_granularity_threshold``.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_combinations import STEPS, _check, _config
from tests.engine.workloads import make_model, train_steps
from zerotrain.models.gpt import Block, CausalSelfAttention
from zerotrain.testing import run_on_ranks
from zerotrain.zero import leaves


# -- choosing leaves (one process) ---------------------------------------------------------
def test_set_unset_by_class_name_and_suffix_like_deepspeed():
    model = make_model()
    found = leaves.set_z3_leaf_modules(model, [Block])
    assert found == list(model.blocks) and leaves.get_z3_leaf_modules(model) == found
    assert all(m._z3_leaf for m in found)  # DeepSpeed's flag: models prepared for it work as is
    leaves.unset_z3_leaf_modules(model, ["Block"])
    assert leaves.get_z3_leaf_modules(model) == []
    leaves.set_z3_leaf_modules(model, ["zerotrain.models.gpt.CausalSelfAttention"])
    assert leaves.get_z3_leaf_modules(model) == [b.attn for b in model.blocks]
    leaves.unset_z3_leaf_modules(model, [CausalSelfAttention])
    found, missing = leaves.set_z3_leaf_modules_by_name(model, ["blocks.1.mlp", "nope"], raise_if_not_found=False)
    assert found == [model.blocks[1].mlp] and missing == ["nope"]
    found, missing = leaves.set_z3_leaf_modules_by_suffix(model, ["attn"])
    assert found == [b.attn for b in model.blocks] and not missing
    with pytest.raises(ValueError, match="no module of"):
        leaves.set_z3_leaf_modules(model, ["NoSuchBlock"])
    with pytest.raises(ValueError, match="no module named"):
        leaves.set_z3_leaf_modules_by_name(model, ["nope"])
    with pytest.raises(TypeError, match="classes or class names"):
        leaves.set_z3_leaf_modules(model, [3])


def test_outermost_leaf_owns_nested_ones():
    model = make_model()
    block = model.blocks[0]
    owner = leaves.leaf_of(model, [block.attn, block])
    assert owner[block] is block and owner[block.attn] is block and owner[block.attn.qkv] is block
    assert model.blocks[1] not in owner and model not in owner


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_granularity_threshold_selects_the_outermost_fine_module():
    """DeepSpeed's granularity: a subtree's parameters over its counted modules (modules with
    parameters; containers such as Sequential neither counted nor chosen, modules without
    children never chosen); from the root down, the first module at or under the threshold."""
    model = make_model()
    attn = model.blocks[0].attn  # counted: qkv, proj and attn itself
    attn_granularity = numel(attn) // 3
    # a block counts ln_1, qkv, proj, attn, ln_2, mlp.0, mlp.2 and itself; the model 2 blocks,
    # wte, wpe, ln_f, lm_head and itself (the head's tied weight counted twice, as DeepSpeed does)
    block_granularity = numel(model.blocks[0]) // 8
    model_granularity = (numel(model) + numel(model.lm_head)) // 20
    assert attn_granularity < model_granularity < block_granularity  # the tiny model's shape
    assert leaves.granularity_leaves(model, attn_granularity) == [b.attn for b in model.blocks]
    assert leaves.granularity_leaves(model, model_granularity) == [model]
    assert leaves.granularity_leaves(model, attn_granularity - 1) == []


# -- training with leaves (2 gloo ranks) ---------------------------------------------------
def _runs(cases: dict) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for name, (precision, gas, optimizer, zero_extra, flag) in cases.items():
        model = make_model()
        if flag:
            leaves.set_z3_leaf_modules(model, [Block])
        cfg = _config(3, precision, gas, optimizer)
        cfg["zero_optimization"].update(zero_extra)
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = train_steps(engine, STEPS)
        coordinator = engine._zero.coordinator
        hooked = {type(m).__name__ for m in coordinator._module_units}
        state = engine.module_state_dict()
        out[name] = {
            "losses": losses,
            "units": len(engine._zero.units),
            "hooked": hooked,
            "hooks": len(coordinator.hook_handles),
            "skipped": engine.skipped_steps,
            "params": {n: v.float().clone() for n, v in state.items()},
        }
        engine.destroy()
        out[name]["plain_parameters"] = all(type(m._parameters) is dict for m in model.modules())
        out[name]["flags_left"] = len(leaves.get_z3_leaf_modules(model))
    return out


BY_CLASS = {"leaf_module": {"classes": ["Block"]}}
CASES = {
    "sgd": ("fp32", 1, "sgd", {}, False),
    "sgd_leaf": ("fp32", 1, "sgd", BY_CLASS, False),
    "adamw_gas": ("fp32", 3, "adamw", {}, False),
    "adamw_gas_leaf": ("fp32", 3, "adamw", BY_CLASS, False),
    "adamw_gas_flag": ("fp32", 3, "adamw", {}, True),
    # the attention modules' granularity (test above): each attention one unit
    "adamw_gas_threshold": ("fp32", 3, "adamw", {"stage3_module_granularity_threshold": 1408}, False),
    "bf16_sgd_leaf": ("bf16", 3, "sgd", {"leaf_module": {"name_suffixes": ["blocks.0", "blocks.1"]}}, False),
    "bf16_sgd": ("bf16", 3, "sgd", {}, False),
}


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_runs, world_size=2, args=(CASES,), timeout=600)


def test_leaves_train_like_per_module_units_and_the_reference(runs):
    rank0 = runs[0]
    for per_module, leafy in (
        ("sgd", "sgd_leaf"),
        ("adamw_gas", "adamw_gas_leaf"),
        ("adamw_gas", "adamw_gas_flag"),
        ("adamw_gas", "adamw_gas_threshold"),
        ("bf16_sgd", "bf16_sgd_leaf"),
    ):
        want, got = rank0[per_module], rank0[leafy]
        for name, value in want["params"].items():
            torch.testing.assert_close(
                got["params"][name], value, rtol=1e-5, atol=1e-7, msg=lambda m, n=name, c=leafy: f"{c} {n}: {m}"
            )
    results = {
        ("fp32", 1, "sgd"): rank0["sgd_leaf"],
        ("fp32", 3, "adamw"): rank0["adamw_gas_leaf"],
        ("bf16", 3, "sgd"): rank0["bf16_sgd_leaf"],
    }
    failures = _check(results, 3, world=2)
    assert not failures, "\n".join(failures)


def test_a_leaf_is_one_unit_with_hooks_on_it_alone(runs):
    rank0 = runs[0]
    per_module, leafy = rank0["sgd"], rank0["sgd_leaf"]
    # per block: ln_1, qkv, proj, ln_2, mlp.0, mlp.2 (6 units) -> 1; wte (tied head), wpe, ln_f stay
    assert per_module["units"] == 2 * 6 + 3 and leafy["units"] == 2 + 3
    assert "Block" in leafy["hooked"] and "Block" not in per_module["hooked"]
    assert leafy["hooks"] < per_module["hooks"] / 2  # no hooks inside the blocks
    assert rank0["adamw_gas_flag"]["units"] == rank0["bf16_sgd_leaf"]["units"] == 2 + 3
    assert rank0["adamw_gas_threshold"]["units"] == 2 * 5 + 3  # qkv + proj: one unit


def test_destroy_restores_the_modules_and_keeps_only_the_users_flags(runs):
    for rank in runs:
        for name, r in rank.items():
            assert r["plain_parameters"], name
            # the config's leaves are the engine's choice: no flag left on the model
            assert r["flags_left"] == (2 if name.endswith("_flag") else 0), name


# -- the default: a Hugging Face model's _no_split_modules on an accelerator ----------------
def _tiny_gpt2():
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def test_default_leaves_are_the_no_split_blocks_on_an_accelerator_only(monkeypatch):
    from zerotrain.accelerator import CPUAccelerator
    from zerotrain.config import load_config

    def zero(**extra):
        return load_config(
            {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **extra}}, world_size=1
        ).zero_optimization

    model = _tiny_gpt2()
    blocks = list(model.transformer.h)
    # The CPU: blocks of at most SMALL_BLOCK_BYTES only (issue 33); larger ones per-module.
    assert leaves.leaf_modules(model, zero()) == blocks
    monkeypatch.setattr(leaves, "SMALL_BLOCK_BYTES", leaves._nbytes(blocks[0]) - 1)
    assert leaves.leaf_modules(model, zero()) == []
    monkeypatch.setattr(leaves, "SMALL_BLOCK_BYTES", leaves._nbytes(blocks[0]))
    assert leaves.leaf_modules(model, zero(leaf_module={})) == []  # an explicit section wins
    monkeypatch.setattr(leaves, "SMALL_BLOCK_BYTES", 0)

    class Device(CPUAccelerator):
        name = "cuda"

    monkeypatch.setattr(leaves, "get_accelerator", lambda: Device())
    assert leaves.leaf_modules(model, zero()) == blocks
    assert leaves.leaf_modules(model, zero(leaf_module={})) == []  # an explicit section wins
    assert leaves.leaf_modules(model, zero(leaf_module={"names": ["transformer.h.1"]})) == blocks[1:]
    assert "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock" in leaves.default_leaf_classes(
        model, on_accelerator=False
    )  # DeepSpeed's default, everywhere


def _hf_runs() -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    blocks = {"leaf_module": {"classes": "GPT2Block"}}
    for name, zero_extra, recompute in (
        ("blocks", blocks, None),
        ("per_module", {"leaf_module": {}}, None),
        ("default", {}, None),
        ("blocks_reentrant", blocks, True),
        ("blocks_non_reentrant", blocks, False),
    ):
        model = _tiny_gpt2()
        if recompute is not None:  # HF activation checkpointing: each block runs again in backward
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": recompute})
        cfg = _config(3, "fp32", 1, "sgd")
        cfg["zero_optimization"].update(zero_extra)
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = train_steps(engine, 4)
        out[name] = {
            "losses": losses,
            "units": len(engine._zero.units),
            "hooked": {type(m).__name__ for m in engine._zero.coordinator._module_units},
            "params": {n: v.clone() for n, v in engine.module_state_dict().items()},
        }
        engine.destroy()
    return out


def test_hugging_face_blocks_as_leaves_train_like_per_module_units():
    out = run_on_ranks(_hf_runs, world_size=2, timeout=300)[0]
    default, per_module = out["blocks"], out["per_module"]
    assert "GPT2Block" in default["hooked"] and "GPT2Block" not in per_module["hooked"]
    # The CPU's default (no leaf_module section): these small blocks are leaves (issue 33).
    assert out["default"]["units"] == default["units"]
    assert out["default"]["hooked"] == default["hooked"]
    # per block: ln_1, c_attn, c_proj (attn), ln_2, c_fc, c_proj (mlp) -> 1; wte (tied), wpe, ln_f
    assert (default["units"], per_module["units"]) == (2 + 3, 2 * 6 + 3)
    for leafy in ("blocks", "default", "blocks_reentrant", "blocks_non_reentrant"):
        assert out[leafy]["losses"] == pytest.approx(per_module["losses"], rel=1e-6), leafy
        for name, value in per_module["params"].items():
            torch.testing.assert_close(
                out[leafy]["params"][name], value, rtol=1e-5, atol=1e-7, msg=lambda m, c=leafy, n=name: f"{c} {n}: {m}"
            )
