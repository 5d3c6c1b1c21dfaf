"""A Hugging Face transformers model (GPT-2, tied embeddings, Conv1D layers) under ZeRO-3."""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import assert_close_trajectory
from zerotrain.testing import run_on_ranks

pytest.importorskip("transformers")


def _train_gpt2(stage: int):
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import zerotrain

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=128,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
        )
    )
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
    }
    engine, *_ = zerotrain.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(8):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    engine.eval()
    with torch.no_grad():  # an eval generation loop: many forwards with a KV cache
        generated = engine.module.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    return losses, generated


def test_hf_gpt2_stage3_matches_stage0_and_generates_the_same():
    (losses0, gen0), _ = run_on_ranks(_train_gpt2, 2, args=(0,))
    (losses3, gen3), _ = run_on_ranks(_train_gpt2, 2, args=(3,))
    assert_close_trajectory(losses3, losses0)
    assert torch.equal(gen3, gen0)
