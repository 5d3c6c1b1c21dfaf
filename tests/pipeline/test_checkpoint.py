"""Pipeline engine checkpoints (DeepSpeed's layout) against one process, on 4 ranks.

For each case (ZeRO 1 with SGD-momentum, ZeRO 2 with AdamW, and a model whose first and last
layer are one tied module, ZeRO 1 with AdamW): P=2 x D=2 trains 2 steps, saves, trains 2 more.

- resume: a fresh P=2 x D=2 engine (other initial weights) loads and repeats the last 2 steps
  bit-identically (losses and every weight);
- reshard: the same checkpoint loads at P=4 x D=1 and at P=1 x D=4 (and, for the untied models,
  into a plain ``nn.Sequential`` engine at D=4: the same parameter names) and the next 2 steps
  follow the single-process reference trajectory (weights within 1e-6 relative, losses too);
- the tag folder holds DeepSpeed's files: ``layer_XX-model_states.pt`` equal to the saved
  layers, ``mp_rank_0X_model_states.pt`` with ``module`` None and the counters, the ZeRO files
  per (stage, data rank); ``get_fp32_state_dict_from_zero_checkpoint`` and ``zerotrain
  consolidate`` give exactly the weights the stages held at the save.

The global batch (8 micro-batches per step) is the same at every D: each data rank takes its
consecutive share, with gradient_accumulation_steps = 8 / D.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

from zerotrain.testing import run_on_ranks

WIDTH, LAYERS, MICRO, BATCH, STEPS, SAVED_AT = 8, 6, 2, 8, 4, 2
LR = {"sgd": 0.1, "adamw": 0.01}
CASES = [("zero1-sgd", 1, "sgd", False), ("zero2-adamw", 2, "adamw", False), ("tied-adamw", 1, "adamw", True)]


class TiedLinear(nn.Linear):
    """The tied first/last layer: the same initial values wherever and however often it is built."""

    def __init__(self, seed: int = 11):
        super().__init__(WIDTH, WIDTH)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) * 0.3)
            self.bias.copy_(torch.randn(WIDTH, generator=g) * 0.1)


def _layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]


def _specs(tied: bool, seed: int = 0) -> list:
    from zerotrain.pipeline import TiedLayerSpec

    layers = _layers(seed)
    if not tied:
        return layers
    tie = dict(tied_weight_attr=["weight", "bias"])
    return (
        [TiedLayerSpec("emb", TiedLinear, 11 + seed, **tie)]
        + layers[1:-1]
        + [TiedLayerSpec("emb", TiedLinear, 11 + seed, **tie)]
    )


def _batches() -> list:
    """``[step][micro-batch] -> (inputs, labels)``: the global batch of every step."""
    g = torch.Generator().manual_seed(7)
    return [
        [(torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)) for _ in range(BATCH)]
        for _ in range(STEPS)
    ]


def _share(step: list, dp: int, rank: int) -> list:
    m = BATCH // dp
    return step[rank * m : (rank + 1) * m]


def _optimizer(params, name: str):
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR[name], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR[name], weight_decay=0.1)


def _config(dp: int, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": BATCH // dp,
        "train_batch_size": MICRO * BATCH,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
    }


def _reference_name(name: str) -> str:
    """The reference Sequential's name of a pipeline parameter (the tied module is layer 0)."""
    return name.replace("tied_modules.emb.", "0.")


def _reference(optimizer: str, tied: bool) -> dict:
    layers = _layers()
    if tied:
        shared = TiedLinear()
        layers = [shared] + layers[1:-1] + [shared]
    model = nn.Sequential(*layers)
    opt = _optimizer(model.parameters(), optimizer)
    losses, weights = [], []
    for step in _batches():
        total = 0.0
        for x, y in step:
            loss = nn.functional.mse_loss(model(x), y)
            (loss / BATCH).backward()
            total += float(loss.detach())
        losses.append(total / BATCH)
        opt.step()
        opt.zero_grad()
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "weights": weights}


def _pipeline_engine(pipe: int, stage: int, optimizer: str, tied: bool, seed: int = 0):
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    model = PipelineModule(
        _specs(tied, seed), num_stages=pipe, loss_fn=nn.functional.mse_loss, partition_method="uniform"
    )
    dp = model.mpu().get_data_parallel_world_size()
    engine, *_ = zerotrain.initialize(
        model=model, optimizer=lambda p: _optimizer(p, optimizer), config=_config(dp, stage)
    )
    return engine, dp


def _train(engine, dp: int, steps) -> list[float]:
    rank = engine.topology.data_rank
    return [float(engine.train_batch(iter(_share(_batches()[s], dp, rank)))) for s in steps]


def _weights(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _plain_engine(stage: int, optimizer: str):
    """A non-pipeline engine over the same layers at D=4 (an nn.Sequential: the same names)."""
    import zerotrain

    model = nn.Sequential(*_layers(seed=5))
    engine, *_ = zerotrain.initialize(
        model=model, optimizer=lambda p: _optimizer(p, optimizer), config=_config(4, stage)
    )
    return engine


def _train_plain(engine, steps) -> list[float]:
    rank = engine.topology.data_rank
    losses = []
    for s in steps:
        total = 0.0
        for x, y in _share(_batches()[s], 4, rank):
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        t = torch.tensor(total / (BATCH // 4))
        torch.distributed.all_reduce(t)
        losses.append(float(t) / 4)
    return losses


def _run(root: str) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    after = range(SAVED_AT, STEPS)
    for name, stage, optimizer, tied in CASES:
        save_dir = os.path.join(root, name)
        res = out[name] = {}
        engine, dp = _pipeline_engine(2, stage, optimizer, tied)
        _train(engine, dp, range(SAVED_AT))
        res["at_save"] = _weights(engine)
        engine.save_checkpoint(save_dir, tag="ck", client_state={"epoch": 3, "note": name})
        res["first"] = (_train(engine, dp, after), _weights(engine))
        engine.destroy()

        for pipe in (2, 4, 1):
            engine, dp = _pipeline_engine(pipe, stage, optimizer, tied, seed=3)
            path, client = engine.load_checkpoint(save_dir)
            res[f"P{pipe}"] = {
                "client": client,
                "steps": engine.global_steps,
                "losses": _train(engine, dp, after),
                "weights": _weights(engine),
            }
            engine.destroy()
        if not tied:
            engine = _plain_engine(stage, optimizer)
            _, client = engine.load_checkpoint(save_dir, tag="ck")
            res["plain"] = {
                "client": client,
                "steps": engine.global_steps,
                "losses": _train_plain(engine, after),
                "weights": _weights(engine),
            }
            engine.destroy()
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_pipeline_checkpoint_resumes_and_reshards(tmp_path):
    results = run_on_ranks(_run, world_size=4, args=(str(tmp_path),), timeout=900)
    failures = []
    for name, stage, optimizer, tied in CASES:
        ref = _reference(optimizer, tied)
        folder = tmp_path / name / "ck"
        # Resume at P=2 x D=2: bit-identical losses and weights on every rank.
        for rank, res in enumerate(results):
            first_losses, first_weights = res[name]["first"]
            again = res[name]["P2"]
            assert again["client"] == {"epoch": 3, "note": name}, again["client"]
            assert again["steps"] == SAVED_AT
            if again["losses"] != first_losses:
                failures.append(f"{name} rank {rank}: resumed losses {again['losses']} != {first_losses}")
            assert sorted(again["weights"]) == sorted(first_weights)
            for n, w in first_weights.items():
                if not torch.equal(again["weights"][n], w):
                    failures.append(f"{name} rank {rank}: resumed {n} differs")
        # Every loading layout continues on the reference trajectory.
        for layout in ("P2", "P4", "P1") + (() if tied else ("plain",)):
            whole = {}
            for rank, res in enumerate(results):
                got = res[name][layout]
                whole.update(got["weights"])
                for step, (a, b) in enumerate(zip(got["losses"], ref["losses"][SAVED_AT:])):
                    if not abs(a - b) <= 1e-6 * abs(b):
                        failures.append(f"{name} {layout} rank {rank}: step {SAVED_AT + step} loss {a} != {b}")
                for n, w in got["weights"].items():
                    err = _relative(w, ref["weights"][-1][_reference_name(n)])
                    if not err <= 1e-6:
                        failures.append(f"{name} {layout} rank {rank}: {n} relative error {err:.2e}")
            want = {n for n in ref["weights"][-1] if not (tied and n.startswith(f"{LAYERS - 1}."))}
            assert {_reference_name(n) for n in whole} == want, (name, layout, sorted(whole))
        # DeepSpeed's layout, and consolidation equals the weights held at the save.
        saved = {}
        for res in results:
            saved.update(res[name]["at_save"])
        _check_layout(folder, saved, stage, tied)
        _check_consolidated(tmp_path / name, saved)
    assert not failures, "\n".join(failures[:30])


def _check_layout(folder, saved: dict, stage: int, tied: bool) -> None:
    files = sorted(p.name for p in folder.iterdir())
    layer_indices = range(LAYERS)
    for idx in layer_indices:
        state = torch.load(folder / f"layer_{idx:02d}-model_states.pt", weights_only=True)
        prefix = "tied_modules.emb." if tied and idx in (0, LAYERS - 1) else f"{idx}."
        assert sorted(state) == ["bias", "weight"], (idx, sorted(state))
        for key, value in state.items():
            assert torch.equal(value, saved[prefix + key]), (idx, key)
    for s in range(2):
        ms = torch.load(folder / f"mp_rank_{s:02d}_model_states.pt", weights_only=True)
        assert ms["module"] is None and ms["global_steps"] == SAVED_AT and ms["mp_world_size"] == 2
        assert ms["dp_world_size"] == 2 and ms["epoch"] == 3 and ms["ds_config"]["zero_optimization"]["stage"] == stage
        for d in range(2):
            assert f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" in files, files
    assert "metadata.json" in files and (folder.parent / "latest").read_text() == "ck"
    assert not [f for f in folder.parent.iterdir() if f.name.startswith(".")]


def _check_consolidated(save_dir, saved: dict) -> None:
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    assert sorted(state) == sorted(saved), (sorted(state), sorted(saved))
    for n, w in saved.items():
        assert torch.equal(state[n], w), n
    out = save_dir / "consolidated"
    subprocess.run(
        [sys.executable, "-m", "zerotrain.launcher.cli", "consolidate", str(save_dir), str(out), "--safetensors"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    assert sorted(state) == sorted(saved)
    for n, w in saved.items():
        assert torch.equal(state[n], w), n


# -- P=2 x D=1: ZeRO 0 (whole parameters in the stage's mp_rank file), bf16 (bf16_ files, fp32
# masters), an asynchronous save, and a refusal on one stage failing the save on both.


def _to_bf16(batch):
    x, y = batch
    return x.to(torch.bfloat16), y.to(torch.bfloat16)


def _small_engine(stage: int, bf16: bool, seed: int = 0):
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    model = PipelineModule(_layers(seed), num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    config = _config(1, stage)
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = zerotrain.initialize(model=model, optimizer=lambda p: _optimizer(p, "adamw"), config=config)
    if bf16:
        engine.set_batch_fn(_to_bf16)
    return engine


def _run_small(root: str) -> dict:
    import zerotrain
    from zerotrain.checkpoint import CheckpointError

    zerotrain.init_distributed()
    out = {}
    for name, stage, bf16, async_save in (("zero0", 0, False, False), ("bf16-zero1", 1, True, True)):
        save_dir = os.path.join(root, name)
        engine = _small_engine(stage, bf16)
        _train(engine, 1, range(SAVED_AT))
        engine.save_checkpoint(save_dir, client_state={"k": 1}, async_save=async_save)
        first = (_train(engine, 1, range(SAVED_AT, STEPS)), _weights(engine))
        engine.wait_for_checkpoint()
        # stage 1 refuses its client state: both stages raise, latest stays, nothing is left
        bad = {"f": (lambda: 0)} if engine.stage_id == 1 else {}
        try:
            engine.save_checkpoint(save_dir, tag="bad", client_state=bad)
            refused = None
        except (TypeError, CheckpointError) as error:
            refused = "CheckpointError" if isinstance(error, CheckpointError) else "TypeError"
        engine.destroy()
        engine = _small_engine(stage, bf16, seed=3)
        engine.load_checkpoint(save_dir)
        again = (_train(engine, 1, range(SAVED_AT, STEPS)), _weights(engine))
        out[name] = {
            "first": first,
            "again": again,
            "refused": refused,
            "dtype": str(next(engine.module.parameters()).dtype),
        }
        engine.destroy()
    return out


def test_pipeline_checkpoint_zero0_bf16_async_and_refusal(tmp_path):
    results = run_on_ranks(_run_small, world_size=2, args=(str(tmp_path),), timeout=600)
    for name, bf16 in (("zero0", False), ("bf16-zero1", True)):
        for rank, res in enumerate(results):
            got = res[name]
            assert got["dtype"] == ("torch.bfloat16" if bf16 else "torch.float32")
            assert got["again"][0] == got["first"][0], (name, rank, got)
            for n, w in got["first"][1].items():
                assert torch.equal(got["again"][1][n], w), (name, rank, n)
            assert got["refused"] == ("CheckpointError" if rank == 0 else "TypeError"), got["refused"]
        folder = tmp_path / name / f"global_step{SAVED_AT}"
        files = sorted(p.name for p in folder.iterdir())
        assert (tmp_path / name / "latest").read_text() == f"global_step{SAVED_AT}"
        assert not (tmp_path / name / "bad").exists()
        assert not [f for f in (tmp_path / name).iterdir() if f.name.startswith(".")]
        if bf16:
            assert [f for f in files if "optim_states" in f] == [
                "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
            ]
        else:  # fp32 ZeRO 0: no ZeRO files; the stage's parameters and their state in mp_rank_XX
            assert not [f for f in files if "optim_states" in f], files
            ms = torch.load(folder / "mp_rank_01_model_states.pt", weights_only=True)
            assert ms["module"] is None and ms["k"] == 1
            assert {k for k in ms["zerotrain_tensors"] if k.startswith("param/")} == {
                f"param/{i}.{w}" for i in range(3, 6) for w in ("weight", "bias")
            }
