"""Virtual stages: ``PipelineModule(virtual_stages=V)`` with torch's ``ScheduleInterleaved1F1B``
(``"pipeline": {"schedule": "interleaved_1f1b"}``), ``ScheduleLoopedBFS`` (``"looped_bfs"``) and
``ScheduleInterleavedZeroBubble`` (``"zero_bubble"``), against a single-process fp32 reference
(the same initial weights, micro-batches and optimizer).

- P=2 x V=2 (2 ranks) and P=2 x D=2 x V=2 (4 ranks), 4 micro-batches, 8 layers in 4 virtual
  stages (rank 0 holds layers 0-1 and 4-5, rank 1 layers 2-3 and 6-7), SGD with momentum and
  AdamW, ZeRO 0/1/2, gradient clipping active at every step: every weight after ``STEPS`` steps
  within 1e-6 relative of the reference, the returned loss the reference's on every rank;
  ``eval_batch`` through the interleaved schedule.
- Zero-bubble in bf16 with fp32 gradient accumulation (its weight steps assign ``.grad`` past the
  gradient hooks): the update within the combination suite's bounds.
- A tied embedding used by three layers in three virtual stages (twice on rank 0, in two of its
  chunks, once on rank 1 as the output head): weights on the reference, copies equal.
- Bad combinations give one line each: an interleaved schedule with one chunk per rank, a
  single-stage schedule with chunks, gradient_accumulation_steps torch's interleaving cannot
  split, ``pipeline.virtual_stages`` other than the module's, ``virtual_stages=0``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.pipeline import mlp
from tests.pipeline.mlp import HIDDEN, MICRO, STEPS, M
from tests.pipeline.mlp import batches as _batches
from tests.pipeline.mlp import optimizer as _optimizer
from tests.pipeline.tied_lm import SEQ, VOCAB, WIDTH, copies_differ
from tests.pipeline.tied_lm import head as _head
from tests.pipeline.tied_lm import lm_loss as _lm_loss
from tests.pipeline.tied_lm import mix as _mix
from tests.pipeline.tied_lm import optimizer as _tied_optimizer
from zerotrain.testing import run_on_ranks

LAYERS, CLIP, V = 8, 0.05, 2


def _config(dp: int, stage: int, schedule: str, m: int = M, **pipeline) -> dict:
    return mlp.config(dp, stage, schedule, CLIP, m, **pipeline)


def _layers() -> list[nn.Module]:
    return mlp.layers(LAYERS)


def _reference(dp: int, optimizer: str) -> dict:
    return mlp.reference(_layers(), dp, optimizer, CLIP)


def _train(combos: list) -> dict:
    """On every rank: for each (stage, optimizer, schedule) train STEPS batches; this rank's
    weights (by global layer name), the returned losses, then an eval_batch loss."""
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    zerotrain.init_distributed()
    out = {}
    for combo in combos:
        stage, optimizer, schedule, *interval = combo  # interval: activation checkpoints per chunk
        model = PipelineModule(
            _layers(), num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform", virtual_stages=V
        )
        dp = model.mpu().get_data_parallel_world_size()
        extra = {"activation_checkpoint_interval": interval[0], "use_reentrant": False} if interval else {}
        engine, *_ = zerotrain.initialize(
            model=model,
            optimizer=lambda p, o=optimizer: _optimizer(p, o),
            config=_config(dp, stage, schedule, virtual_stages=V, **extra),
        )
        out[combo] = {
            **mlp.train_and_eval(engine, dp),
            "layers": list(model._local_layers),
            "skipped": engine.skipped_steps,
            "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "checkpointed": [model._checkpointable_blocks(*model._chunk_ranges[c]) for c in range(V)]
            if interval
            else None,
        }
        engine.destroy()
    return out


def _check(results: list, dp: int) -> list[str]:
    failures = []
    for combo in results[0]:
        stage, optimizer, schedule, *interval = combo
        ref = _reference(dp, optimizer)
        assert min(ref["norms"]) > CLIP, "clipping must be active at every step"
        what = f"D={dp} V={V} stage {stage} {optimizer} {schedule} checkpoint interval {interval}"
        for rank, res in enumerate(results):
            got = res[combo]
            pipe_rank = rank // dp  # the topology's pipe axis is outermost
            assert got["layers"] == [pipe_rank * 2, pipe_rank * 2 + 1, 4 + pipe_rank * 2, 5 + pipe_rank * 2]
            # with an interval of 1 every layer of each chunk (2 Linear) is its own checkpoint
            assert got["checkpointed"] == ([[True, True]] * V if interval else None)
        failures += mlp.check_replicas(what, [res[combo] for res in results], ref, dp)
    return failures


TWO_RANKS = [(stage, opt, "interleaved_1f1b") for stage in (0, 1, 2) for opt in ("sgd", "adamw")]
TWO_RANKS += [(0, "sgd", "looped_bfs"), (2, "adamw", "looped_bfs")]
TWO_RANKS += [(stage, opt, "zero_bubble") for stage in (0, 1, 2) for opt in ("sgd", "adamw")]
TWO_RANKS += [(1, "sgd", "interleaved_1f1b", 1), (2, "adamw", "zero_bubble", 1)]  # activation checkpoints


def test_interleaved_two_ranks_match_single_process():
    results = run_on_ranks(_train, world_size=2, args=(TWO_RANKS,), timeout=900)
    failures = _check(results, dp=1)
    assert not failures, "\n".join(failures)


FOUR_RANKS = [
    (0, "adamw", "interleaved_1f1b"),
    (1, "sgd", "interleaved_1f1b"),
    (2, "adamw", "interleaved_1f1b"),
    (2, "sgd", "interleaved_1f1b"),
    (1, "adamw", "looped_bfs"),
    (0, "sgd", "zero_bubble"),
    (1, "adamw", "zero_bubble"),
    (2, "sgd", "zero_bubble"),
]


def test_interleaved_two_replicas_match_single_process():
    results = run_on_ranks(_train, world_size=4, args=(FOUR_RANKS,), timeout=900)
    failures = _check(results, dp=2)
    assert not failures, "\n".join(failures)


# -- bf16: zero-bubble's hand-assigned weight gradients reach the fp32 accumulation buffers ------
def _train_bf16(combos: list) -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    zerotrain.init_distributed()
    out = {}
    for stage, schedule in combos:
        model = PipelineModule(
            _layers(), num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform", virtual_stages=V
        )
        config = {**_config(1, stage, schedule), "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
        engine, *_ = zerotrain.initialize(model=model, optimizer=lambda p: _optimizer(p, "adamw"), config=config)
        engine.set_batch_fn(lambda b: (b[0].to(torch.bfloat16), b[1].to(torch.bfloat16)))
        losses = [float(engine.train_batch(iter(step[0]))) for step in _batches(1)]
        out[(stage, schedule)] = {
            "losses": losses,
            "skipped": engine.skipped_steps,
            "weights": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        }
        engine.destroy()
    return out


def test_zero_bubble_bf16_fp32_accumulation_within_bounds():
    """With 16-bit weights and fp32 accumulation the stage keeps gradients in an fp32 buffer the
    hooks fill; zero-bubble's weight steps bypass them, so without folding each step's ``.grad``
    in, those weights' gradients were lost. The combination suite's bounds: the whole-model update
    0.9-1.1x the fp32 reference's, cosine > 0.99; and close to interleaved 1F1B's in bf16."""
    combos = [(stage, "zero_bubble") for stage in (0, 1, 2)] + [(1, "interleaved_1f1b")]
    results = run_on_ranks(_train_bf16, world_size=2, args=(combos,), timeout=900)
    ref = _reference(1, "adamw")["weights"]
    init = dict(nn.Sequential(*_layers()).named_parameters())
    failures = []
    whole = {combo: {n: w for res in results for n, w in res[combo]["weights"].items()} for combo in combos}
    names = sorted(ref)
    want = torch.cat([(ref[n] - init[n].detach()).flatten() for n in names])
    for combo in combos:
        assert all(res[combo]["skipped"] == 0 for res in results)
        assert results[0][combo]["losses"] == results[1][combo]["losses"]
        update = torch.cat([(whole[combo][n] - init[n].detach()).flatten() for n in names])
        size = float(update.norm() / want.norm())
        cosine = float(nn.functional.cosine_similarity(update, want, dim=0))
        if not (0.9 <= size <= 1.1 and cosine > 0.99):
            failures.append(f"bf16 {combo}: update size {size:.4f}x the reference's, cosine {cosine:.4f}")
        same = torch.cat([(whole[(1, "interleaved_1f1b")][n] - init[n].detach()).flatten() for n in names])
        closeness = float(nn.functional.cosine_similarity(update, same, dim=0))
        if not closeness > 0.999:
            failures.append(f"bf16 {combo}: cosine {closeness:.5f} to interleaved 1F1B's update")
    assert not failures, "\n".join(failures)


# -- a tied embedding in three virtual stages -----------------------------------------------
def _tied_specs():
    """8 layers, 4 virtual stages of 2: the embedding runs at layer 0 (rank 0, chunk 0), 4 (rank
    0, chunk 1, through ``_mix``) and 7 (rank 1, chunk 1, the head)."""
    from zerotrain.pipeline import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        nn.Tanh(),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=_mix),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        LayerSpec(nn.LayerNorm, WIDTH),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=_head),
    ]


def _tied_batches(dp: int) -> list:
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


def _tied_reference(dp: int) -> dict:
    """The layers as PipelineModule(seed_layers=True) builds them (seed 1234 + index; the tied
    module is the one built at its first index), trained in one process."""
    from zerotrain.pipeline import LayerSpec
    from zerotrain.seeding import set_random_seed

    specs, layers = _tied_specs(), {}
    for idx, spec in enumerate(specs):
        if isinstance(spec, LayerSpec) and idx not in (4, 7):
            set_random_seed(1234 + idx)
            layers[idx] = spec.build()
    embed = layers[0]
    named = {f"tied_modules.embed.{n}": p for n, p in embed.named_parameters()}
    named.update({f"{i}.{n}": p for i, layer in layers.items() if i != 0 for n, p in layer.named_parameters()})
    opt = _tied_optimizer(list(named.values()))
    norms = []
    for step in _tied_batches(dp):
        for rank in step:
            for ids, labels in rank:
                x = embed(ids)
                x = layers[3](torch.tanh(layers[1](x)))
                x = layers[6](layers[5](_mix(embed, x)))
                (_lm_loss(_head(embed, x), labels) / (M * dp)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(named.values()), CLIP)))
        opt.step()
        opt.zero_grad()
    assert min(norms) > CLIP, f"clipping must be active at every step: {norms}"
    return {n: p.detach().clone() for n, p in named.items()}


def _train_tied(stages: list) -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    zerotrain.init_distributed()
    out = {}
    for stage in stages:
        model = PipelineModule(
            _tied_specs(),
            num_stages=2,
            loss_fn=_lm_loss,
            partition_method="uniform",
            seed_layers=True,
            base_seed=1234,
            virtual_stages=V,
        )
        dp = model.mpu().get_data_parallel_world_size()
        engine, *_ = zerotrain.initialize(
            model=model, optimizer=_tied_optimizer, config=_config(dp, stage, "interleaved_1f1b")
        )
        rank = engine.topology.data_rank
        tied = []
        for step in _tied_batches(dp):
            engine.train_batch(iter(step[rank]))
            tied.append(engine.module.tied_modules["embed"].weight.detach().clone())
        out[stage] = {"tied": tied, "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}
        engine.destroy()
    return out


def test_tied_embedding_across_chunks_matches_single_process():
    results = run_on_ranks(_train_tied, world_size=2, args=([0, 1, 2],), timeout=900)
    ref = _tied_reference(dp=1)
    failures = []
    for stage in (0, 1, 2):
        failures += copies_differ(f"stage {stage}", [res[stage]["tied"] for res in results])
        for rank, res in enumerate(results):
            failures += mlp.compare_weights(f"stage {stage} rank {rank}", res[stage]["weights"], ref)
        assert sorted(set(results[0][stage]["weights"]) | set(results[1][stage]["weights"])) == sorted(ref)
    assert not failures, "\n".join(failures)


# -- one-line errors -------------------------------------------------------------------------
def _errors() -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    zerotrain.init_distributed()
    out = {}

    def attempt(name, virtual, config):
        try:
            model = PipelineModule(
                _layers(),
                num_stages=2,
                loss_fn=nn.functional.mse_loss,
                partition_method="uniform",
                virtual_stages=virtual,
            )
            engine, *_ = zerotrain.initialize(model=model, optimizer=lambda p: _optimizer(p, "sgd"), config=config)
            out[name] = None
            engine.destroy()
        except (ValueError, TypeError) as error:
            out[name] = str(error)

    attempt("one_chunk", 1, _config(1, 0, "interleaved_1f1b"))
    attempt("bfs_one_chunk", 1, _config(1, 0, "looped_bfs"))
    attempt("single_stage_schedule", V, _config(1, 0, "1f1b"))
    attempt("micro_batches", V, _config(1, 1, "interleaved_1f1b", m=5))
    attempt("config_disagrees", V, _config(1, 0, "interleaved_1f1b", virtual_stages=3))
    attempt("zero", 0, _config(1, 0, "interleaved_1f1b"))
    attempt("three_ok", V, _config(1, 0, "interleaved_1f1b", m=3))  # torch splits 3 in one round
    return out


def test_bad_virtual_stage_combinations_give_one_line():
    results = run_on_ranks(_errors, world_size=2, timeout=600)
    assert results[0] == results[1]
    errors = results[0]
    assert errors["three_ok"] is None
    for name, text in errors.items():
        if name != "three_ok":
            assert text is not None and "\n" not in text and "Traceback" not in text, (name, text)
    assert errors["one_chunk"].startswith("pipeline.schedule='interleaved_1f1b' runs several model chunks")
    assert "virtual_stages=2" in errors["one_chunk"]
    assert errors["bfs_one_chunk"].startswith("pipeline.schedule='looped_bfs' runs several model chunks")
    assert errors["single_stage_schedule"].startswith("pipeline.schedule='1f1b' runs one stage per rank")
    assert "gradient_accumulation_steps" in errors["micro_batches"]
    assert "multiple of 2" in errors["micro_batches"]
    assert errors["config_disagrees"].startswith(
        "pipeline.virtual_stages=3 but the PipelineModule was built with virtual_stages=2"
    )
    assert errors["zero"].startswith("PipelineModule: virtual_stages must be a positive int")


def test_config_keys():
    from zerotrain.config import ConfigError, ZeroTrainConfig

    cfg = ZeroTrainConfig(**{"train_batch_size": 8, "pipeline": {"schedule": "Interleaved_1F1B", "virtual_stages": 4}})
    assert (cfg.pipeline.schedule, cfg.pipeline.virtual_stages) == ("interleaved_1f1b", 4)
    assert ZeroTrainConfig(train_batch_size=8).pipeline.virtual_stages == "auto"
    assert (
        ZeroTrainConfig(**{"train_batch_size": 8, "pipeline": {"schedule": "zero_bubble"}}).pipeline.schedule
        == "zero_bubble"
    )
    for bad in ({"virtual_stages": 0}, {"schedule": "zero-bubble"}):
        with pytest.raises((ConfigError, ValueError)):
            ZeroTrainConfig(**{"train_batch_size": 8, "pipeline": bad})


# -- checkpoints: layer files by global index, whatever V ------------------------------------
def _checkpoint_across_v(save_dir: str) -> dict:
    """V=2 trains 2 steps and saves; a V=1 engine (P=2) loads it and trains the 3rd step, saves;
    a V=2 engine loads that. ZeRO 1, AdamW (optimizer state by name across layouts)."""
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    zerotrain.init_distributed()
    batches = _batches(1)

    def build(virtual, schedule):
        model = PipelineModule(
            _layers(), num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform", virtual_stages=virtual
        )
        # other initial weights, so loading must replace them
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        engine, *_ = zerotrain.initialize(
            model=model, optimizer=lambda p: _optimizer(p, "adamw"), config=_config(1, 1, schedule)
        )
        return engine

    def weights(engine):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    first = _fresh(V)
    for step in batches[:2]:
        first.train_batch(iter(step[0]))
    first.save_checkpoint(save_dir, tag="v2")
    saved = weights(first)
    layer_dir = f"{save_dir}/layers"
    first.module.save_state_dict(layer_dir)  # DeepSpeed's per-layer files, by global index
    torch.distributed.barrier()
    first.destroy()
    plain_module = build(1, "1f1b")
    plain_module.module.load_state_dir(layer_dir)
    from_layer_files = weights(plain_module)
    plain_module.destroy()
    plain = build(1, "1f1b")
    plain.load_checkpoint(save_dir, tag="v2")
    loaded = weights(plain)
    plain.train_batch(iter(batches[2][0]))
    plain.save_checkpoint(save_dir, tag="v1")
    after = weights(plain)
    plain.destroy()
    again = build(V, "interleaved_1f1b")
    again.load_checkpoint(save_dir, tag="v1")
    reloaded = weights(again)
    again.destroy()
    import os

    return {
        "saved": saved,
        "loaded": loaded,
        "after": after,
        "reloaded": reloaded,
        "from_layer_files": from_layer_files,
        "layer_files": sorted(os.listdir(layer_dir)),
    }


def _fresh(virtual):
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    model = PipelineModule(
        _layers(), num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform", virtual_stages=virtual
    )
    engine, *_ = zerotrain.initialize(
        model=model,
        optimizer=lambda p: _optimizer(p, "adamw"),
        config=_config(1, 1, "interleaved_1f1b" if virtual > 1 else "1f1b"),
    )
    return engine


def test_checkpoint_loads_across_virtual_stages(tmp_path):
    results = run_on_ranks(_checkpoint_across_v, world_size=2, args=(str(tmp_path),), timeout=600)
    ref = _reference(1, "adamw")["weights"]
    # V=2 rank 0 holds layers 0, 1, 4, 5; V=1 rank 0 holds 0-3: the layouts differ.
    assert {n.split(".")[0] for n in results[0]["saved"]} == {"0", "1", "4", "5"}
    assert {n.split(".")[0] for n in results[0]["loaded"]} == {"0", "1", "2", "3"}
    saved = {n: w for res in results for n, w in res["saved"].items()}
    loaded = {n: w for res in results for n, w in res["loaded"].items()}
    after = {n: w for res in results for n, w in res["after"].items()}
    reloaded = {n: w for res in results for n, w in res["reloaded"].items()}
    from_files = {n: w for res in results for n, w in res["from_layer_files"].items()}
    assert results[0]["layer_files"] == [f"layer_{i:02d}-model_states.pt" for i in range(LAYERS)]
    assert sorted(saved) == sorted(loaded) == sorted(reloaded) == sorted(ref)
    for name in ref:
        assert torch.equal(loaded[name], saved[name]), name
        assert torch.equal(from_files[name], saved[name]), name
        assert torch.equal(reloaded[name], after[name]), name
        err = float((after[name] - ref[name]).norm() / ref[name].norm())
        assert err <= 1e-6, (name, err)  # the optimizer state followed the layers


# -- shapes that change between batches (dynamic_shape=True): every chunk's stage is rebuilt ---
SHAPE_T = [3, 5, 5, 2]


def _shape_layers() -> list:
    torch.manual_seed(0)
    return [m for _ in range(4) for m in (nn.Linear(HIDDEN, HIDDEN), nn.Tanh())]


def _shape_batch(seed: int, t: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(MICRO, t, HIDDEN, generator=g), torch.randn(MICRO, t, HIDDEN, generator=g)) for _ in range(M)]


def _dynamic(schedules: list) -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    zerotrain.init_distributed()
    out = {}
    for schedule in schedules:
        model = PipelineModule(
            _shape_layers(),
            num_stages=2,
            loss_fn=nn.functional.mse_loss,
            partition_method="uniform",
            virtual_stages=V,
            dynamic_shape=True,
        )
        engine, *_ = zerotrain.initialize(
            model=model,
            optimizer=lambda p: _optimizer(p, "sgd"),
            config={**_config(1, 1, schedule), "gradient_clipping": 0.0},
        )
        losses = [float(engine.train_batch(iter(_shape_batch(step, t)))) for step, t in enumerate(SHAPE_T)]
        out[schedule] = {
            "losses": losses,
            "rebuilds": engine._runner.shapes.rebuilds,
            "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        }
        engine.destroy()
    return out


def test_dynamic_shapes_with_virtual_stages():
    results = run_on_ranks(_dynamic, world_size=2, args=(["interleaved_1f1b", "zero_bubble"],), timeout=600)
    model = nn.Sequential(*_shape_layers())
    opt = _optimizer(model.parameters(), "sgd")
    losses = []
    for step, t in enumerate(SHAPE_T):
        total = 0.0
        for x, y in _shape_batch(step, t):
            loss = nn.functional.mse_loss(model(x), y)
            (loss / M).backward()
            total += float(loss.detach())
        losses.append(total / M)
        opt.step()
        opt.zero_grad()
    ref = {n: p.detach() for n, p in model.named_parameters()}
    for schedule in ("interleaved_1f1b", "zero_bubble"):
        for res in results:
            got = res[schedule]
            assert got["rebuilds"] == 2, (schedule, got["rebuilds"])
            assert got["losses"] == pytest.approx(losses, rel=1e-6), schedule
            for name, value in got["weights"].items():
                err = float((value - ref[name]).norm() / ref[name].norm())
                assert err <= 1e-6, (schedule, name, err)
