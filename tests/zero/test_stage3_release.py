"""Stage 3 under ``memory_release: "eager"`` holds less at its peaks (issue 19) and trains the
same as under "off":

- shard gradients are freed between steps (so the start of backward, where every activation is
  saved, does not hold them) and written fresh by the next reduction;
- a tied embedding/output weight's gathered buffer is emptied once the output layer's backward
  is over (the embedding's backward reads indices only), instead of living to the end of backward;
- in 16-bit training each shard gradient is freed as soon as the step has its fp32 copy;
- forward hands back its heap holes as it gathers (trims counted through a stand-in libc), and
  backward once per eighth of the model, not after every module;
- where backward starts (the step's peak) the gather pool is dropped and nothing is gathered
  ahead until the first module's backward is over; the staging slots hold no memory between
  backwards; a pass's last gather drops the pool too (nothing in the pass would reuse it).
"""

from __future__ import annotations

import torch

from zerotrain.testing import run_on_ranks

STEPS = 3
CASES = (("fp32", "off"), ("fp32", "eager"), ("bf16", "off"), ("bf16", "eager"))


class _CountingLibc:
    trims = 0

    def malloc_trim(self, pad):
        self.trims += 1
        return 1

    def mallopt(self, param, value):
        return 1


def _train_cases():
    import zerotrain
    from tests.engine.workloads import adamw_config, make_model, train_steps
    from zerotrain import memory_release

    fake = _CountingLibc()
    memory_release._libc = lambda: fake  # policies switchable in one process, trims counted
    memory_release._fix_mmap_threshold = memory_release._fix_mmap_threshold.__wrapped__
    zerotrain.init_distributed()
    out = {}
    for dtype, policy in CASES:
        model = make_model()
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
        extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
        engine, *_ = zerotrain.initialize(
            model=model, config=adamw_config(2, memory_release=policy, zero_optimization=zero, **extra)
        )
        stage, coordinator = engine._zero, engine._zero.coordinator
        wte = coordinator._unit_of[id(model.wte.weight)]
        at_embedding_backward, at_step, held_after_step = [], [], []

        def record_wte_storage(module, inputs, output):
            if output.requires_grad:
                output.register_hook(
                    lambda grad: at_embedding_backward.append(
                        None if wte.flat is None else wte.flat.untyped_storage().nbytes()
                    )
                )

        # The embedding's output needs no grad (token ids in): hook the sum it feeds instead.
        model.wpe.register_forward_hook(record_wte_storage)
        # The gather pool at the forward's last gather (the output layer's).
        pool_at_last_gather = []
        last = list(model.modules())[-1]
        last.register_forward_pre_hook(lambda m, args: pool_at_last_gather.append(coordinator.buffers.pool_numel))
        optimizer_step = engine.optimizer.step

        def step(*args, **kwargs):
            at_step[-1].append(sum(g.numel() for g in stage.shard_grads))
            return optimizer_step(*args, **kwargs)

        engine.optimizer.step = step
        first_use_inflight, staging_held = [], []
        pre_backward = coordinator._pre_backward

        def record_first_use(units, module):
            first = coordinator._first_backward_use
            pre_backward(units, module)
            if first:  # gathers started ahead by the first backward use (the output layer)
                first_use_inflight.append(len(coordinator._inflight))

        coordinator._pre_backward = record_first_use
        losses = []
        for _ in range(STEPS):
            at_step.append([])  # one entry per optimizer.step() call (bf16: one per chunk)
            losses += train_steps(engine, 1)
            held_after_step.append(sum(g.untyped_storage().nbytes() for g in stage.shard_grads))
            staging_held.append(sum(s.flat is not None for s in stage.reduction.staging.slots))
        weights = {k: v.detach().float().clone() for k, v in engine.module_state_dict().items()}
        trims_before = fake.trims
        with torch.no_grad():
            engine(torch.zeros(2, 16, dtype=torch.long))
        out[(dtype, policy)] = {
            "losses": losses,
            "weights": weights,
            "held_after_step": held_after_step,
            "freed_numel": stage.reduction.freed_numel,
            "shard_numel": sum(u.layout.shard_numel for u in stage.trained),
            "gradients_reported": engine.memory_breakdown()["gradients"],
            "hollowed": coordinator.hollowed,
            "at_embedding_backward": at_embedding_backward,
            "wte_bytes": wte.layout.padded_numel * wte.dtype.itemsize,
            "at_step": at_step,
            "forward_trims": fake.trims - trims_before,
            "first_use_inflight": first_use_inflight,
            "staging_held": staging_held,
            "pool_drops": coordinator.pool_drops,
            "pool_at_last_gather": pool_at_last_gather,
            "pool_after": coordinator.buffers.pool_numel,
        }
        engine.destroy()
    return out


def test_eager_release_frees_gradients_tied_weight_and_forward_holes_and_trains_the_same():
    for r in run_on_ranks(_train_cases, world_size=2):
        for dtype in ("fp32", "bf16"):
            off, eager = r[(dtype, "off")], r[(dtype, "eager")]
            # Same arithmetic: a fresh gradient is written where "off" adds to zeros.
            assert eager["losses"] == off["losses"], (dtype, eager["losses"], off["losses"])
            for name, value in off["weights"].items():  # the last step's update included
                assert torch.equal(eager["weights"][name], value), (dtype, name)
            # Shard gradients: freed between steps under "eager", held under "off"; the
            # breakdown reports what a step holds either way.
            assert eager["held_after_step"] == [0] * STEPS, eager["held_after_step"]
            assert eager["freed_numel"] == eager["shard_numel"] > 0
            assert min(off["held_after_step"]) > 0 and off["freed_numel"] == 0
            assert eager["gradients_reported"] == off["gradients_reported"] > 0
            # The tied unit's storage is emptied before the embedding's backward (it was whole
            # there before), under either policy: it costs nothing. So is the position
            # embedding's, instead of a gather for its backward (which reads ids only).
            for case in (off, eager):
                assert case["hollowed"] == 2 * STEPS, case["hollowed"]
                assert case["at_embedding_backward"] == [0] * STEPS, case["at_embedding_backward"]
            # Forward trims only under "eager".
            assert eager["forward_trims"] > 0 and off["forward_trims"] == 0
            # Where backward starts: under "eager" no idle pool, no gathers ahead, no staging
            # memory held since the last backward; under "off" prefetching starts right away.
            assert eager["pool_drops"] == STEPS and off["pool_drops"] == 0
            assert eager["first_use_inflight"] == [0] * STEPS, eager["first_use_inflight"]
            assert min(off["first_use_inflight"][1:]) > 0, off["first_use_inflight"]  # after recording
            assert eager["staging_held"] == [0] * STEPS, eager["staging_held"]
            # A pass's last gather drops the pool under "eager" (once the order is recorded:
            # from the second forward on), where "off" keeps it.
            assert eager["pool_at_last_gather"][1:] == [0] * STEPS, eager["pool_at_last_gather"]
            assert min(off["pool_at_last_gather"][1:]) > 0, off["pool_at_last_gather"]
            assert min(off["staging_held"]) > 0, off["staging_held"]
        # fp32: the step reads the shard gradients themselves, in one call. bf16 steps chunk by
        # chunk; under "eager" each chunk's shard gradients are freed once cast to fp32, so fewer
        # are left at every call and none at the last.
        fp32 = r[("fp32", "eager")]
        assert fp32["at_step"] == [[fp32["shard_numel"]]] * STEPS
        for calls in r[("bf16", "eager")]["at_step"]:
            assert len(calls) > 1 and calls[-1] == 0, calls
            assert all(a > b for a, b in zip(calls, calls[1:])), calls
        bf16_off = r[("bf16", "off")]
        for calls in bf16_off["at_step"]:
            assert len(calls) > 1 and set(calls) == {bf16_off["shard_numel"]}, calls
        # bf16 follows fp32 loosely (rounding), so the bf16 path is really exercised.
        gap = max(abs(a - b) / b for a, b in zip(r[("bf16", "eager")]["losses"], fp32["losses"]))
        assert 0 < gap < 0.05, gap


def _backward_trims(bucket: int) -> list[int]:
    import zerotrain
    from tests.engine.workloads import adamw_config, make_model, train_steps
    from zerotrain import memory_release

    fake = _CountingLibc()
    memory_release._libc = lambda: fake
    memory_release._fix_mmap_threshold = memory_release._fix_mmap_threshold.__wrapped__
    zerotrain.init_distributed()
    model = make_model()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": bucket}
    engine, *_ = zerotrain.initialize(
        model=model, config=adamw_config(2, memory_release="eager", zero_optimization=zero)
    )
    per_backward, backward = [], engine.backward

    def counted(loss, *args, **kwargs):
        before = fake.trims
        out = backward(loss, *args, **kwargs)
        per_backward.append(fake.trims - before)
        return out

    engine.backward = counted
    train_steps(engine, STEPS)
    units = len(engine._zero.trained)
    engine.destroy()
    return per_backward + [units]


def test_eager_stage3_trims_backward_per_eighth_of_the_model_not_per_module():
    """Stage 3's units are single modules: with a small bucket, trimming per unit reduced would
    hand memory back after nearly every module (and fault it in again at the next). Backward
    trims once per eighth of the model, plus once where it starts (and once more where the
    first module's backward begins)."""
    *per_backward, units = run_on_ranks(_backward_trims, world_size=2, args=(2000,))[0]
    assert units > 12, units  # enough modules that per-unit trimming would exceed the bound
    assert all(1 <= n <= 8 + 2 for n in per_backward), (per_backward, units)
