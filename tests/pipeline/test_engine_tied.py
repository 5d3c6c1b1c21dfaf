"""Tied embedding across the first and last pipeline stage (``TiedLayerSpec``) through
``train_batch``, against one process training the same tiny GPT with its embedding used twice.

The tied gradient must be summed where the ZeRO stage accumulates it: with 16-bit weights and
``grad_accum_dtype: fp32`` at stages 0-1 that is the stage's fp32 buffer, not ``.grad`` (which
stays None), so summing ``.grad`` summed zeros and the two copies drifted apart.

Checks, at P=2 (2 ranks) and P=2 x D=2 (4 ranks), ZeRO 0/1/2, AdamW, 4 micro-batches:
- the embedding's two copies (stage 0's and the last stage's) bitwise equal after every step;
- fp32: every weight within 1e-6 relative of the reference after every step's end;
- bf16/fp16 (with fp32 and with 16-bit gradient accumulation): the whole-model update within the
  combination suite's bounds (size 0.9-1.1x the reference's, cosine > 0.99), no skipped step.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.testing import run_on_ranks

VOCAB, WIDTH, MICRO, SEQ, M, STEPS, LR, CLIP = 11, 8, 2, 5, 4, 4, 0.2, 0.5


def _optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _head(embedding, x):
    return x @ embedding.weight.t()


def _lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def _specs():
    from zerotrain.pipeline import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        nn.Tanh(),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        LayerSpec(nn.LayerNorm, WIDTH),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=_head),
    ]


def _reference_layers() -> list:
    """The layers as PipelineModule builds them with seed_layers=True (base seed 1234 + index)."""
    from zerotrain.pipeline import LayerSpec
    from zerotrain.seeding import set_random_seed

    layers = []
    for idx, spec in enumerate(_specs()[:5]):
        set_random_seed(1234 + idx)
        layers.append(spec.build() if isinstance(spec, LayerSpec) else spec)
    return layers


def _name(index: int, suffix: str) -> str:
    """The reference parameter's name in the PipelineModule (layer index or the tied module)."""
    return f"tied_modules.embed.{suffix}" if index == 0 else f"{index}.{suffix}"


def _reference_named(layers) -> dict:
    return {
        _name(i, n): p
        for i, layer in enumerate(layers)
        if isinstance(layer, nn.Module)
        for n, p in layer.named_parameters()
    }


def _batches(dp: int) -> list:
    g = torch.Generator().manual_seed(3)
    return [
        [
            [
                (torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
                for _ in range(M)
            ]
            for _ in range(dp)
        ]
        for _ in range(STEPS)
    ]


def _reference(dp: int) -> list[dict]:
    """The reference's weights after every step."""
    layers = _reference_layers()
    params = [p for layer in layers if isinstance(layer, nn.Module) for p in layer.parameters()]
    opt = _optimizer(params)
    out, norms = [{n: p.detach().clone() for n, p in _reference_named(layers).items()}], []
    for step in _batches(dp):
        for rank in step:
            for ids, labels in rank:
                x = ids
                for layer in layers:
                    x = layer(x)
                (_lm_loss(_head(layers[0], x), labels) / (M * dp)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
        out.append({n: p.detach().clone() for n, p in _reference_named(layers).items()})
    assert min(norms) > CLIP, f"clipping must be active at every step: {norms}"
    return out


def _config(dp: int, stage: int, precision: str, accum: str | None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": M,
        "train_batch_size": MICRO * M * dp,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": CLIP,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    return cfg


def _train(combos: list) -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    zerotrain.init_distributed()
    out = {}
    for precision, stage, accum in combos:
        model = PipelineModule(
            _specs(), num_stages=2, loss_fn=_lm_loss, partition_method="uniform", seed_layers=True, base_seed=1234
        )
        dp = model.mpu().get_data_parallel_world_size()
        engine, *_ = zerotrain.initialize(
            model=model, optimizer=_optimizer, config=_config(dp, stage, precision, accum)
        )
        tied = engine.module.tied_modules["embed"].weight
        rank = engine.topology.data_rank
        history, losses = [], []
        for step in _batches(dp):
            losses.append(float(engine.train_batch(iter(step[rank]))))
            history.append(
                {
                    "tied": tied.detach().clone(),
                    "weights": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
                }
            )
        out[(precision, stage, accum)] = {
            "history": history,
            "losses": losses,
            "stage": engine.stage_id,
            "dp_rank": rank,
            "skipped": engine.skipped_steps,
        }
        engine.destroy()
    return out


def _check(results: list, dp: int) -> list[str]:
    ref = _reference(dp)
    init, final = ref[0], ref[-1]
    failures = []
    for combo in results[0]:
        precision, stage, accum = combo
        what = f"D={dp} {precision} stage {stage} accum {accum}"
        whole = {}
        for rank, res in enumerate(results):
            got = res[combo]
            if got["skipped"]:
                failures.append(f"{what} rank {rank}: {got['skipped']} skipped steps")
            whole.update(got["history"][-1]["weights"])
            # The other copy of this data rank's embedding: the other stage's rank, same data rank.
            peer = next(
                r for r in results if r[combo]["dp_rank"] == got["dp_rank"] and r[combo]["stage"] != got["stage"]
            )[combo]
            for step, (mine, theirs) in enumerate(zip(got["history"], peer["history"])):
                if not torch.equal(mine["tied"], theirs["tied"]):
                    diff = float((mine["tied"].float() - theirs["tied"].float()).abs().max())
                    failures.append(f"{what} rank {rank} step {step}: tied copies differ (max {diff:.3e})")
                    break
            if precision == "fp32":
                for step, snapshot in enumerate(got["history"]):
                    for name, value in snapshot["weights"].items():
                        want = ref[step + 1][name]
                        err = float((value - want).norm() / want.norm())
                        if not err <= 1e-6:
                            failures.append(f"{what} rank {rank} step {step}: {name} relative error {err:.2e}")
        assert sorted(whole) == sorted(final), (sorted(whole), sorted(final))
        if precision != "fp32":
            names = sorted(final)
            update = torch.cat([(whole[n] - init[n]).flatten() for n in names])
            want = torch.cat([(final[n] - init[n]).flatten() for n in names])
            size = float(update.norm() / want.norm())
            cosine = float(nn.functional.cosine_similarity(update, want, dim=0))
            if not (0.9 <= size <= 1.1 and cosine > 0.99):
                failures.append(f"{what}: update size {size:.4f}x the reference's, cosine {cosine:.4f}")
    return failures


SIXTEEN_FP32_ACCUM = [(precision, stage, "fp32") for precision in ("bf16", "fp16") for stage in (0, 1, 2)]
FP32 = [("fp32", stage, None) for stage in (0, 1, 2)]


def test_tied_embedding_two_stages():
    combos = FP32 + SIXTEEN_FP32_ACCUM + [(p, s, None) for p in ("bf16", "fp16") for s in (0, 1, 2)]
    results = run_on_ranks(_train, world_size=2, args=(combos,), timeout=900)
    failures = _check(results, dp=1)
    assert not failures, "\n".join(failures)


def test_tied_embedding_two_stages_two_replicas():
    combos = FP32 + SIXTEEN_FP32_ACCUM
    results = run_on_ranks(_train, world_size=4, args=(combos,), timeout=900)
    failures = _check(results, dp=2)
    assert not failures, "\n".join(failures)
