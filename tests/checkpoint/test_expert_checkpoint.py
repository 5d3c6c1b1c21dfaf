"""Checkpoints of models with experts (issue 32): DeepSpeed's per-expert files, reload on another
``ep_size`` and world size, bit-identical resume, consolidation to the single-process names.

The model: dense -> MoE (4 experts, a persistent buffer in each) -> MoE (2 experts) -> dense,
top-1 dropless gates without random draws, so a token's output does not depend on which rank
holds it. Every expert starts from its own values, set by its global id, so a checkpoint that
swapped two experts would not match.

One 4-rank job at ep_size 2 (2 expert-data replicas) trains 2 steps, saves (one run in the
background while it trains on), and trains 2 more steps: the uninterrupted reference. A fresh
engine of the same layout (built from another seed)
loads the checkpoint: its weights, fp32 masters and optimizer state equal those saved bit for
bit, and its 2 steps repeat the reference bit for bit. One 2-rank job at ep_size 1 (every rank
holds every expert) loads each checkpoint at another stage, runs the same 2 global batches (each
rank the rows two ranks had) and must end on the reference weights (SGD and AdamW; float
summation order only). In this process, the tag folder's expert files are DeepSpeed's names,
checksummed in metadata.json, and ``get_fp32_state_dict_from_zero_checkpoint`` and
``zerotrain consolidate`` give the single-process model's state dict.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from tests.checkpoint.resume import save_and_resume
from zerotrain.testing import run_on_ranks

warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)

H = 6
TOKENS = 4  # rows per rank at 4 ranks (8 at 2 ranks)
BEFORE, AFTER = 2, 2  # steps before the save, and after it
NUM_EXPERTS = (4, 2)  # per MoE layer
EP = 2
SGD = {"lr": 0.1, "momentum": 0.9}
ADAMW = {"lr": 2e-2, "weight_decay": 0.1, "eps": 1e-6}
# name -> (stage, precision, optimizer) at 4 ranks, ep_size 2
RUNS = {
    "s0-sgd": (0, "fp32", "sgd"),
    "s0-adamw": (0, "fp32", "adamw"),
    "s1-sgd": (1, "fp32", "sgd"),
    "s1-adamw": (1, "fp32", "adamw"),
    "s2-sgd": (2, "fp32", "sgd"),
    "s2-adamw": (2, "fp32", "adamw"),
    "s2-bf16": (2, "bf16", "adamw"),
    "s3-adamw": (3, "fp32", "adamw"),
}
# the stage each fp32 checkpoint is loaded at on 2 ranks, ep_size 1
RELOAD_STAGE = {"s0-sgd": 2, "s0-adamw": 1, "s1-sgd": 3, "s1-adamw": 2, "s2-sgd": 1, "s2-adamw": 0, "s3-adamw": 1}
TAG = "t"
LOCAL = re.compile(r"^(.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.*)$")


class ScaledLinear(nn.Module):
    """An expert with a persistent buffer (it must travel with its expert)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.register_buffer("scale", torch.ones(H))

    def forward(self, x):
        return self.lin(x) * self.scale


class MoENet(nn.Module):
    def __init__(self, ep_size: int, ep_rank: int, seed: int = 0):
        from zerotrain.moe.layer import MoE

        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(H, H)
        gate = {"k": 1, "min_capacity": 0, "drop_tokens": False, "use_rts": False}
        self.moe = MoE(H, ScaledLinear(), num_experts=NUM_EXPERTS[0], ep_size=ep_size, **gate)
        self.moe2 = MoE(H, nn.Linear(H, H), num_experts=NUM_EXPERTS[1], ep_size=ep_size, **gate)
        self.out = nn.Linear(H, 2)
        with torch.no_grad():  # each expert its own values, by global id
            for layer, moe in enumerate((self.moe, self.moe2)):
                for j, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                    g = torch.Generator().manual_seed(1000 * seed + 10 * layer + ep_rank * moe.num_local_experts + j)
                    for t in list(expert.parameters()) + list(expert.buffers()):
                        around = 1.0 if t is getattr(expert, "scale", None) else 0.0
                        t.copy_(torch.randn(t.shape, generator=g) * 0.4 + around)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        m, _, _ = self.moe(h)
        h = h + m
        m, _, _ = self.moe2(h)
        return self.out(h + m)


def global_name(name: str, model: nn.Module) -> str:
    """``name`` with its local expert index replaced by the global one (DeepSpeed's rule)."""
    hit = LOCAL.match(name)
    if not hit:
        return name
    moe = model.get_submodule(hit.group(1))
    ep_rank = getattr(model, "_ep_rank", 0)
    expert = ep_rank * moe.num_local_experts + int(hit.group(2))
    return f"{hit.group(1)}.deepspeed_moe.experts.deepspeed_experts.{expert}.{hit.group(3)}"


def _batches(rows_per_rank: int, rank: int, steps: range) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    every = torch.randn(BEFORE + AFTER, 4 * TOKENS, H, generator=g)
    return [every[s, rank * rows_per_rank : (rank + 1) * rows_per_rank] for s in steps]


def _build(ep_size: int, stage: int, precision: str, optimizer: str, seed: int, rows: int):
    import zerotrain
    from zerotrain.topology import Topology

    ep_rank = Topology.from_group(None).expert_groups(ep_size).expert_rank if ep_size > 1 else 0
    model = MoENet(ep_size, ep_rank, seed)
    model._ep_rank = ep_rank
    cfg = {
        "train_micro_batch_size_per_gpu": rows,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD" if optimizer == "sgd" else "AdamW", "params": SGD if optimizer == "sgd" else ADAMW},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _train(engine, rows: int, rank: int, steps: range) -> list[float]:
    losses = []
    for x in _batches(rows, rank, steps):
        out = engine(x.to(next(engine.module.parameters()).dtype))
        loss = out.float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _weights(engine) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers under their global names."""
    model = engine.module
    return {global_name(k, model): v.detach().clone() for k, v in model.state_dict().items()}


def _save_and_resume(root: str):
    """4 ranks, ep_size 2: the reference run with a save, and a same-layout resume."""
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank = dist.get_rank()
    out = {}
    for name, (stage, precision, opt) in RUNS.items():
        engine = _build(EP, stage, precision, opt, seed=0, rows=TOKENS)
        _train(engine, TOKENS, rank, range(BEFORE))
        # s1-adamw in the background while training goes on (its snapshot holds the experts)
        out[name] = save_and_resume(
            engine,
            f"{root}/{name}",
            TAG,
            _weights,
            train_on=lambda e: _train(e, TOKENS, rank, range(BEFORE, BEFORE + AFTER)),
            build_fresh=lambda: _build(EP, stage, precision, opt, seed=1, rows=TOKENS),
            async_save=name == "s1-adamw",
        )
    return out


def _reload_elsewhere(root: str):
    """2 ranks, ep_size 1: each fp32 checkpoint at another stage, the same global batches."""
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank = dist.get_rank()
    out = {}
    for name, stage in RELOAD_STAGE.items():
        _, precision, opt = RUNS[name]
        engine = _build(1, stage, precision, opt, seed=2, rows=2 * TOKENS)
        engine.load_checkpoint(f"{root}/{name}")
        loaded = _weights(engine)
        _train(engine, 2 * TOKENS, rank, range(BEFORE, BEFORE + AFTER))
        out[name] = {"loaded": loaded, "final": _weights(engine), "step": engine.global_steps}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_ckpt")
    four = run_on_ranks(_save_and_resume, world_size=4, args=(str(root),), timeout=900, comm_timeout=120)
    two = run_on_ranks(_reload_elsewhere, world_size=2, args=(str(root),), timeout=600, comm_timeout=120)
    return root, four, two


def _merged(per_rank: list, run: str, key: str) -> dict[str, torch.Tensor]:
    """The whole model from the ranks' global names (ranks holding the same name agree)."""
    out = {}
    for rank_out in per_rank:
        for name, value in rank_out[run][key].items():
            if name in out:
                assert torch.equal(out[name], value), (run, key, name)
            out[name] = value
    return out


def _reference_keys() -> list[str]:
    return list(MoENet(1, 0).state_dict().keys())


def test_same_layout_resume_is_bit_identical(runs):
    _, four, _ = runs
    for run in RUNS:
        for rank, out in enumerate(four):
            got = out[run]
            assert got["loaded_equal"], (run, rank, "weights after load")
            assert got["state_equal"], (run, rank, "fp32 masters / optimizer state after load")
            assert got["losses"] == got["ref_losses"], (run, rank)
            assert got["step"] == BEFORE + AFTER
            for name, want in got["final"].items():
                assert torch.equal(got["resumed"][name], want), (run, rank, name)


def test_reload_at_ep_size_1_on_2_ranks_continues_the_reference(runs):
    _, four, two = runs
    keys = _reference_keys()
    for run in RELOAD_STAGE:
        saved, final = _merged(four, run, "saved"), _merged(four, run, "final")
        assert sorted(saved) == sorted(keys)
        # the experts of one layer differ from each other: a swapped expert would show
        assert not torch.equal(
            saved["moe.deepspeed_moe.experts.deepspeed_experts.0.lin.weight"],
            saved["moe.deepspeed_moe.experts.deepspeed_experts.2.lin.weight"],
        )
        for rank, out in enumerate(two):
            got = out[run]
            assert list(got["loaded"]) == keys  # every expert on every rank, single-process names
            for name in keys:
                assert torch.equal(got["loaded"][name], saved[name]), (run, rank, name)
                assert torch.allclose(got["final"][name], final[name], rtol=1e-5, atol=1e-6), (
                    run,
                    rank,
                    name,
                    (got["final"][name] - final[name]).abs().max(),
                )
            assert got["step"] == BEFORE + AFTER
        moved = max(float((final[k] - saved[k]).abs().max()) for k in keys)
        assert moved > 1e-3, (run, moved)  # the steps after the load did train


def test_expert_files_carry_deepspeeds_names_and_checksums(runs):
    root, _, _ = runs
    for run in RUNS:
        folder = root / run / TAG
        meta = json.loads((folder / "metadata.json").read_text())
        # DeepSpeed 0.19.8's _get_expert_ckpt_name(save_dir, layer_id, expert_id, tag), mp rank 0
        want = {
            f"layer_{layer}_expert_{e}_mp_rank_{0:02d}_model_states.pt"
            for layer, n in enumerate(NUM_EXPERTS)
            for e in range(n)
        }
        on_disk = {p.name for p in folder.iterdir() if p.name.startswith("layer_")}
        assert on_disk == want, run
        assert want <= set(meta["files"]) and all(len(meta["files"][f]["sha256"]) == 64 for f in want)
        assert meta["moe"]["num_experts"] == list(NUM_EXPERTS)
        assert [(m["module"], m["ep_size"], m["num_local_experts"]) for m in meta["moe"]["layers"]] == [
            ("moe", EP, 2),
            ("moe2", EP, 1),
        ]
        assert meta["keys"] == _reference_keys()
        # DeepSpeed's content: the expert's keys under its global id (the file holds that expert only)
        content = torch.load(folder / "layer_0_expert_3_mp_rank_00_model_states.pt", weights_only=True)
        ds_keys = {k for k in content if not k.startswith("zerotrain_")}
        assert ds_keys == {
            f"moe.deepspeed_moe.experts.deepspeed_experts.3.{k}" for k in ("lin.weight", "lin.bias", "scale")
        }
        # no expert in the dense files
        dense = [f for f in meta["files"] if f.startswith(("model.", "shards."))]
        from zerotrain.checkpoint.format import TensorFile

        for f in dense:
            header = TensorFile(folder / f).header
            assert not any("deepspeed_experts" in k for k in header), (run, f)


def test_consolidation_gives_the_single_process_state_dict(runs, tmp_path):
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint
    from zerotrain.checkpoint.format import CheckpointError

    root, four, _ = runs
    keys = _reference_keys()
    for run, (_, _precision, _) in RUNS.items():
        saved = _merged(four, run, "saved")
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(root / run))
        assert list(fp32) == keys
        for name in keys:
            # fp32: the weights themselves; bf16: the masters, whose rounding is the weight
            assert torch.equal(fp32[name].to(saved[name].dtype), saved[name]), (run, name)
        MoENet(1, 0).load_state_dict(fp32)  # the single-process model takes it as it is
    out = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "zerotrain.launcher.cli", "consolidate", str(root / "s1-adamw"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    written = torch.load(out / "pytorch_model.bin", weights_only=True)
    saved = _merged(four, "s1-adamw", "saved")
    assert list(written) == keys and all(torch.equal(written[k], saved[k]) for k in keys)
    # an expert file is checksummed like every other file
    damaged = tmp_path / "damaged"
    shutil.copytree(root / "s2-sgd", damaged)
    path = damaged / TAG / "layer_1_expert_1_mp_rank_00_model_states.pt"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="layer_1_expert_1_mp_rank_00_model_states.pt"):
        get_fp32_state_dict_from_zero_checkpoint(str(damaged))
