"""``zerotrain.pipeline.from_hf_causal_lm``: transformers GPT-2 and Llama as a ``PipelineModule``,
against the HF model itself in one process.

- Built from a model (its modules used in place), P=2 (2 ranks) and P=2 x D=2 (4 ranks), 2
  micro-batches per replica: the loss train_batch returns at step 0 equals the HF model's own
  ``model(ids, labels=ids).loss`` on the whole batch (1e-5), and after 3 steps (SGD with momentum,
  gradient clipping active; AdamW) every weight, mapped back to HF names by ``hf_state_dict``,
  equals a single-process HF training run on the same micro-batches within 1e-5 relative; a tied
  embedding/head (GPT-2, Llama with ``tie_word_embeddings``) is the same tensor on the first and
  the last stage.
- Built from a config (each stage materializes only its layers, ``seed_layers``): the weights
  gathered from the stages load into the HF model, whose loss equals the pipeline's, and HF's
  initialization shows (norms at one, GPT-2's scaled residual projections).
"""

from __future__ import annotations

import pytest
import torch

from zerotrain.testing import run_on_ranks

pytest.importorskip("transformers")

VOCAB, SEQ, MICRO, M, STEPS, CLIP = 64, 8, 2, 2, 3, 0.5
LR = {"sgd": 0.05, "adamw": 0.01}


def _config(kind: str):
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=16,
            n_layer=4,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=kind == "llama_tied",
    )


def _model(kind: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(kind))


def _batches(dp: int) -> list:
    """``[step][data rank][micro-batch] -> (input_ids, labels)``."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        out.append(
            [
                [(ids, ids) for ids in (torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(M))]
                for _ in range(dp)
            ]
        )
    return out


def _optimizer(params, name: str):
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR[name], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR[name], weight_decay=0.1)


def _clip(name: str) -> float:
    return CLIP if name == "sgd" else 0.0


def _reference(kind: str, dp: int, optimizer: str, model=None) -> dict:
    """The HF model trained in one process on every replica's micro-batches."""
    model = _model(kind) if model is None else model
    opt = _optimizer(model.parameters(), optimizer)
    losses, norms = [], []
    for step in _batches(dp):
        total = 0.0
        for rank in step:
            for ids, labels in rank:
                loss = model(ids, labels=labels).loss
                (loss / (M * dp)).backward()
                total += float(loss.detach())
        losses.append(total / (M * dp))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), _clip(optimizer) or 1e9)))
        opt.step()
        opt.zero_grad()
    return {
        "losses": losses,
        "norms": norms,
        "weights": {n: p.detach().clone() for n, p in model.state_dict().items() if not n.endswith("inv_freq")},
    }


def _train(kind: str, pipe, dp: int, optimizer: str, stage: int, schedule: str) -> dict:
    import zerotrain
    from zerotrain.pipeline import hf_state_dict

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": M,
        "train_batch_size": MICRO * M * dp,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": _clip(optimizer),
        "pipeline": {"schedule": schedule},
    }
    engine, *_ = zerotrain.initialize(model=pipe, optimizer=lambda p: _optimizer(p, optimizer), config=config)
    rank = engine.topology.data_rank
    losses = [float(engine.train_batch(iter(step[rank]))) for step in _batches(dp)]
    out = {
        "losses": losses,
        "stage": engine.stage_id,
        "parts": pipe.parts,
        "weights": {n: p.detach().clone() for n, p in hf_state_dict(pipe).items()},
        "tied_keys": sorted(pipe.tied_modules.keys()),
    }
    engine.destroy()
    return out


def _from_models(pipe_size: int, combos: list) -> dict:
    import zerotrain
    from zerotrain.pipeline import from_hf_causal_lm

    zerotrain.init_distributed()
    out = {}
    for kind, optimizer, stage, schedule in combos:
        pipe = from_hf_causal_lm(_model(kind), num_stages=pipe_size)
        dp = pipe.mpu().get_data_parallel_world_size()
        out[(kind, optimizer, stage, schedule)] = _train(kind, pipe, dp, optimizer, stage, schedule)
    return out


def _hf_loss(kind: str, dp: int, model=None) -> float:
    model = _model(kind) if model is None else model
    ids = torch.cat([ids for rank in _batches(dp)[0] for ids, _ in rank])
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


def _check(results: list, dp: int) -> list[str]:
    failures = []
    for combo in results[0]:
        kind, optimizer, stage, schedule = combo
        what = f"{kind} {optimizer} ZeRO-{stage} {schedule} D={dp}"
        ref = _reference(kind, dp, optimizer)
        if _clip(optimizer):
            assert min(ref["norms"]) > CLIP, f"{what}: clipping must be active at every step"
        want0 = _hf_loss(kind, dp)
        gathered: dict[str, list] = {}
        for rank, res in enumerate(results):
            got = res[combo]
            assert got["parts"] == ([0, 4, 8] if kind == "gpt2" else [0, 3, 7]), (
                what,
                got["parts"],
            )  # 2 blocks a stage
            if abs(got["losses"][0] - want0) > 1e-5 * abs(want0):
                failures.append(f"{what} rank {rank}: step-0 loss {got['losses'][0]} != HF loss {want0}")
            for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
                if abs(a - b) > 1e-5 * abs(b):
                    failures.append(f"{what} rank {rank}: step {step} loss {a} != reference {b}")
            for name, value in got["weights"].items():
                gathered.setdefault(name, []).append((got["stage"], value))
        tied = kind in ("gpt2", "llama_tied")
        embed = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
        # A tied embedding lives on both stages (every replica), the head name is not a parameter.
        assert sorted(gathered) == sorted(n for n in ref["weights"] if not (tied and n == "lm_head.weight")), what
        assert sorted({s for s, _ in gathered[embed]}) == ([0, 1] if tied else [0]), what
        for name, copies in gathered.items():
            for stage_id, value in copies:
                if not torch.equal(value, copies[0][1]):
                    failures.append(f"{what}: {name} differs between ranks (stage {stage_id})")
            got_w, want = _comparable(kind, optimizer, name, copies[0][1], ref["weights"][name])
            err = float((got_w - want).norm() / want.norm())
            if not err <= 1e-5:
                failures.append(f"{what}: {name} relative error {err:.2e}")
    return failures


def _comparable(kind: str, optimizer: str, name: str, got, want):
    """GPT-2's key bias (the middle third of ``c_attn.bias``) has a zero gradient in exact
    arithmetic (softmax is shift-invariant); its fp32 gradient is rounding noise, which AdamW
    normalizes into lr-sized steps of arbitrary sign, in the HF run as in the pipeline. Under
    AdamW it is compared by its size only (at most lr per step); the query and value biases as
    every other weight."""
    if kind == "gpt2" and optimizer == "adamw" and name.endswith("attn.c_attn.bias"):
        q, k, v = got.chunk(3)
        qw, kw, vw = want.chunk(3)
        assert (
            float(k.abs().max()) <= LR["adamw"] * STEPS * 1.01 and float(kw.abs().max()) <= LR["adamw"] * STEPS * 1.01
        )
        return torch.cat([q, v]), torch.cat([qw, vw])
    return got, want


TWO_RANKS = [
    ("gpt2", "sgd", 0, "1f1b"),
    ("gpt2", "adamw", 1, "1f1b"),
    ("llama", "sgd", 1, "1f1b"),
    ("llama", "adamw", 2, "gpipe"),
    ("llama_tied", "sgd", 2, "1f1b"),
    ("llama_tied", "adamw", 0, "1f1b"),
]


def test_gpt2_and_llama_two_stages_match_the_hf_model():
    results = run_on_ranks(_from_models, world_size=2, args=(2, TWO_RANKS), timeout=900)
    failures = _check(results, dp=1)
    assert not failures, "\n".join(failures)


FOUR_RANKS = [
    ("gpt2", "sgd", 2, "1f1b"),
    ("gpt2", "adamw", 0, "gpipe"),
    ("llama", "adamw", 1, "1f1b"),
    ("llama_tied", "sgd", 1, "1f1b"),
]


def test_gpt2_and_llama_two_stages_two_replicas_match_the_hf_model():
    results = run_on_ranks(_from_models, world_size=4, args=(2, FOUR_RANKS), timeout=900)
    failures = _check(results, dp=2)
    assert not failures, "\n".join(failures)


# -- built from a config: each stage initializes only its own layers --------------------------
def _from_configs() -> dict:
    import zerotrain
    from zerotrain.pipeline import from_hf_causal_lm, hf_state_dict

    zerotrain.init_distributed()
    out = {}
    for kind in ("gpt2", "llama_tied"):
        pipe = from_hf_causal_lm(_config(kind), num_stages=2, seed_layers=True)
        weights = {n: p.detach().clone() for n, p in hf_state_dict(pipe).items()}
        assert not any(p.is_meta for p in pipe.parameters())
        dp = pipe.mpu().get_data_parallel_world_size()
        out[kind] = {"init": weights, **_train(kind, pipe, dp, "adamw", 1, "1f1b")}
    return out


def test_from_config_each_stage_initializes_its_layers_like_hf():
    import math

    results = run_on_ranks(_from_configs, world_size=4, timeout=900)
    for kind in ("gpt2", "llama_tied"):
        init: dict[str, list] = {}
        for res in results:
            for name, value in res[kind]["init"].items():
                init.setdefault(name, []).append(value)
        for name, copies in init.items():  # replicas (and the tied copies) agree
            assert all(torch.equal(c, copies[0]) for c in copies), (kind, name)
        state = {n: c[0] for n, c in init.items()}
        model = _model(kind)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(n == "lm_head.weight" or n.endswith("inv_freq") for n in missing), missing
        # HF's init: norms at one, embeddings and projections at initializer_range, GPT-2's
        # residual projections scaled by 1/sqrt(2 n_layer).
        std = model.config.initializer_range
        if kind == "gpt2":
            assert torch.equal(state["transformer.h.1.ln_1.weight"], torch.ones(16))
            assert abs(float(state["transformer.h.2.attn.c_attn.weight"].std()) / std - 1) < 0.2
            scaled = float(state["transformer.h.3.mlp.c_proj.weight"].std()) / (std / math.sqrt(8))
            assert abs(scaled - 1) < 0.2, scaled
        else:
            assert torch.equal(state["model.layers.1.input_layernorm.weight"], torch.ones(16))
            assert abs(float(state["model.layers.2.mlp.up_proj.weight"].std()) / std - 1) < 0.2
        assert abs(float(state[next(n for n in state if "wte" in n or "embed_tokens" in n)].std()) / std - 1) < 0.2
        # The pipeline trains that model as HF does.
        want0 = _hf_loss(kind, 2, model=model)
        ref = _reference(kind, 2, "adamw", model=model)
        for res in results:
            got = res[kind]
            assert got["losses"][0] == pytest.approx(want0, rel=1e-5)
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
            for name, value in got["weights"].items():
                value, want = _comparable(kind, "adamw", name, value, ref["weights"][name])
                assert float((value - want).norm() / want.norm()) <= 1e-5, (kind, name)


def test_unsupported_models_are_refused_in_one_line():
    from transformers import BertConfig

    from zerotrain.pipeline import from_hf_causal_lm

    with pytest.raises(ValueError, match="model_type 'bert' is not supported; supported: gpt2, llama"):
        from_hf_causal_lm(BertConfig(), num_stages=2)
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel or PretrainedConfig"):
        from_hf_causal_lm({"model_type": "gpt2"}, num_stages=2)
