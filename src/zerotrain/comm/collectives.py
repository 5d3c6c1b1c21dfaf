"""Every collective zerotrain issues goes through this module.

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

Each call takes the next sequence number of its process group; when a collective times out or a
peer dies, the error names the op, its size, that number and the ranks that had not arrived
(``zerotrain.comm.hang``). The comms logger (``zerotrain.comm.logger``) replaces these functions
with timed wrappers while it is enabled, and puts these back when it is disabled.

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
import time
import weakref
import zlib
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from zerotrain.comm.hang import diagnose

ReduceOp = dist.ReduceOp

# Last sequence number issued per process group: the default group's in ``_world_seq``, other
# groups' keyed weakly, so a group used here is not kept (with gloo's worker threads) past
# destroy_process_group(): threads still running at the interpreter's teardown abort the rank.
_world_seq = [0]
_seq: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _next_seq(group) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        _world_seq[0] += 1
        return _world_seq[0]
    n = _seq.get(group, 0) + 1
    _seq[group] = n
    return n


def last_seq(group=None) -> int:
    """The sequence number of the last collective issued on ``group`` by this rank."""
    if group is None or group is dist.GroupMember.WORLD:
        return _world_seq[0]
    return _seq.get(group, 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PendingCollective:
    """The handle of an async collective: ``wait()`` turns a timeout into a ``CollectiveError``.
    Waiting again is a no-op (a gloo receive waited for twice would wait for a second message)."""

    __slots__ = ("work", "op", "seq", "group", "tensor", "started", "then", "done")

    def __init__(self, work, op: str, seq: int, group, tensor: torch.Tensor, started: float,
                 then=None):
        self.work, self.op, self.seq, self.group = work, op, seq, group
        self.tensor, self.started, self.then = tensor, started, then
        self.done = False

    @property
    def nbytes(self) -> int:
        return _nbytes(self.tensor)

    def wait(self, *args, **kwargs):
        if self.done:
            return True
        try:
            result = self.work.wait(*args, **kwargs)
        except CollectiveMismatch:
            raise
        except RuntimeError as exc:
            raise diagnose(exc, self.op, self.nbytes, self.seq, self.group, self.started) from exc
        self.done = True
        if self.then is not None:  # finish the op's local part (e.g. copy out a slice) once
            then, self.then = self.then, None
            then()
        return result

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self):
        return self.work.get_future()

    def __getattr__(self, name):
        return getattr(self.work, name)


def _run(name: str, tensor: torch.Tensor, group, async_op: bool, fn, *args, then=None, **kwargs):
    """Issue ``fn`` as collective ``name`` (``tensor`` is the full buffer, for its size);
    ``then()`` runs once the collective has completed."""
    seq = _next_seq(group)
    started = time.monotonic()
    try:
        work = fn(*args, group=group, async_op=async_op, **kwargs)
    except CollectiveMismatch:
        raise
    except RuntimeError as exc:
        raise diagnose(exc, name, _nbytes(tensor), seq, group, started) from exc
    if async_op:
        return PendingCollective(work, name, seq, group, tensor, started, then)
    if then is not None:
        then()
    return work

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


# How gloo all-gathers and reduce-scatters: "send_recv" (default) or "all_reduce" (in place).
GLOO_FORMS = ("send_recv", "all_reduce")


def gloo_form() -> str:
    form = os.environ.get("ZEROTRAIN_GLOO_COLLECTIVES", "send_recv")
    if form not in GLOO_FORMS:
        raise ValueError(f"ZEROTRAIN_GLOO_COLLECTIVES must be one of {', '.join(GLOO_FORMS)}, "
                         f"got {form!r}")
    return form


def _sends_and_receives(group) -> bool:
    return _is_gloo(group) and gloo_form() == "send_recv"


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """In-place all-reduce of ``tensor``."""
    return _run("all_reduce", tensor, group, async_op, dist.all_reduce, tensor, op=op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """In-place broadcast of ``tensor`` from global rank ``src``."""
    return _run("broadcast", tensor, group, async_op, dist.broadcast, tensor, src=src)


def _rank_slice(flat: torch.Tensor, world: int, group) -> tuple[torch.Tensor, int]:
    """This rank's slice of ``flat`` and its offset."""
    n = flat.numel() // world
    start = dist.get_rank(group) * n
    return flat.narrow(0, start, n), start


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


# -- collectives from point-to-point ops (gloo) ---------------------------------------------
# Tags of their own, counted per group like the sequence numbers (every rank issues the same
# collectives in the same order), above the small tags user code sends with.
_P2P_TAG_BASE = 1 << 30
_p2p_count: dict = {}


def _next_tag(group) -> int:
    key = None if group is None or group is dist.GroupMember.WORLD else group
    n = _p2p_count.get(key, 0)
    _p2p_count[key] = n + 1
    return _P2P_TAG_BASE + n % _SEQ_TAG_SPAN


# Data of identified collectives goes under tags derived from the identity, in a range of its own
# (the sequence tags above stay below it): 2**30 + 2**29 up to 2**31 - 1.
_SEQ_TAG_SPAN = 1 << 29
_IDENTITY_TAG_BASE = _P2P_TAG_BASE + _SEQ_TAG_SPAN
HEADER_LEN = 4  # int64 values in an identity header


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives (seen in the identity headers): raised on every rank
    before any of the mismatched data is used."""


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

    __slots__ = ("headers", "heard", "peer_ranks", "data", "identity", "rank", "world", "key",
                 "checked")

    def __init__(self, headers, heard, peer_ranks, data, identity, rank, world, key):
        self.headers, self.heard, self.peer_ranks = headers, heard, peer_ranks
        self.data, self.identity, self.rank, self.world = data, identity, rank, world
        self.key, self.checked = key, False
        _unchecked.setdefault(key, collections.deque()).append(self)

    def _check(self) -> None:
        for work in self.headers.works[:len(self.peer_ranks)]:  # the receives; sends at the end
            work.wait()
        self.checked = True
        codes = [tuple(row) for row in self.heard.tolist()]
        if any(code != self.identity.code for code in codes):
            every = [self.identity.code] * self.world
            for r, code in zip(self.peer_ranks, codes):
                every[r] = code
            _mismatched[self.key] = self.identity.explain(every)

    def wait(self, *args, **kwargs) -> bool:
        queue = _unchecked.get(self.key)
        while not self.checked and queue and self.key not in _mismatched:
            queue.popleft()._check()
        failure = _mismatched.get(self.key)
        if failure is not None:
            raise failure
        self.data.wait(*args, **kwargs)
        for work in self.headers.works[len(self.peer_ranks):]:  # the sends (long done by now)
            work.wait(*args, **kwargs)
        return True

    def is_completed(self) -> bool:
        return self.headers.is_completed() and self.data.is_completed()

    def get_future(self):
        return torch.futures.collect_all([self.headers.get_future(), self.data.get_future()])


# Per group: identified exchanges whose headers are not checked yet (in issue order), and the
# first disagreement found.
_unchecked: dict = {}
_mismatched: dict = {}


def _identified_exchange(sends, receives, group, identity: Identity) -> _CheckedExchange:
    """``_exchange`` with identity headers: each peer gets ours under the sequence tag; the data
    goes under the identity's tag. Data is posted before headers on both sides, so a peer's
    header reaches this rank after its data (one connection per pair, written in order): the
    wait for the header is then the only one that sleeps."""
    peers = _peers(group)
    heard = torch.empty((len(peers), HEADER_LEN), dtype=torch.int64)
    tag = _next_tag(group)
    data = [dist.irecv(t, src, group=group, tag=identity.tag) for src, t in receives]
    data += [dist.isend(t, dst, group=group, tag=identity.tag) for dst, t in sends]
    works = [dist.irecv(heard[i], g, group=group, tag=tag) for i, (_, g) in enumerate(peers)]
    works += [dist.isend(identity.header, g, group=group, tag=tag) for _, g in peers]
    key = None if group is None or group is dist.GroupMember.WORLD else group
    return _CheckedExchange(_Exchange(works), heard, [r for r, _ in peers], _Exchange(data),
                            identity, dist.get_rank(group), dist.get_world_size(group), key)


def _peers(group) -> list[tuple[int, int]]:
    """(group rank, global rank) of every other member of ``group``, starting after this rank
    (so on more than 2 ranks not everyone sends to rank 0 first)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = [(rank + k) % world for k in range(1, world)]
    if group is None or group is dist.GroupMember.WORLD:
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


def _exchange(sends, receives, group, identity: Identity | None = None):
    """Post ``receives`` ``[(peer global rank, tensor)]`` and ``sends`` under one fresh tag
    (with an ``identity``: checked, see ``_identified_exchange``)."""
    if identity is not None and (sends or receives):  # one rank: no peer to disagree with
        return _identified_exchange(sends, receives, group, identity)
    tag = _next_tag(group)
    works = [dist.irecv(t, src, group=group, tag=tag) for src, t in receives]
    works += [dist.isend(t, dst, group=group, tag=tag) for dst, t in sends]
    return _Exchange(works)


def _gather_by_send_recv(output, mine, group, async_op: bool, identity=None):
    n = mine.numel()
    peers = _peers(group)
    return _run("all_gather_into_tensor", output, group, async_op,
                lambda group, async_op: _p2p_result(_exchange(
                    [(g, mine) for _, g in peers],
                    [(g, output.narrow(0, r * n, n)) for r, g in peers], group, identity),
                    async_op))


def _p2p_result(exchange, async_op: bool):
    if async_op:
        return exchange
    exchange.wait()
    return None


def reduce_scatter_scratch_rows(group=None) -> int:
    """Shard-sized rows of scratch space a reduce-scatter on ``group`` receives into (pass them
    as ``scratch`` to :func:`reduce_scatter_into` to avoid an allocation per call): one per peer
    on gloo, none on backends that reduce in place."""
    return dist.get_world_size(group) - 1 if _sends_and_receives(group) else 0


def _scatter_by_send_recv(output, flat, mine, op, group, async_op, scratch, identity=None):
    world, n = dist.get_world_size(group), mine.numel()
    if op != ReduceOp.SUM:
        raise ValueError(f"reduce_scatter_into on gloo sums (op=SUM); got {op}")
    rows = world - 1
    if scratch is None:
        scratch = torch.empty(rows * n, dtype=flat.dtype, device=flat.device)
    elif scratch.numel() < rows * n:
        raise ValueError(f"reduce_scatter_into: scratch has {scratch.numel()} elements, "
                         f"needs {rows} x {n}")
    peers = _peers(group)
    received = [scratch.narrow(0, i * n, n) for i in range(rows)]

    def reduce_locally():
        if not _same_memory(mine, output):
            output.copy_(mine)
        for row in received:
            output.add_(row)

    return _run("reduce_scatter_tensor", flat, group, async_op,
                lambda group, async_op: _p2p_result(_exchange(
                    [(g, flat.narrow(0, r * n, n)) for r, g in peers],
                    [(g, t) for (_, g), t in zip(peers, received)], group, identity), async_op),
                then=reduce_locally)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False,
                    identity: Identity | None = None):
    """Gather every rank's ``shard`` into the flat ``output`` (rank r's shard at ``r * shard.numel()``).

    ``shard`` may be this rank's slice of ``output`` itself (no copy is made then). With an
    ``identity`` (gloo's send/recv form; ignored by the other forms) waiting raises
    ``CollectiveMismatch`` when a peer's collective has another identity."""
    world = dist.get_world_size(group)
    if output.numel() != shard.numel() * world:
        raise ValueError(
            f"all_gather_into: output has {output.numel()} elements, expected "
            f"{world} x {shard.numel()}"
        )
    mine, start = _rank_slice(output, world, group)
    if _is_gloo(group):
        if not _same_memory(mine, shard):
            mine.copy_(shard.reshape(-1))
        if gloo_form() == "send_recv":
            return _gather_by_send_recv(output, mine, group, async_op, identity)
        n = mine.numel()
        output.narrow(0, 0, start).zero_()
        output.narrow(0, start + n, output.numel() - start - n).zero_()
        return _run("all_gather_into_tensor", output, group, async_op, dist.all_reduce, output,
                    op=ReduceOp.SUM)
    if _same_memory(mine, shard):
        shard = mine  # NCCL gathers in place when the input is the output's rank slice
    return _run("all_gather_into_tensor", output, group, async_op, _all_gather_single, output, shard)


def reduce_scatter_into(output: torch.Tensor, flat: torch.Tensor, op=ReduceOp.SUM, group=None,
                        async_op: bool = False, scratch: torch.Tensor | None = None,
                        identity: Identity | None = None):
    """Reduce ``flat`` across ranks and keep this rank's contiguous slice in ``output``.

    ``flat`` is used as scratch space: its contents are undefined afterwards. Passing this rank's
    slice of ``flat`` as ``output`` avoids a copy (and NCCL then reduces in place). On gloo the
    peers' rows are received into ``scratch`` (:func:`reduce_scatter_scratch_rows` rows of
    ``output``'s size; allocated per call when not given) and summed when the work is waited for.
    ``identity``: as for :func:`all_gather_into`."""
    world = dist.get_world_size(group)
    if flat.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter_into: input has {flat.numel()} elements, expected "
            f"{world} x {output.numel()}"
        )
    mine, _ = _rank_slice(flat, world, group)
    if _is_gloo(group):
        if gloo_form() == "send_recv":
            return _scatter_by_send_recv(output, flat, mine, op, group, async_op, scratch, identity)
        then = None if _same_memory(mine, output) else (lambda: output.copy_(mine))
        return _run("reduce_scatter_tensor", flat, group, async_op, dist.all_reduce, flat, op=op,
                    then=then)
    if _same_memory(mine, output):
        output = mine
    return _run("reduce_scatter_tensor", flat, group, async_op, _reduce_scatter_single, output, flat,
                op=op)


_NO_BYTES = torch.empty(0)


def barrier(group=None) -> None:
    _run("barrier", _NO_BYTES, group, False, dist.barrier)
