"""What runs around a collective: the ``Call`` a hook sees, the hook interface, and byte counts.

Every collective of a process group is issued by that group's ``Collectives`` object
(``zerotrain.comm.group``), which runs it through a chain of hooks: the process-wide hooks first
(the comms logger, while it is enabled), then the group's own, then hang diagnosis, innermost.
A hook's ``run(call, issue)`` calls ``issue()`` once and returns what it returned, or a handle
wrapping it for an async op (``call.async_op``): ``issue()`` returns the op's work handle then,
and what completes it is the handle's ``wait()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Call:
    """One collective as a hook sees it: ``op`` (DeepSpeed's name, e.g.
    ``all_gather_into_tensor``), ``nbytes`` (the whole buffer: what the comms logger reports),
    ``group`` (None for the world), ``seq`` (its number in the group) and ``async_op``."""

    __slots__ = ("op", "nbytes", "group", "seq", "async_op")

    def __init__(self, op: str, nbytes: int, group, seq: int, async_op: bool):
        self.op, self.nbytes, self.group, self.seq, self.async_op = op, nbytes, group, seq, async_op


class CollectiveHook:
    """Runs around each collective of a ``Collectives`` object (or of every one, as a
    process-wide hook). The base class issues the call unchanged."""

    def run(self, call: Call, issue: Callable[[], Any]) -> Any:
        return issue()


class ByteCounter(CollectiveHook):
    """Counts the collectives it sees and their bytes: ``counts[op] == [calls, bytes]``.

    Install it on one group (``Collectives.of(group).add_hook(ByteCounter())``) or on every
    group (``zerotrain.comm.group.add_process_hook``); it adds one dict update per call."""

    def __init__(self):
        self.counts: dict[str, list[int]] = {}

    def run(self, call: Call, issue: Callable[[], Any]) -> Any:
        row = self.counts.get(call.op)
        if row is None:
            row = self.counts[call.op] = [0, 0]
        row[0] += 1
        row[1] += call.nbytes
        return issue()

    def bytes(self, op: str) -> int:
        return self.counts.get(op, (0, 0))[1]

    def calls(self, op: str) -> int:
        return self.counts.get(op, (0, 0))[0]
