"""DeepSpeed's AutoEP config section (``"expert_parallel": {"enabled": true, "autoep_size": N}``,
issue 32): ``zerotrain.initialize`` makes a Hugging Face MoE model expert-parallel itself, and
training then equals calling ``zerotrain.experts.expert_parallel`` by hand, bit for bit; with
parameters listed (or a client optimizer built) before ``initialize``, the replaced experts
still train (DeepSpeed #8377 froze them). Bad sections raise one line naming the key.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from zerotrain.testing import run_on_ranks

warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)

STEPS = 3


def make():
    import transformers as hf

    config = hf.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        intermediate_size=8,
        num_local_experts=4,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return hf.MixtralForCausalLM(config)


def _run(engine, rank: int) -> tuple[list[float], dict]:
    from zerotrain.experts import gather_expert_state_dict

    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(input_ids=ids, labels=ids, output_router_logits=True).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.clone() for k, v in gather_expert_state_dict(engine.module).items()}


def _on_rank():
    import torch.distributed as dist

    import zerotrain
    from zerotrain.experts import expert_parallel

    zerotrain.init_distributed()
    rank = dist.get_rank()
    base = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    adamw = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}}
    out = {}
    # config optimizer; the section as DeepSpeed users write it (other keys at DeepSpeed's defaults)
    model = make()
    expert_parallel(model, 2)
    engine, *_ = zerotrain.initialize(model=model, config={**base, "optimizer": adamw})
    out["by_hand"] = _run(engine, rank)
    engine.destroy()
    model = make()
    section = {"enabled": True, "autoep_size": 2, "top_k": "auto", "use_grouped_mm": True}
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=list(model.parameters()),
        config={**base, "optimizer": adamw, "expert_parallel": section},
    )
    out["config"] = _run(engine, rank)
    out["sliced"] = tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape)
    engine.destroy()
    # a client optimizer built before initialize (its expert tensors replaced under it)
    model = make()
    expert_parallel(model, 2)
    engine, *_ = zerotrain.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=base)
    out["sgd_by_hand"] = _run(engine, rank)
    engine.destroy()
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = zerotrain.initialize(
        model=model, optimizer=opt, config={**base, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    )
    out["sgd_config"] = _run(engine, rank)
    engine.destroy()
    # a model without fused experts
    try:
        zerotrain.initialize(
            model=nn.Linear(4, 4),
            config={**base, "optimizer": adamw, "expert_parallel": {"enabled": True, "autoep_size": 2}},
        )
        out["no_experts"] = None
    except ValueError as error:
        out["no_experts"] = str(error)
    return out


def test_initialize_with_the_section_equals_expert_parallel_by_hand():
    results = run_on_ranks(_on_rank, world_size=2, timeout=600)
    full = make().state_dict()
    for rank, out in enumerate(results):
        assert out["sliced"] == (2, 16, 16), rank  # 2 of 4 experts on each rank
        for by_hand, config in (("by_hand", "config"), ("sgd_by_hand", "sgd_config")):
            (want_losses, want), (losses, got) = out[by_hand], out[config]
            assert losses == want_losses, (rank, config)
            assert list(got) == list(want)
            for k, v in want.items():
                assert torch.equal(got[k], v), (rank, config, k)
            # the experts did train (not frozen under a stale optimizer)
            key = "model.layers.0.mlp.experts.down_proj"
            assert float((got[key] - full[key]).abs().max()) > 1e-4, (rank, config)
        assert out["no_experts"] is not None and "expert_parallel.enabled" in out["no_experts"]
        assert "\n" not in out["no_experts"]


@pytest.mark.parametrize(
    "section, error, named",
    [
        (
            {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"},
            NotImplementedError,
            "expert_parallel.preset_model",
        ),
        (
            {"enabled": True, "autoep_size": 2, "comm_backend": "deepep", "top_k": 2},
            NotImplementedError,
            "expert_parallel.comm_backend='deepep', expert_parallel.top_k=2",
        ),
        ({"enabled": True, "autoep_sz": 2}, ValueError, "autoep_sz"),
        ({"enabled": True, "autoep_size": 0}, ValueError, "expert_parallel.autoep_size"),
        ({"enabled": "yes"}, ValueError, "expert_parallel.enabled"),
        (True, ValueError, "expert_parallel"),
    ],
)
def test_bad_sections_raise_one_line_naming_the_key(section, error, named):
    from zerotrain.experts.autoep import autoep_size

    with pytest.raises(error) as info:
        autoep_size(section)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_disabled_or_absent_sections_do_nothing():
    from zerotrain.experts.autoep import autoep_size

    assert autoep_size(None) is None
    assert autoep_size({"enabled": False, "autoep_size": 4, "preset_model": "x"}) is None
    assert autoep_size({"enabled": True}) == 1
    assert autoep_size({"enabled": True, "autoep_size": 4, "route_scale": 1.0}) == 4
