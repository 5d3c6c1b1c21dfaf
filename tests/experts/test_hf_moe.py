"""Hugging Face MoE models with their experts spread over an expert-parallel group
(``zerotrain.experts.expert_parallel``, issue 32).

Tiny Mixtral, Qwen2-MoE (shared expert, unnormalized top-k), Qwen3-MoE and DeepSeek-V3 (grouped
sigmoid router, shared expert) models are built from configs with one seed. On two gloo ranks
with ``ep_size`` 2 each rank keeps half the experts; the reference is the same model unsharded in
one process. Each rank feeds its own tokens (a different count per rank), so the expert slices'
gradients are the sum over both ranks' tokens (what the all-to-all's backward brings back) and
dense gradients are the rank's own. Checked: the MoE block's output and every gradient (input,
router, shared expert, expert slices), the whole model's loss with the router aux loss and its
gradients (also under HF's gradient checkpointing), the gathered/sliced state dicts, and 5 steps
of ``zerotrain.initialize`` at ZeRO stages 0, 2 and 3 (SGD, AdamW; clipping acting, the gradient
norm counting each expert once; bf16 by update direction) against single-process HF training on
the mean of the ranks' losses; 4 ranks (two replicas of each expert slice: stage 3 shards
them over the pair) at stages 2 and 3.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from zerotrain.testing import run_on_ranks

KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
TRAIN_KINDS = ("mixtral", "qwen2_moe")
STAGES = (0, 2, 3)  # stage 3: stage3_param_persistence_threshold 0, every parameter partitioned
# AdamW's eps above the roundoff of gradients that are zero in exact arithmetic (attention key
# biases: softmax ignores them), which Adam would otherwise blow up to lr-sized steps.
OPTIMIZERS = {"SGD": {"lr": 0.5, "momentum": 0.9}, "AdamW": {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}}
EP = 2
STEPS = 5
SEQ = 8
TOL = 1e-6
CLIP = 0.5  # acts at every step (2 and 4 ranks): the norm must count each expert slice once


def make(kind: str):
    """A tiny model from a config, random init under seed 0 (every rank builds the same one)."""
    import transformers as hf

    common = dict(
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
    )
    if kind == "mixtral":
        config, cls = hf.MixtralConfig(intermediate_size=8, num_local_experts=4, **common), hf.MixtralForCausalLM
    elif kind == "qwen2_moe":
        config = hf.Qwen2MoeConfig(
            intermediate_size=16,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
            num_experts=4,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            **common,
        )
        cls = hf.Qwen2MoeForCausalLM
    elif kind == "qwen3_moe":
        config = hf.Qwen3MoeConfig(
            intermediate_size=16,
            moe_intermediate_size=8,
            num_experts=4,
            head_dim=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            **common,
        )
        cls = hf.Qwen3MoeForCausalLM
    else:  # DeepSeek-V3: no aux loss (bias-balanced), multi-head latent attention
        common.update(num_key_value_heads=2)
        common.pop("router_aux_loss_coef")
        config = hf.DeepseekV3Config(
            intermediate_size=16,
            moe_intermediate_size=8,
            n_routed_experts=4,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=8,
            qk_nope_head_dim=4,
            qk_rope_head_dim=4,
            v_head_dim=4,
            **common,
        )
        cls = hf.DeepseekV3ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config)


def _tokens(rank: int) -> int:
    return 5 + 4 * rank  # ranks hold different token counts (dropless, uneven all-to-all)


def _block_inputs(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(1, _tokens(rank), 16, generator=g), torch.randn(1, _tokens(rank), 16, generator=g)


def _ids(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 32, (2, SEQ), generator=g)


def _expert_keys(model) -> set[str]:
    from zerotrain.experts.hf import expert_modules

    return {f"{name}.{p}" for name, m in expert_modules(model) for p, _ in m.named_parameters(recurse=False)}


def _grads(module) -> dict:
    return {k: p.grad.detach().clone() for k, p in module.named_parameters() if p.grad is not None}


def _config(stage: int, optimizer: str) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "gradient_clipping": CLIP,
        "optimizer": {"type": optimizer, "params": OPTIMIZERS[optimizer]},
    }


def _on_rank(kinds, train_kinds, stages, bf16=False):
    import zerotrain
    from zerotrain.experts import expert_parallel, gather_expert_state_dict, shard_expert_state_dict

    zerotrain.init_distributed()
    rank = dist.get_rank()
    out = {"rank": rank}
    for kind in kinds:
        full = make(kind)
        model = copy.deepcopy(full)
        names = expert_parallel(model, EP)
        res = {"names": names}
        # The state dict: same keys, expert rows sliced; gathered back whole; a full one sliced.
        state = model.state_dict()
        res["local_state"] = {k: v.clone() for k, v in state.items()}
        res["gathered"] = gather_expert_state_dict(model)
        model.load_state_dict(shard_expert_state_dict(model, full.state_dict()))
        res["markers"] = {
            k: (getattr(p, "allreduce", True), getattr(p, "group_name", None)) for k, p in model.named_parameters()
        }
        # One MoE block: output and every gradient.
        block = model.model.layers[0].mlp
        x, grad_out = _block_inputs(rank)
        x.requires_grad_(True)
        y = block(x)
        y.backward(grad_out)
        res["block"] = (y.detach(), x.grad.clone(), _grads(block))
        # The whole model with output_router_logits=True: loss (incl. router aux loss), gradients.
        model.zero_grad()
        ids = _ids(0, rank)
        result = model(input_ids=ids, labels=ids, output_router_logits=True)
        result.loss.backward()
        aux = None if result.aux_loss is None else float(result.aux_loss)
        res["model"] = (float(result.loss), aux, _grads(model))
        # HF's gradient checkpointing recomputes the block, its all-to-alls included, in backward.
        model.zero_grad()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
        res["checkpointed"] = _grads(model)
        out[kind] = res
    runs = [(kind, stage, optimizer, "fp32") for kind in train_kinds for stage in stages for optimizer in OPTIMIZERS]
    if bf16:
        runs.append((train_kinds[0], stages[-1], "AdamW", "bf16"))
    for kind, stage, optimizer, precision in runs:
        model = make(kind)
        expert_parallel(model, EP)
        config = _config(stage, optimizer)
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        engine, _, _, _ = zerotrain.initialize(model=model, config=config)
        losses, norms = [], []
        for step in range(STEPS):
            ids = _ids(step, rank)
            loss = engine(input_ids=ids, labels=ids, output_router_logits=True).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            norms.append(float(engine.get_global_grad_norm()))
        from zerotrain.zero import GatheredParameters

        with GatheredParameters([p for p in engine.module.parameters() if hasattr(p, "ds_id")]):  # stage 3
            local = {k: p.detach().float().clone() for k, p in engine.module.named_parameters()}
        gathered = {k: v.float() for k, v in gather_expert_state_dict(engine.module).items()}
        key = (kind, stage, optimizer) if precision == "fp32" else (kind, stage, optimizer, precision)
        out[key] = (local, losses, norms, gathered)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_on_rank, 2, args=(KINDS, TRAIN_KINDS, STAGES, True), timeout=900)


def _slice(name: str, tensor: torch.Tensor, experts: set[str], rank: int) -> torch.Tensor:
    """The rows rank ``rank`` holds: expert-parallel groups are blocks of EP consecutive ranks."""
    if name not in experts:
        return tensor
    local, ep_rank = tensor.shape[0] // EP, rank % EP
    return tensor[ep_rank * local : (ep_rank + 1) * local]


def _compare(what: str, got: dict, want: dict, failures: list, tol: float = TOL) -> None:
    if set(got) != set(want):
        failures.append(f"{what}: keys differ: {sorted(set(got) ^ set(want))}")
    for k in sorted(set(got) & set(want)):
        if got[k].shape != want[k].shape:
            failures.append(f"{what}: {k} shape {tuple(got[k].shape)} != {tuple(want[k].shape)}")
        elif not torch.allclose(got[k], want[k], rtol=0, atol=tol):
            failures.append(f"{what}: {k} differs by {float((got[k] - want[k]).abs().max()):.3g}")


def _reference_grads(module_of, run, experts: set[str], rank: int) -> dict:
    """Dense gradients from this rank's input; expert rows summed over every rank's input."""
    per_rank = []
    for r in range(EP):
        module = module_of()
        run(module, r)
        per_rank.append(_grads(module))
    want = {}
    for k, g in per_rank[rank].items():
        total = sum(p[k] for p in per_rank if k in p) if k in experts else g
        want[k] = _slice(k, total, experts, rank)
    return want


@pytest.mark.parametrize("kind", KINDS)
def test_block_and_model_equal_unsharded(two_ranks, kind):
    failures = []
    full = make(kind)
    reference_state = full.state_dict()
    experts_in_model = _expert_keys(full)
    block_experts = {k[len("model.layers.0.mlp.") :] for k in experts_in_model if k.startswith("model.layers.0.mlp.")}
    assert experts_in_model and len(block_experts) == 2
    for res in two_ranks:
        rank = res["rank"]
        got = res[kind]
        assert got["names"] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
        # Markers: DeepSpeed's, on the expert slices only.
        for k, (allreduce, group) in got["markers"].items():
            expected = (False, f"ep_size_{EP}") if k in experts_in_model else (True, None)
            if (allreduce, group) != expected:
                failures.append(f"rank {rank}: {k} markers {(allreduce, group)} != {expected}")
        _compare(
            f"rank {rank} local state",
            got["local_state"],
            {k: _slice(k, v, experts_in_model, rank) for k, v in reference_state.items()},
            failures,
            0,
        )
        _compare(f"rank {rank} gathered state", got["gathered"], reference_state, failures, 0)

        # The block: output and input gradient from this rank's tokens alone.
        def run_block(block, r):
            x, grad_out = _block_inputs(r)
            x.requires_grad_(True)
            block(x).backward(grad_out)
            return x

        x, grad_out = _block_inputs(rank)
        x.requires_grad_(True)
        ref_block = make(kind).model.layers[0].mlp
        y = ref_block(x)
        y.backward(grad_out)
        out, x_grad, grads = got["block"]
        _compare(
            f"{kind} rank {rank} block",
            {"output": out, "input grad": x_grad},
            {"output": y.detach(), "input grad": x.grad},
            failures,
        )
        want = _reference_grads(lambda: make(kind).model.layers[0].mlp, run_block, block_experts, rank)
        _compare(f"{kind} rank {rank} block grads", grads, want, failures)

        # The whole model: loss with the router aux loss, every gradient.
        def run_model(model, r):
            ids = _ids(0, r)
            model(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()

        ids = _ids(0, rank)
        with torch.no_grad():
            result = make(kind)(input_ids=ids, labels=ids, output_router_logits=True)
        loss, aux, grads = got["model"]
        if kind == "deepseek_v3":
            assert aux is None and result.aux_loss is None
        else:
            assert result.aux_loss is not None and float(result.aux_loss) > 0
            if abs(aux - float(result.aux_loss)) > TOL:
                failures.append(f"{kind} rank {rank}: aux loss {aux} != {float(result.aux_loss)}")
        if abs(loss - float(result.loss)) > TOL:
            failures.append(f"{kind} rank {rank}: loss {loss} != {float(result.loss)}")
        want = _reference_grads(lambda: make(kind), run_model, experts_in_model, rank)
        _compare(f"{kind} rank {rank} model grads", grads, want, failures)
        _compare(f"{kind} rank {rank} model grads, gradient checkpointing", got["checkpointed"], want, failures)
    assert not failures, "\n".join(failures)


def _reference_training(kind: str, optimizer: str, world: int):
    model = make(kind)
    opt = getattr(torch.optim, optimizer)(model.parameters(), **OPTIMIZERS[optimizer])
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = []
        for r in range(world):
            ids = _ids(step, r)
            per_rank.append(model(input_ids=ids, labels=ids, output_router_logits=True).loss)
        torch.stack(per_rank).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append([float(v.detach()) for v in per_rank])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


@pytest.mark.parametrize("kind", TRAIN_KINDS)
def test_training_equals_unsharded(two_ranks, kind):
    failures = _check_training(two_ranks, kind, STAGES)
    assert not failures, "\n".join(failures)


def test_bf16_training_follows_unsharded(two_ranks):
    """bf16 (HF's router weights stay fp32 through the all-to-all): ZeRO 3, AdamW, against the
    fp32 unsharded run; bf16 rounding flips some top-k choices, so the update is compared by size
    and direction, the losses within bf16's resolution."""
    want, want_losses, _ = _reference_training("mixtral", "AdamW", EP)
    initial = make("mixtral").state_dict()
    for res in two_ranks:
        _, losses, _, gathered = res[("mixtral", STAGES[-1], "AdamW", "bf16")]
        for keys in (list(want), sorted(_expert_keys(make("mixtral")))):
            update = torch.cat([(gathered[k] - initial[k]).flatten() for k in keys])
            ref = torch.cat([(want[k] - initial[k]).flatten() for k in keys])
            size = float(update.norm() / ref.norm())
            cosine = float(torch.nn.functional.cosine_similarity(update, ref, dim=0))
            assert 0.9 < size < 1.1 and cosine > 0.9, (res["rank"], len(keys), size, cosine)
        ref_losses = [step[res["rank"]] for step in want_losses]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 0.02, (losses, ref_losses)


def test_four_ranks_two_expert_data_replicas():
    """ep_size 2 on 4 ranks: each expert slice on 2 ranks, its gradients summed over them (and at
    stage 3 the slice itself sharded over them)."""
    per_rank = run_on_ranks(_on_rank, 4, args=((), ("mixtral",), (2, 3)), timeout=900)
    failures = _check_training(per_rank, "mixtral", (2, 3))
    assert not failures, "\n".join(failures)


def _check_training(per_rank: list, kind: str, stages) -> list[str]:
    failures = []
    experts = _expert_keys(make(kind))
    for optimizer in OPTIMIZERS:
        want, want_losses, want_norms = _reference_training(kind, optimizer, len(per_rank))
        assert min(want_norms) > CLIP, want_norms
        initial = make(kind).state_dict()
        assert any(not torch.allclose(want[k], initial[k]) for k in experts)  # the experts trained
        for stage in stages:
            for res in per_rank:
                rank = res["rank"]
                local, losses, norms, gathered = res[(kind, stage, optimizer)]
                what = f"{kind} stage {stage} {optimizer} rank {rank}"
                _compare(what, local, {k: _slice(k, v, experts, rank) for k, v in want.items()}, failures)
                _compare(f"{what} gathered", gathered, want, failures)
                ref = [step[rank] for step in want_losses]
                if max(abs(a - b) for a, b in zip(losses, ref)) > TOL:
                    failures.append(f"{what}: losses {losses} != {ref}")
                if max(abs(a - b) for a, b in zip(norms, want_norms)) > 1e-5:
                    failures.append(f"{what}: gradient norms {norms} != {want_norms}")
    return failures


def test_bad_input_one_line_errors():
    from zerotrain.experts import expert_parallel

    model = make("mixtral")
    with pytest.raises(ValueError, match=r"ep_size=3 must divide the 4 experts of model.layers.0.mlp.experts"):
        expert_parallel(model, 3)
    with pytest.raises(ValueError, match=r"ep_size=0 must be a positive integer"):
        expert_parallel(model, 0)
    with pytest.raises(ValueError, match=r"no Hugging Face fused experts module"):
        expert_parallel(torch.nn.Linear(2, 2), 1)
    expert_parallel(model, 1)
    with pytest.raises(ValueError, match=r"already expert-parallel"):
        expert_parallel(model, 1)
