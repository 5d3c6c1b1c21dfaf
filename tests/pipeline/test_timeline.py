"""Seed 001's view of idle time: ``"pipeline": {"timeline": true}`` records each stage's forward
and backward per ``train_batch``; busy/idle per stage beside the ideal bubble (P-1)/(M+P-1).

One spawned group (P=2, gloo) checks, for 1F1B and GPipe at M=4 and GPipe at M=1 (naive model
parallelism):
- the events are consistent: per stage M forwards and M backwards, in the schedule's order
  (1F1B: stage 0 ``F F B F B F B B``, stage 1 ``F B F B F B F B``; GPipe: all F then all B), no
  two events of a stage overlapping, every event inside the batch; every stage holds the same
  gathered timeline;
- the summary: busy = the stage's event time, idle share = 1 - busy / duration exactly;
- M=1: the shares against the formula, from the same measurements, with no speed threshold. One
  micro-batch crosses the stages one after the other, and stage 0's span runs from before its
  forward to after its backward, so the batch lasts at least every stage's busy time together:
  each stage's idle share is at least the other stages' busy time over the duration, and the
  mean idle share at least (P-1)/P, the formula at M=1;
- timing changes nothing: weights bitwise equal to the same run with the timeline off;
- DeepSpeed's step line (``steps: N loss: L iter time (s): T samples/sec: S``) and zerotrain's
  busy/idle line, the monitor events on the first stage only, ``pipeline_timeline()`` refusing
  with the timeline off.
The picture writers run on a recorded timeline: the SVG's boxes and colours, the PNG's size and
colours, the command line and its one-line errors.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import sys

import pytest
import torch
from torch import nn

from zerotrain.pipeline import timeline as tl
from zerotrain.testing import run_on_ranks

WIDTH, LAYERS, MICRO = 64, 4, 16


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    out = []
    for _ in range(LAYERS):
        out += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return out


def _batches(m: int, steps: int) -> list:
    g = torch.Generator().manual_seed(3)
    return [
        [(torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)) for _ in range(m)]
        for _ in range(steps)
    ]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


LOSS_SLEEP = 0.01


def _slow_loss(outputs, labels):
    """The loss counts as the last stage's forward: each forward lasts at least this sleep."""
    import time

    time.sleep(LOSS_SLEEP)
    return nn.functional.mse_loss(outputs, labels)


def _run(schedule: str, m: int, timeline: bool, out_dir: str, steps: int = 2, slow_loss: bool = False) -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    loss_fn = _slow_loss if slow_loss else nn.functional.mse_loss
    model = PipelineModule(_layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    rank = model.mpu().get_pipe_parallel_rank()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": m,
        "train_batch_size": MICRO * m,
        "steps_per_print": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "pipeline": {"schedule": schedule, "timeline": timeline},
        "csv_monitor": {"enabled": timeline, "output_path": out_dir, "job_name": f"{schedule}{m}_stage{rank}"},
    }
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    handler = _Lines()
    logging.getLogger("zerotrain").addHandler(handler)
    try:
        for step in _batches(m, steps):
            engine.train_batch(iter(step))
    finally:
        logging.getLogger("zerotrain").removeHandler(handler)
    out = {
        "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "lines": handler.lines,
        "stage": engine.stage_id,
    }
    if timeline:
        out["events"] = [tuple(e) for e in engine.pipeline_timeline()]
        out["bubble"] = engine.pipeline_bubble()
        if engine.is_first_stage():
            path = os.path.join(out_dir, f"{schedule}{m}.json")
            engine.save_pipeline_timeline(path)
            out["file"] = path
    else:
        errors = []
        for call in (engine.pipeline_timeline, engine.pipeline_bubble):
            try:
                call()
            except ValueError as error:
                errors.append(str(error))
        out["errors"] = errors
    from torch.distributed.pipelining import schedules

    out["wait_wrapped"] = getattr(schedules._wait_batch_p2p, "_zerotrain_timed", False)
    engine.destroy()
    out["wait_wrapped_after_destroy"] = getattr(schedules._wait_batch_p2p, "_zerotrain_timed", False)
    return out


def _ranks(out_dir: str) -> dict:
    import zerotrain

    zerotrain.init_distributed()
    results = {}
    for schedule, m in (("1f1b", 4), ("gpipe", 4), ("gpipe", 1)):
        results[(schedule, m)] = _run(
            schedule, m, True, out_dir, steps=3 if m == 1 else 2, slow_loss=schedule == "gpipe" and m == 4
        )
    results["off"] = _run("1f1b", 4, False, out_dir)
    return results


def _order(schedule: str, m: int, stage: int, p: int = 2) -> list[str]:
    if schedule == "gpipe":
        return ["forward"] * m + ["backward"] * m
    warmup = min(m, p - stage)
    kinds = ["forward"] * warmup
    for i in range(m):
        kinds.append("backward")
        if warmup + i < m:
            kinds.append("forward")
    return kinds


def _check_timeline(schedule: str, m: int, results: list, comm_events: list) -> dict:
    bubble = results[0][(schedule, m)]["bubble"]
    events = [tl.PipelineEvent(*e) for e in results[0][(schedule, m)]["events"]]
    for res in results[1:]:  # every stage holds the same gathered timeline
        assert res[(schedule, m)]["events"] == results[0][(schedule, m)]["events"]
        assert res[(schedule, m)]["bubble"] == bubble
    duration = bubble["duration"]
    assert bubble["num_stages"] == 2 and bubble["micro_batches"] == m
    assert bubble["ideal_bubble"] == pytest.approx(1 / (m + 1))
    for s in range(2):
        everything = [e for e in events if e.stage == s]
        mine = [e for e in everything if e.kind in tl.COMPUTE]
        comm = [e for e in everything if e.kind == "comm"]
        assert {e.kind for e in everything} <= set(tl.KINDS)
        assert [e.kind for e in mine] == _order(schedule, m, s), (schedule, m, s, [e.kind for e in mine])
        # comm events (the p2p waits past the neighbour's computation) and compute never overlap
        for a, b in zip(everything, everything[1:]):
            assert a.start <= a.end <= b.start <= b.end, (schedule, m, s, a, b)
        assert all(0.0 <= e.start <= e.end <= duration for e in everything), (schedule, m, s)
        # between the stages: stage 1 receives every micro-batch's activations, stage 0 every
        # gradient. Whether a given stage's waits leave comm is timing: a receive can find its
        # data already there, and a wait shorter than the stages' clock skew (the barrier's
        # exit; longer on a loaded machine, as with two test files at a time) leaves none.
        # test_timeline_p2 counts them over every run.
        comm_events[0] += len(comm)
        other = [e for e in events if e.stage != s and e.kind in tl.COMPUTE]
        for c in comm:  # the other stage's computation had ended: no end of one falls inside
            assert not [e for e in other if c.start < e.end < c.end], (c, other)
        row = bubble["stages"][s]
        busy = sum(e.end - e.start for e in mine)
        assert row["busy"] == pytest.approx(busy, rel=1e-12, abs=1e-12)
        assert row["comm"] == pytest.approx(sum(e.end - e.start for e in comm), rel=1e-12, abs=1e-12)
        assert (row["comm"] > 0.0) == bool(comm)
        assert row["weight"] == 0.0  # no weight steps: full backwards
        assert row["forward"] + row["backward"] == pytest.approx(busy, rel=1e-12)
        assert row["idle"] == pytest.approx(duration - row["busy"] - row["comm"], rel=1e-12, abs=1e-12)
        assert row["idle_share"] == pytest.approx(row["idle"] / duration, rel=1e-12, abs=1e-12)
        assert row["comm_share"] == pytest.approx(row["comm"] / duration, rel=1e-12, abs=1e-12)
        assert 0.0 < row["busy"] < duration
    return bubble


def _check_lines(lines: list[str], m: int, steps: int, first: bool) -> None:
    ds = [line for line in lines if line.startswith("steps: ")]
    if not first:  # DeepSpeed prints on global rank 0
        assert ds == []
        return
    assert len(ds) == steps, lines
    for n, line in enumerate(ds, 1):
        assert re.fullmatch(
            rf"steps: {n} loss: \d+\.\d{{4}} iter time \(s\): \d+\.\d{{3}} "
            r"samples/sec: \d+\.\d{3}",
            line,
        ), line
    ours = [line for line in lines if line.startswith("pipeline batch ")]
    assert len(ours) == steps
    assert f"(P=2, M={m}, ideal bubble {1 / (m + 1):.1%})" in ours[-1]
    assert "stage 0: busy " in ours[-1] and "stage 1: busy " in ours[-1]
    assert re.search(r"stage 1: busy \d+\.\d comm \d+\.\d idle \d+\.\d \(\d+\.\d%\)", ours[-1]), ours[-1]


def _check_monitor(out_dir: str, schedule: str, m: int, bubble: dict, steps: int) -> None:
    first = os.path.join(out_dir, f"{schedule}{m}_stage0")
    with open(os.path.join(first, "Train_Pipeline_stage1_idle_share.csv")) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "stage1_idle_share"] and len(rows) == 1 + steps
    assert [int(r[0]) for r in rows[1:]] == [MICRO * m * (i + 1) for i in range(steps)]
    assert float(rows[-1][1]) == pytest.approx(bubble["stages"][1]["idle_share"], rel=1e-12)
    with open(os.path.join(first, "Train_Pipeline_stage0_comm_ms.csv")) as f:
        assert float(list(csv.reader(f))[-1][1]) == pytest.approx(bubble["stages"][0]["comm"] * 1e3, rel=1e-9)
    with open(os.path.join(first, "Train_Pipeline_ideal_bubble.csv")) as f:
        assert float(list(csv.reader(f))[-1][1]) == pytest.approx(1 / (m + 1))
    other = os.path.join(out_dir, f"{schedule}{m}_stage1")  # the first stage alone writes them
    assert not any(name.startswith("Train_Pipeline") for name in os.listdir(other))


def test_timeline_p2(tmp_path):
    results = run_on_ranks(_ranks, world_size=2, args=(str(tmp_path),), timeout=600)
    assert [r["off"]["stage"] for r in results] == [0, 1]
    for res in results:  # the timeline wraps torch's p2p wait while on; destroy() gives it back
        assert res[("1f1b", 4)]["wait_wrapped"] and not res[("1f1b", 4)]["wait_wrapped_after_destroy"]
        assert not res["off"]["wait_wrapped"]
    comm_events = [0]
    for schedule, m in (("1f1b", 4), ("gpipe", 4), ("gpipe", 1)):
        bubble = _check_timeline(schedule, m, results, comm_events)
        steps = 3 if m == 1 else 2
        for res in results:
            _check_lines(res[(schedule, m)]["lines"], m, steps, first=res[(schedule, m)]["stage"] == 0)
        _check_monitor(str(tmp_path), schedule, m, bubble, steps)
        if m == 1:  # naive model parallelism: bounds from the same measurements
            rows, duration = bubble["stages"], bubble["duration"]
            for s in range(2):
                others = sum(r["busy"] for r in rows if r["stage"] != s)
                not_busy = rows[s]["idle_share"] + rows[s]["comm_share"]
                assert not_busy >= others / duration - 1e-9, (s, rows)
            mean = sum(r["idle_share"] + r["comm_share"] for r in rows) / 2
            assert mean >= tl.ideal_bubble(2, 1) - 1e-9, rows
    assert comm_events[0] > 0  # the waits on the neighbour's transfers are recorded as comm
    # The last stage's loss is part of its forward (a lower bound: the loss sleeps).
    forwards = [tl.PipelineEvent(*e) for e in results[0][("gpipe", 4)]["events"]]
    assert all(e.end - e.start >= LOSS_SLEEP for e in forwards if e.stage == 1 and e.kind == "forward")
    # Timing changes nothing: the same weights as the run with the timeline off.
    for res in results:
        for name, value in res["off"]["weights"].items():
            assert torch.equal(res[("1f1b", 4)]["weights"][name], value), name
        assert len(res["off"]["errors"]) == 2
        assert all('"pipeline": {"timeline": true}' in e for e in res["off"]["errors"])
        assert not any(line.startswith("pipeline batch ") for line in res["off"]["lines"])
    assert [line.startswith("steps: 2 loss: ") for line in results[0]["off"]["lines"]].count(True) == 1
    # The recorded file round-trips.
    doc = tl.load_timeline(results[0][("1f1b", 4)]["file"])
    assert [tuple(e) for e in doc["events"]] == results[0][("1f1b", 4)]["events"]
    assert doc["schedule"] == "1f1b" and doc["micro_batches"] == 4 and doc["num_stages"] == 2


# -- the picture writers, on a recorded timeline --------------------------------------------
def _recorded(path) -> str:
    """A 1F1B timeline at P=2, M=4 (recorded by the engine, rounded)."""
    events = [
        (0, "forward", 0.0, 1.0),
        (0, "forward", 1.0, 2.0),
        (0, "backward", 4.2, 6.2),
        (0, "forward", 6.2, 7.2),
        (0, "backward", 7.3, 9.3),
        (0, "forward", 9.3, 10.3),
        (0, "backward", 10.4, 12.4),
        (0, "backward", 13.4, 15.4),
        (1, "forward", 1.1, 2.1),
        (1, "backward", 2.1, 4.1),
        (1, "forward", 4.2, 5.2),
        (1, "backward", 5.2, 7.2),
        (1, "forward", 7.3, 8.3),
        (1, "backward", 8.3, 10.3),
        (1, "forward", 10.3, 11.3),
        (1, "backward", 11.3, 13.3),
    ]
    events.sort(key=lambda e: (e[0], e[2]))
    events = [tl.PipelineEvent(s, k, a / 1e3, b / 1e3) for s, k, a, b in events]
    tl.save_timeline(path, events, num_stages=2, micro_batches=4, duration=15.5e-3, schedule="1f1b")
    return str(path)


def test_svg_picture(tmp_path):
    src = _recorded(tmp_path / "t.json")
    out = tmp_path / "t.svg"
    assert tl.main([src, "--out", str(out)]) == 0
    svg = out.read_text()
    assert svg.startswith("<svg") and 'width="960"' in svg
    fills = re.findall(r'<rect [^>]*fill="(#[0-9a-f]{6})"', svg)
    # one idle bar per stage + 8 forward and 8 backward boxes + one legend swatch each
    assert fills.count(tl.COLOURS["forward"]) == 8 + 1
    assert fills.count(tl.COLOURS["backward"]) == 8 + 1
    assert fills.count(tl.COLOURS["idle"]) == 2 + 1
    assert "stage 0" in svg and "stage 1" in svg and "15.5 ms" in svg
    assert "1f1b: P=2 M=4" in svg and "(ideal 20%)" in svg


def test_png_picture(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    src = _recorded(tmp_path / "t.json")
    out = tmp_path / "t.png"
    assert tl.main([src, "--out", str(out)]) == 0
    assert "pipeline batch 15.5 ms (P=2, M=4, ideal bubble 20.0%)" in capsys.readouterr().out
    image = matplotlib.image.imread(str(out))
    assert image.shape[:2] == (int((0.7 * 2 + 1.4) * 100), 1000)
    pixels = {tuple(round(float(c) * 255) for c in px[:3]) for px in image.reshape(-1, image.shape[-1])}
    for colour in tl.COLOURS.values():
        rgb = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
        assert rgb in pixels, colour


def test_picture_errors(tmp_path, capsys, monkeypatch):
    src = _recorded(tmp_path / "t.json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    assert tl.main([src, "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install matplotlib" in err
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"num_stages": 2, "micro_batches": 1, "duration": 1.0, "events": [[0, "sleep", 0.0, 1.0]]})
    )
    assert tl.main([str(bad), "--out", str(tmp_path / "b.svg")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown kind" in err
    (tmp_path / "junk.json").write_text("{")
    assert tl.main([str(tmp_path / "junk.json"), "--out", str(tmp_path / "j.svg")]) == 2
    assert "not a pipeline timeline" in capsys.readouterr().err


def test_split_waits():
    """A raw wait is comm from the end of the neighbour's computation that ended nearest the wait's
    end (of those started before it); before that the stage waited for the neighbour (idle). A wait
    with no such computation is all comm; one whose computation seems to end after it (the
    clocks' skew) has none."""
    W = tl._WAIT
    raw = [
        tl.PipelineEvent(0, "forward", 0.0, 1.0),
        tl.PipelineEvent(0, W, 1.0, 4.5),
        tl.PipelineEvent(0, "backward", 4.5, 6.0),
        tl.PipelineEvent(1, W, 0.0, 1.25),
        tl.PipelineEvent(1, "forward", 1.25, 2.25),
        tl.PipelineEvent(1, "backward", 2.25, 4.0),
        tl.PipelineEvent(1, W, 4.0, 4.25),
        tl.PipelineEvent(1, W, 6.0, 6.5),
    ]
    out = tl.split_waits(raw, 2)
    comm = [e for e in out if e.kind == "comm"]
    assert comm == [
        tl.PipelineEvent(0, "comm", 4.0, 4.5),  # after stage 1's backward
        tl.PipelineEvent(1, "comm", 1.0, 1.25),  # after stage 0's forward
        tl.PipelineEvent(1, "comm", 4.0, 4.25),  # its own send: stage 0 computed before 4.0
        tl.PipelineEvent(1, "comm", 6.0, 6.5),
    ]  # wait after the neighbour's last computation
    assert [e for e in out if e.kind != "comm"] == sorted(
        [e for e in raw if e.kind != W], key=lambda e: (e.stage, e.start)
    )
    assert tl.split_waits([tl.PipelineEvent(0, W, 0.0, 1.0)], 2) == [tl.PipelineEvent(0, "comm", 0.0, 1.0)]
    skewed = [
        tl.PipelineEvent(1, "forward", 0.0, 1.0),
        tl.PipelineEvent(1, "backward", 1.0, 2.0001),
        tl.PipelineEvent(0, W, 0.5, 2.0),
    ]
    assert tl.split_waits(skewed, 2) == skewed[:2]  # waited for the backward: no comm
    summary = tl.summarize(out, 2, 1, 6.5)
    row = summary["stages"][0]
    assert row["busy"] == 2.5 and row["comm"] == 0.5 and row["idle"] == 3.5
    assert row["idle_share"] == 3.5 / 6.5 and row["comm_share"] == 0.5 / 6.5
