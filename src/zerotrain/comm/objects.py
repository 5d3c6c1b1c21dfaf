"""Host-side exchanges of small Python objects, with the same timeout and hang diagnosis as
every other zerotrain collective.

``torch.distributed.all_gather_object`` and ``new_group`` fail after the group's timeout with
a bare backend error (and ``new_group`` without ``timeout=`` waits torch's 30 minutes whatever
the default group's timeout is). Here each call is a collective of its group's ``Collectives``
object (``zerotrain.comm.group``): it takes the next sequence number of its group, a
new group gets ``default_timeout()`` (``ZEROTRAIN_COMM_TIMEOUT``), and a timeout or a dead peer
raises ``CollectiveError`` naming the ranks that had not arrived (``zerotrain.comm.hang``).
"""

from __future__ import annotations

import torch.distributed as dist

from zerotrain.comm.distributed import default_timeout
from zerotrain.comm.group import Collectives


def all_gather_object(value, group=None, op: str = "all_gather_object") -> list:
    """Every rank's ``value`` (picklable), ordered by group rank. ``op`` names the exchange in
    a ``CollectiveError`` (every rank must pass the same)."""
    return Collectives.of(group).all_gather_object(value, op=op)


def broadcast_object(value, src: int, group=None, op: str = "broadcast_object"):
    """Global rank ``src``'s ``value`` (picklable) on every rank of ``group``; the other ranks'
    ``value`` is ignored."""
    return Collectives.of(group).broadcast_object(value, src, op=op)


def new_group(ranks=None, backend=None, op: str = "new_group", within=None):
    """``torch.distributed.new_group`` with ``default_timeout()`` for the group's collectives and
    a ``CollectiveError`` naming the absent ranks if they do not all create it (it is a collective
    of the default group: every rank must call it, in the same order).

    ``within``: an existing group holding exactly ``ranks``; then only those ranks create the new
    group (torch's ``use_local_synchronization``: ranks outside take no part), and the creation
    counts as a collective of ``within`` for the error naming an absent rank."""
    if within is None:
        return Collectives.of(None).run(
            op, 0, False, lambda: dist.new_group(ranks=ranks, backend=backend, timeout=default_timeout()))
    return Collectives.of(within).run(
        op, 0, False, lambda: dist.new_group(ranks=ranks, backend=backend, timeout=default_timeout(),
                                             use_local_synchronization=True))


__all__ = ["all_gather_object", "broadcast_object", "new_group"]
