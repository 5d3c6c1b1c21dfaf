"""DeepSpeed's Muon optimizer (zerotrain.optim.muon): Muon on hidden matrices, AdamW on the rest.

- With ``ns_method: "standard"`` one step of MuonWithAuxAdam is torch.optim.Muon on the Muon half
  plus torch's fused AdamW on the rest, bit for bit (single process).
- On 2 ranks at ZeRO stages 0-3 (the Muon update orthogonalizes whole matrices gathered from the
  shards) the weights are bit-identical to a single-process MuonWithAuxAdam whose gradient is the
  two ranks' (each on its rows, halved and summed).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.workloads import global_batches, make_model
from zerotrain.optim import build_optimizer
from zerotrain.optim.muon import MuonWithAuxAdam, orthogonalize, uses_muon
from zerotrain.testing import run_on_ranks

STEPS = 3
MICRO = 2
WORLD = 2
PARAMS = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "adam_lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8}


def _muon(method: str) -> dict:
    return {"type": "Muon", "params": {**PARAMS, "ns_method": method}}


def _steps(model, opt, grads_of) -> None:
    data = global_batches(STEPS, MICRO * WORLD)
    for step in range(STEPS):
        grads_of(model, data[step])
        opt.step()
        opt.zero_grad()


def _two_rank_grads(model, batch) -> None:
    """The gradient the engine steps: each rank's on its rows, halved, summed."""
    params = list(model.parameters())
    per_rank = []
    for rank in range(WORLD):
        rows = batch[rank * MICRO : (rank + 1) * MICRO]
        model(rows, labels=rows).loss.backward()
        per_rank.append([p.grad / WORLD for p in params])
        for p in params:
            p.grad = None
    for p, a, b in zip(params, *per_rank):
        p.grad = a + b


def test_groups_follow_deepspeeds_rule():
    model = make_model()
    opt = build_optimizer("Muon", PARAMS, model.parameters(), model.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"muon-params", "adam-params"}
    muon = {names[id(p)] for p in groups["muon-params"]["params"]}
    adam = {names[id(p)] for p in groups["adam-params"]["params"]}
    assert muon == {n for n, p in model.named_parameters() if p.dim() >= 2}  # GPT: no "embed"/"lm_head" names
    assert all(model.get_parameter(n).dim() == 1 for n in adam)
    assert groups["muon-params"]["lr"] == 0.02 and groups["adam-params"]["lr"] == 1e-3
    assert groups["adam-params"]["betas"] == (0.9, 0.95) and groups["muon-params"]["ns_method"] == "gram"
    assert not uses_muon("model.embed_tokens.weight", torch.zeros(4, 4))
    assert not uses_muon("lm_head.weight", torch.zeros(4, 4))


def test_standard_equals_torch_muon_and_adamw():
    model = make_model()
    opt = build_optimizer("Muon", {**PARAMS, "ns_method": "standard"}, model.parameters(), model.named_parameters())
    _steps(model, opt, _two_rank_grads)

    ref = make_model()
    matrices = [p for p in ref.parameters() if p.dim() >= 2]
    rest = [p for p in ref.parameters() if p.dim() < 2]
    torch_muon = torch.optim.Muon(matrices, lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True)
    adamw = torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)

    class Both:
        def step(self):
            torch_muon.step()
            adamw.step()

        def zero_grad(self):
            torch_muon.zero_grad()
            adamw.zero_grad()

    _steps(ref, Both(), _two_rank_grads)
    start = make_model().state_dict()
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(got, want), name
        assert not torch.equal(got, start[name]), name


def test_gram_matches_standard_iteration():
    g = torch.Generator().manual_seed(0)
    for shape in [(16, 48), (48, 16), (32, 32)]:
        x = torch.randn(*shape, generator=g)
        gram, scale = orthogonalize(x, "gram")
        standard, same_scale = orthogonalize(x, "standard")
        assert scale == same_scale
        # The same polynomial: gram in fp32, standard in bf16.
        torch.testing.assert_close(gram, standard, atol=0.02, rtol=0.05)
        singular = torch.linalg.svdvals(gram)
        assert singular.min() > 0.5 and singular.max() < 1.3  # orthogonalized (US'V^T, S' ~ 1)


def _engine_config(stage: int, method: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": _muon(method),
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
    }


def _train_engines(runs, checkpoint_dir):
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank = dist.get_rank()
    data = global_batches(STEPS, MICRO * WORLD)
    out = []
    for stage, method in runs:
        model = make_model()
        engine, opt, _, _ = zerotrain.initialize(model=model, config=_engine_config(stage, method))
        for step in range(STEPS):
            rows = data[step, rank * MICRO : (rank + 1) * MICRO]
            engine.backward(engine(rows, labels=rows).loss)
            engine.step()
        state = [(k, tuple(v.shape)) for s in opt.state.values() for k, v in s.items() if k == "momentum_buffer"]
        out.append(
            {
                "state": {n: v.clone() for n, v in engine.module_state_dict().items()},
                "type": type(opt).__name__,
                "groups": [g["name"] for g in opt.param_groups],
                "momentum_numel": sum(n[0] for _, n in state),
                "units": len(getattr(engine._zero, "units", [])),
            }
        )
        engine.destroy()
    out.append(_resumes(checkpoint_dir, data, rank))
    return out


def _resumes(path, data, rank) -> dict:
    """Save after 2 steps, take a third; a fresh engine loading the checkpoint takes the same
    third step: {stage: whether the weights are bit-identical}."""
    import zerotrain

    def step(engine, s):
        rows = data[s, rank * MICRO : (rank + 1) * MICRO]
        engine.backward(engine(rows, labels=rows).loss)
        engine.step()

    out = {}
    for stage in (0, 2, 3):
        engine, _, _, _ = zerotrain.initialize(model=make_model(), config=_engine_config(stage, "gram"))
        step(engine, 0)
        step(engine, 1)
        engine.save_checkpoint(path, tag=f"stage{stage}")
        step(engine, 2)
        want = engine.module_state_dict()
        engine.destroy()
        engine, _, _, _ = zerotrain.initialize(model=make_model(), config=_engine_config(stage, "gram"))
        engine.load_checkpoint(path, tag=f"stage{stage}")
        step(engine, 2)
        got = engine.module_state_dict()
        out[stage] = all(torch.equal(got[n], v) for n, v in want.items())
        engine.destroy()
    return out


RUNS = [(0, "gram"), (1, "gram"), (2, "gram"), (3, "gram"), (2, "standard")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_train_engines, WORLD, args=(RUNS, str(tmp_path_factory.mktemp("ckpt"))))


def test_checkpoint_round_trip_resumes_bit_identically(results):
    for r in results:
        assert r[len(RUNS)] == {0: True, 2: True, 3: True}


@pytest.mark.parametrize("run", range(len(RUNS)), ids=[f"stage{s}-{m}" for s, m in RUNS])
def test_sharded_muon_equals_single_process(results, run):
    stage, method = RUNS[run]
    model = make_model()
    opt = build_optimizer("Muon", _muon(method)["params"], model.parameters(), model.named_parameters())
    assert isinstance(opt, MuonWithAuxAdam)
    _steps(model, opt, _two_rank_grads)
    want = model.state_dict()
    for r in results:
        got = r[run]
        assert got["type"] == "MuonWithAuxAdam"
        assert got["groups"] == ["muon-params", "adam-params"]
        if not got["state"]:  # stage 3: module_state_dict() gathers onto rank 0 only
            continue
        for name, value in want.items():
            assert torch.equal(got["state"][name], value), (
                f"{name}: max diff {(got['state'][name] - value).abs().max()}"
            )
    if stage >= 1:  # the momentum is sharded: each rank holds about half of the matrices' elements
        matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
        for r in results:
            assert r[run]["momentum_numel"] < 0.6 * matrices
        assert results[0][run]["units"] > 2  # several units: matrices cut by shard edges too


def test_refusals_name_the_key(in_process_rank):
    import zerotrain

    model = make_model()
    with pytest.raises(NotImplementedError, match="per_head_muon"):
        build_optimizer("Muon", {"per_head_muon": True}, model.parameters(), model.named_parameters())
    with pytest.raises(ValueError, match="named_parameters"):
        build_optimizer("Muon", {}, model.parameters())
    with pytest.raises(ValueError, match="'nesterov'"):
        build_optimizer("Muon", {"nesterov": False}, model.parameters(), model.named_parameters())
    cfg = {
        "train_batch_size": 2,
        "optimizer": _muon("gram"),
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    with pytest.raises(NotImplementedError, match="offload_optimizer"):
        zerotrain.initialize(model=model, config=cfg)


def test_bf16_stage2_steps_fp32_masters(in_process_rank):
    import zerotrain

    model = make_model()
    cfg = {
        "train_batch_size": 2,
        "optimizer": _muon("gram"),
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000},
    }
    engine, opt, _, _ = zerotrain.initialize(model=model, config=cfg)
    before = {n: v.clone() for n, v in engine.module_state_dict().items()}
    batch = global_batches(1, 2)[0]
    engine.backward(engine(batch, labels=batch).loss)
    engine.step()
    matrices = [n for n, p in model.named_parameters() if p.dim() >= 2]
    after = engine.module_state_dict()
    assert all(not torch.equal(after[n], before[n]) for n in matrices)  # every Muon matrix moved
    assert {v.dtype for s in opt.state.values() for k, v in s.items() if k == "momentum_buffer"} == {torch.float32}
    engine.destroy()
