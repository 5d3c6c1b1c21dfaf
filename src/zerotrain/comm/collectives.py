"""Every collective zerotrain issues goes through this module.

One place picks the right torch API for the installed version (torch 2.13 renamed
``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single``; older torch only has the old
names) and the fastest form per backend. On gloo, ``all_gather``/``reduce_scatter`` (list or tensor
form) allocate a temporary as large as the whole buffer on every call, and on 2 ranks they were
slower than an in-place ``all_reduce`` of the same buffer, which allocates nothing
(``bench/collectives.py``, docs/benchmarks.md). So on gloo an all-gather is an in-place sum of
a buffer whose other ranks' slices are zero (``x + 0`` is exact), and a reduce-scatter is an
in-place all-reduce of which this rank keeps its slice. NCCL gets the native single-tensor
collectives, in place where the output is a slice of the input. Timeouts come from the process
group (see ``zerotrain.comm.distributed.default_timeout``).

Each call takes the next sequence number of its process group; when a collective times out or a
peer dies, the error names the op, its size, that number and the ranks that had not arrived
(``zerotrain.comm.hang``). The comms logger (``zerotrain.comm.logger``) replaces these functions
with timed wrappers while it is enabled, and puts these back when it is disabled.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zerotrain.comm.hang import diagnose

ReduceOp = dist.ReduceOp

# Last sequence number issued per process group (None = the default group).
_seq: dict = {}


def _next_seq(group) -> int:
    if group is not None and group is dist.GroupMember.WORLD:
        group = None
    n = _seq.get(group, 0) + 1
    _seq[group] = n
    return n


def last_seq(group=None) -> int:
    """The sequence number of the last collective issued on ``group`` by this rank."""
    if group is not None and group is dist.GroupMember.WORLD:
        group = None
    return _seq.get(group, 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PendingCollective:
    """The handle of an async collective: ``wait()`` turns a timeout into a ``CollectiveError``."""

    __slots__ = ("work", "op", "seq", "group", "tensor", "started", "then")

    def __init__(self, work, op: str, seq: int, group, tensor: torch.Tensor, started: float,
                 then=None):
        self.work, self.op, self.seq, self.group = work, op, seq, group
        self.tensor, self.started, self.then = tensor, started, then

    @property
    def nbytes(self) -> int:
        return _nbytes(self.tensor)

    def wait(self, *args, **kwargs):
        try:
            result = self.work.wait(*args, **kwargs)
        except RuntimeError as exc:
            raise diagnose(exc, self.op, self.nbytes, self.seq, self.group, self.started) from exc
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


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``shard`` into the flat ``output`` (rank r's shard at ``r * shard.numel()``).

    ``shard`` may be this rank's slice of ``output`` itself (no copy is made then)."""
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
        n = mine.numel()
        output.narrow(0, 0, start).zero_()
        output.narrow(0, start + n, output.numel() - start - n).zero_()
        return _run("all_gather_into_tensor", output, group, async_op, dist.all_reduce, output,
                    op=ReduceOp.SUM)
    if _same_memory(mine, shard):
        shard = mine  # NCCL gathers in place when the input is the output's rank slice
    return _run("all_gather_into_tensor", output, group, async_op, _all_gather_single, output, shard)


def reduce_scatter_into(output: torch.Tensor, flat: torch.Tensor, op=ReduceOp.SUM, group=None,
                        async_op: bool = False):
    """Reduce ``flat`` across ranks and keep this rank's contiguous slice in ``output``.

    ``flat`` is used as scratch space: its contents are undefined afterwards. Passing this rank's
    slice of ``flat`` as ``output`` avoids a copy (and NCCL then reduces in place)."""
    world = dist.get_world_size(group)
    if flat.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter_into: input has {flat.numel()} elements, expected "
            f"{world} x {output.numel()}"
        )
    mine, _ = _rank_slice(flat, world, group)
    if _is_gloo(group):
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
