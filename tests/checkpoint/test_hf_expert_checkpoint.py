"""Checkpoints of Hugging Face MoE models made expert-parallel (``zerotrain.experts.expert_parallel``,
issue 32): fused expert parameters (``gate_up_proj[E, ...]``, ``down_proj[E, ...]``) saved by rows
into DeepSpeed's per-expert files, reloaded at another ``ep_size``, world size and stage, resumed
bit for bit on the same layout, and consolidated to the unsharded HF state dict.

A tiny Mixtral (2 layers, 4 experts, top-2, router aux loss on) from a config. One 4-rank job at
``ep_size`` 2 (2 expert-data replicas) trains 2 steps, saves, and trains 2 more: the reference. A
fresh engine of the same layout (another seed) loads the checkpoint: gathered weights, fp32
masters and optimizer state equal those saved bit for bit and its 2 steps repeat the reference
bit for bit. A 2-rank job loads each checkpoint at ``ep_size`` 1 at another stage, and at
``ep_size`` 2 (which saves again at once: a 2-rank ``ep_size`` 2 checkpoint); one process at
``ep_size`` 1 loads that. Every reload runs the same 4 micro-batches per step (gradient
accumulation where there are fewer ranks, so the router aux loss sees the same batches) and
must end on the reference weights (1e-6, fp32).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from tests.checkpoint.resume import save_and_resume
from zerotrain.testing import run_on_ranks

warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)

EP = 2
BEFORE, AFTER = 2, 2
SEQ = 8
MICRO = 4  # micro-batches per optimizer step, over the ranks and accumulation steps
OPTIMIZERS = {"SGD": {"lr": 0.5, "momentum": 0.9}, "AdamW": {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}}
# name -> (stage, optimizer) of the 4-rank ep_size 2 runs
CASES = {"s2-sgd": (2, "SGD"), "s2-adamw": (2, "AdamW"), "s3-sgd": (3, "SGD"), "s3-adamw": (3, "AdamW")}
RELOAD_2 = {"s2-sgd": 3, "s2-adamw": 3, "s3-sgd": 2, "s3-adamw": 2}  # stage at ep_size 1 on 2 ranks
RELOAD_1 = {"s2-sgd": 0, "s2-adamw": 3, "s3-sgd": 2, "s3-adamw": 0}  # stage in one process
TAG = "t"
TOL = 1e-6


def make(seed: int = 0):
    import transformers as hf

    config = hf.MixtralConfig(
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
        intermediate_size=8,
        num_local_experts=4,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return hf.MixtralForCausalLM(config)


def _ids(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, 32, (2, SEQ), generator=g)


def _build(ep_size: int, stage: int, optimizer: str, seed: int, accumulation: int):
    import zerotrain
    from zerotrain.experts import expert_parallel

    model = make(seed)
    expert_parallel(model, ep_size)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero,
        "optimizer": {"type": optimizer, "params": OPTIMIZERS[optimizer]},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    return engine


def _train(engine, rank: int, world: int, steps: range) -> list[float]:
    """Each optimizer step covers micro-batches 0..MICRO-1: rank r runs r, r + world, ..."""
    losses = []
    for step in steps:
        for micro in range(rank, MICRO, world):
            ids = _ids(step, micro)
            loss = engine(input_ids=ids, labels=ids, output_router_logits=True).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _full(engine) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict (a collective)."""
    from zerotrain.experts import gather_expert_state_dict

    return {k: v.detach().clone() for k, v in gather_expert_state_dict(engine.module).items()}


def _four_ranks(root: str):
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (stage, opt) in CASES.items():
        engine = _build(EP, stage, opt, seed=0, accumulation=MICRO // world)
        _train(engine, rank, world, range(BEFORE))
        out[name] = save_and_resume(
            engine,
            f"{root}/{name}",
            TAG,
            _full,
            train_on=lambda e: _train(e, rank, world, range(BEFORE, BEFORE + AFTER)),
            build_fresh=lambda: _build(EP, stage, opt, seed=1, accumulation=MICRO // world),
        )
    return out


def _two_ranks(root: str):
    """Each checkpoint at ep_size 1 (another stage), and at ep_size 2 (saved again at once)."""
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (stage, opt) in CASES.items():
        for ep_size, at in ((1, RELOAD_2[name]), (EP, stage)):
            engine = _build(ep_size, at, opt, seed=2, accumulation=MICRO // world)
            engine.load_checkpoint(f"{root}/{name}")
            loaded = _full(engine)
            if ep_size == EP:
                engine.save_checkpoint(f"{root}/{name}-2ranks", tag=TAG)
            _train(engine, rank, world, range(BEFORE, BEFORE + AFTER))
            out[(name, ep_size)] = {"loaded": loaded, "final": _full(engine), "step": engine.global_steps}
            engine.destroy()
    return out


def _one_process(root: str):
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for name, (_, opt) in CASES.items():
        engine = _build(1, RELOAD_1[name], opt, seed=3, accumulation=MICRO)
        engine.load_checkpoint(f"{root}/{name}-2ranks")
        loaded = _full(engine)
        _train(engine, 0, 1, range(BEFORE, BEFORE + AFTER))
        out[name] = {"loaded": loaded, "final": _full(engine), "step": engine.global_steps}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_expert_ckpt")
    four = run_on_ranks(_four_ranks, world_size=4, args=(str(root),), timeout=900, comm_timeout=120)
    two = run_on_ranks(_two_ranks, world_size=2, args=(str(root),), timeout=600, comm_timeout=120)
    one = run_on_ranks(_one_process, world_size=1, args=(str(root),), timeout=600, comm_timeout=120)
    return root, four, two, one


def _close(got: dict, want: dict, what) -> None:
    assert list(got) == list(want), what
    for k, v in want.items():
        assert got[k].shape == v.shape, (what, k)
        diff = float((got[k] - v).abs().max())
        assert diff <= TOL, (what, k, diff)


def test_same_layout_resume_is_bit_identical(runs):
    _, four, _, _ = runs
    for name in CASES:
        for rank, out in enumerate(four):
            got = out[name]
            assert got["loaded_equal"], (name, rank, "weights after load")
            assert got["state_equal"], (name, rank, "fp32 masters / optimizer state after load")
            assert got["losses"] == got["ref_losses"], (name, rank)
            assert got["step"] == BEFORE + AFTER
            for k, want in got["final"].items():
                assert torch.equal(got["resumed"][k], want), (name, rank, k)
        # the ranks agree on the whole model, and the steps after the save did train
        assert all(torch.equal(four[0][name]["final"][k], v) for k, v in four[1][name]["final"].items())
        saved, final = four[0][name]["saved"], four[0][name]["final"]
        assert max(float((final[k] - saved[k]).abs().max()) for k in saved) > 1e-3, name


def test_reload_at_other_ep_size_world_size_and_stage_continues_the_reference(runs):
    _, four, two, one = runs
    keys = list(make().state_dict())
    for name in CASES:
        saved, final = four[0][name]["saved"], four[0][name]["final"]
        assert list(saved) == keys
        experts = "model.layers.1.mlp.experts.gate_up_proj"
        assert not torch.equal(saved[experts][0], saved[experts][3])  # a swapped expert would show
        for rank, out in enumerate(two):
            for ep_size in (1, EP):
                got = out[(name, ep_size)]
                _close(got["loaded"], saved, (name, ep_size, rank, "loaded"))
                _close(got["final"], final, (name, ep_size, rank, "final"))
                assert got["step"] == BEFORE + AFTER
        _close(one[0][name]["loaded"], saved, (name, "one process", "loaded"))
        _close(one[0][name]["final"], final, (name, "one process", "final"))
        assert one[0][name]["step"] == BEFORE + AFTER


def test_expert_rows_are_in_deepspeeds_per_expert_files(runs):
    root, four, _, _ = runs
    fused = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
    for name in (*CASES, "s2-sgd-2ranks"):
        folder = root / name / TAG
        meta = json.loads((folder / "metadata.json").read_text())
        want = {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in range(2) for e in range(4)}
        assert {p.name for p in folder.iterdir() if p.name.startswith("layer_")} == want, name
        assert want <= set(meta["files"])
        saved = four[0][name.removesuffix("-2ranks")]["saved"]
        for key in fused:
            entry = meta["whole"][key]
            assert entry["shape"] == list(saved[key].shape) and entry["shape"][0] == 4
            layer = int(key.split(".")[2])
            assert entry["row_files"] == [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)]
        # DeepSpeed AutoEP's content: row E of each fused parameter under <name>.<E>
        content = torch.load(folder / "layer_1_expert_3_mp_rank_00_model_states.pt", weights_only=True)
        ds = {k: v for k, v in content.items() if not k.startswith("zerotrain_")}
        assert sorted(ds) == sorted(f"{k}.3" for k in fused if ".layers.1." in k)
        for k, v in ds.items():
            assert torch.equal(v, saved[k.removesuffix(".3")][3]), (name, k)
        # no expert rows in the dense files
        from zerotrain.checkpoint.format import TensorFile

        for f in meta["files"]:
            if f.startswith(("model.", "shards.")):
                assert not any(".experts." in k for k in TensorFile(folder / f).header), (name, f)


def test_consolidation_gives_the_unsharded_hf_state_dict(runs, tmp_path):
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    root, four, _, _ = runs
    keys = list(make().state_dict())
    for name in (*CASES, "s3-adamw-2ranks"):
        saved = four[0][name.removesuffix("-2ranks")]["saved"]
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(root / name))
        assert list(fp32) == keys
        for k in keys:
            assert torch.equal(fp32[k], saved[k]), (name, k)
        model = make(seed=5)
        model.load_state_dict(fp32)  # strict: the plain HF model takes it as it is
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    out = tmp_path / "cli"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotrain.launcher.cli",
            "consolidate",
            str(root / "s3-sgd"),
            str(out),
            "--safe_serialization",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    written = load_file(out / "model.safetensors")
    saved = four[0]["s3-sgd"]["saved"]
    assert sorted(written) == sorted(keys) and all(torch.equal(written[k], saved[k]) for k in keys)
