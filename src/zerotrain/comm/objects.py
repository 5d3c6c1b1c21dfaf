"""Host-side exchanges of small Python objects, with the same timeout and hang diagnosis as
every other zerotrain collective.

``torch.distributed.all_gather_object`` fails after the group's timeout with a bare backend
error. Here each call takes the next sequence number of its group, and a timeout or a dead peer
raises ``CollectiveError`` naming the ranks that had not arrived (``zerotrain.comm.hang``).
Groups are created by ``zerotrain.topology.groups.new_group``; this module attaches the same
timeout and diagnosis to their creation (``_DiagnosedCreation``).
"""

from __future__ import annotations

import pickle
import time

import torch.distributed as dist

from zerotrain.comm.collectives import _next_seq
from zerotrain.comm.distributed import default_timeout
from zerotrain.comm.hang import diagnose
from zerotrain.topology.groups import CreationWatch, watch_group_creation


def all_gather_object(value, group=None, op: str = "all_gather_object") -> list:
    """Every rank's ``value`` (picklable), ordered by group rank. ``op`` names the exchange in
    a ``CollectiveError`` (every rank must pass the same)."""
    seq = _next_seq(group)
    started = time.monotonic()
    out = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, value, group=group)
    except RuntimeError as exc:
        raise diagnose(exc, op, len(pickle.dumps(value)), seq, group, started) from exc
    return out


class _DiagnosedCreation(CreationWatch):
    """Group creation (zerotrain.topology.groups) under comm's timeout and hang diagnosis: a new
    group's collectives time out after ``default_timeout()``, and a creation a rank never joins
    raises ``CollectiveError`` naming it, counted as a collective of the group it is made within."""

    def timeout(self):
        return default_timeout()

    def begin(self, within):
        return _next_seq(within), time.monotonic()

    def failed(self, error, op, within, token):
        seq, started = token
        return diagnose(error, op, 0, seq, within, started)


watch_group_creation(_DiagnosedCreation())

__all__ = ["all_gather_object"]
