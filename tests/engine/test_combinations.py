"""Every stage x precision x accumulation x optimizer trains like single-process fp32 PyTorch.

Each combination trains the tiny GPT for ``STEPS`` optimizer steps through ``zerotrain.initialize``
on 2 (or 4) gloo ranks, and its **final weights** are compared with a plain fp32 loop over the
same global batches:

- fp32: equal within 1e-5 relative (per tensor);
- bf16/fp16: the whole-model update ``w_final - w_init`` has the reference's size (0.9-1.1x) and
  direction (cosine > 0.99). The issue's bounds were 0.8-1.25x and 0.95; the stage-0 16-bit SGD
  combinations measure 0.9998-1.0001x and cosine >= 0.9999 here, and a reshape bug that reduced every
  gradient through two bucket systems still passed 0.95 (cosine 0.951), so the bounds are tighter.

Every rank must also end with the whole model, bit-identical to rank 0's: at stage 3 each rank
gathers it with ``GatheredParameters`` (``module_state_dict()`` returns it on rank 0 only, so
comparing that compared nothing), and rank 0's gathered copy must equal its ``module_state_dict()``.

SGD with momentum and clipping 1.0 sits beside AdamW: Adam normalises the gradient, so a gradient
off by a constant factor (the fp16 loss scale, the accumulation steps) hides behind it; SGD moves
the weights by exactly that factor, and clipping multiplies the error in.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.engine.workloads import global_batches, make_model, train_steps
from zerotrain.testing import run_on_ranks

STEPS = 10
MICRO = 2
PRECISIONS = ("fp32", "bf16", "fp16")
ACCUMULATION = (1, 3)
OPTIMIZERS = ("sgd", "adamw")
SGD = {"lr": 0.05, "momentum": 0.9}
# eps 1e-6: the attention key bias gets an exactly-zero gradient up to rounding, which Adam
# with eps 1e-8 would blow up to full-size (and rank-count-dependent) updates.
ADAMW = {"lr": 2e-3, "weight_decay": 0.1, "eps": 1e-6}
CLIP = {"sgd": 1.0, "adamw": 0.0}


def _config(stage: int, precision: str, gas: int, optimizer: str) -> dict:
    opt = {"type": "SGD", "params": SGD} if optimizer == "sgd" else {"type": "AdamW", "params": ADAMW}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP[optimizer],
        "optimizer": opt,
        "zero_optimization": {"stage": stage},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        # Dynamic scaling from 2^10: the default 2^16 overflows (and skips) the tiny model's first
        # steps, which the fp32 reference does not; test_loss_scaler covers skipping.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 10}
    if stage == 3:  # partition even the tiny model's LayerNorms and biases
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg


def _final_weights(engine, stage: int) -> tuple[dict, list[str]]:
    """This rank's whole final weights in fp32 by name (a collective at stage 3), and the names
    where ``module_state_dict()`` disagrees with them (stage 3, rank 0; else empty).

    Stages 0-2: the rank's own replica (``module_state_dict()``, no collective). Stage 3:
    ``module_state_dict()`` gathers onto rank 0 only (rank 1 gets ``{}``), so every rank gathers
    with ``GatheredParameters`` instead; rank 0 also lists the names where the two ways differ."""
    if stage < 3:
        return {k: v.float().clone() for k, v in engine.module_state_dict().items()}, []
    import torch.distributed as dist

    from zerotrain.zero import GatheredParameters

    state = engine.module_state_dict()  # collective: every rank calls it
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        gathered = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    disagree = []
    if dist.get_rank() == 0:  # a name missing from the state dict counts as a disagreement
        disagree = [n for n, v in gathered.items() if n not in state or not torch.equal(v, state[n].float())]
    return gathered, disagree


def _train_combinations(stage: int, combos: list[tuple[str, int, str]]) -> dict:
    """On every rank: train each combination from the same init; return final weights."""
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for precision, gas, optimizer in combos:
        model = make_model()
        engine, *_ = zerotrain.initialize(
            model=model, model_parameters=model.parameters(), config=_config(stage, precision, gas, optimizer)
        )
        losses = train_steps(engine, STEPS)
        weights, disagree = _final_weights(engine, stage)
        names = [n for n, _ in make_model().named_parameters()]
        out[(precision, gas, optimizer)] = {
            "params": {n: weights[n] for n in names if n in weights},
            "missing": [n for n in names if n not in weights],
            "disagree": disagree,
            "losses": losses,
            "skipped": engine.skipped_steps,
        }
        engine.destroy()
    return out


def _assert_every_rank_same_whole_weights(per_rank: list[dict]) -> None:
    """Every rank holds every parameter, and bit-identical values."""
    names = [n for n, _ in make_model().named_parameters()]
    assert names
    for rank, results in enumerate(per_rank):
        for combo, got in results.items():
            assert not got["missing"] and list(got["params"]) == names, (rank, combo, got["missing"])
            assert not got["disagree"], (rank, combo, "GatheredParameters != module_state_dict", got["disagree"])
    for combo in per_rank[0]:
        for rank in range(1, len(per_rank)):
            for name in names:
                assert torch.equal(per_rank[rank][combo]["params"][name], per_rank[0][combo]["params"][name]), (
                    combo,
                    rank,
                    name,
                )


def _reference(gas: int, optimizer: str, world: int) -> dict:
    model = make_model()
    opt = (
        torch.optim.SGD(model.parameters(), **SGD)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), **ADAMW)
    )
    data = global_batches(STEPS, MICRO * gas * world)
    for step in range(STEPS):
        loss = model(data[step], labels=data[step]).loss
        loss.backward()
        if CLIP[optimizer]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP[optimizer])
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check(results: dict, stage: int, world: int, fp32_rtol: float = 1e-5) -> list[str]:
    init = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    references = {(gas, opt): _reference(gas, opt, world) for gas, opt in itertools.product(ACCUMULATION, OPTIMIZERS)}
    failures = []
    for (precision, gas, optimizer), got in results.items():
        ref = references[(gas, optimizer)]
        what = f"stage {stage} {precision} gas={gas} {optimizer}"
        if got["skipped"]:
            failures.append(f"{what}: {got['skipped']} overflow-skipped steps")
            continue
        if precision == "fp32":
            for name, want in ref.items():
                err = (got["params"][name] - want).norm() / want.norm()
                if not err <= fp32_rtol:
                    failures.append(f"{what}: {name} relative error {float(err):.2e} > {fp32_rtol}")
            continue
        update = torch.cat([(got["params"][n] - init[n]).flatten() for n in ref])
        want = torch.cat([(ref[n] - init[n]).flatten() for n in ref])
        size = float(update.norm() / want.norm())
        cosine = float(torch.nn.functional.cosine_similarity(update, want, dim=0))
        if not (0.9 <= size <= 1.1 and cosine > 0.99):
            failures.append(f"{what}: update size {size:.4f}x the reference's, cosine {cosine:.4f}")
    return failures


ALL = list(itertools.product(PRECISIONS, ACCUMULATION, OPTIMIZERS))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_combination_matches_fp32_reference(stage):
    per_rank = run_on_ranks(_train_combinations, world_size=2, args=(stage, ALL), timeout=600)
    _assert_every_rank_same_whole_weights(per_rank)
    failures = _check(per_rank[0], stage, world=2)
    assert not failures, "\n".join(failures)


FOUR_RANK_COMBOS = [("fp32", 3, "sgd"), ("bf16", 1, "adamw"), ("fp16", 3, "sgd")]


def _four_rank_stages() -> dict:
    return {stage: _train_combinations(stage, FOUR_RANK_COMBOS) for stage in (1, 2, 3)}


def test_four_ranks_uneven_shards():
    """4 ranks: the tiny model's units do not divide evenly, so shards carry padding (stages 1-3
    in one process group)."""
    per_rank = run_on_ranks(_four_rank_stages, world_size=4, timeout=600)
    for stage in (1, 2, 3):
        _assert_every_rank_same_whole_weights([r[stage] for r in per_rank])
    failures = [f for stage in (1, 2, 3) for f in _check(per_rank[0][stage], stage, world=4)]
    assert not failures, "\n".join(failures)
    assert all(math.isfinite(v) for r in per_rank for st in r.values() for c in st.values() for v in c["losses"])
