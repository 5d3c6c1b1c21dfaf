"""``Collectives``: one object per process group, which issues every collective of that group.

``Collectives.of(group)`` returns the group's object (the world's for None), made on first use.
It holds what is per group: the sequence number of the last collective (the same collective has
the same number on every rank: hang diagnosis names collectives by it), the state of gloo's
send/recv forms (tags, identity headers not checked yet, the first mismatch), the group's hooks
and its codec. Each collective runs through the hook chain (``zerotrain.comm.hooks``): the
process-wide hooks (the comms logger while it is enabled), the group's own (``add_hook``: a
``ByteCounter``, say), and hang diagnosis, innermost. ``codec`` (``zerotrain.comm.codec``; None by
default) is the wire format of the group's all-gathers and reduce-scatters.

The objects are kept weakly by group, and an object holds its group weakly: nothing here keeps a
group, and with it gloo's worker threads, alive past ``destroy_process_group()`` (threads still
running at the interpreter's teardown abort the rank).

``zerotrain.comm.collectives``' functions (``all_reduce(tensor, group=...)`` and the rest) are this
class's methods reached through ``Collectives.of(group)``.
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerotrain.comm.codec import Codec
from zerotrain.comm.hang import HangDiagnosis
from zerotrain.comm.hooks import Call, CollectiveHook
from zerotrain.comm.transport import (
    ExchangeState,
    Finishing,
    Identity,
    ReduceOp,
    all_gather_single,
    exchange,
    gloo_form,
    is_gloo,
    is_world,
    nbytes,
    peers_of,
    rank_slice,
    reduce_scatter_single,
    same_memory,
    sends_and_receives,
)

_DIAGNOSIS = HangDiagnosis()
# Hooks every group's collectives run through (outermost), in the order added.
_PROCESS_HOOKS: list[CollectiveHook] = []
_NO_BYTES = torch.empty(0)


def add_process_hook(hook: CollectiveHook) -> None:
    """Run ``hook`` around every collective of every group (once, however often added)."""
    if not any(h is hook for h in _PROCESS_HOOKS):
        _PROCESS_HOOKS.append(hook)


def remove_process_hook(hook: CollectiveHook) -> None:
    _PROCESS_HOOKS[:] = [h for h in _PROCESS_HOOKS if h is not hook]


def process_hooks() -> tuple[CollectiveHook, ...]:
    return tuple(_PROCESS_HOOKS)


def _through(hooks: list, i: int, call: Call, base: Callable[[], Any]):
    if i == len(hooks):
        return base()
    return hooks[i].run(call, lambda: _through(hooks, i + 1, call, base))


class Collectives:
    """The collectives of one process group (see the module's docstring)."""

    __slots__ = ("_group_ref", "seq", "hooks", "codec", "exchange_state", "__weakref__")

    def __init__(self, group=None):
        self._group_ref = None if group is None else weakref.ref(group)
        self.seq = 0
        self.hooks: list[CollectiveHook] = []
        self.codec: Codec | None = None
        self.exchange_state = ExchangeState()

    @classmethod
    def of(cls, group=None) -> Collectives:
        """The one object of ``group`` (None or the world group: the world's)."""
        if is_world(group):
            return _WORLD
        found = _BY_GROUP.get(group)
        if found is None:
            found = _BY_GROUP[group] = cls(group)
        return found

    @property
    def group(self):
        """The process group (None for the world)."""
        if self._group_ref is None:
            return None
        group = self._group_ref()
        if group is None:
            raise RuntimeError("this Collectives object's process group no longer exists")
        return group

    def add_hook(self, hook: CollectiveHook) -> None:
        """Run ``hook`` around every collective of this group (inside the process-wide hooks)."""
        if not any(h is hook for h in self.hooks):
            self.hooks.append(hook)

    def remove_hook(self, hook: CollectiveHook) -> None:
        self.hooks = [h for h in self.hooks if h is not hook]

    def size(self) -> int:
        return dist.get_world_size(self.group)

    # -- the chain every collective runs through ----------------------------------------------
    def run(self, op: str, size: int, async_op: bool, issue: Callable[[], Any], then=None):
        """Issue ``issue()`` as collective ``op`` moving ``size`` bytes, through the hooks;
        ``then()`` runs once the transfer has completed (at ``wait()`` for an async op)."""
        self.seq += 1
        call = Call(op, size, self.group, self.seq, async_op)

        def base():
            work = issue()
            if async_op:
                return Finishing(work, then)
            if then is not None:
                then()
            return work

        if not _PROCESS_HOOKS and not self.hooks:
            return _DIAGNOSIS.run(call, base)
        return _through([*_PROCESS_HOOKS, *self.hooks, _DIAGNOSIS], 0, call, base)

    # -- tensor collectives ------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False):
        group = self.group
        return self.run(
            "all_reduce",
            nbytes(tensor),
            async_op,
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        group = self.group
        return self.run(
            "broadcast",
            nbytes(tensor),
            async_op,
            lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
        )

    def barrier(self) -> None:
        group = self.group
        self.run("barrier", 0, False, lambda: dist.barrier(group=group))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes=None,
        input_split_sizes=None,
        async_op: bool = False,
    ):
        """``torch.distributed.all_to_all_single`` (even or uneven splits); logged with the bytes
        this rank sends."""
        group = self.group
        return self.run(
            "all_to_all_single",
            nbytes(input),
            async_op,
            lambda: dist.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
            ),
        )

    def all_gather_into(
        self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False, identity: Identity | None = None
    ):
        world = self.size()
        if output.numel() != shard.numel() * world:
            raise ValueError(
                f"all_gather_into: output has {output.numel()} elements, expected {world} x {shard.numel()}"
            )
        if self.codec is not None:
            return self._gather_encoded(self.codec, output, shard, world, async_op, identity)
        return self._gather(output, shard, world, async_op, identity)

    def reduce_scatter_into(
        self,
        output: torch.Tensor,
        flat: torch.Tensor,
        op=ReduceOp.SUM,
        async_op: bool = False,
        scratch: torch.Tensor | None = None,
        identity: Identity | None = None,
    ):
        world = self.size()
        if flat.numel() != output.numel() * world:
            raise ValueError(
                f"reduce_scatter_into: input has {flat.numel()} elements, expected {world} x {output.numel()}"
            )
        if self.codec is not None:
            return self._scatter_encoded(self.codec, output, flat, op, world, async_op, identity)
        group = self.group
        mine, _ = rank_slice(flat, world, group)
        if is_gloo(group):
            if gloo_form() == "send_recv":
                return self._scatter_by_send_recv(output, flat, mine, op, world, async_op, scratch, identity)
            then = None if same_memory(mine, output) else (lambda: output.copy_(mine))
            return self.run(
                "reduce_scatter_tensor",
                nbytes(flat),
                async_op,
                lambda: dist.all_reduce(flat, op=op, group=group, async_op=async_op),
                then=then,
            )
        if same_memory(mine, output):
            output = mine  # NCCL reduces in place when the output is the input's rank slice
        return self.run(
            "reduce_scatter_tensor",
            nbytes(flat),
            async_op,
            lambda: reduce_scatter_single(output, flat, op=op, group=group, async_op=async_op),
        )

    def reduce_scatter_scratch_rows(self) -> int:
        """Shard-sized rows of scratch space a reduce-scatter receives into: one per peer on
        gloo's send/recv form, none on backends that reduce in place (nor with a codec)."""
        if self.codec is not None or not sends_and_receives(self.group):
            return 0
        return self.size() - 1

    # -- host objects --------------------------------------------------------------------------
    def all_gather_object(self, value, op: str = "all_gather_object") -> list:
        group = self.group
        out = [None] * self.size()
        self.run(op, len(pickle.dumps(value)), False, lambda: dist.all_gather_object(out, value, group=group))
        return out

    def broadcast_object(self, value, src: int, op: str = "broadcast_object"):
        """Global rank ``src``'s ``value`` (picklable), on every rank of the group."""
        group = self.group
        box = [value]
        self.run(
            op,
            len(pickle.dumps(value)) if value is not None else 0,
            False,
            lambda: dist.broadcast_object_list(box, src=src, group=group),
        )
        return box[0]

    # -- forms ---------------------------------------------------------------------------------
    def _gather(self, output, shard, world: int, async_op: bool, identity, then=None):
        group = self.group
        mine, start = rank_slice(output, world, group)
        if is_gloo(group):
            if not same_memory(mine, shard):
                mine.copy_(shard.reshape(-1))
            if gloo_form() == "send_recv":
                n, peers, state = mine.numel(), peers_of(group), self.exchange_state
                return self.run(
                    "all_gather_into_tensor",
                    nbytes(output),
                    async_op,
                    lambda: exchange(
                        [(g, mine) for _, g in peers],
                        [(g, output.narrow(0, r * n, n)) for r, g in peers],
                        group,
                        state,
                        async_op,
                        identity,
                    ),
                    then=then,
                )
            n = mine.numel()
            output.narrow(0, 0, start).zero_()
            output.narrow(0, start + n, output.numel() - start - n).zero_()
            return self.run(
                "all_gather_into_tensor",
                nbytes(output),
                async_op,
                lambda: dist.all_reduce(output, op=ReduceOp.SUM, group=group, async_op=async_op),
                then=then,
            )
        if same_memory(mine, shard):
            shard = mine  # NCCL gathers in place when the input is the output's rank slice
        return self.run(
            "all_gather_into_tensor",
            nbytes(output),
            async_op,
            lambda: all_gather_single(output, shard, group=group, async_op=async_op),
            then=then,
        )

    def _scatter_by_send_recv(self, output, flat, mine, op, world, async_op, scratch, identity):
        n = mine.numel()
        if op != ReduceOp.SUM:
            raise ValueError(f"reduce_scatter_into on gloo sums (op=SUM); got {op}")
        rows = world - 1
        if scratch is None:
            scratch = torch.empty(rows * n, dtype=flat.dtype, device=flat.device)
        elif scratch.numel() < rows * n:
            raise ValueError(f"reduce_scatter_into: scratch has {scratch.numel()} elements, needs {rows} x {n}")
        group, state = self.group, self.exchange_state
        peers = peers_of(group)
        received = [scratch.narrow(0, i * n, n) for i in range(rows)]

        def reduce_locally():
            if not same_memory(mine, output):
                output.copy_(mine)
            for row in received:
                output.add_(row)

        return self.run(
            "reduce_scatter_tensor",
            nbytes(flat),
            async_op,
            lambda: exchange(
                [(g, flat.narrow(0, r * n, n)) for r, g in peers],
                [(g, t) for (_, g), t in zip(peers, received)],
                group,
                state,
                async_op,
                identity,
            ),
            then=reduce_locally,
        )

    def _gather_encoded(self, codec: Codec, output, shard, world: int, async_op: bool, identity):
        n = shard.numel()
        payload = codec.encode(shard.reshape(-1)).reshape(-1).contiguous()
        m = payload.numel()
        wire = payload.new_empty(world * m)

        def decode():
            for r in range(world):
                codec.decode(wire.narrow(0, r * m, m), output.narrow(0, r * n, n))

        return self._gather(wire, payload, world, async_op, identity, then=decode)

    def _scatter_encoded(self, codec: Codec, output, flat, op, world: int, async_op: bool, identity):
        if op != ReduceOp.SUM:
            raise ValueError(f"reduce_scatter_into with a codec sums (op=SUM); got {op}")
        n, group = output.numel(), self.group
        send = torch.cat([codec.encode(flat.narrow(0, r * n, n)).reshape(-1) for r in range(world)])
        m = send.numel() // world
        received = send.new_empty(world * m)
        rank = dist.get_rank(group)
        row = lambda t, r: t.narrow(0, r * m, m)  # noqa: E731

        def reduce_locally():
            decoded = torch.empty_like(output)
            output.zero_()
            for r in range(world):
                codec.decode(row(received, r), decoded)
                output.add_(decoded)

        if sends_and_receives(group):
            row(received, rank).copy_(row(send, rank))
            peers, state = peers_of(group), self.exchange_state

            def issue():
                sends = [(g, row(send, r)) for r, g in peers]
                return exchange(sends, [(g, row(received, r)) for r, g in peers], group, state, async_op, identity)
        else:

            def issue():
                return dist.all_to_all_single(received, send, group=group, async_op=async_op)

        return self.run("reduce_scatter_tensor", nbytes(send), async_op, issue, then=reduce_locally)


_WORLD = Collectives(None)
_BY_GROUP: weakref.WeakKeyDictionary[Any, Collectives] = weakref.WeakKeyDictionary()

__all__ = ["Collectives", "add_process_hook", "remove_process_hook", "process_hooks"]
