"""Optimizer offload to host memory and NVMe swap files reproduces the in-memory trajectory.

One process group of 2 ranks trains the tiny GPT under many configurations (stages 1-3, fp32
and bf16, AdamW and SGD, offload none/cpu/nvme) and checks, while training, that the swap files
exist, and after ``destroy()`` that they are gone.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.engine.workloads import adamw_config, make_model, train_steps
from zerotrain.testing import run_on_ranks

STEPS = 6


def _config(stage: int, device: str, nvme_path: str, bf16: bool = False, sgd: bool = False) -> dict:
    cfg = adamw_config(2, gas=2, clip=0.05)
    if sgd:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    zero = {"stage": stage, "reduce_bucket_size": 3000,
            "stage3_param_persistence_threshold": 100}
    if device == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif device == "nvme":
        # small chunks and 2 buffers: many chunks, read-ahead and write-behind all exercised
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2,
                                     "pin_memory": True, "fast_init": False}
        zero["sub_group_size"] = 700
        cfg["aio"] = {"block_size": 4096, "queue_depth": 4, "thread_count": 2,
                      "single_submit": False, "overlap_events": True}
    cfg["zero_optimization"] = zero
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _swap_files(nvme_path: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(nvme_path) for f in files)


def _trajectories(cases, nvme_path):
    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for name, (stage, device, bf16, sgd) in cases.items():
        model = make_model()
        engine, opt, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(),
                                                 config=_config(stage, device, nvme_path, bf16, sgd))
        losses = train_steps(engine, STEPS)
        record = {"losses": losses, "memory": engine.memory_breakdown()}
        if device == "nvme":
            offload = engine._zero.offload
            record["folder"] = offload.folder
            record["files"] = sorted(os.listdir(offload.folder))
            record["stats"] = engine._zero.offload_stats()
            record["chunks"] = len(offload.swapper.chunks)
            named = engine._zero.named_optimizer_state(opt)
            record["named"] = {k: [(s, {kk: vv.clone() if torch.is_tensor(vv) else vv
                                        for kk, vv in d.items()}) for s, d in v]
                               for k, v in named.items()}
            record["resident_state"] = len(opt.state)
        else:
            record["named"] = engine._zero.named_optimizer_state(opt)
        engine.destroy()
        record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if device == "nvme":
            record["exists_after"] = os.path.exists(record["folder"])
        out[name] = record
    return out


CASES = {
    "s2": (2, "none", False, False), "s2cpu": (2, "cpu", False, False), "s2nvme": (2, "nvme", False, False),
    "s3": (3, "none", False, False), "s3cpu": (3, "cpu", False, False), "s3nvme": (3, "nvme", False, False),
    "s2sgd": (2, "none", False, True), "s2sgdnvme": (2, "nvme", False, True),
    "s1": (1, "none", False, False), "s1nvme": (1, "nvme", False, False),
    "s3bf": (3, "none", True, False), "s3bfnvme": (3, "nvme", True, False),
    "s2bf": (2, "none", True, False), "s2bfcpu": (2, "cpu", True, False), "s2bfnvme": (2, "nvme", True, False),
}
PAIRS = [("s2", "s2cpu"), ("s2", "s2nvme"), ("s3", "s3cpu"), ("s3", "s3nvme"), ("s2sgd", "s2sgdnvme"),
         ("s1", "s1nvme"), ("s3bf", "s3bfnvme"), ("s2bf", "s2bfcpu"), ("s2bf", "s2bfnvme")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    nvme = tmp_path_factory.mktemp("nvme")
    return run_on_ranks(_trajectories, 2, args=(CASES, str(nvme)), timeout=300), nvme


@pytest.mark.parametrize("reference,offloaded", PAIRS)
def test_offload_reproduces_the_in_memory_trajectory(runs, reference, offloaded):
    results, _ = runs
    for rank in results:
        want, got = rank[reference], rank[offloaded]
        # same operations on the same values, chunk by chunk: bit-identical, fp32 and bf16 alike
        assert got["losses"] == want["losses"], (got["losses"], want["losses"])
        for name, p in want["params"].items():
            assert torch.equal(got["params"][name], p), name
        # the optimizer state by name matches too (what checkpoints save)
        assert sorted(got["named"]) == sorted(want["named"])
        for name, pieces in want["named"].items():
            have = got["named"][name]
            for key in pieces[0][1]:
                if not torch.is_tensor(pieces[0][1][key]) or pieces[0][1][key].dim() == 0:
                    continue
                a = torch.cat([d[key] for _, d in sorted(pieces, key=lambda x: x[0])])
                b = torch.cat([d[key] for _, d in sorted(have, key=lambda x: x[0])])
                assert torch.equal(a, b), (name, key)


def test_nvme_swap_files_live_while_training_and_go_after(runs):
    results, nvme = runs
    for rank, out in enumerate(results):
        for name, record in out.items():
            if not name.endswith("nvme"):
                continue
            assert f"rank{rank}" in os.path.basename(record["folder"])
            assert record["chunks"] > 3, record["chunks"]  # sub_group_size 700 cut the units
            # every chunk has a master file (bf16) and its state files (one for SGD momentum)
            per_chunk = (1 if "sgd" in name else 2) + (1 if "bf" in name else 0)
            assert len(record["files"]) == per_chunk * record["chunks"], (name, record["files"][:5])
            assert record["resident_state"] == 0  # nothing of the state stays in memory
            stats = record["stats"]
            assert stats["bytes_read"] > 0 and stats["bytes_written"] >= stats["bytes_read"]
            assert 0 <= stats["io_wait_s"] <= stats["step_s"] and 0 <= stats["io_wait_share"] <= 1
            assert stats["swap_file_bytes"] >= stats["bytes_written"] > 0 and stats["direct_io"]
            assert record["memory"]["optimizer_state"] == 0
            assert 0 < record["memory"]["offload_buffers"]
            assert not record["exists_after"]
    assert _swap_files(str(nvme)) == []
