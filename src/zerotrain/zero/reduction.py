"""How a stage reduces the gradients of its trained units across ranks.

Two ways, chosen by the stage strategy:

- ``AllReduceGradients`` (stages 0 and 1): full gradients live in persistent flat buffers laid out
  like the units (``.grad`` is a view, so autograd accumulates in place) and are all-reduced once
  per accumulation window; this rank's gradient shard is a view of the reduced buffer.
- ``ReduceScatterGradients`` (stages 2 and 3): every backward copies a finished unit's gradients,
  averaged, into a small staging pool and reduce-scatters them straight into shard-sized
  gradients; the full-size ones are freed at once.

Both launch buckets strictly in unit order, so ranks whose backward completes units in another
order (a branch taken on one rank only) still issue the same collectives.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from zerotrain.comm import collectives
from zerotrain.memory_release import TrimEvery
from zerotrain.precision import PrecisionPolicy
from zerotrain.zero.gradient_buckets import BucketedGradients, GradientBucket
from zerotrain.zero.partition import FlatParamUnit
from zerotrain.zero.staging import StagingPool


class _Reduction:
    """What both ways share: the buckets, the shard gradients, the backward protocol."""

    grads: BucketedGradients
    shard_grads: list[torch.Tensor]
    staging: StagingPool | None
    reduces_every_backward = False
    agreement = None  # a zero.agreement.CollectiveAgreement when ZEROTRAIN_CHECK_COLLECTIVES=1

    def _agree(self, bucket: GradientBucket) -> None:
        if self.agreement is not None:
            self.agreement.check("reduce", self.grads.buckets.index(bucket))

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        sync = (not no_sync) and (boundary or self.reduces_every_backward)
        self.grads.begin_backward(sync=sync)

    def end_backward(self) -> None:
        self.grads.end_backward()

    def abort_backward(self) -> None:
        self.grads.abort_backward()

    @property
    def syncing(self) -> bool:
        return self.grads.syncing

    def unused_names(self, units: Sequence[FlatParamUnit]) -> list[str]:
        """Names of parameters that got no gradient in the current backward."""
        return [name for bucket, unit in zip(self.grads.buckets, units)
                for name, seen in zip(unit.names, bucket.seen) if not seen]

    @property
    def nbytes(self) -> int:
        """Bytes of gradient memory held between steps."""
        raise NotImplementedError

    def close(self) -> None:
        self.grads.remove_hooks()


class AllReduceGradients(_Reduction):
    def __init__(self, units: Sequence[FlatParamUnit], precision: PrecisionPolicy, world_size: int,
                 shard_rank: int, group, overlap: bool, trim: TrimEvery):
        self.world_size, self.group, self._trim = world_size, group, trim
        self.grads = BucketedGradients([u.params for u in units], self._launch, overlap,
                                       [u.layout for u in units], persistent=True,
                                       dtype=precision.grad_accum_dtype)
        self.shard_grads = [b.layout.shard(b.flat, shard_rank) for b in self.grads.buckets]
        largest = max((u.layout.padded_numel for u in units), default=1)
        device = units[0].shard.device if units else None
        needs_cast = precision.comm_dtype != precision.grad_accum_dtype
        self.staging = (StagingPool(2 if overlap else 1, largest, precision.comm_dtype, device)
                        if needs_cast and world_size > 1 else None)

    def _launch(self, bucket: GradientBucket):
        self._trim.reduced(bucket.layout.padded_numel)
        if self.world_size == 1:
            return None
        self._agree(bucket)
        if self.staging is None:
            # Dividing before the sum keeps the launch inside backward, off the critical path.
            bucket.flat.div_(self.world_size)
            return collectives.all_reduce(bucket.flat, group=self.group, async_op=True)
        slot = self.staging.acquire()  # reduced in another dtype: cast through a slot
        wire = slot.flat.narrow(0, 0, bucket.flat.numel())
        wire.copy_(bucket.flat).div_(self.world_size)
        work = collectives.all_reduce(wire, group=self.group, async_op=True)
        return slot.track(work, lambda: bucket.flat.copy_(wire))

    def zero(self) -> None:
        self.grads.zero()

    @property
    def nbytes(self) -> int:
        return self.grads.nbytes


class ReduceScatterGradients(_Reduction):
    reduces_every_backward = True  # full gradients cannot be kept across micro-steps
    before_reduce: Callable[[FlatParamUnit], None] | None = None

    def __init__(self, units: Sequence[FlatParamUnit], precision: PrecisionPolicy, world_size: int,
                 shard_rank: int, group, overlap: bool, trim: TrimEvery, slot_numel: int,
                 use_reduce_scatter: bool = True,
                 reduced: Callable[[FlatParamUnit], None] | None = None):
        self.world_size, self.rank, self.group, self._trim = world_size, shard_rank, group, trim
        self._use_reduce_scatter = use_reduce_scatter
        self._reduced = reduced  # called once a unit's gradients are copied out (stage 3 frees it)
        self.grads = BucketedGradients([u.params for u in units], self._launch, overlap,
                                       [u.layout for u in units], persistent=False)
        device = units[0].shard.device if units else None
        self.shard_grads = [torch.zeros(u.layout.shard_numel, dtype=precision.grad_accum_dtype,
                                        device=device) for u in units]
        self._unit_of = {id(b): (u, g) for b, u, g in zip(self.grads.buckets, units, self.shard_grads)}
        largest = max((u.layout.padded_numel for u in units), default=1)
        # Slots hold one bucket (or the largest unit, if smaller); bigger units go in chunks.
        # One bucket in four slots: up to three reductions stay in flight while backward goes on
        # (with two slots backward waited ~0.35 s per step on the 110M GPT-2).
        self.staging = StagingPool(4 if overlap else 1, min(largest, max(slot_numel, world_size)),
                                   precision.comm_dtype, device)

    def _launch(self, bucket: GradientBucket):
        """Reduce a finished unit's gradients into this rank's shard, in chunks that fit the
        staging slots (so a huge parameter, e.g. an embedding, needs no model-sized buffer)."""
        unit, shard_grad = self._unit_of[id(bucket)]
        if self.before_reduce is not None:  # NVMe offload: the shard gradient back in memory
            self.before_reduce(unit)
        world, shard = self.world_size, bucket.layout.shard_numel
        self._agree(bucket)
        chunk = self.staging.chunk_numel(world)
        pending = []
        for c0 in range(0, shard, chunk):
            n = min(chunk, shard - c0)
            slot = self.staging.acquire()
            wire = slot.flat.narrow(0, 0, n * world)
            for r in range(world):  # row r: the part of rank r's shard in this chunk, averaged
                bucket.copy_grad_range(wire.narrow(0, r * n, n), r * shard + c0,
                                       r * shard + c0 + n, divisor=world)
            target = shard_grad.narrow(0, c0, n)
            if world == 1:
                target.add_(wire)
                continue
            mine = wire.narrow(0, self.rank * n, n)  # reduced in place: this rank's slice
            if self._use_reduce_scatter:
                work = collectives.reduce_scatter_into(mine, wire, group=self.group, async_op=True)
            else:
                work = collectives.all_reduce(wire, group=self.group, async_op=True)
            pending.append(slot.track(work, lambda t=target, m=mine: t.add_(m)))
        bucket.free_grads()
        if self._reduced is not None:
            self._reduced(unit)
        self._trim.reduced(bucket.layout.padded_numel)
        return _WaitAll(pending) if pending else None

    def zero(self) -> None:
        self.grads.zero()
        for g in self.shard_grads:
            g.zero_()

    @property
    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.shard_grads)


class _WaitAll:
    """The chunks of one unit's reduction, waited for together."""

    def __init__(self, pending):
        self._pending = pending

    def wait(self) -> None:
        for p in self._pending:
            p.wait()
