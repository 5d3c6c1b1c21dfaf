"""Rank decisions come from the engine's topology: on 4 ranks as two disjoint data groups {0,1}
and {2,3}, each engine's accessors report its own group, each group's first rank writes its own
monitor files (hardware rows named by global rank), per-engine log lines come from each group's
first rank, a ZeRO divergence report names the group's global ranks; and an engine over the whole
world answers DeepSpeed's expert-group accessors from its topology's ep_size_N groups."""

from __future__ import annotations

import csv
import logging

import pytest

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.testing import run_on_ranks

STEPS, MICRO = 2, 2


def _group_config(out: str, group: int) -> dict:
    return adamw_config(
        MICRO,
        zero_optimization={"stage": 1},
        csv_monitor={"enabled": True, "output_path": f"{out}/csv", "job_name": f"group{group}"},
    )


def _attempt(fn):
    """``fn()``, or the error it raised as text (each check fails on its own)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - reported by the test that reads it
        return f"{type(err).__name__}: {err}"


def _ranks_in_groups(out: str) -> dict:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.log import log_dist, log_rank0, logger
    from zerotrain.zero.agreement import CollectiveAgreement

    zerotrain.init_distributed()
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger.addHandler(Keep())
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = dist.get_rank() // 2
    engine, *_ = zerotrain.initialize(
        model=make_model(), config=_group_config(out, mine), data_parallel_group=groups[mine]
    )
    res = {
        "data_rank": engine.get_data_parallel_rank(),  # DeepSpeed's; it was the global rank
        "data": _attempt(
            lambda: (
                engine.get_data_parallel_rank(),
                engine.get_data_parallel_world_size(),
                dist.get_process_group_ranks(engine.get_data_parallel_group()),
            )
        ),
        "pipe": _attempt(lambda: (engine.get_pipe_parallel_rank(), engine.get_pipe_parallel_world_size())),
        "model": _attempt(
            lambda: (
                engine.get_model_parallel_rank(),
                engine.get_model_parallel_world_size(),
                engine.mp_world_size,
                engine.get_tensor_parallel_rank(),
            )
        ),
        "writers": len(engine.monitor.monitors),
        "monitor_rank": (engine.monitor.rank, engine.monitor.world_size),
        "unbuilt_expert": _attempt(lambda: engine.get_expert_parallel_rank("ep_size_2")),
    }
    rank = dist.get_rank(groups[mine])
    data = global_batches(STEPS, MICRO * 2, seed=1 + mine)
    losses = []
    for step in range(STEPS):
        batch = data[step, rank * MICRO : (rank + 1) * MICRO]
        loss = engine(batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    res["losses"], res["samples"] = losses, engine.global_samples
    _attempt(lambda: log_rank0("per-engine %d", mine, topology=engine.topology))
    log_rank0("process-wide")
    log_dist("to rank 2", ranks=[2])
    # A divergence inside group {2,3} (agreeing inside {0,1}) names the group's global ranks.
    agreement = CollectiveAgreement(groups[mine], lambda kind, i: f"unit {i}")
    try:
        agreement.check("gather", rank if mine == 1 else 0)
        res["agreement"] = "agreed"
    except RuntimeError as err:
        res["agreement"] = str(err)
    engine.destroy()

    # One engine over the whole world: DeepSpeed's ep_size_2 groups, built on every rank.
    from zerotrain.utils import groups as ds_groups

    world_engine, *_ = zerotrain.initialize(model=make_model(), config=adamw_config(MICRO))
    ds_groups._create_expert_and_data_parallel(2)
    e = world_engine
    res["expert"] = _attempt(
        lambda: (
            e.get_expert_parallel_rank("ep_size_2"),
            e.get_expert_parallel_world_size("ep_size_2"),
            dist.get_process_group_ranks(e.get_expert_parallel_group("ep_size_2")),
            e.get_expert_data_parallel_rank("ep_size_2"),
            e.get_expert_data_parallel_world_size("ep_size_2"),
            dist.get_process_group_ranks(e.get_expert_data_parallel_group("ep_size_2")),
        )
    )
    res["world_data"] = _attempt(lambda: (e.get_data_parallel_rank(), e.get_data_parallel_world_size()))
    world_engine.destroy()
    res["lines"] = lines
    return res


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("topology_accessors")
    return out, run_on_ranks(_ranks_in_groups, world_size=4, args=(str(out),), timeout=300)


def test_each_engine_reports_its_own_group(per_rank):
    _, res = per_rank
    assert [r["data_rank"] for r in res] == [0, 1, 0, 1]
    assert [r["data"] for r in res] == [(0, 2, [0, 1]), (1, 2, [0, 1]), (0, 2, [2, 3]), (1, 2, [2, 3])]
    for r in res:
        assert r["pipe"] == (0, 1) and r["model"] == (0, 1, 1, 0)
        assert r["monitor_rank"][1] == 2
        assert r["unbuilt_expert"] == (
            "ValueError: expert group 'ep_size_2' is not built on this engine "
            "(built: none); build it on every rank with zerotrain.utils.groups."
            "_create_expert_and_data_parallel(N) for the engine's topology, or "
            "engine.topology.expert_groups(N)"
        )


def test_each_group_first_rank_writes_its_monitor_files(per_rank):
    out, res = per_rank
    assert [r["writers"] for r in res] == [1, 0, 1, 0]
    assert [r["monitor_rank"][0] for r in res] == [0, 1, 0, 1]
    for group, first in ((0, res[0]), (1, res[2])):
        job = out / "csv" / f"group{group}"
        rows = list(csv.reader(open(job / "Train_Samples_train_loss.csv")))
        assert [float(v) for _, v in rows[1:]] == pytest.approx(first["losses"], rel=1e-6)
        assert int(rows[-1][0]) == first["samples"] == STEPS * MICRO * 2
        hardware = sorted(p.name for p in job.glob("Hardware_rank*_rss_MB.csv"))
        assert hardware == [f"Hardware_rank{r}_rss_MB.csv" for r in (2 * group, 2 * group + 1)]


def test_logs_come_from_the_right_ranks(per_rank):
    _, res = per_rank
    per_engine = [[line for line in r["lines"] if line.startswith("per-engine")] for r in res]
    assert per_engine == [["per-engine 0"], [], ["per-engine 1"], []]
    assert [sum(line == "process-wide" for line in r["lines"]) for r in res] == [1, 0, 0, 0]
    assert [[line for line in r["lines"] if "to rank 2" in line] for r in res] == [[], [], ["[Rank 2] to rank 2"], []]


def test_divergence_names_global_ranks(per_rank):
    _, res = per_rank
    assert res[0]["agreement"] == res[1]["agreement"] == "agreed"
    for r in res[2:]:
        assert "rank 2 gathers unit 0, rank 3 gathers unit 1" in r["agreement"], r["agreement"]


def test_world_engine_answers_expert_accessors_from_its_topology(per_rank):
    _, res = per_rank
    # DeepSpeed's ep_size_2 layout over data ranks [0,1,2,3]: expert groups are blocks, expert-data
    # groups stride by 2.
    assert [r["expert"] for r in res] == [
        (0, 2, [0, 1], 0, 2, [0, 2]),
        (1, 2, [0, 1], 0, 2, [1, 3]),
        (0, 2, [2, 3], 1, 2, [0, 2]),
        (1, 2, [2, 3], 1, 2, [1, 3]),
    ]
    assert [r["world_data"] for r in res] == [(0, 4), (1, 4), (2, 4), (3, 4)]
