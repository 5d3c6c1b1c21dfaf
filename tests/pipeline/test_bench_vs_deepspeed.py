"""Smoke test of bench/pipeline_vs_deepspeed.py (no timing checked; DeepSpeed's cases need its own
virtualenv and are left to the bench): the cases it builds cover every schedule the engine offers,
each with the model chunks per rank it needs, and its zerotrain cases do the same work -- the
pipeline (1F1B) and ZeRO-1 data parallelism over the same 2 processes report the same losses on a
tiny model, from the same weights and sequences."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from zerotrain.pipeline import schedule as sched

BENCH = Path(__file__).resolve().parents[2] / "bench" / "pipeline_vs_deepspeed.py"


def _bench():
    spec = importlib.util.spec_from_file_location("pipeline_vs_deepspeed", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(**kw):
    base = {"micro_batches": [4, 8], "ext_micro_batches": [4], "schedules": "all", "only": ""}
    return argparse.Namespace(**{**base, **kw})


def test_cases_cover_every_offered_schedule():
    bench = _bench()
    cases = bench._cases(_args())
    at_m4 = {c["schedule"]: c for c in cases if c["system"] == "zerotrain" and c["m"] == 4}
    assert sorted(at_m4) == sorted(sched.SCHEDULES)
    for name, case in at_m4.items():
        # the engine accepts the case as built: its chunks per rank and their placement
        sched.check_schedule(name, case.get("virtual", 1), case.get("layout", "looped"))
        if name in sched.MULTI_STAGE_SCHEDULES:
            assert case["virtual"] == 2, name
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names))
    assert {"ds_m4", "ds_m8", "zt_1f1b_m8", "dp_m4", "dp_m8", "dp_gas1"} <= set(names)
    with pytest.raises(SystemExit, match="--schedules: 'nope'"):
        bench._cases(_args(schedules="nope"))
    with pytest.raises(SystemExit, match="--only: no case named"):
        bench._cases(_args(only="zt_1f1b_m4,nope"))


def test_pipeline_and_data_parallel_cases_train_alike(tmp_path):
    bench = _bench()
    out = bench.main(
        [
            "--rounds",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--batch",
            "8",
            "--seq",
            "8",
            "--hidden",
            "16",
            "--heads",
            "2",
            "--layers",
            "2",
            "--vocab",
            "32",
            "--only",
            "zt_1f1b_m4,dp_gas1",
            "--json",
            str(tmp_path / "out.json"),
        ]
    )
    runs = {r["case"]: r for r in out["runs"]}
    assert set(runs) == {"zt_1f1b_m4", "dp_gas1"}
    pipe, dp = runs["zt_1f1b_m4"]["losses"], runs["dp_gas1"]["losses"]
    assert len(pipe) == len(dp) == 3
    assert pipe == pytest.approx(dp, rel=1e-5)
    assert all(r["samples_per_s"] > 0 for r in out["runs"])
    # the breakdown launch of the pipeline case: every stage's busy + comm + idle within its schedule span
    (breakdown,) = out["breakdowns"]
    assert sorted(r["stage"] for r in breakdown["ranks"]) == [0, 1]
    for rank in breakdown["ranks"]:
        for row in rank["breakdown"]:
            assert row["busy"] + row["comm"] + row["idle"] == pytest.approx(row["schedule"], rel=1e-6, abs=1e-6)
            assert row["total"] >= row["schedule"]
