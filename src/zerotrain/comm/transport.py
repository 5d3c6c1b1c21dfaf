"""How a collective travels: the torch API per version, gloo's send/recv forms and their
identity headers. ``zerotrain.comm.group.Collectives`` picks the form per call; the state a form
keeps (tag counters, unchecked identity headers, the first mismatch) lives on that object.

One place picks the right torch API for the installed version (torch 2.13 renamed
``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single``; older torch only has the old
names) and the fastest form per backend. On gloo, ``all_gather``/``reduce_scatter`` (list or tensor
form) allocate a temporary as large as the whole buffer on every call, and even an in-place
``all_reduce`` moves twice the bytes a gather needs. So on gloo an all-gather is one
``isend``/``irecv`` pair per peer straight into the output's slices, and a reduce-scatter sends
each peer its rows and sums the rows received into this rank's slice: half the time of the
in-place ``all_reduce`` on 2 and 4 ranks, nothing allocated (``bench/collectives.py``,
docs/benchmarks.md). ``ZEROTRAIN_GLOO_COLLECTIVES=all_reduce`` selects the previous in-place
``all_reduce`` forms instead. NCCL gets the native single-tensor collectives, in place where the
output is a slice of the input. Timeouts come from the process group (see
``zerotrain.comm.distributed.default_timeout``); gloo's sends and receives wait with it too.

A gloo all-gather or reduce-scatter may carry an ``Identity`` (what this rank's collective is:
ZeRO stage 3 names the unit it gathers or reduces). Each rank then also sends every peer a
fixed-size header with the identity, under the collective's sequence tag, and sends its data
under a tag derived from the identity: data of different collectives never pair (so gloo never
receives a message larger than the posted buffer, which aborts the process), and waiting checks
the peers' headers before any data is used, raising ``CollectiveMismatch`` on every rank when
the ranks issued different collectives. No extra round trip: headers and data travel together.
"""

from __future__ import annotations

import collections
import os
import struct
import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from zerotrain.comm.hang import CollectiveMismatch

ReduceOp = dist.ReduceOp

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_world(group) -> bool:
    return group is None or group is dist.GroupMember.WORLD


def is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


# How gloo all-gathers and reduce-scatters: "send_recv" (default) or "all_reduce" (in place).
GLOO_FORMS = ("send_recv", "all_reduce")


def gloo_form() -> str:
    form = os.environ.get("ZEROTRAIN_GLOO_COLLECTIVES", "send_recv")
    if form not in GLOO_FORMS:
        raise ValueError(f"ZEROTRAIN_GLOO_COLLECTIVES must be one of {', '.join(GLOO_FORMS)}, got {form!r}")
    return form


def sends_and_receives(group) -> bool:
    return is_gloo(group) and gloo_form() == "send_recv"


def rank_slice(flat: torch.Tensor, world: int, group) -> tuple[torch.Tensor, int]:
    """This rank's slice of ``flat`` and its offset."""
    n = flat.numel() // world
    start = dist.get_rank(group) * n
    return flat.narrow(0, start, n), start


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


class Finishing:
    """An async collective's handle that runs the op's local part (``then``: e.g. sum the rows
    received) once, after the transfer completed. Waiting again is a no-op (a gloo receive
    waited for twice would wait for a second message)."""

    __slots__ = ("work", "then", "done")

    def __init__(self, work, then=None):
        self.work, self.then, self.done = work, then, False

    def wait(self, *args, **kwargs):
        if self.done:
            return True
        result = self.work.wait(*args, **kwargs)
        self.done = True
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return result

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self):
        return self.work.get_future()

    def __getattr__(self, name):
        return getattr(self.work, name)


# -- collectives from point-to-point ops (gloo) ---------------------------------------------
# Tags of their own, counted per group like the sequence numbers (every rank issues the same
# collectives in the same order), above the small tags user code sends with.
_P2P_TAG_BASE = 1 << 30
# Data of identified collectives goes under tags derived from the identity, in a range of its own
# (the sequence tags stay below it): 2**30 + 2**29 up to 2**31 - 1.
_SEQ_TAG_SPAN = 1 << 29
_IDENTITY_TAG_BASE = _P2P_TAG_BASE + _SEQ_TAG_SPAN
HEADER_LEN = 4  # int64 values in an identity header


class ExchangeState:
    """What gloo's send/recv forms remember per group: the tag counter, the identified
    exchanges whose headers are not checked yet (in issue order), and the first disagreement."""

    __slots__ = ("p2p_count", "unchecked", "mismatched")

    def __init__(self):
        self.p2p_count = 0
        self.unchecked: collections.deque = collections.deque()
        self.mismatched: BaseException | None = None

    def next_tag(self) -> int:
        n = self.p2p_count
        self.p2p_count = n + 1
        return _P2P_TAG_BASE + n % _SEQ_TAG_SPAN


class Identity:
    """What one rank's collective is: up to ``HEADER_LEN`` integers (``code``). ``explain``
    gets every rank's code (a list of tuples, by group rank) when they differ and returns the
    exception to raise."""

    __slots__ = ("code", "explain", "header", "tag")

    def __init__(self, code: Sequence[int], explain: Callable[[list], BaseException]):
        if len(code) > HEADER_LEN:
            raise ValueError(f"an Identity holds at most {HEADER_LEN} integers, got {len(code)}")
        self.code = tuple(int(c) for c in code) + (0,) * (HEADER_LEN - len(code))
        self.explain = explain
        self.header = torch.tensor(self.code, dtype=torch.int64)
        packed = struct.pack(f"<{HEADER_LEN}q", *self.code)
        self.tag = _IDENTITY_TAG_BASE + (zlib.crc32(packed) & (_SEQ_TAG_SPAN - 1))


class _CheckedExchange:
    """An exchange whose peers' identity headers are checked before its data is waited for.

    Headers are checked in the order the collectives were issued, each group's earlier ones
    first: a rank waiting for a later collective than its peer (which stopped at the first
    disagreement) still finds that first disagreement, and every rank raises the same error.
    After it, every identified collective of the group raises it again."""

    __slots__ = ("headers", "heard", "peer_ranks", "data", "identity", "world", "state", "checked")

    def __init__(self, headers, heard, peer_ranks, data, identity, world, state: ExchangeState):
        self.headers, self.heard, self.peer_ranks = headers, heard, peer_ranks
        self.data, self.identity, self.world = data, identity, world
        self.state, self.checked = state, False
        state.unchecked.append(self)

    def _check(self) -> None:
        for work in self.headers.works[: len(self.peer_ranks)]:  # the receives; sends at the end
            work.wait()
        self.checked = True
        codes = [tuple(row) for row in self.heard.tolist()]
        if any(code != self.identity.code for code in codes):
            every = [self.identity.code] * self.world
            for r, code in zip(self.peer_ranks, codes):
                every[r] = code
            self.state.mismatched = self.identity.explain(every)

    def wait(self, *args, **kwargs) -> bool:
        state = self.state
        queue = state.unchecked
        while not self.checked and queue and state.mismatched is None:
            queue.popleft()._check()
        if state.mismatched is not None:
            raise state.mismatched
        self.data.wait(*args, **kwargs)
        for work in self.headers.works[len(self.peer_ranks) :]:  # the sends (long done by now)
            work.wait(*args, **kwargs)
        return True

    def is_completed(self) -> bool:
        return self.headers.is_completed() and self.data.is_completed()

    def get_future(self):
        return torch.futures.collect_all([self.headers.get_future(), self.data.get_future()])


def _identified_exchange(sends, receives, group, state: ExchangeState, identity: Identity) -> _CheckedExchange:
    """``exchange`` with identity headers: each peer gets ours under the sequence tag; the data
    goes under the identity's tag. Data is posted before headers on both sides, so a peer's
    header reaches this rank after its data (one connection per pair, written in order): the
    wait for the header is then the only one that sleeps."""
    peers = peers_of(group)
    heard = torch.empty((len(peers), HEADER_LEN), dtype=torch.int64)
    tag = state.next_tag()
    data = [dist.irecv(t, src, group=group, tag=identity.tag) for src, t in receives]
    data += [dist.isend(t, dst, group=group, tag=identity.tag) for dst, t in sends]
    works = [dist.irecv(heard[i], g, group=group, tag=tag) for i, (_, g) in enumerate(peers)]
    works += [dist.isend(identity.header, g, group=group, tag=tag) for _, g in peers]
    return _CheckedExchange(
        _Exchange(works), heard, [r for r, _ in peers], _Exchange(data), identity, dist.get_world_size(group), state
    )


def peers_of(group) -> list[tuple[int, int]]:
    """(group rank, global rank) of every other member of ``group``, starting after this rank
    (so on more than 2 ranks not everyone sends to rank 0 first)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = [(rank + k) % world for k in range(1, world)]
    if is_world(group):
        return [(r, r) for r in ranks]
    return [(r, dist.get_global_rank(group, r)) for r in ranks]


class _Exchange:
    """The sends and receives that make up one collective, waited for together."""

    __slots__ = ("works",)

    def __init__(self, works):
        self.works = works

    def wait(self, *args, **kwargs) -> bool:
        for work in self.works:
            work.wait(*args, **kwargs)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def get_future(self):
        return torch.futures.collect_all([work.get_future() for work in self.works])


def exchange(sends, receives, group, state: ExchangeState, async_op: bool, identity: Identity | None = None):
    """Post ``receives`` ``[(peer global rank, tensor)]`` and ``sends`` under one fresh tag
    (with an ``identity``: checked, see ``_identified_exchange``); the handle when ``async_op``,
    else wait."""
    handle: _CheckedExchange | _Exchange
    if identity is not None and (sends or receives):  # one rank: no peer to disagree with
        handle = _identified_exchange(sends, receives, group, state, identity)
    else:
        tag = state.next_tag()
        works = [dist.irecv(t, src, group=group, tag=tag) for src, t in receives]
        works += [dist.isend(t, dst, group=group, tag=tag) for dst, t in sends]
        handle = _Exchange(works)
    if async_op:
        return handle
    handle.wait()
    return None


__all__ = [
    "ReduceOp",
    "CollectiveMismatch",
    "Identity",
    "HEADER_LEN",
    "GLOO_FORMS",
    "gloo_form",
    "ExchangeState",
    "Finishing",
]
