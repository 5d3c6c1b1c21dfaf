"""Tiny transformers models built from configs (random init, no dropout, nothing downloaded) and
their training runs, for tests/hf/test_models.py.

`zoo_runs` runs on every rank of one 2-rank group: each model x ZeRO stage 0-3 x fp32/bf16,
10 steps through `zerotrain.initialize` with the `.loss` of the model's own output.
`plain_run` is the same training in plain PyTorch, one process, on the ranks' joint batch.
"""

from __future__ import annotations

import torch

VOCAB, SEQ, MICRO, WORLD, STEPS, LR = 64, 16, 2, 2, 10, 1e-3
PRECISIONS = ("fp32", "bf16")
# Every stage in fp32; bf16 at stages 0, 2 and 3 (stage 1 differs from stage 2 only in how
# gradients are reduced, which the engine's combination suite covers in every precision).
COMBOS = [(stage, "fp32") for stage in (0, 1, 2, 3)] + [(stage, "bf16") for stage in (0, 2, 3)]

# name: (config class, model class, config kwargs)
MODELS = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        ),
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=2,
            max_position_embeddings=32,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(hidden_size=32, n_layer=2, n_head=2, hidden_dropout=0.0, attention_dropout=0.0),
    ),
}


def make_model(name: str, seed: int = 0):
    import transformers

    config_cls, model_cls, kwargs = MODELS[name]
    config = getattr(transformers, config_cls)(vocab_size=VOCAB, **kwargs)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config)


def batches() -> torch.Tensor:
    """``[STEPS, MICRO * WORLD, SEQ]`` token ids (rank r takes rows r*MICRO .. (r+1)*MICRO)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, MICRO * WORLD, SEQ), generator=g)


def config(stage: int, precision: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def zoo_runs(models=tuple(MODELS), combos=tuple(COMBOS)) -> dict:
    """On each rank: {(model, stage, precision): {"losses": [...], "params": {...} (rank 0)}}."""
    import torch.distributed as dist

    import zerotrain
    from tests.hf.hf_workloads import train_causal_lm

    zerotrain.init_distributed()
    rank = dist.get_rank()
    data = batches()
    out = {}
    for name in models:
        for stage, precision in combos:
            model = make_model(name)
            engine, *_ = zerotrain.initialize(
                model=model, model_parameters=model.parameters(), config=config(stage, precision)
            )
            losses = train_causal_lm(engine, data[:STEPS], MICRO)
            weights = engine.module_state_dict()  # gathered at stage 3 (collective)
            out[(name, stage, precision)] = {
                "losses": losses,
                "params": {k: v.detach().float().clone() for k, v in weights.items()} if rank == 0 else None,
            }
            engine.destroy()  # what a script should do between engines (collective)
            del engine, model
    return out


def plain_run(name: str) -> dict:
    """The same training in plain PyTorch fp32: AdamW, clipping 1.0, the joint batch each step."""
    model = make_model(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    data = batches()
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=data[step], labels=data[step]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
