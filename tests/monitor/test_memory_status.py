"""memory_status / see_memory_usage on CPU: RSS, peak RSS and the engine's bytes, checked."""

from __future__ import annotations

import contextlib
import io
import logging
import re

from tests.engine.workloads import adamw_config, global_batches, make_model
from zerotrain.testing import run_on_ranks

GB = 1024**3


def _report():
    import resource

    import psutil

    import zerotrain

    model = make_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=adamw_config(2))
    batch = global_batches(1, 2)[0]
    engine.backward(engine(batch, labels=batch).loss)
    engine.step()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rss_before = psutil.Process().memory_info().rss
        stats = zerotrain.memory_status("after step")
        peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rss_after = psutil.Process().memory_info().rss
        skipped = zerotrain.memory_status("not me", print_rank=1)
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    logging.getLogger("zerotrain").addHandler(handler)
    zerotrain.see_memory_usage("quiet")  # force=False: nothing
    zerotrain.see_memory_usage("forced", force=True)
    logging.getLogger("zerotrain").removeHandler(handler)
    n = sum(p.numel() for p in model.parameters())
    return {
        "stats": stats,
        "printed": stdout.getvalue(),
        "skipped": skipped,
        "peak_after": peak_after,
        "rss_range": (min(rss_before, rss_after), max(rss_before, rss_after)),
        "breakdown": engine.memory_breakdown(),
        "n_params": n,
        "logs": logs.getvalue(),
    }


def test_cpu_memory_status_matches_breakdown_and_getrusage():
    (r,) = run_on_ranks(_report, 1)
    stats, breakdown, n = r["stats"], r["breakdown"], r["n_params"]
    assert stats["device"] == "cpu"
    assert stats["engine"] == breakdown
    assert breakdown["parameters"] == 4 * n and breakdown["gradients"] == 4 * n  # fp32, stage 0
    assert breakdown["optimizer_state"] >= 8 * n  # AdamW's two moments
    lo, hi = r["rss_range"]
    assert lo - 2**20 <= stats["rss"] <= hi + 2**20  # psutil's RSS, read within the call
    # getrusage's peak (it only grows; the kernel may fold the current RSS in a few pages late)
    assert stats["rss"] <= stats["max_rss"] <= max(r["peak_after"], hi)
    assert r["peak_after"] - stats["max_rss"] < 64 * 2**20
    line = r["printed"].strip()
    assert r["skipped"] is None and line.count("\n") == 0  # print_rank=1 printed nothing on rank 0
    m = re.fullmatch(
        r"RANK=0 MEMSTATS after step device=cpu current rss=([\d.]+)GB "
        r"\(delta=([-\d.]+)GB max=([\d.]+)GB\) engine=([\d.]+)GB \((.*)\)",
        line,
    )
    assert m, line
    assert float(m[1]) == round(stats["rss"] / GB, 4) and float(m[3]) == round(stats["max_rss"] / GB, 4)
    assert float(m[2]) == round(stats["rss"] / GB, 4)  # first call: delta from zero
    assert float(m[4]) == round(sum(breakdown.values()) / GB, 4)
    printed = dict(item.split("=") for item in m[5].split())
    assert printed == {k: f"{v / GB:0.4f}GB" for k, v in breakdown.items()}
    assert "quiet" not in r["logs"] and "forced" in r["logs"]
    assert "Max_RSS" in r["logs"] and "CPU Virtual Memory:  used = " in r["logs"]
