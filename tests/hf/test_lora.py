"""peft LoRA on a random-init GPT-2 at ZeRO stages 0-3, and QLoRA refused at stage 3.

One 2-rank group: fp32 at every stage must give a plain single-process peft loop's losses and
adapter weights, with only adapter parameters in the optimizer and its state; stage 3 keeps the
frozen base partitioned; bf16 at stage 3 reports the model-state bytes that docs/lora.md puts
next to seed 000's LoRA table.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import assert_close_trajectory
from tests.hf.hf_workloads import plain_causal_lm, train_causal_lm
from zerotrain.testing import run_on_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")

WORLD, MICRO, SEQ, STEPS, LR = 2, 2, 16, 4, 1e-2
GPT2 = dict(
    n_layer=2,
    n_embd=64,
    n_head=4,
    vocab_size=128,
    n_positions=SEQ,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
)


def _lora_model():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(**GPT2))
    return get_peft_model(
        base,
        LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, fan_in_fan_out=True, target_modules=["c_attn", "c_proj", "c_fc"]
        ),
    )


def _batches():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, GPT2["vocab_size"], (STEPS, WORLD * MICRO, SEQ), generator=g)


def _counts(model):
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return adapter, base


def _plain_reference():
    model = _lora_model()
    losses = plain_causal_lm(model, _batches(), LR)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, adapters, _counts(model)


def _train(
    stage: int, bf16: bool = False, prefetch: bool = True, leaves: bool = False, reentrant_checkpointing: bool = False
):
    import zerotrain

    model = _lora_model()
    if reentrant_checkpointing:  # each block runs again in backward; its first forward has no grad
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.base_model.model.enable_input_require_grads()
    adapter_numel, base_numel = _counts(model)
    transformer = model.base_model.model.transformer
    block_numel = sum(p.numel() for p in transformer.h[0].parameters())
    embedding_numel = transformer.wte.weight.numel()
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if not prefetch:  # gathered = what is in use: shows when frozen units are released
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    if bf16:
        cfg["bf16"] = {"enabled": True}
    # leaves: each GPT2Block one unit (frozen base and adapters apart); else per-module units
    # (the CPU's default makes these small blocks leaves too: docs/zero.md "Leaf modules").
    cfg["zero_optimization"]["leaf_module"] = {"classes": ["GPT2Block"]} if leaves else {}
    # All parameters are handed over, as a Trainer does: the frozen ones must stay out of the optimizer.
    engine, optimizer, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = train_causal_lm(engine, _batches(), MICRO)
    state_numel = sum(
        t.numel() for s in optimizer.state.values() for k, t in s.items() if torch.is_tensor(t) and k != "step"
    )
    optimized_numel = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    frozen_local = {n: tuple(p.shape) for n, p in model.named_parameters() if not p.requires_grad}
    memory = engine.memory_breakdown()
    state = engine.module_state_dict()
    out = {
        "losses": losses,
        "state_numel": state_numel,
        "optimized_numel": optimized_numel,
        "memory": memory,
        "frozen_local": frozen_local,
        "adapter_numel": adapter_numel,
        "base_numel": base_numel,
        "block_numel": block_numel,
        "embedding_numel": embedding_numel,
        "adapters": {k: v.float() for k, v in state.items() if "lora_" in k},
        "frozen_unchanged": all(torch.equal(state[k].float(), v) for k, v in frozen_before.items() if k in state),
    }
    engine.destroy()
    return out


def _all_cases():
    import zerotrain

    zerotrain.init_distributed()
    out = {stage: _train(stage, prefetch=stage != 3) for stage in range(4)}
    out["bf16"] = _train(3, bf16=True)
    out["leaves"] = _train(3, prefetch=False, leaves=True)
    out["reentrant"] = _train(3, prefetch=False, reentrant_checkpointing=True)
    return out


def test_lora_trains_adapters_only_at_every_stage():
    want_losses, want_adapters, (adapter, base) = _plain_reference()
    results = run_on_ranks(_all_cases, WORLD, timeout=600)
    for _rank, out in enumerate(results):
        for stage in range(4):
            r = out[stage]
            assert_close_trajectory(r["losses"], want_losses)
            # Only adapter parameters are optimised and have state: exactly them at stage 0,
            # this rank's shard of them (plus alignment padding) at stages 1-3.
            # Stage 0 steps the user's optimizer as given (frozen parameters passed to it stay in
            # its groups, get no gradient, hence no state and no update).
            optimized = adapter if stage == 0 else r["optimized_numel"]
            if stage:
                assert adapter / WORLD <= optimized <= adapter / WORLD + 64 * 4 * 3 * GPT2["n_layer"]
            assert r["state_numel"] == 2 * optimized and optimized < base / 10
            # Adam moments of the adapters only: 8 bytes per optimised element (+ step counters).
            assert 8 * optimized <= r["memory"]["optimizer_state"] <= 8 * optimized + 4096
        # Stage 3: the frozen base is partitioned (placeholders here, 1/N of it in shards).
        r3 = out[3]
        assert all(numel == (0,) for numel in r3["frozen_local"].values())
        held = r3["memory"]["parameters"]
        assert 4 * (adapter + base) / WORLD <= held <= 4 * (adapter + base) / WORLD + 4 * 2048, held
        assert out[0]["memory"]["parameters"] >= 4 * (adapter + base)
        # Frozen base units are released when their module's backward ends, not at the end of
        # backward (which gathered 85% of the model by then): a quarter of it at most.
        peak = r3["memory"]["peak_gathered_parameters"] / 4
        assert peak <= (adapter + base) / 4, (peak, adapter + base)
        # With GPT2Blocks as leaves: at most one block at a time, beside the tied embedding
        # (gathered for the output layer, kept for the embedding's backward). Releasing a
        # block only after the next one was gathered held two (112k elements).
        leafy = out["leaves"]
        assert_close_trajectory(leafy["losses"], want_losses)
        peak = leafy["memory"]["peak_gathered_parameters"] / 4
        assert peak <= leafy["block_numel"] + leafy["embedding_numel"], (peak, leafy["block_numel"])
        # Reentrant activation checkpointing, per-module units: the recomputed block is gathered
        # whole, and its frozen units go when its recomputed backward is over (the first forward
        # ran without grad, so only the recomputation can register that release; before, every
        # frozen unit stayed to the end of backward: 112k elements, the whole model).
        recomputed = out["reentrant"]
        assert_close_trajectory(recomputed["losses"], want_losses)
        peak = recomputed["memory"]["peak_gathered_parameters"] / 4
        assert peak <= recomputed["block_numel"] + recomputed["embedding_numel"], peak
    # The gathered adapters equal the plain loop's; the frozen base never moved.
    for stage in range(4):
        r = results[0][stage]
        assert r["frozen_unchanged"]
        for name, want in want_adapters.items():
            key = name.replace("base_model.model.", "", 0)
            got = r["adapters"].get(name, r["adapters"].get(key))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # bf16 at stage 3: model states per rank = bf16 base/N + adapter (fp32 master, fp32 Adam
    # moments; gradient shard in bf16; no bf16 shard: gathers cast the master) / N, within
    # alignment padding.
    m = results[0]["bf16"]["memory"]
    states = m["parameters"] + m["master_parameters"] + m["gradients"] + m["optimizer_state"]
    formula = (2 * base + (4 + 2 + 8) * adapter) / WORLD
    assert formula <= states <= formula + 16 * 2048, (states, formula, m)
    print(
        f"LoRA bf16 stage 3 per rank: {states} bytes of model states (formula {formula:.0f}); "
        f"base {base}, adapters {adapter} ({100 * adapter / base:.1f}%); breakdown {m}"
    )


class Linear4bit(torch.nn.Linear):
    """Stands in for bitsandbytes' class (the check goes by class and package, not by import)."""


Linear4bit.__module__ = "bitsandbytes.nn.modules"


def _qlora_at(stage: int):
    import zerotrain

    model = _lora_model()
    model.base_model.model.lm_head = Linear4bit(GPT2["n_embd"], GPT2["vocab_size"])
    model.base_model.model.lm_head.requires_grad_(False)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
    }
    try:
        zerotrain.initialize(model=model, config=cfg)
    except NotImplementedError as error:
        return str(error)
    return None


def test_qlora_base_is_refused_at_stage3_with_the_reason():
    from zerotrain.lora import find_quantized_layers

    message = run_on_ranks(_qlora_at, 1, args=(3,))[0]
    assert message is not None
    for words in (
        "QLoRA",
        "incompatible with ZeRO stage 3",
        "lm_head: bitsandbytes.nn.modules.Linear4bit",
        "stage 0-2",
    ):
        assert words in message, message
    # The same detection by parameter type and by the Hugging Face flag; a plain LoRA model has none.
    plain = _lora_model()
    assert find_quantized_layers(plain) == []
    plain.base_model.model.transformer.wte.weight = torch.nn.Parameter(
        torch.zeros(128, 32, dtype=torch.uint8), requires_grad=False
    )
    plain.is_loaded_in_4bit = True
    found = find_quantized_layers(plain)
    assert any("is_loaded_in_4bit" in f for f in found) and any("torch.uint8" in f for f in found), found
