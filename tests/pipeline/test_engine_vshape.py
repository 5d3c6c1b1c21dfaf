"""V-shaped virtual stages: ``PipelineModule(virtual_stages=2, virtual_layout="v")`` with torch's
``ScheduleZBVZeroBubble`` (``"pipeline": {"schedule": "zbv"}``) and ``ScheduleDualPipeV``
(``"dualpipev"``), against a single-process fp32 reference.

- The layout: 8 layers in 4 virtual stages of 2; rank r holds virtual stages r and 3 - r, so rank 0
  holds layers 0-1 and 6-7 (the first and the last stage: it reads inputs and labels and computes
  the loss) and rank 1 layers 2-5.
- P=2 (2 ranks) and P=2 x D=2 (4 ranks), 4 micro-batches, SGD with momentum and AdamW, ZeRO 0
  and 2, clipping active at every step: every weight after ``STEPS`` steps within 1e-6 relative,
  the returned loss the reference's on every rank; ``eval_batch`` through the V schedule.
- A tied embedding used at layer 0 (rank 0, chunk 0), layer 4 (rank 1, chunk 1) and as the output
  head at layer 7 (rank 0, chunk 1: the same rank as the first stage): weights on the reference,
  copies equal after every step.
- A checkpoint saved under ``"zbv"`` loads into the default 1F1B (V=1: other layers per rank, by
  global layer index) and training continues on the reference trajectory.
- One-line errors: a V schedule with the looped layout, a looped schedule with the V layout,
  ``virtual_layout="v"`` with 3 chunks, too few micro-batches for DualPipeV.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.pipeline import mlp
from tests.pipeline.mlp import MICRO, STEPS, M
from tests.pipeline.mlp import batches as _batches
from tests.pipeline.mlp import optimizer as _optimizer
from tests.pipeline.tied_lm import SEQ, VOCAB, WIDTH, copies_differ
from tests.pipeline.tied_lm import head as _head
from tests.pipeline.tied_lm import lm_loss as _lm_loss
from tests.pipeline.tied_lm import mix as _mix
from tests.pipeline.tied_lm import optimizer as _tied_optimizer
from zerotrain.testing import run_on_ranks

LAYERS, CLIP = 8, 0.05


def _config(dp: int, stage: int, schedule: str, m: int = M) -> dict:
    return mlp.config(dp, stage, schedule, CLIP, m)


def _module(virtual: int = 2, layout: str = "v", layers=None, **kwargs):
    from zerotrain.pipeline import PipelineModule

    return PipelineModule(
        layers if layers is not None else mlp.layers(LAYERS),
        num_stages=2,
        loss_fn=kwargs.pop("loss_fn", nn.functional.mse_loss),
        partition_method="uniform",
        virtual_stages=virtual,
        virtual_layout=layout,
        **kwargs,
    )


def _weights(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


# -- training against the single-process reference ------------------------------------------
def _train(combos: list) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for combo in combos:
        stage, optimizer, schedule = combo
        model = _module()
        dp = model.mpu().get_data_parallel_world_size()
        engine, *_ = zerotrain.initialize(
            model=model, optimizer=lambda p, o=optimizer: _optimizer(p, o), config=_config(dp, stage, schedule)
        )
        out[combo] = {
            **mlp.train_and_eval(engine, dp),
            "layers": list(model._local_layers),
            "skipped": engine.skipped_steps,
            "ends": (engine.is_first_stage(), engine.is_last_stage()),
            "weights": _weights(engine),
        }
        engine.destroy()
    return out


def _check(results: list, dp: int) -> list[str]:
    failures = []
    for combo in results[0]:
        stage, optimizer, schedule = combo
        ref = mlp.reference(mlp.layers(LAYERS), dp, optimizer, CLIP)
        assert min(ref["norms"]) > CLIP, "clipping must be active at every step"
        what = f"D={dp} {schedule} ZeRO {stage} {optimizer}"
        for rank, res in enumerate(results):
            got = res[combo]
            pipe_rank = rank // dp  # the topology's pipe axis is outermost
            assert got["layers"] == ([0, 1, 6, 7] if pipe_rank == 0 else [2, 3, 4, 5]), (what, got["layers"])
            assert got["ends"] == ((True, True) if pipe_rank == 0 else (False, False)), (what, got["ends"])
        failures += mlp.check_replicas(what, [res[combo] for res in results], ref, dp)
    return failures


TWO_RANKS = [
    (stage, opt, schedule) for schedule in ("zbv", "dualpipev") for stage in (0, 2) for opt in ("sgd", "adamw")
]


def test_vshape_two_ranks_match_single_process():
    results = run_on_ranks(_train, world_size=2, args=(TWO_RANKS,), timeout=900)
    failures = _check(results, dp=1)
    assert not failures, "\n".join(failures)


FOUR_RANKS = [(0, "sgd", "zbv"), (2, "adamw", "zbv"), (0, "adamw", "dualpipev"), (2, "sgd", "dualpipev")]


def test_vshape_two_replicas_match_single_process():
    results = run_on_ranks(_train, world_size=4, args=(FOUR_RANKS,), timeout=900)
    failures = _check(results, dp=2)
    assert not failures, "\n".join(failures)


# -- a tied embedding: first and last stage on rank 0, once more on rank 1 --------------------
def _tied_specs(middle: bool = True):
    """Virtual stages of 2 layers: [0, 1] rank 0, [2, 3] rank 1, [4, 5] rank 1, [6, 7] rank 0;
    the embedding runs at layers 0, 7 (the head) and, with ``middle``, 4 (``_mix``; else a
    Linear there, and the embedding lives on rank 0 only: a tied group of one rank)."""
    from zerotrain.pipeline import LayerSpec, TiedLayerSpec

    fourth = (
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=_mix)
        if middle
        else LayerSpec(nn.Linear, WIDTH, WIDTH)
    )
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        nn.Tanh(),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        fourth,
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        LayerSpec(nn.LayerNorm, WIDTH),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=_head),
    ]


def _tied_batches() -> list:
    g = torch.Generator().manual_seed(3)
    return [
        [
            (torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
            for _ in range(M)
        ]
        for _ in range(STEPS)
    ]


def _tied_reference(middle: bool) -> dict:
    """The layers as PipelineModule(seed_layers=True) builds them (seed 1234 + index; the tied
    module is the one built at its first index), run in order in one process."""
    from zerotrain.pipeline import LayerSpec, TiedLayerSpec
    from zerotrain.seeding import set_random_seed

    specs, run, named, embed = _tied_specs(middle), [], {}, None
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if embed is None:
                set_random_seed(1234 + idx)
                embed = spec.build()
                named.update({f"tied_modules.embed.{n}": p for n, p in embed.named_parameters()})
            run.append(embed if spec.forward_fn is None else (lambda x, f=spec.forward_fn: f(embed, x)))
        elif isinstance(spec, LayerSpec):
            set_random_seed(1234 + idx)
            layer = spec.build()
            named.update({f"{idx}.{n}": p for n, p in layer.named_parameters()})
            run.append(layer)
        else:
            run.append(spec)
    opt = _tied_optimizer(list(named.values()))
    norms = []
    for step in _tied_batches():
        for ids, labels in step:
            x = ids
            for layer in run:
                x = layer(x)
            (_lm_loss(x, labels) / M).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(named.values()), CLIP)))
        opt.step()
        opt.zero_grad()
    assert min(norms) > CLIP, f"clipping must be active at every step: {norms}"
    return {n: p.detach().clone() for n, p in named.items()}


def _train_tied(combos: list) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for stage, schedule, middle in combos:
        layout = "looped" if schedule == "zero_bubble" else "v"
        model = _module(layout=layout, layers=_tied_specs(middle), loss_fn=_lm_loss, seed_layers=True, base_seed=1234)
        engine, *_ = zerotrain.initialize(model=model, optimizer=_tied_optimizer, config=_config(1, stage, schedule))
        tied = []
        for step in _tied_batches():
            engine.train_batch(iter(step))
            if "embed" in engine.module.tied_modules:
                tied.append(engine.module.tied_modules["embed"].weight.detach().clone())
        out[(stage, schedule, middle)] = {
            "tied": tied,
            "weights": _weights(engine),
            "tied_ranks": engine.module.tied_comms["embed"]["ranks"] if "embed" in engine.module.tied_comms else None,
        }
        engine.destroy()
    return out


def test_tied_embedding_in_a_v_matches_single_process():
    # zero_bubble (looped layout) too: its input-gradient steps also met the Linear layers' 3-d
    # outputs, which are views torch cannot detach in place.
    # Without the middle occurrence the embedding is on rank 0 only (first and last stage).
    combos = [
        (0, "zbv", True),
        (2, "zbv", True),
        (2, "dualpipev", True),
        (1, "zero_bubble", True),
        (2, "zbv", False),
        (0, "dualpipev", False),
    ]
    results = run_on_ranks(_train_tied, world_size=2, args=(combos,), timeout=900)
    failures = []
    for combo in combos:
        middle = combo[2]
        ref = _tied_reference(middle)
        if middle:
            assert results[0][combo]["tied_ranks"] == results[1][combo]["tied_ranks"] == [0, 1]
            failures += copies_differ(f"{combo}", [res[combo]["tied"] for res in results])
        else:
            assert results[0][combo]["tied_ranks"] == [0] and results[1][combo]["tied_ranks"] is None
            assert "tied_modules.embed.weight" not in results[1][combo]["weights"]
        for rank, res in enumerate(results):
            failures += mlp.compare_weights(f"{combo} rank {rank}", res[combo]["weights"], ref)
        assert sorted(set(results[0][combo]["weights"]) | set(results[1][combo]["weights"])) == sorted(ref)
    assert not failures, "\n".join(failures)


# -- a checkpoint saved under zbv loads at the default 1F1B ----------------------------------
def _checkpoint_to_1f1b(save_dir: str) -> dict:
    """ZBV (ZeRO 2, AdamW) trains 2 steps and saves; a 1F1B engine (V=1, other initial weights)
    loads it and trains the 3rd step."""
    import os

    import zerotrain

    zerotrain.init_distributed()
    batches = _batches(1)

    def build(virtual, layout, schedule, scale):
        model = _module(virtual, layout)
        with torch.no_grad():  # other initial weights for the loading engine: loading must replace them
            for p in model.parameters():
                p.mul_(scale)
        engine, *_ = zerotrain.initialize(
            model=model, optimizer=lambda p: _optimizer(p, "adamw"), config=_config(1, 2, schedule)
        )
        return engine

    first = build(2, "v", "zbv", 1.0)
    for step in batches[:2]:
        first.train_batch(iter(step[0]))
    first.save_checkpoint(save_dir, tag="zbv")
    saved = _weights(first)
    first.destroy()
    plain = build(1, "looped", "1f1b", 0.5)
    plain.load_checkpoint(save_dir, tag="zbv")
    loaded = _weights(plain)
    plain.train_batch(iter(batches[2][0]))
    after = _weights(plain)
    plain.destroy()
    files = sorted(f for f in os.listdir(os.path.join(save_dir, "zbv")) if f.startswith("layer_"))
    return {"saved": saved, "loaded": loaded, "after": after, "layer_files": files}


def test_zbv_checkpoint_loads_at_1f1b(tmp_path):
    results = run_on_ranks(_checkpoint_to_1f1b, world_size=2, args=(str(tmp_path),), timeout=600)
    ref = mlp.reference(mlp.layers(LAYERS), 1, "adamw", CLIP)["weights"]
    # V: rank 0 holds layers 0, 1, 6, 7; 1F1B at V=1: layers 0-3.
    assert {n.split(".")[0] for n in results[0]["saved"]} == {"0", "1", "6", "7"}
    assert {n.split(".")[0] for n in results[0]["loaded"]} == {"0", "1", "2", "3"}
    assert results[0]["layer_files"] == [f"layer_{i:02d}-model_states.pt" for i in range(LAYERS)]
    saved = {n: w for res in results for n, w in res["saved"].items()}
    loaded = {n: w for res in results for n, w in res["loaded"].items()}
    after = {n: w for res in results for n, w in res["after"].items()}
    assert sorted(saved) == sorted(loaded) == sorted(ref)
    for name in ref:
        assert torch.equal(loaded[name], saved[name]), name
        err = float((after[name] - ref[name]).norm() / ref[name].norm())
        assert err <= 1e-6, (name, err)  # the optimizer state followed the layers


# -- one-line errors -------------------------------------------------------------------------
def _errors() -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {}

    def attempt(name, virtual, layout, config):
        try:
            model = _module(virtual, layout)
            engine, *_ = zerotrain.initialize(model=model, optimizer=lambda p: _optimizer(p, "sgd"), config=config)
            out[name] = None
            engine.destroy()
        except (ValueError, TypeError) as error:
            out[name] = str(error)

    attempt("zbv_looped", 2, "looped", _config(1, 0, "zbv"))
    attempt("dualpipev_one_chunk", 1, "looped", _config(1, 0, "dualpipev"))
    attempt("interleaved_v", 2, "v", _config(1, 0, "interleaved_1f1b"))
    attempt("v_three_chunks", 3, "v", _config(1, 0, "zbv"))
    attempt("bad_layout", 2, "w", _config(1, 0, "zbv"))
    attempt("dualpipev_few", 2, "v", _config(1, 0, "dualpipev", m=2))
    attempt("zbv_two_ok", 2, "v", _config(1, 0, "zbv", m=2))
    return out


def test_bad_v_combinations_give_one_line():
    results = run_on_ranks(_errors, world_size=2, timeout=600)
    assert results[0] == results[1]
    errors = results[0]
    assert errors["zbv_two_ok"] is None
    for name, text in errors.items():
        if name != "zbv_two_ok":
            assert text is not None and "\n" not in text and "Traceback" not in text, (name, text)
    assert errors["zbv_looped"].startswith("pipeline.schedule='zbv' runs 2 model chunks per rank placed in a V")
    assert 'virtual_layout="v"' in errors["zbv_looped"]
    assert errors["dualpipev_one_chunk"].startswith("pipeline.schedule='dualpipev' runs 2 model chunks")
    assert errors["interleaved_v"].startswith("pipeline.schedule='interleaved_1f1b' needs the looped placement")
    assert errors["v_three_chunks"].startswith("PipelineModule: virtual_layout='v' places 2 virtual stages")
    assert errors["bad_layout"].startswith("PipelineModule: virtual_layout='w' is not one of")
    assert "gradient_accumulation_steps" in errors["dualpipev_few"] and "4 or more" in errors["dualpipev_few"]


def test_config_keys():
    from zerotrain.config import ZeroTrainConfig

    for name in ("zbv", "DualPipeV"):
        assert (
            ZeroTrainConfig(**{"train_batch_size": 8, "pipeline": {"schedule": name}}).pipeline.schedule == name.lower()
        )


def test_rank_virtual_stages():
    from zerotrain.pipeline.partition import rank_virtual_stages

    assert [rank_virtual_stages(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_virtual_stages(r, 2, 3) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    with pytest.raises(ValueError):
        rank_virtual_stages(0, 2, 3, "v")
