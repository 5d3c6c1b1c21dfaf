"""The comms logger: what it records for real ZeRO steps, its table, and that off means off."""

from __future__ import annotations

import io
import logging

import pytest

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.comm import collectives
from zerotrain.comm import group as comm_group
from zerotrain.comm import logger as comm_logger
from zerotrain.comm.hooks import Call
from zerotrain.comm.logger import CommsLogger, calc_bw_log, convert_size, trim_mean
from zerotrain.testing import run_on_ranks

BUCKET = 3000  # elements: the tiny GPT (~31k parameters) then has many gradient buckets


def _one_step(engine, rank: int) -> None:
    batch = global_batches(1, 4)[0][rank * 2 : rank * 2 + 2]
    loss = engine(batch, labels=batch).loss
    engine.backward(loss)
    engine.step()


def _logged_steps():
    """A stage-0 and a stage-2 step with the comms logger on; what each logged."""
    import torch
    import torch.distributed as dist

    import zerotrain
    from zerotrain.comm import comms_logger

    rank, out = dist.get_rank() if dist.is_initialized() else 0, {}
    originals = {name: getattr(collectives, name) for name in _FUNCTIONS}
    for stage in (0, 2):
        model = make_model()
        cfg = adamw_config(
            2,
            zero_optimization={"stage": stage, "reduce_bucket_size": BUCKET},
            comms_logger={"enabled": True, "prof_all": True},
        )
        engine, _, _, _ = zerotrain.initialize(model=model, config=cfg)
        rank = dist.get_rank()
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        broadcast = comms_logger.summary()["ops"].get("broadcast", {})
        comms_logger.reset()
        _one_step(engine, rank)
        summary = zerotrain.comm.log_summary()
        out[stage] = {
            "n_params": n_params,
            "broadcast_bytes": sum(size * row["count"] for size, row in broadcast.items()),
            "model_bytes": sum(
                t.numel() * t.element_size()
                for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
            ),
            "summary": summary,
            "padded_numel": (sum(u.layout.padded_numel for u in engine._zero.units) if stage == 2 else None),
            "units": len(engine._zero.units) if stage == 2 else None,
        }
        engine.destroy()
        # destroy() removed the logger's hook (this engine's config enabled it): a collective
        # after it is not logged, and the functions were never replaced.
        before = comms_logger.summary()["ops"]
        zerotrain.comm.all_reduce(torch.ones(3))
        out[stage]["after_destroy"] = {
            "enabled": comms_logger.enabled,
            "hooked": comms_logger in comm_group.process_hooks(),
            "unchanged": comms_logger.summary()["ops"] == before,
            "originals": all(
                getattr(collectives, n) is originals[n] and getattr(zerotrain.comm, n) is originals[n]
                for n in _FUNCTIONS
            ),
        }
    zerotrain.comm.configure(enabled=False)
    out["restored"] = collectives.all_reduce is originals["all_reduce"]
    return out


_FUNCTIONS = ("all_reduce", "broadcast", "all_gather_into", "reduce_scatter_into", "all_to_all_single", "barrier")


@pytest.fixture(scope="module")
def logged():
    return run_on_ranks(_logged_steps, 2)


def _bytes(summary, op):
    return sum(size * row["count"] for size, row in summary["ops"].get(op, {}).items())


def test_stage0_all_reduces_exactly_the_gradient_bytes(logged):
    for rank_out in logged:
        s0 = rank_out[0]
        rows = s0["summary"]["ops"]["all_reduce"]
        assert sum(row["count"] for row in rows.values()) > 3, "expected several gradient buckets"
        assert _bytes(s0["summary"], "all_reduce") == 4 * s0["n_params"]
        assert set(s0["summary"]["ops"]) == {"all_reduce"}
        # initialize() broadcast rank 0's parameters and buffers once, each byte once
        assert s0["broadcast_bytes"] == s0["model_bytes"]
        assert rank_out["restored"]
        for stage in (0, 2):
            assert rank_out[stage]["after_destroy"] == {
                "enabled": False,
                "hooked": False,
                "unchanged": True,
                "originals": True,
            }


def test_stage2_reduce_scatters_and_gathers_the_padded_units(logged):
    for rank_out in logged:
        s2 = rank_out[2]
        padded_bytes = 4 * s2["padded_numel"]
        assert padded_bytes >= 4 * s2["n_params"]
        assert s2["padded_numel"] - s2["n_params"] < s2["units"] * 2 * 4  # 16-byte shard alignment
        assert _bytes(s2["summary"], "reduce_scatter_tensor") == padded_bytes
        assert _bytes(s2["summary"], "all_gather_into_tensor") == padded_bytes
        assert "all_reduce" not in s2["summary"]["ops"]  # no clipping: no norm all-reduce


def test_rows_follow_the_bandwidth_formulas(logged):
    summary = logged[0][0]["summary"]
    for size, row in summary["ops"]["all_reduce"].items():
        lats = row["latencies_ms"]
        assert row["count"] == len(lats) and row["total_latency_ms"] == pytest.approx(sum(lats))
        algbw = trim_mean([size / lat * 8 / 1e6 for lat in lats], 0.1)
        assert row["algbw_gbps"] == pytest.approx(algbw)
        assert row["busbw_gbps"] == pytest.approx(algbw * 2 * (2 - 1) / 2)  # n = 2
    assert 0 < summary["wait_ms"] < summary["wall_ms"]
    assert summary["wait_share"] == pytest.approx(summary["wait_ms"] / summary["wall_ms"])
    assert "Waiting in collectives:" in summary["table"]


def test_nccl_tests_bus_bandwidth_factors():
    size, ms = 2**30, 100.0  # 1 GiB in 100 ms = 85.9 Gbps algorithmic
    algbw = size / ms * 8 / 1e6
    assert calc_bw_log("all_reduce", size, ms, 4) == pytest.approx((algbw, algbw * 2 * 3 / 4))
    assert calc_bw_log("all_gather_into_tensor", size, ms, 4) == pytest.approx((algbw, algbw * 3 / 4))
    assert calc_bw_log("reduce_scatter_tensor", size, ms, 8) == pytest.approx((algbw, algbw * 7 / 8))
    assert calc_bw_log("broadcast", size, ms, 4) == pytest.approx((algbw, algbw))
    assert calc_bw_log("barrier", 0, ms, 4) == (0.0, 0.0)


def test_table_has_deepspeeds_layout_and_numbers(capsys):
    log = CommsLogger()
    size = 4 * 2**20
    for latency in (1.0, 2.0, 3.0):
        log.append("broadcast", "broadcast", latency, size)
    log.append("all_reduce", "all_reduce", 0.5, 4096)
    data = log.log_all(print_log=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "Comm. Op            Message Size        Count               Total Latency(ms)   "
        "Avg Latency(ms)     tput_avg (Gbps)     busbw_avg (Gbps)    "
    )
    assert lines[1] == "broadcast"
    cols = [lines[2][i : i + 20].strip() for i in range(0, 140, 20)]
    algbw = sum(size / lat * 8 / 1e6 for lat in (1.0, 2.0, 3.0)) / 3
    assert cols == ["", "4.0 MB", "3", "6.00", "2.00", f"{algbw:.2f}", f"{algbw:.2f}"]
    assert lines[3] == "all_reduce" and lines[4][20:40].strip() == "4.0 KB"
    assert data["ops"]["broadcast"][size]["algbw_gbps"] == pytest.approx(algbw)
    assert [convert_size(n) for n in (0, 1023, 113.27 * 2**10, 1.24 * 2**30)] == [
        "0B",
        "1023.0 B",
        "113.27 KB",
        "1.24 GB",
    ]
    assert trim_mean(list(range(10)), 0.1) == pytest.approx(4.5)  # drops 0 and 9


def test_disabled_logger_is_no_hook_and_the_functions_never_change():
    from zerotrain import comm

    originals = {name: getattr(collectives, name) for name in _FUNCTIONS}
    for name, fn in originals.items():
        assert fn.__module__ == "zerotrain.comm.collectives"
        assert getattr(comm, name) is fn
    assert comm.comms_logger not in comm_group.process_hooks()
    comm.configure(enabled=True)
    try:
        assert comm.comms_logger in comm_group.process_hooks()
        for name, fn in originals.items():
            assert getattr(collectives, name) is fn and getattr(comm, name) is fn
    finally:
        comm.configure(enabled=False)
    assert comm.comms_logger not in comm_group.process_hooks()  # off: no work per call
    for name, fn in originals.items():
        assert getattr(collectives, name) is fn and getattr(comm, name) is fn


def test_release_disables_only_what_the_config_enabled():
    from zerotrain import comm
    from zerotrain.config import load_config

    engine_a, engine_b = (load_config({"train_batch_size": 1, "comms_logger": {"enabled": True}}) for _ in "ab")
    try:
        comm.configure(engine_a)
        comm.configure(engine_b)
        comm_logger.release(engine_a)
        assert comm.comms_logger.enabled  # engine_b still holds it
        comm_logger.release(engine_b)
        assert not comm.comms_logger.enabled and comm.comms_logger not in comm_group.process_hooks()
        comm.configure(enabled=True)  # a script's switch is not an engine's to undo
        comm.configure(engine_a)
        comm_logger.release(engine_a)
        assert comm.comms_logger.enabled
    finally:
        comm.configure(enabled=False)


def test_prof_ops_filters_and_verbose_prints_each_op():
    log = CommsLogger()
    log.configure({"enabled": False, "prof_all": False, "prof_ops": ["all_gather_into"], "verbose": True})
    assert log.prof_ops == ["all_gather_into_tensor"]  # zerotrain's name maps to DeepSpeed's
    calls = []
    log.run(Call("broadcast", 8, None, 1, False), lambda: calls.append(1))
    assert calls == [1] and log.comms_dict == {}
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("zerotrain").addHandler(handler)
    try:
        log.run(Call("all_gather_into_tensor", 2048, None, 2, False), lambda: None)
    finally:
        logging.getLogger("zerotrain").removeHandler(handler)
    assert log.comms_dict["all_gather_into_tensor"][2048][0] == 1
    assert "comm op: all_gather_into_tensor | time (ms): " in stream.getvalue()
    assert "msg size: 2.0 KB" in stream.getvalue()


def _logged_stage3_step():
    """One ZeRO-3 step of the tiny GPT (tied embeddings) with the comms logger on."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.comm import comms_logger

    model = make_model()
    cfg = adamw_config(
        2,
        zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 0},
        comms_logger={"enabled": True, "prof_all": True},
    )
    engine, _, _, _ = zerotrain.initialize(model=model, config=cfg)
    comms_logger.reset()
    _one_step(engine, dist.get_rank())
    summary = zerotrain.comm.log_summary()
    units = engine._zero.units
    wte_unit = zerotrain.zero.registry.unit_of(model.wte.weight)
    zerotrain.comm.configure(enabled=False)
    return {
        "summary": summary,
        "partitioned": sum(u.layout.padded_numel for u in units if u.resharded),
        "persistent": sum(u.layout.padded_numel for u in units if not u.resharded),
        "wte": wte_unit.layout.padded_numel,
        "wpe": zerotrain.zero.registry.unit_of(model.wpe.weight).layout.padded_numel,
    }


def test_stage3_gathers_each_unit_for_forward_and_backward():
    for out in run_on_ranks(_logged_stage3_step, 2):
        s = out["summary"]
        # Every unit's gradients are reduce-scattered once, partitioned or not.
        assert _bytes(s, "reduce_scatter_tensor") == 4 * (out["partitioned"] + out["persistent"])
        # Partitioned units are gathered for forward and again for backward, but the position
        # embedding's (its backward reads ids only); the tied embedding once more, when lm_head
        # reads it in forward; persistent units after the step. (This first step records the
        # orders: later steps keep lm_head's unit from forward into backward,
        # tests/zero/test_stage3_gathers_saved.py.)
        expected = 2 * out["partitioned"] - out["wpe"] + out["wte"] + out["persistent"]
        # Each embedding's first forward also gathers every rank's token count (int64): too
        # many tokens for a lookup from the shards in this tiny table, so the table is gathered
        # (zero/embedding_lookup.py), and the counts are not exchanged again.
        counts = 2 * 2 * 8
        assert _bytes(s, "all_gather_into_tensor") == 4 * expected + counts
