"""Host-side exchanges of small Python objects, with the same timeout and hang diagnosis as
every other zerotrain collective.

``torch.distributed.all_gather_object`` and ``new_group`` fail after the group's timeout with
a bare backend error (and ``new_group`` without ``timeout=`` waits torch's 30 minutes whatever
the default group's timeout is). Here each exchange is a collective of its group's
``Collectives`` object (``zerotrain.comm.group``): it takes the next sequence number of its
group, and a timeout or a dead peer raises ``CollectiveError`` naming the ranks that had not
arrived (``zerotrain.comm.hang``). Groups are created by ``zerotrain.topology.groups.new_group``;
this module attaches the same to their creation (``_DiagnosedCreation``), and a new group gets
``default_timeout()`` (``ZEROTRAIN_COMM_TIMEOUT``).
"""

from __future__ import annotations

from zerotrain.comm.distributed import default_timeout
from zerotrain.comm.group import Collectives
from zerotrain.topology.groups import CreationWatch, watch_group_creation


def all_gather_object(value, group=None, op: str = "all_gather_object") -> list:
    """Every rank's ``value`` (picklable), ordered by group rank. ``op`` names the exchange in
    a ``CollectiveError`` (every rank must pass the same)."""
    return Collectives.of(group).all_gather_object(value, op=op)


def broadcast_object(value, src: int, group=None, op: str = "broadcast_object"):
    """Global rank ``src``'s ``value`` (picklable) on every rank of ``group``; the other ranks'
    ``value`` is ignored."""
    return Collectives.of(group).broadcast_object(value, src, op=op)


class _DiagnosedCreation(CreationWatch):
    """Group creation (zerotrain.topology.groups) under comm's timeout and hang diagnosis: a new
    group's collectives time out after ``default_timeout()``, and a creation a rank never joins
    raises ``CollectiveError`` naming it, counted as a collective of the group it is made within."""

    def timeout(self):
        return default_timeout()

    def run(self, op, within, create):
        return Collectives.of(within).run(op, 0, False, create)


watch_group_creation(_DiagnosedCreation())

__all__ = ["all_gather_object", "broadcast_object"]
