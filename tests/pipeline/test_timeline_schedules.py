"""Each schedule's ideal bubble in the pipeline bubble report (no processes spawned).

- The closed forms: GPipe/1F1B (P-1)/(M+P-1); interleaved 1F1B and looped BFS with V chunks per
  rank 1 - V*M/(V*max(M,P) + min(M,P) - 1), i.e. (P-1)/(V*M+P-1) for M >= P (Narayanan et al.
  2021) and 1 - V*M/(V*P+M-1) for M < P; the split-backward schedules (zero_bubble, zbv,
  dualpipev) have none: None ("n/a" in the line) and a reason, never a number.
- The looped formulas against torch's own action orders: every rank runs its actions (torch's
  ``_calculate_single_rank_operations``) in order, each starting once its rank is free and its
  input is ready (the previous virtual stage's forward, the next one's backward), with equal
  chunks and free communication; each rank's idle share over the span is the formula, for
  T_B = T_F and T_B = 2 T_F, at every (P, V, M) below (M a multiple of P, M < P, and torch's
  flexible rounds such as P=4, M=10).
- The log line, the monitor events (``ideal_bubble`` only with a closed form, ``idle_share``
  always), the file's ``virtual_stages`` and the picture's title, older files without it.
"""

from __future__ import annotations

import json

import pytest

from zerotrain.pipeline import timeline as tl
from zerotrain.pipeline.schedule import SCHEDULES

CASES = [
    (2, 2, 4),
    (2, 2, 2),
    (2, 2, 1),
    (2, 2, 3),
    (2, 3, 6),
    (3, 2, 4),
    (3, 2, 5),
    (4, 2, 8),
    (4, 2, 4),
    (4, 2, 2),
    (4, 2, 5),
    (4, 2, 10),
    (4, 3, 3),
    (4, 3, 8),
]


def test_closed_forms():
    for p, m in ((2, 1), (2, 4), (4, 8), (4, 3)):
        for schedule in ("gpipe", "1f1b"):
            assert tl.ideal_bubble(p, m, schedule) == (p - 1) / (m + p - 1)
            assert tl.bubble_formula(p, m, schedule) == "(P-1)/(M+P-1)"
    assert tl.ideal_bubble(2, 4) == 0.2  # the old call: 1F1B
    for schedule in ("interleaved_1f1b", "looped_bfs"):
        assert tl.ideal_bubble(2, 4, schedule, 2) == pytest.approx(1 / 9, abs=1e-15)
        assert tl.ideal_bubble(4, 8, schedule, 2) == pytest.approx(3 / 19, abs=1e-15)
        assert tl.ideal_bubble(4, 8, schedule, 3) == pytest.approx(3 / 27, abs=1e-15)
        assert tl.bubble_formula(4, 8, schedule, 2) == "(P-1)/(V*M+P-1)"
        assert tl.ideal_bubble(4, 2, schedule, 2) == pytest.approx(1 - 4 / 9, abs=1e-15)  # M < P
        assert tl.bubble_formula(4, 2, schedule, 2) == "1-V*M/(V*P+M-1)"
        assert tl.ideal_bubble(4, 8, schedule, 1) == pytest.approx(3 / 11, abs=1e-15)  # V=1: 1F1B's
        assert tl.ideal_bubble(4, 8, schedule, 0) is None  # V unknown (an older file)
    for schedule in ("zero_bubble", "zbv", "dualpipev"):
        assert tl.ideal_bubble(2, 4, schedule, 2) is None
        assert tl.bubble_formula(2, 4, schedule, 2) == tl.NO_CLOSED_FORM[schedule]
        assert "T_F=T_B=T_W" in tl.NO_CLOSED_FORM[schedule] or "T_W" in tl.NO_CLOSED_FORM[schedule]
    assert tl.ideal_bubble(2, 4, "gpipe", 2) is None  # a one-chunk schedule with chunks: no claim
    # every schedule the engine offers has a number or a reason
    for schedule in SCHEDULES:
        v = 2 if schedule not in ("gpipe", "1f1b") else 1
        formula = tl.bubble_formula(2, 4, schedule, v)
        assert (tl.ideal_bubble(2, 4, schedule, v) is None) == formula.startswith("n/a: ")
        assert "no ideal bubble known" not in formula, schedule


def _simulate(orders: dict, total_stages: int, forward: float, backward: float) -> list[float]:
    """Each rank's idle share when it runs ``orders[rank]`` in order, every action starting when its
    rank is free and its input is ready; communication free."""
    from torch.distributed.pipelining.schedules import _ComputationType

    done, clock, busy, nxt = {}, dict.fromkeys(orders, 0.0), dict.fromkeys(orders, 0.0), dict.fromkeys(orders, 0)
    moved = True
    while moved:
        moved = False
        for rank, actions in orders.items():
            while nxt[rank] < len(actions):
                a = actions[nxt[rank]]
                s, mb = a.stage_index, a.microbatch_index
                if a.computation_type == _ComputationType.FORWARD:
                    key, need, cost = ("F", s, mb), (("F", s - 1, mb) if s > 0 else None), forward
                else:
                    key = ("B", s, mb)
                    need = ("B", s + 1, mb) if s < total_stages - 1 else ("F", s, mb)
                    cost = backward
                if need is not None and need not in done:
                    break
                clock[rank] = max(clock[rank], done[need] if need else 0.0) + cost
                done[key], busy[rank] = clock[rank], busy[rank] + cost
                nxt[rank] += 1
                moved = True
    assert all(nxt[r] == len(orders[r]) for r in orders), "the order deadlocks"
    span = max(clock.values())
    return [1.0 - busy[r] / span for r in sorted(orders)]


def _torch_orders(cls, p: int, v: int, m: int) -> dict:
    """torch's per-rank action order for ``cls`` (its own generator, without building stages)."""
    schedule = cls.__new__(cls)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = p, v, m
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    schedule._stages = [None] * v
    return {r: [a for a in schedule._calculate_single_rank_operations(r) if a is not None] for r in range(p)}


@pytest.mark.parametrize("name", ["interleaved_1f1b", "looped_bfs"])
def test_looped_formula_matches_torch_orders(name):
    from torch.distributed.pipelining import schedules

    cls = {"interleaved_1f1b": schedules.ScheduleInterleaved1F1B, "looped_bfs": schedules.ScheduleLoopedBFS}[name]
    for p, v, m in CASES:
        if name == "interleaved_1f1b" and m % max(1, m // p):
            continue  # torch refuses it (rounds)
        orders = _torch_orders(cls, p, v, m)
        assert sum(len(a) for a in orders.values()) == 2 * p * v * m
        for backward in (1.0, 2.0):
            shares = _simulate(orders, p * v, 1.0, backward)
            assert shares == pytest.approx([tl.ideal_bubble(p, m, name, v)] * p, abs=1e-12), (p, v, m, backward)


def _summary(schedule: str, v: int) -> dict:
    events = [
        tl.PipelineEvent(0, "forward", 0.0, 1.0),
        tl.PipelineEvent(0, "backward", 2.0, 3.0),
        tl.PipelineEvent(0, "weight", 3.0, 3.5),
        tl.PipelineEvent(1, "forward", 1.0, 2.0),
        tl.PipelineEvent(1, "backward", 2.0, 3.0),
        tl.PipelineEvent(1, "comm", 3.0, 3.25),
    ]
    return tl.summarize(events, 2, 4, 4.0, schedule, v)


def test_summary_line_and_monitors():
    s = _summary("interleaved_1f1b", 2)
    assert s["schedule"] == "interleaved_1f1b" and s["virtual_stages"] == 2
    assert s["ideal_bubble"] == pytest.approx(1 / 9) and s["ideal_bubble_formula"] == "(P-1)/(V*M+P-1)"
    rows = s["stages"]
    assert rows[0]["busy"] == 2.5 and rows[0]["weight"] == 0.5  # the weight step is busy time
    assert rows[0]["idle"] == 1.5 and rows[1]["idle"] == 1.75
    assert s["idle_share"] == (1.5 / 4 + 1.75 / 4) / 2
    line = tl.describe(s)
    assert line.startswith(
        "pipeline batch 4000.0 ms (P=2, M=4, ideal bubble 11.1%) "
        "[interleaved_1f1b V=2: (P-1)/(V*M+P-1); mean idle 40.6%] | stage 0: busy 2500.0 "
    )
    events = dict((k, v) for k, v, _ in tl.monitor_events(s, 7))
    assert events["Train/Pipeline/ideal_bubble"] == s["ideal_bubble"]
    assert events["Train/Pipeline/idle_share"] == s["idle_share"]
    assert events["Train/Pipeline/stage0_idle_share"] == 1.5 / 4 and events["Train/Pipeline/batch_ms"] == 4000.0

    z = _summary("zbv", 2)
    assert z["ideal_bubble"] is None and z["ideal_bubble_formula"] == tl.NO_CLOSED_FORM["zbv"]
    line = tl.describe(z)
    assert "(P=2, M=4, ideal bubble n/a) [zbv V=2: n/a: ZB-V" in line and "mean idle 40.6%]" in line
    keys = [k for k, *_ in tl.monitor_events(z, 7)]
    assert "Train/Pipeline/ideal_bubble" not in keys and "Train/Pipeline/idle_share" in keys
    assert tl.describe(_summary("1f1b", 1)).startswith(
        "pipeline batch 4000.0 ms (P=2, M=4, ideal bubble 20.0%) [1f1b: (P-1)/(M+P-1); mean idle"
    )


def test_file_records_virtual_stages(tmp_path, capsys):
    events = [tl.PipelineEvent(0, "forward", 0.0, 1.0), tl.PipelineEvent(1, "forward", 1.0, 2.0)]
    path = tmp_path / "t.json"
    tl.save_timeline(path, events, 2, 4, 3.0, schedule="interleaved_1f1b", virtual_stages=2)
    doc = tl.load_timeline(path)
    assert doc["virtual_stages"] == 2 and doc["schedule"] == "interleaved_1f1b"
    assert tl.main([str(path), "--out", str(tmp_path / "t.svg")]) == 0
    assert "ideal bubble 11.1%) [interleaved_1f1b V=2" in capsys.readouterr().out
    assert "(ideal 11%)" in (tmp_path / "t.svg").read_text()
    # an older file (no virtual_stages) of a looped schedule: the chunk count is unknown, so n/a
    raw = json.loads(path.read_text())
    del raw["virtual_stages"]
    path.write_text(json.dumps(raw))
    assert tl.load_timeline(path)["virtual_stages"] == 0
    assert tl.main([str(path), "--out", str(tmp_path / "old.svg")]) == 0
    assert "ideal bubble n/a) [interleaved_1f1b V=?: n/a: the timeline file does not record" in capsys.readouterr().out
    assert "(ideal n/a)" in (tmp_path / "old.svg").read_text()
