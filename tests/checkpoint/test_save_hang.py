"""A rank that never reaches ``save_checkpoint`` is reported like any other hang: the ranks that
did get there raise ``CollectiveError`` naming it after ``ZEROTRAIN_COMM_TIMEOUT``, instead of
waiting 30 minutes (the checkpoint group's torch default) in a bare ``all_gather_object``."""

from __future__ import annotations

import time

import pytest

from zerotrain.testing import run_on_ranks

TIMEOUT = 2.0


def _engine():
    import zerotrain
    from tests.engine.workloads import make_model

    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1000,
    }
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _rank1_stays_away(root: str, saves_first: bool):
    """Rank 1 does not call ``save_checkpoint`` (it waits, as if stuck in its data loader,
    until rank 0 has its error); rank 0 saves. With ``saves_first`` both ranks saved once
    before, so the checkpoint group already exists."""
    import os

    import torch.distributed as dist

    import zerotrain.comm as comm

    engine = _engine()
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    if saves_first:
        engine.save_checkpoint(root, tag="first")
    if rank == 1:
        while not store.check(["test/rank0-done"]):  # no deadline: the test's timeout bounds it
            time.sleep(0.05)
        store.set("test/rank1-done", "1")  # rank 0 hosts the store: it leaves after this
        return None
    start = time.monotonic()
    try:
        engine.save_checkpoint(root, tag="second")
        result = {"message": "no error"}
    except comm.CollectiveError as error:
        result = {"message": str(error), "missing": error.missing, "op": error.op, "elapsed": time.monotonic() - start}
    except Exception as error:  # noqa: BLE001 - the type is what the test checks
        result = {"message": f"{type(error).__name__}: {error}"}
    store.set("test/rank0-done", "1")
    while not store.check(["test/rank1-done"]):
        time.sleep(0.05)
    result["files"] = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return result


@pytest.mark.parametrize("saves_first", [True, False], ids=["exchange", "group-creation"])
def test_a_rank_missing_from_save_checkpoint_is_named(tmp_path, saves_first):
    root = str(tmp_path / "ckpt")
    results = run_on_ranks(_rank1_stays_away, 2, args=(root, saves_first), comm_timeout=TIMEOUT, timeout=300)
    r = results[0]
    assert "missing" in r, r["message"]
    assert r["missing"] == [1], r["message"]
    assert r["elapsed"] >= TIMEOUT - 0.5  # it waited for the collective timeout, not less
    op = "all_gather_object (save_checkpoint)" if saves_first else "new_group (save_checkpoint)"
    assert r["op"] == op
    first = r["message"].splitlines()[0]
    assert first.startswith(f"{op} #") and first.endswith("rank 1 had not arrived."), first
    assert "failed on rank 0 after" in first
    assert "rank 1: no report within" in r["message"]  # rank 1 is in no collective at all
    assert "second" not in r["files"] and ".second.partial" not in r["files"]
    if saves_first:
        assert "first" in r["files"]
