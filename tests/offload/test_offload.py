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
from tests.offload import checkpoint_cases
from zerotrain.testing import run_on_ranks

STEPS = 4


def _config(stage: int, device: str, nvme_path: str, bf16: bool = False, sgd: bool = False) -> dict:
    cfg = adamw_config(2, gas=2, clip=0.05)
    if sgd:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    zero = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 100}
    if device == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif device in ("nvme", "pnvme"):
        # small chunks and 2 buffers: many chunks, read-ahead and write-behind all exercised
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "buffer_count": 2,
            "pin_memory": True,
            "fast_init": False,
        }
        zero["sub_group_size"] = 700
        cfg["aio"] = {
            "block_size": 4096,
            "queue_depth": 4,
            "thread_count": 2,
            "single_submit": False,
            "overlap_events": True,
        }
        if device == "pnvme":  # parameters (and so gradients) too; few in memory: evicted often
            zero["offload_param"] = {
                "device": "nvme",
                "nvme_path": nvme_path,
                "buffer_count": 2,
                "buffer_size": 10**6,
                "max_in_cpu": 3000,
            }
    cfg["zero_optimization"] = zero
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _swap_files(nvme_path: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(nvme_path) for f in files)


def _trajectories(cases, nvme_path, checkpoints):
    import zerotrain

    zerotrain.init_distributed()
    out = {"checkpoint": checkpoint_cases.save_and_resume(checkpoints, nvme_path)}
    for name, (stage, device, bf16, sgd) in cases.items():
        model = make_model()
        engine, opt, _, _ = zerotrain.initialize(
            model=model, model_parameters=model.parameters(), config=_config(stage, device, nvme_path, bf16, sgd)
        )
        losses = train_steps(engine, STEPS)
        record = {"losses": losses, "memory": engine.memory_breakdown()}
        if device.endswith("nvme"):
            offload = engine._zero.offload
            record["folder"] = offload.folder
            if engine._zero.param_offload is not None:
                record["param_folder"] = engine._zero.param_offload.folder
                record["param_files"] = len(os.listdir(record["param_folder"]))
            record["files"] = sorted(os.listdir(offload.folder))
            record["stats"] = engine._zero.statistics(engine.module, engine.optimizer).offload
            record["chunks"] = len(offload.swapper.chunks)
            named = engine._zero.named_optimizer_state(opt)
            record["named"] = {
                k: [(s, {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in d.items()}) for s, d in v]
                for k, v in named.items()
            }
            record["resident_state"] = len(opt.state)
        else:
            record["named"] = engine._zero.named_optimizer_state(opt)
        engine.destroy()
        record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if device.endswith("nvme"):
            record["exists_after"] = any(os.path.exists(record[k]) for k in ("folder", "param_folder") if k in record)
        out[name] = record
    return out


# Each offload path once against its in-memory reference: stages 2 and 3 with cpu and nvme
# (fp32), parameters and gradients on NVMe too (fp32, and bf16 where the master is swapped),
# stage 1 with SGD (another optimizer's state).
CASES = {
    "s2": (2, "none", False, False),
    "s2cpu": (2, "cpu", False, False),
    "s2nvme": (2, "nvme", False, False),
    "s3": (3, "none", False, False),
    "s3cpu": (3, "cpu", False, False),
    "s3nvme": (3, "nvme", False, False),
    "s3pnvme": (3, "pnvme", False, False),
    "s3bf": (3, "none", True, False),
    "s3bfpnvme": (3, "pnvme", True, False),
    "s1sgd": (1, "none", False, True),
    "s1sgdnvme": (1, "nvme", False, True),
}
PAIRS = [
    ("s2", "s2cpu"),
    ("s2", "s2nvme"),
    ("s3", "s3cpu"),
    ("s3", "s3nvme"),
    ("s3", "s3pnvme"),
    ("s3bf", "s3bfpnvme"),
    ("s1sgd", "s1sgdnvme"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    nvme = tmp_path_factory.mktemp("nvme")
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    results = run_on_ranks(_trajectories, 2, args=(CASES, str(nvme), str(checkpoints)), timeout=300)
    return results, nvme, checkpoints


@pytest.mark.parametrize("reference,offloaded", PAIRS)
def test_offload_reproduces_the_in_memory_trajectory(runs, reference, offloaded):
    results = runs[0]
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
    results, nvme, _ = runs
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
            assert stats["io_busy_s"] > 0  # the disk was busy during the step's swaps
            assert stats["swap_file_bytes"] >= stats["bytes_written"] > 0 and stats["direct_io"]
            assert record["memory"]["optimizer_state"] == 0
            assert 0 < record["memory"]["offload_buffers"]
            assert not record["exists_after"]
            if "pnvme" in name:  # one file per partitioned shard; shards and gradients moved
                assert record["param_files"] > 3
                assert stats["params"]["bytes_read"] > 0 and stats["params"]["bytes_written"] > 0
                assert stats["params"]["peak_resident_numel"] <= 3000 + 2048
                assert stats["grads"]["bytes_written"] > 0
    assert _swap_files(str(nvme)) == []


def test_nvme_checkpoints_resume_bit_identically_and_reshard(runs, in_process_rank):
    """Saved with optimizer state and parameters on NVMe on 2 ranks: resumed with and without
    offload (and the other way round) bit-identically; loaded on 1 rank (here, in-process)."""
    import zerotrain

    results, nvme, checkpoints = runs
    zerotrain.init_distributed()
    single = checkpoint_cases.load_on_one_rank(str(checkpoints), str(nvme))
    checkpoint_cases.check([r["checkpoint"] for r in results], single, nvme)


def test_disk_activity_counts_overlapping_operations_once(monkeypatch):
    """``io_busy_s`` is the wall time with any swap I/O under way: two operations that overlap
    count once, a gap between operations not at all, a running one up to now. Read on a scripted
    clock (no sleeps, no timing window); ``bench/disk_activity.py`` measures it on the real clock."""
    import types

    from zerotrain.offload import aio

    now = [0.0]
    monkeypatch.setattr(aio, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    clock = aio.DiskActivity()

    def at(t, then=None):
        now[0] = t
        if then is not None:
            then()

    at(0.0, clock.__enter__)  # A starts
    at(1.0, clock.__enter__)  # B starts while A runs
    at(2.0)
    assert clock.busy_s == 2.0  # running: counted up to now, once
    at(3.0, clock.__exit__)  # A ends, B still runs
    assert clock.busy_s == 3.0
    at(4.0, clock.__exit__)  # B ends: [0, 4] was busy, not 3 + 3
    assert clock.busy_s == 4.0
    at(6.0)
    assert clock.busy_s == 4.0  # idle 4..6: not counted
    with clock:  # C: 6..7.5
        at(7.5)
    at(9.0)
    assert clock.busy_s == 5.5
