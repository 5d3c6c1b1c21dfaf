"""fp16 with pipelining: an overflow on one stage (one data rank of it) skips the step on every
stage and every replica, and the loss scale halves everywhere (through ``train_batch``).

A gradient hook on one parameter of the last stage, on data rank 0 only, turns its gradient into
inf during one chosen batch. Checked at P=2 x D=1 and P=2 x D=2, ZeRO 0/1/2:
- every rank reports that step skipped (``skipped_steps``), its weights bitwise unchanged by it;
- every rank's loss scale halved (``hysteresis: 1``), the same on every rank;
- the other steps train on: the whole-model update follows an fp32 reference that trains on the
  same batches minus the skipped one, within the combination suite's 16-bit bounds (so no inf
  is left in a gradient buffer afterwards).
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.testing import run_on_ranks

D_IN, HIDDEN, LAYERS, MICRO, M, STEPS, LR, SKIP, SCALE_POWER = 6, 8, 4, 2, 4, 4, 0.05, 1, 10


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(D_IN if i == 0 else HIDDEN, HIDDEN) for i in range(LAYERS)]


def _batches(dp: int) -> list:
    g = torch.Generator().manual_seed(5)
    return [
        [
            [(torch.randn(MICRO, D_IN, generator=g), torch.randn(MICRO, HIDDEN, generator=g)) for _ in range(M)]
            for _ in range(dp)
        ]
        for _ in range(STEPS)
    ]


def _optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _to_fp16(batch):
    x, y = batch
    return x.half(), y.half()


def _mse(out, y):
    return nn.functional.mse_loss(out.float(), y.float())


def _reference(dp: int) -> tuple[dict, dict]:
    model = nn.Sequential(*_layers())
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _optimizer(model.parameters())
    for step, batch in enumerate(_batches(dp)):
        if step == SKIP:
            continue
        for rank in batch:
            for x, y in rank:
                # The pipeline's data is fp16: the reference sees the same rounded values.
                (_mse(model(x.half().float()), y.half().float()) / (M * dp)).backward()
        opt.step()
        opt.zero_grad()
    return init, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(stages: list) -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    zerotrain.init_distributed()
    out = {}
    for stage in stages:
        model = PipelineModule(_layers(), num_stages=2, loss_fn=_mse, partition_method="uniform")
        dp = model.mpu().get_data_parallel_world_size()
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": M,
            "train_batch_size": MICRO * M * dp,
            "zero_optimization": {"stage": stage},
            "gradient_clipping": 0.0,
            "fp16": {"enabled": True, "initial_scale_power": SCALE_POWER, "hysteresis": 1},
        }
        engine, *_ = zerotrain.initialize(model=model, optimizer=_optimizer, config=config)
        engine.set_batch_fn(_to_fp16)
        rank = engine.topology.data_rank
        poisoned = engine.is_last_stage() and rank == 0
        state = {"step": -1}
        if poisoned:
            weight = next(engine.module.parameters())
            weight.register_hook(lambda g: g * float("inf") if state["step"] == SKIP else g)
        scales, skipped, weights = [], [], []
        for step, batch in enumerate(_batches(dp)):
            state["step"] = step
            before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            engine.train_batch(iter(batch[rank]))
            after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            scales.append(engine.loss_scale)
            skipped.append(engine.skipped_steps)
            weights.append(all(torch.equal(before[n], after[n]) for n in before))
        out[stage] = {
            "scales": scales,
            "skipped": skipped,
            "unchanged": weights,
            "global_steps": engine.global_steps,
            "poisoned": poisoned,
            "weights": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        }
        engine.destroy()
    return out


def _check(results: list, dp: int) -> list[str]:
    init, final = _reference(dp)
    failures = []
    scale = 2.0**SCALE_POWER
    for stage in results[0]:
        assert sum(r[stage]["poisoned"] for r in results) == 1
        whole = {}
        for rank, res in enumerate(results):
            got = res[stage]
            what = f"D={dp} stage {stage} rank {rank}"
            want_skipped = [0 if s < SKIP else 1 for s in range(STEPS)]
            if got["skipped"] != want_skipped:
                failures.append(f"{what}: skipped_steps per step {got['skipped']} != {want_skipped}")
            want_scales = [scale if s < SKIP else scale / 2 for s in range(STEPS)]
            if got["scales"] != want_scales:
                failures.append(f"{what}: loss scale per step {got['scales']} != {want_scales}")
            unchanged = [s == SKIP for s in range(STEPS)]
            if got["unchanged"] != unchanged:
                failures.append(f"{what}: weights unchanged per step {got['unchanged']} != {unchanged}")
            whole.update(got["weights"])
        names = sorted(final)
        assert sorted(whole) == names
        update = torch.cat([(whole[n] - init[n]).flatten() for n in names])
        want = torch.cat([(final[n] - init[n]).flatten() for n in names])
        size = float(update.norm() / want.norm())
        cosine = float(nn.functional.cosine_similarity(update, want, dim=0))
        if not (0.9 <= size <= 1.1 and cosine > 0.99):
            failures.append(f"D={dp} stage {stage}: update size {size:.4f}x the reference's, cosine {cosine:.4f}")
    return failures


def test_overflow_on_one_stage_skips_every_stage():
    results = run_on_ranks(_train, world_size=2, args=([0, 1, 2],), timeout=600)
    failures = _check(results, dp=1)
    assert not failures, "\n".join(failures)


def test_overflow_on_one_replica_of_one_stage_skips_everywhere():
    results = run_on_ranks(_train, world_size=4, args=([0, 1, 2],), timeout=600)
    failures = _check(results, dp=2)
    assert not failures, "\n".join(failures)
