"""Where the pipeline engine's time went, idle included: per stage, when it computed (forward,
backward, weight steps) during one ``train_batch`` and when it waited, beside the schedule's ideal
bubble (``ideal_bubble``: (P-1)/(M+P-1) for GPipe/1F1B, (P-1)/(V*M+P-1) with V chunks per rank
for interleaved 1F1B and looped BFS at M >= P, none for the split-backward schedules).

- ``StageClock`` records one stage's events (``PipelineEvent(stage, kind, start, end)``, seconds
  from the batch's start) by wrapping torch's ``PipelineStage.forward_one_chunk`` and
  ``backward_one_chunk`` (the stage module's forward, and the autograd backward of its outputs);
  on the last stage the loss computed on a micro-batch's outputs counts as part of its forward.
  It also times every wait on torch's point-to-point transfers: torch's schedules post them with
  ``schedules._batch_p2p`` and wait on them with the module function
  ``schedules._wait_batch_p2p``, which is wrapped once per process (``install_wait_hook``; it
  records only while a clock is active on this process, else it is the plain call).
- A wait lasts until the neighbour has computed what it sends (or posted the receive of what
  this stage sends) and then until the data has crossed. ``split_waits`` keeps the second part
  as a ``"comm"`` event: the part of the wait after the last computation of a neighbouring stage
  (rank s-1 or s+1, cyclically with virtual stages) that ended nearest the wait's end; the first
  part is waiting for the neighbour, i.e. idle (the bubble). A wait no neighbour computation
  precedes (the first batch's connection set-up) is comm entirely.
  The batch starts and ends at a barrier over the pipe group, so every stage's clock starts at
  the same moment (to within the barrier's exit skew). With a ``sync`` (the accelerator's
  synchronize, CUDA only) every reading waits for the device.
- ``gather_timeline`` puts every stage's events on every stage of the pipe group (two small
  collectives) and turns the waits into comm events; ``summarize`` gives busy, comm, idle and
  their shares per stage: idle = duration - busy - comm, idle share = idle / duration, comm
  share = comm / duration, duration = the longest stage's span of the batch. With equal stages
  the idle share should be the schedule's ideal bubble: 1 - busy/duration is that plus the
  comm share.
- ``save_timeline``/``load_timeline``: a JSON file; ``write_svg`` (no dependency) and
  ``write_png`` (matplotlib, optional) draw stages x time, forward/backward/weight/comm/idle.

Command line: ``python -m zerotrain.pipeline.timeline FILE.json --out timeline.png`` (or
``.svg``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from zerotrain.pipeline.bubble import (  # noqa: F401
    LOOPED_SCHEDULES,
    NO_CLOSED_FORM,
    ONE_CHUNK_SCHEDULES,
    bubble_formula,
    ideal_bubble,
)

# "weight": the separate weight-gradient step of zero-bubble schedules (backward_weight_one_chunk);
# "comm": the transfer part of a wait on torch's point-to-point sends/receives (split_waits).
COMPUTE = ("forward", "backward", "weight")
KINDS = COMPUTE + ("comm",)
_WAIT = "wait"  # a raw wait as one stage recorded it, before split_waits
_GATHERED = KINDS + (_WAIT,)
COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "weight": "#55a868", "comm": "#c44e52", "idle": "#d9d9d9"}


class PipelineEvent(NamedTuple):
    stage: int
    kind: str  # "forward", "backward", "weight" or "comm"
    start: float  # seconds from the batch's start
    end: float


_CURRENT: list = [None]  # the StageClock recording on this process (one train_batch at a time)


_HOOK_USERS: set = set()  # ids of the StageClocks that installed the wait hook and are not closed


def install_wait_hook() -> None:
    """Wrap torch's ``schedules._wait_batch_p2p`` (the function every schedule calls to wait on
    the works its ``_batch_p2p`` posted) once per process: while a ``StageClock`` is active, a
    wait on a non-empty list of works is recorded as a raw wait on it; otherwise the plain call.
    ``remove_wait_hook`` puts torch's function back."""
    from torch.distributed.pipelining import schedules

    wait = schedules._wait_batch_p2p
    if getattr(wait, "_zerotrain_timed", False):
        return

    def timed_wait(work, *args, **kwargs):
        clock = _CURRENT[0]
        if clock is None or not clock.active or not work:
            return wait(work, *args, **kwargs)
        start = clock.now()
        out = wait(work, *args, **kwargs)
        clock.record(_WAIT, start)
        return out

    timed_wait.__wrapped__ = wait
    timed_wait._zerotrain_timed = True
    schedules._wait_batch_p2p = timed_wait


def remove_wait_hook() -> None:
    """Give torch's ``schedules._wait_batch_p2p`` back (no-op when it is not wrapped)."""
    from torch.distributed.pipelining import schedules

    wait = schedules._wait_batch_p2p
    if getattr(wait, "_zerotrain_timed", False):
        schedules._wait_batch_p2p = wait.__wrapped__


class StageClock:
    """One stage's recorder; ``active`` only between ``begin()`` and ``finish()``."""

    def __init__(self, stage_id: int, sync: Callable[[], None] | None = None):
        self.stage_id = stage_id
        self.sync = sync
        self.active = False
        self.events: list[PipelineEvent] = []
        self._t0 = 0.0

    def now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter() - self._t0

    def begin(self) -> None:
        """Start the batch's clock (call right after the pipe group's barrier)."""
        self.events = []
        if self.sync is not None:
            self.sync()
        self._t0 = time.perf_counter()
        self.active = True
        _CURRENT[0] = self

    def finish(self) -> float:
        """Stop recording; the batch's span on this stage (call right after the closing barrier)."""
        self.active = False
        if _CURRENT[0] is self:
            _CURRENT[0] = None
        return self.now()

    def record(self, kind: str, start: float) -> None:
        self.events.append(PipelineEvent(self.stage_id, kind, start, self.now()))

    def extend_last(self, kind: str) -> None:
        """Stretch the latest ``kind`` event to now (the last stage's loss after its forward)."""
        if self.active and self.events and self.events[-1].kind == kind:
            self.events[-1] = self.events[-1]._replace(end=self.now())

    def close(self) -> None:
        """Stop recording for good; the last clock closed gives torch's wait function back (the
        engine's ``destroy()``)."""
        if self.active:
            self.finish()
        _HOOK_USERS.discard(id(self))
        if not _HOOK_USERS:
            remove_wait_hook()

    def attach(self, runner) -> None:
        """Time every torch stage of a ``StageRunner`` not timed yet (they are rebuilt when the
        input shapes change: call it before every batch)."""
        for stage in getattr(runner, "stages", None) or [runner.stage]:
            if getattr(stage, "_zerotrain_clock", None) is not self:
                self.wrap(stage)
                stage._zerotrain_clock = self

    def wrap(self, stage) -> None:
        """Time torch's ``stage.forward_one_chunk``/``backward_one_chunk`` (instance attributes:
        the class is untouched) and the schedules' p2p waits. Costs one attribute test per call
        when inactive."""
        install_wait_hook()
        _HOOK_USERS.add(id(self))
        for name, kind in (
            ("forward_one_chunk", "forward"),
            ("backward_one_chunk", "backward"),
            ("backward_weight_one_chunk", "weight"),
        ):
            if hasattr(stage, name):
                setattr(stage, name, self._timed(getattr(stage, name), kind))

    def _timed(self, fn, kind: str):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = self.now()
            out = fn(*args, **kwargs)
            self.record(kind, start)
            return out

        timed.__wrapped__ = fn
        return timed


def gather_timeline(
    events: Sequence[PipelineEvent], span: float, stage_id: int, num_stages: int, group, device
) -> tuple[list[PipelineEvent], list[float]]:
    """Every stage's events and spans on every stage of the pipe ``group`` (its rank i is stage i),
    the waits split into idle and comm events (``split_waits``). Collective over the group."""
    if num_stages == 1:
        return split_waits(events, 1), [span]
    import torch

    from zerotrain.comm import collectives

    count = torch.tensor([len(events)], dtype=torch.int64, device=device)
    collectives.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
    rows = int(count.item())
    width = 1 + 3 * rows  # span, then (kind, start, end) per event; kind -1: padding
    shard = torch.full((width,), -1.0, dtype=torch.float64)
    shard[0] = span
    for i, event in enumerate(events):
        shard[1 + 3 * i : 4 + 3 * i] = torch.tensor(
            [_GATHERED.index(event.kind), event.start, event.end], dtype=torch.float64
        )
    out = torch.empty(width * num_stages, dtype=torch.float64, device=device)
    collectives.all_gather_into(out, shard.to(device), group=group)
    table = out.cpu().view(num_stages, width)
    gathered, spans = [], []
    for stage in range(num_stages):
        spans.append(float(table[stage, 0]))
        for i in range(rows):
            kind, start, end = table[stage, 1 + 3 * i : 4 + 3 * i].tolist()
            if kind >= 0:
                gathered.append(PipelineEvent(stage, _GATHERED[int(kind)], start, end))
    return split_waits(gathered, num_stages), spans


def split_waits(events: Sequence[PipelineEvent], num_stages: int) -> list[PipelineEvent]:
    """The raw waits of every stage turned into ``"comm"`` events: a wait ``[a, b]`` on stage s
    waited for the computation of a neighbouring stage (s-1 or s+1 modulo P) that started before
    ``b`` and ended nearest to ``b`` (nearest, not latest before ``b``: the stages' clocks agree
    only to the barrier's exit skew, a fraction of a millisecond, so the computation a receive
    waited for can seem to end just after it); it is comm from that end (clamped to ``[a, b]``;
    from ``a`` with no such computation) to ``b``, and before that the stage was waiting for the
    neighbour (idle). Compute events are kept; empty comm is dropped."""
    compute = [e for e in events if e.kind != _WAIT]
    out = list(compute)
    for w in events:
        if w.kind != _WAIT:
            continue
        neighbours = {(w.stage - 1) % num_stages, (w.stage + 1) % num_stages} - {w.stage}
        ends = [e.end for e in compute if e.stage in neighbours and e.kind in COMPUTE and e.start < w.end]
        ready = min(ends, key=lambda t: abs(t - w.end)) if ends else w.start
        start = min(max(ready, w.start), w.end)
        if w.end > start:
            out.append(PipelineEvent(w.stage, "comm", start, w.end))
    out.sort(key=lambda e: (e.stage, e.start, e.end))
    return out


def summarize(
    events: Sequence[PipelineEvent],
    num_stages: int,
    micro_batches: int,
    duration: float,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
) -> dict:
    """Busy (forward + backward + weight steps), comm (the transfer part of the p2p waits) and
    idle seconds per stage over ``duration`` (idle = duration - busy - comm), their shares, the
    mean idle share over the stages, and the schedule's ideal bubble (``ideal_bubble``; None where
    no closed form holds) with its formula (``bubble_formula``)."""
    stages = []
    for s in range(num_stages):
        mine = [e for e in events if e.stage == s]
        forward = sum(e.end - e.start for e in mine if e.kind == "forward")
        backward = sum(e.end - e.start for e in mine if e.kind == "backward")
        weight = sum(e.end - e.start for e in mine if e.kind == "weight")
        comm = sum(e.end - e.start for e in mine if e.kind == "comm")
        busy = forward + backward + weight
        idle = max(duration - busy - comm, 0.0)
        share = (lambda t: t / duration) if duration > 0 else (lambda t: 0.0)
        stages.append(
            {
                "stage": s,
                "forward": forward,
                "backward": backward,
                "weight": weight,
                "busy": busy,
                "comm": comm,
                "idle": idle,
                "idle_share": share(idle),
                "comm_share": share(comm),
            }
        )
    return {
        "num_stages": num_stages,
        "micro_batches": micro_batches,
        "duration": duration,
        "ideal_bubble": ideal_bubble(num_stages, micro_batches, schedule, virtual_stages),
        "schedule": schedule,
        "virtual_stages": virtual_stages,
        "ideal_bubble_formula": bubble_formula(num_stages, micro_batches, schedule, virtual_stages),
        "idle_share": sum(s["idle_share"] for s in stages) / max(len(stages), 1),
        "stages": stages,
    }


def _percent(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}%}"


def describe(summary: dict) -> str:
    """The step log's zerotrain line: busy/comm/idle per stage beside the schedule's ideal bubble
    (n/a where no closed form holds) and the measured mean idle share."""
    parts = [
        f"stage {s['stage']}: busy {s['busy'] * 1e3:.1f} comm {s['comm'] * 1e3:.1f} "
        f"idle {s['idle'] * 1e3:.1f} ({s['idle_share']:.1%})"
        for s in summary["stages"]
    ]
    schedule = summary.get("schedule", "1f1b")
    v = summary.get("virtual_stages", 1)
    chunks = f" V={v}" if v > 1 else (" V=?" if v < 1 else "")  # V < 1: an older file did not record it
    formula = summary.get("ideal_bubble_formula") or bubble_formula(summary["num_stages"], summary["micro_batches"])
    mean = summary.get("idle_share", sum(s["idle_share"] for s in summary["stages"]) / max(len(parts), 1))
    return (
        f"pipeline batch {summary['duration'] * 1e3:.1f} ms (P={summary['num_stages']}, "
        f"M={summary['micro_batches']}, ideal bubble {_percent(summary['ideal_bubble'])}) "
        f"[{schedule}{chunks}: {formula}; mean idle {mean:.1%}] | " + " | ".join(parts)
    )


def monitor_events(summary: dict, step: int) -> list[tuple[str, float, int]]:
    """The monitors' events; ``ideal_bubble`` only where the schedule has a closed form (no
    number rather than a wrong one), ``idle_share`` (the stages' mean) always."""
    events = (
        [("Train/Pipeline/ideal_bubble", summary["ideal_bubble"], step)] if summary["ideal_bubble"] is not None else []
    )
    events += [
        ("Train/Pipeline/batch_ms", summary["duration"] * 1e3, step),
        ("Train/Pipeline/idle_share", summary["idle_share"], step),
    ]
    for s in summary["stages"]:
        i = s["stage"]
        events += [
            (f"Train/Pipeline/stage{i}_busy_ms", s["busy"] * 1e3, step),
            (f"Train/Pipeline/stage{i}_comm_ms", s["comm"] * 1e3, step),
            (f"Train/Pipeline/stage{i}_idle_ms", s["idle"] * 1e3, step),
            (f"Train/Pipeline/stage{i}_idle_share", s["idle_share"], step),
        ]
    return events


# -- files and pictures ---------------------------------------------------------------------
def save_timeline(
    path,
    events: Sequence[PipelineEvent],
    num_stages: int,
    micro_batches: int,
    duration: float,
    schedule: str = "",
    virtual_stages: int = 1,
) -> None:
    doc = {
        "num_stages": num_stages,
        "micro_batches": micro_batches,
        "duration": duration,
        "schedule": schedule,
        "virtual_stages": virtual_stages,
        "events": [list(e) for e in events],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def load_timeline(path) -> dict:
    """A file ``save_timeline`` wrote (plain JSON; its ``events`` become ``PipelineEvent``s).
    Raises ``ValueError`` naming what is wrong."""
    try:
        with open(path) as f:
            doc = json.load(f)
        events = [PipelineEvent(int(s), str(k), float(a), float(b)) for s, k, a, b in doc["events"]]
        doc["num_stages"], doc["micro_batches"] = int(doc["num_stages"]), int(doc["micro_batches"])
        doc["duration"] = float(doc["duration"])
        doc["schedule"] = str(doc.get("schedule") or "")
        # files from before virtual_stages was recorded: 0 (unknown) for the multi-chunk schedules
        doc["virtual_stages"] = int(doc.get("virtual_stages", 0 if doc["schedule"] in LOOPED_SCHEDULES else 1))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path}: not a pipeline timeline written by engine.save_pipeline_timeline "
            f"({type(error).__name__}: {error})"
        ) from None
    bad = [e for e in events if e.kind not in KINDS or not 0 <= e.stage < doc["num_stages"]]
    if bad:
        raise ValueError(f"{path}: event {list(bad[0])} has an unknown kind or stage")
    doc["events"] = events
    return doc


def _summarize_doc(doc: dict) -> dict:
    """``summarize`` of a loaded file; a file without a schedule name is taken as 1F1B/GPipe."""
    return summarize(
        doc["events"],
        doc["num_stages"],
        doc["micro_batches"],
        doc["duration"],
        doc.get("schedule") or "1f1b",
        doc.get("virtual_stages", 1),
    )


def _title(doc: dict) -> str:
    summary = _summarize_doc(doc)
    shares = ", ".join(f"{s['idle_share']:.0%}" for s in summary["stages"])
    name = f"{doc.get('schedule') or 'pipeline'}: "
    return (
        f"{name}P={doc['num_stages']} M={doc['micro_batches']}, idle per stage {shares} "
        f"(ideal {_percent(summary['ideal_bubble'], 0)})"
    )


def _labels(events: Sequence[PipelineEvent]) -> list[str]:
    """Micro-batch numbers: each stage runs its forwards, and its backwards, in micro-batch order."""
    seen: dict[tuple[int, str], int] = {}
    labels = []
    for e in events:
        i = seen.get((e.stage, e.kind), 0)
        seen[(e.stage, e.kind)] = i + 1
        labels.append(f"{e.kind[0].upper()}{i}")
    return labels


def write_svg(doc: dict, path, width: int = 960, row: int = 40) -> None:
    """Stages x time as SVG (no dependency): a grey idle bar per stage under its forward (blue),
    backward (orange), weight-step (green) and comm (red) boxes, labelled F<i>/B<i>/W<i> by
    micro-batch."""
    from xml.sax.saxutils import escape

    p, duration = doc["num_stages"], max(doc["duration"], 1e-12)
    left, top = 80, 40
    plot = width - left - 20
    height = top + p * row + 50
    x = lambda t: left + plot * min(max(t, 0.0), duration) / duration  # noqa: E731
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="20">{escape(_title(doc))}</text>',
    ]
    for s in range(p):
        y = top + s * row
        out.append(f'<text x="10" y="{y + row * 0.6:.1f}">stage {s}</text>')
        out.append(f'<rect x="{left}" y="{y + 4}" width="{plot}" height="{row - 8}" fill="{COLOURS["idle"]}"/>')
    for e, label in zip(doc["events"], _labels(doc["events"])):
        y = top + e.stage * row
        x0, x1 = x(e.start), x(e.end)
        out.append(
            f'<rect x="{x0:.2f}" y="{y + 4}" width="{max(x1 - x0, 0.5):.2f}" height="{row - 8}" '
            f'fill="{COLOURS[e.kind]}" stroke="white" stroke-width="0.5"/>'
        )
        if x1 - x0 > 18:
            out.append(
                f'<text x="{(x0 + x1) / 2:.2f}" y="{y + row * 0.6:.1f}" text-anchor="middle" '
                f'fill="white">{label}</text>'
            )
    axis = top + p * row + 15
    out.append(f'<text x="{left}" y="{axis}">0 ms</text>')
    out.append(f'<text x="{left + plot}" y="{axis}" text-anchor="end">{duration * 1e3:.1f} ms</text>')
    for i, (kind, colour) in enumerate(COLOURS.items()):
        lx = left + i * 110
        out.append(f'<rect x="{lx}" y="{axis + 10}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{lx + 16}" y="{axis + 21}">{kind}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def write_png(doc: dict, path, dpi: int = 100) -> None:
    """The same picture through matplotlib (an optional extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError(
            "the PNG timeline needs matplotlib: pip install matplotlib (or write an .svg, which needs nothing)"
        ) from None
    p, duration = doc["num_stages"], doc["duration"] * 1e3
    fig, ax = plt.subplots(figsize=(10, 0.7 * p + 1.4), dpi=dpi)
    try:
        for s in range(p):
            ax.barh(s, duration, left=0, height=0.8, color=COLOURS["idle"])
        for e, label in zip(doc["events"], _labels(doc["events"])):
            w = (e.end - e.start) * 1e3
            ax.barh(e.stage, w, left=e.start * 1e3, height=0.8, color=COLOURS[e.kind], edgecolor="white", linewidth=0.5)
            if w > duration / 40:
                ax.text(e.start * 1e3 + w / 2, e.stage, label, ha="center", va="center", color="white", fontsize=8)
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
        ax.invert_yaxis()
        ax.set_xlim(0, duration)
        ax.set_xlabel("time in the batch (ms)")
        ax.set_title(_title(doc), fontsize=10)
        ax.legend(
            handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.35 if p < 3 else -0.2),
            ncol=5,
            frameon=False,
        )
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def write_picture(doc: dict, path) -> None:
    """SVG for ``.svg`` paths, otherwise matplotlib (PNG, PDF, ... by the suffix)."""
    if str(path).lower().endswith(".svg"):
        write_svg(doc, path)
    else:
        write_png(doc, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zerotrain.pipeline.timeline",
        description="Draw a pipeline timeline (stages x time, forward/backward/comm/idle) from the JSON "
        "file engine.save_pipeline_timeline() wrote.",
    )
    parser.add_argument("timeline", help="the timeline JSON file")
    parser.add_argument(
        "--out", default="timeline.png", help="picture to write: .svg (no dependency) or .png/.pdf (needs matplotlib)"
    )
    args = parser.parse_args(argv)
    try:
        doc = load_timeline(args.timeline)
        write_picture(doc, args.out)
    except (ValueError, ImportError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(describe(_summarize_doc(doc)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
