"""Hang diagnosis: turn a bare backend timeout into "which rank did not arrive".

Every zerotrain collective carries a sequence number per process group (the group's
``Collectives`` object counts them, ``zerotrain.comm.group``). All ranks issue the same collectives in the
same order, so ``#n`` names the same collective on every rank. When a collective times out or
fails, the rank that saw it:

1. writes ``{seq, op, bytes}`` under ``zerotrain/failed/<group>/<rank>`` in the default group's
   c10d store (the rendezvous store every rank already talks to);
2. waits a short grace period (``grace_seconds``) for the other ranks of the group to do the
   same: ranks blocked in the same collective time out too, within their arrival skew;
3. raises ``CollectiveError`` naming the op, its size, its sequence number, the ranks that had
   not arrived (when the store itself is unreachable, ranks it could not hear from are listed
   as unknown, not as absent), and what is known about each: blocked in an earlier or a different collective,
   or not in any zerotrain collective at all (stuck in computation, dead, or it skipped this
   collective). With ``"comms_logger": {"enabled": true, "debug": true}`` every rank also records
   its last completed collective under ``zerotrain/progress/<group>/<rank>`` (one store write per
   collective), and the error quotes it.

Nothing here runs unless a collective has already failed (or debug progress is on). The
diagnosis is a hook (``HangDiagnosis``), the innermost one of every group's ``Collectives``
object (``zerotrain.comm.group``): it sees the backend's error first.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from zerotrain.comm.hooks import Call, CollectiveHook

# Substrings of backend errors that mean "a peer did not answer" (gloo's and NCCL's wording);
# argument errors (wrong shapes, dtypes) are re-raised untouched.
_COMM_FAILURE_WORDS = (
    "timed out",
    "timeout",
    "connection",
    "closed",
    "reset by peer",
    "broken pipe",
    "abort",
    "watchdog",
    "unhandled system error",
    "remote process exited",
)


class CollectiveError(RuntimeError):
    """A collective timed out or failed. Attributes: ``op``, ``seq``, ``nbytes``, ``missing``
    (global ranks that had not arrived), ``reports`` (what each rank of the group said)."""

    def __init__(self, message: str, op: str, seq: int, nbytes: int, missing: list[int], reports: dict[int, dict]):
        super().__init__(message)
        self.op, self.seq, self.nbytes, self.missing, self.reports = op, seq, nbytes, missing, reports

    def __reduce__(self):  # picklable, e.g. to send to a parent process
        return type(self), (str(self), self.op, self.seq, self.nbytes, self.missing, self.reports)


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives (seen in the identity headers of gloo's send/recv
    collectives, ``zerotrain.comm.transport``): raised on every rank before any of the
    mismatched data is used. Not diagnosed further: it already says what differed."""


def convert_size(size_bytes: int | float) -> str:
    """DeepSpeed's size formatting: ``0B``, ``4.0 KB``, ``1.24 GB``."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` from a collective looks like a peer failure rather than bad arguments."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return any(word in text for word in _COMM_FAILURE_WORDS)


def group_key(group) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    return str(getattr(group, "group_name", id(group)))


def grace_seconds(timeout_s: float) -> float:
    """How long a failing rank waits for the others' reports: 10% of the timeout, 1-10 s."""
    return min(10.0, max(1.0, 0.1 * timeout_s))


def _store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def _timeout_seconds() -> float:
    from zerotrain.comm.distributed import default_timeout

    return default_timeout().total_seconds()


def record_progress(group, seq: int, op: str, nbytes: int) -> None:
    """Debug mode: publish this rank's last completed collective (one store write)."""
    try:
        _store().set(
            f"zerotrain/progress/{group_key(group)}/{dist.get_rank()}",
            json.dumps({"seq": seq, "op": op, "bytes": nbytes}),
        )
    except Exception:  # diagnostics must never break training
        pass


def _read(store, key: str):
    if store.check([key]):
        return json.loads(store.get(key))
    return None


def diagnose(
    exc: BaseException, op: str, nbytes: int, seq: int, group, started: float, grace: float | None = None
) -> BaseException:
    """The exception to raise for ``exc`` raised by collective ``op`` #``seq``: a
    ``CollectiveError`` for peer failures, ``exc`` itself otherwise."""
    if not is_comm_failure(exc) or not dist.is_initialized():
        return exc
    waited = time.monotonic() - started
    rank = dist.get_rank()
    gkey = group_key(group)
    try:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD)
    except Exception:
        ranks = list(range(dist.get_world_size()))
    if grace is None:
        grace = grace_seconds(_timeout_seconds())
    here = {"seq": seq, "op": op, "bytes": nbytes}
    reports: dict[int, dict] = {rank: here}
    progress: dict[int, dict] = {}
    store_error = None
    try:
        store = _store()
        store.set(f"zerotrain/failed/{gkey}/{rank}", json.dumps(here))
        deadline = time.monotonic() + grace
        while True:
            for r in ranks:
                if r not in reports:
                    report = _read(store, f"zerotrain/failed/{gkey}/{r}")
                    if report is not None:
                        reports[r] = report
            if len(reports) == len(ranks) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for r in ranks:
            if r not in reports:
                report = _read(store, f"zerotrain/progress/{gkey}/{r}")
                if report is not None:
                    progress[r] = report
    except Exception as err:  # e.g. the store's host (rank 0) is gone
        store_error = err

    lines, missing, unknown = [], [], []
    for r in ranks:
        if r == rank:
            continue
        report = reports.get(r)
        if report is not None and report["seq"] == seq and report["op"] == op:
            lines.append(f"  rank {r}: arrived (also blocked in {op} #{seq})")
            continue
        if report is None and store_error is not None and r not in progress:
            # No store, no news: a rank that did arrive (and then exited, taking the store
            # with it when it was rank 0) must not be named as absent.
            unknown.append(r)
            lines.append(f"  rank {r}: unknown (the rendezvous store could not be consulted)")
            continue
        missing.append(r)
        if report is None:
            what = (
                f"no report within {grace:.1f} s: not in a zerotrain collective (stuck in computation "
                "or I/O, dead, or it skipped this collective)"
            )
            if r in progress:
                p = progress[r]
                what += f"; its last completed collective is {p['op']} #{p['seq']} ({convert_size(p['bytes'])})"
        elif report["seq"] == seq:
            what = (
                f"blocked in {report['op']} #{seq} ({convert_size(report['bytes'])}) instead: "
                "ranks issued different collectives"
            )
        elif report["seq"] < seq:
            what = f"still blocked in an earlier collective, {report['op']} #{report['seq']}"
        else:
            what = (
                f"already at {report['op']} #{report['seq']}: it completed #{seq} without this "
                "rank, so collectives were mismatched"
            )
        lines.append(f"  rank {r}: {what}")
    where = "the default group" if gkey == "world" else f"group {gkey}"
    if missing:
        head = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} had not arrived"
    elif unknown:
        head = (
            "which ranks had not arrived is unknown: the rendezvous store is unreachable (its "
            "host, usually rank 0, has probably exited)"
        )
    else:
        head = "every rank arrived; the backend failed anyway"
    message = (
        f"{op} #{seq} ({convert_size(nbytes)}) on {where} of {len(ranks)} ranks failed on "
        f"rank {rank} after {waited:.1f} s: {head}.\n" + "\n".join(lines)
    )
    if store_error is not None:
        message += f"\n  (could not consult the rendezvous store: {store_error})"
    elif any(r not in reports and r not in progress for r in ranks):
        message += (
            '\n  Set "comms_logger": {"enabled": true, "debug": true} to record every '
            "rank's last completed collective."
        )
    message += f"\nbackend error: {exc}"
    return CollectiveError(message, op, seq, nbytes, missing, {**progress, **reports})


class HangDiagnosis(CollectiveHook):
    """Turns a collective's backend failure into a ``CollectiveError`` (``diagnose``), raised at
    issue or, for an async op, at ``wait()``."""

    def run(self, call: Call, issue: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            work = issue()
        except CollectiveMismatch:
            raise
        except RuntimeError as exc:
            raise diagnose(exc, call.op, call.nbytes, call.seq, call.group, started) from exc
        if call.async_op:
            return DiagnosedWork(work, call, started)
        return work


class DiagnosedWork:
    """An async collective's handle whose ``wait()`` turns a peer failure into a
    ``CollectiveError``."""

    __slots__ = ("work", "call", "started")

    def __init__(self, work, call: Call, started: float):
        self.work, self.call, self.started = work, call, started

    @property
    def seq(self) -> int:
        return self.call.seq

    @property
    def nbytes(self) -> int:
        return self.call.nbytes

    def wait(self, *args, **kwargs):
        try:
            return self.work.wait(*args, **kwargs)
        except CollectiveMismatch:
            raise
        except RuntimeError as exc:
            call = self.call
            raise diagnose(exc, call.op, call.nbytes, call.seq, call.group, self.started) from exc

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self):
        return self.work.get_future()

    def __getattr__(self, name):
        return getattr(self.work, name)
