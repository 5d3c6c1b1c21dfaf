"""Checkpoints of two engines on disjoint data-parallel groups of one job (issue 30).

One 4-rank job; ranks {0, 1} and {2, 3} form two groups (created by every rank in the same
order). Group 0 trains a tiny GPT at stage 2 in fp32, group 1 at stage 3 in bf16, side by side
(AdamW, a warmup scheduler, dropout: the random state must come back too). Each saves into its
own folder, trains 2 more steps, then a fresh engine on the same group loads the checkpoint and
repeats those 2 steps: losses and weights must be bit-identical. Each checkpoint's files must be
those of the same run on a 2-rank world (named by the rank within the group): a 2-rank world
loads both and repeats the 2 steps bit-identically too. In this process, the checkpoints are
consolidated (``get_fp32_state_dict_from_zero_checkpoint`` and ``zerotrain consolidate``) and
loaded on a 1-rank engine; every result equals the weights the group saved.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint.workloads import config
from tests.engine.workloads import SEQ, TINY, make_model
from zerotrain.testing import run_on_ranks

GROUP_SIZE = 2
MICRO = 2
STEPS = 2  # before the save, and after it
RUNS = {0: (2, "fp32"), 1: (3, "bf16")}  # group -> (stage, precision)
SEEDS = (3, 7)  # model seed of each group
TAG = "s2"


def _config(stage: int, precision: str) -> dict:
    cfg = config(stage, precision, micro=MICRO, gas=1)
    if stage == 3:  # small tensors stay whole: both paths saved
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return cfg


def _build(group: int, data_parallel_group=None, seed: int | None = None):
    import zerotrain

    stage, precision = RUNS[group]
    model = make_model(seed=SEEDS[group] if seed is None else seed, dropout=0.1)
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_config(stage, precision),
        data_parallel_group=data_parallel_group,
    )
    return engine


def _train(engine, group: int, steps: int) -> list[float]:
    """``steps`` steps from the engine's global step; group rank r takes rows [r*MICRO, ...) of
    the step's batch (the same rows whatever the global ranks). The group's mean loss of each."""
    import torch.distributed as dist

    topo = engine.topology
    rank, size = topo.data_rank, topo.data_size
    losses = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(1000 * (group + 1) + engine.global_steps)
        data = torch.randint(0, TINY["vocab_size"], (MICRO * size, SEQ), generator=g)
        batch = data[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        if size > 1:
            dist.all_reduce(total, group=topo.data_group)
        losses.append(total.item() / size)
    return losses


def _weights(engine) -> dict:
    """The whole weights (gathered to the group's first rank at stage 3; {} on the others)."""
    return {k: v.detach().clone() for k, v in engine.module_state_dict().items()}


def _job(root: str) -> dict:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.checkpoint.model16 import save_16bit_model

    zerotrain.init_distributed()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = dist.get_rank() // GROUP_SIZE
    g = groups[mine]
    folder = str(Path(root) / f"group{mine}")
    out = {"group": mine, "grank": dist.get_rank(g)}

    engine = _build(mine, g)
    out["before"] = _train(engine, mine, STEPS)
    engine.save_checkpoint(folder, tag=TAG, client_state={"group": mine})
    out["saved"] = _weights(engine)
    engine.save_16bit_model(str(Path(root) / f"model16-{mine}"), "model.pt")
    out["after"] = _train(engine, mine, STEPS)
    out["final"] = _weights(engine)
    engine.destroy()

    # A fresh engine on the same group (other initial weights) resumes from the checkpoint.
    engine = _build(mine, g, seed=99)
    path, client = engine.load_checkpoint(folder)
    out["loaded_from"], out["client"] = Path(path).name, client
    out["loaded"] = _weights(engine)
    out["resumed"] = _train(engine, mine, STEPS)
    out["resumed_final"] = _weights(engine)
    engine.destroy()

    # The whole-model file of replicated weights, by the group's first rank (not global rank 0).
    plain = torch.nn.Linear(3, 2)
    with torch.no_grad():
        plain.weight.fill_(float(mine + 1))
    written = save_16bit_model(plain, str(Path(root) / f"plain-{mine}"), "plain.pt", group=g)
    out["plain_written"] = written is not None
    # Rank 0 hosts the rendezvous store: no rank leaves while the other group still works.
    dist.barrier()
    return out


def _world_resume(root: str) -> dict:
    """Both groups' checkpoints on a 2-rank world: the same files a 2-rank run would have."""
    out = {}
    for group in RUNS:
        engine = _build(group, seed=99)
        engine.load_checkpoint(str(Path(root) / f"group{group}"))
        out[group] = {"resumed": _train(engine, group, STEPS), "final": _weights(engine)}
        engine.destroy()
    return out


def _one_rank_load(root: str) -> dict:
    out = {}
    for group in RUNS:
        engine = _build(group, seed=99)
        _, client = engine.load_checkpoint(str(Path(root) / f"group{group}"))
        out[group] = {"weights": _weights(engine), "client": client, "steps": engine.global_steps}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    per_rank = run_on_ranks(_job, world_size=4, args=(str(root),), timeout=900, comm_timeout=120)
    return {"root": root, "per_rank": per_rank}


def _first(results, group: int) -> dict:
    return results["per_rank"][group * GROUP_SIZE]


def _assert_identical(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, w in want.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), f"{what}: {name} differs"


def test_each_group_saves_its_own_checkpoint_with_the_files_of_a_group_sized_world(results):
    from zerotrain.checkpoint.format import CheckpointReader, shard_file, state_file

    for group, (stage, precision) in RUNS.items():
        save_dir = results["root"] / f"group{group}"
        assert (save_dir / "latest").read_text() == TAG
        reader = CheckpointReader(save_dir / TAG)
        try:
            meta = reader.meta
        finally:
            reader.close()
        assert set(meta["files"]) == {
            "model.safetensors",
            shard_file(0),
            shard_file(1),
            state_file(0),
            state_file(1),
        }, group
        assert (meta["world_size"], meta["stage"], meta["param_dtype"]) == (
            GROUP_SIZE,
            stage,
            "float32" if precision == "fp32" else "bfloat16",
        )
        assert meta["global_steps"] == STEPS
    for out in results["per_rank"]:
        assert out["client"] == {"group": out["group"]}
        assert out["loaded_from"] == TAG


def test_a_fresh_engine_on_the_group_resumes_bit_identically(results):
    for out in results["per_rank"]:
        what = f"group {out['group']} rank {out['grank']}"
        assert out["before"] != out["after"], what
        assert out["resumed"] == out["after"], what  # exact floats
        _assert_identical(out["loaded"], out["saved"], what + " loaded")
        _assert_identical(out["resumed_final"], out["final"], what + " resumed")
    # the groups trained different models: nothing leaked between them
    first, second = _first(results, 0)["saved"], _first(results, 1)["saved"]
    assert first.keys() == second.keys()
    assert all(not torch.equal(first[k].float(), second[k].float()) for k in first if first[k].dim() > 1)


def test_a_two_rank_world_resumes_each_group_bit_identically(results):
    world = run_on_ranks(_world_resume, world_size=2, args=(str(results["root"]),), timeout=600)
    for group in RUNS:
        for rank in range(GROUP_SIZE):
            want = results["per_rank"][group * GROUP_SIZE + rank]
            got = world[rank][group]
            assert got["resumed"] == want["after"], (group, rank)
            _assert_identical(got["final"], want["final"], f"group {group} on a 2-rank world, rank {rank}")


def test_one_rank_loads_each_groups_checkpoint(results):
    (single,) = run_on_ranks(_one_rank_load, world_size=1, args=(str(results["root"]),), timeout=600)
    for group in RUNS:
        got = single[group]
        assert got["client"] == {"group": group} and got["steps"] == STEPS
        _assert_identical(got["weights"], _first(results, group)["saved"], f"group {group} on 1 rank")


def test_consolidation_equals_the_saved_weights(results, tmp_path):
    from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    for group, (_, precision) in RUNS.items():
        folder = results["root"] / f"group{group}"
        saved = _first(results, group)["saved"]
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(folder))
        assert fp32.keys() == saved.keys()
        for name, want in saved.items():
            assert fp32[name].dtype == torch.float32
            # fp32: the weights themselves; bf16: the masters, whose rounding is the weight
            assert torch.equal(fp32[name].to(want.dtype), want), (group, name)
        out = tmp_path / f"cli{group}"
        dtype = "fp32" if precision == "fp32" else "bf16"
        done = subprocess.run(
            [sys.executable, "-m", "zerotrain.launcher.cli", "consolidate", str(folder), str(out), "--dtype", dtype],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        _assert_identical(
            torch.load(out / "pytorch_model.bin", weights_only=True), saved, f"group {group} consolidated by the CLI"
        )


def test_model_files_are_written_by_each_groups_first_rank(results):
    for group in RUNS:
        saved = _first(results, group)["saved"]
        model16 = torch.load(results["root"] / f"model16-{group}" / "model.pt", weights_only=True)
        _assert_identical({k: model16[k] for k in saved}, saved, f"group {group} save_16bit_model")
        plain = torch.load(results["root"] / f"plain-{group}" / "plain.pt", weights_only=True)
        assert torch.equal(plain["weight"], torch.full((2, 3), float(group + 1)))
    assert [out["plain_written"] for out in results["per_rank"]] == [True, False, True, False]


def _group_rank_stays_away(root: str) -> dict:
    """Group 1's rank 3 never calls ``save_checkpoint``: rank 2 must name global rank 3 after the
    collective timeout, while group 0 saves as if nothing happened (it never waits for 2 or 3)."""
    import os
    import time

    import torch.distributed as dist

    import zerotrain
    import zerotrain.comm as comm

    zerotrain.init_distributed()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rank = dist.get_rank()
    mine = rank // GROUP_SIZE
    engine = _build(mine, groups[mine])
    store = dist.distributed_c10d._get_default_store()
    folder = str(Path(root) / f"away{mine}")
    out = {}
    if rank == 3:  # as if stuck in its data loader until rank 2 has its error
        while not store.check(["test/rank2-done"]):  # no deadline: the test's timeout bounds it
            time.sleep(0.05)
    else:
        try:
            engine.save_checkpoint(folder, tag="t")
            out["message"] = "saved"
        except comm.CollectiveError as error:
            out.update(message=str(error), missing=error.missing, op=error.op)
        if rank == 2:
            store.set("test/rank2-done", "1")
    out["files"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    store.set(f"test/left-{rank}", "1")  # rank 0 hosts the store: it leaves last
    while rank == 0 and not store.check([f"test/left-{r}" for r in range(4)]):
        time.sleep(0.05)
    engine.destroy()
    return out


def test_a_rank_missing_from_its_groups_save_is_named_and_the_other_group_saves(tmp_path):
    results = run_on_ranks(_group_rank_stays_away, world_size=4, args=(str(tmp_path),), timeout=600, comm_timeout=3.0)
    for rank in (0, 1):
        assert results[rank]["message"] == "saved", results[rank]["message"]
        assert "t" in results[rank]["files"] and (tmp_path / "away0" / "latest").read_text() == "t"
    r = results[2]
    assert r.get("missing") == [3], r["message"]
    assert r["op"] == "new_group (save_checkpoint)"
    first = r["message"].splitlines()[0]
    assert "of 2 ranks failed on rank 2 after" in first and first.endswith("rank 3 had not arrived."), first
    assert "t" not in r["files"] and "latest" not in r["files"]
