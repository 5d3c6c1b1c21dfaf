"""How a stage reduces the gradients of its trained units across ranks.

Two ways, chosen by the stage strategy:

- ``AllReduceGradients`` (stages 0 and 1): full gradients live in persistent flat buffers laid out
  like the units (``.grad`` is a view, so autograd accumulates in place) and are all-reduced once
  per accumulation window; this rank's gradient shard is a view of the reduced buffer.
- ``ReduceScatterGradients`` (stages 2 and 3): every backward copies a finished unit's gradients,
  averaged, into a small staging pool and reduce-scatters them straight into shard-sized
  gradients; the full-size ones are freed at once. Under ``memory_release: "eager"`` the shard
  gradients themselves exist only from the unit's first reduction to the step: ``zero()`` frees
  them, so the start of backward (the peak: every activation saved) does not hold them.

Both launch buckets strictly in unit order, so ranks whose backward completes units in another
order (a branch taken on one rank only) still issue the same collectives. Each unit is reduced
over its own ``UnitReduction`` (zero/reduce_groups.py): its group, and the divide factor its sum
is divided by ("averaged" above: the default, the group's size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from zerotrain.comm import collectives
from zerotrain.memory_release import TrimEvery, release_freed_memory
from zerotrain.precision import PrecisionPolicy
from zerotrain.zero.divergence import CollectiveChecks
from zerotrain.zero.gradient_buckets import BucketedGradients, GradientBucket, Pending
from zerotrain.zero.partition import FlatParamUnit
from zerotrain.zero.reduce_groups import UnitReduction
from zerotrain.zero.staging import StagingPool

if TYPE_CHECKING:
    from zerotrain.offload.params import GradSwapper


class _Reduction:
    """What both ways share: the buckets, the shard gradients, the backward protocol."""

    grads: BucketedGradients
    shard_grads: list[torch.Tensor]
    staging: StagingPool | None
    reduces_every_backward = False
    checks: CollectiveChecks  # each reduction's identity (stage 3) and agreement check
    grad_swapper: GradSwapper | None = None  # NVMe gradient offload (stage 3, offload_param "nvme")

    def _agree(self, bucket: GradientBucket) -> None:
        if self.checks.agreement is not None:
            self.checks.agreement.check("reduce", self.grads.buckets.index(bucket))

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        sync = (not no_sync) and (boundary or self.reduces_every_backward)
        self.grads.begin_backward(sync=sync)

    def end_backward(self) -> None:
        self.grads.end_backward()

    def ensure_shard_grads(self) -> None:
        """Make every shard gradient a real tensor before the step or the norm reads them."""

    def grads_for(self, masters: Sequence[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
        """The step's gradient of each master (of the trained units at ``indices``; call
        ``ensure_shard_grads()`` first): the shard gradient, or a copy in the master's dtype and
        device (then, where ``zero()`` frees them anyway, the shard gradient is freed as soon as
        it is copied: bf16 GPT-2 110M, 105 MiB less at the step's peak)."""
        out = []
        for i, master in zip(indices, masters):
            grad = self.shard_grads[i]
            if grad.dtype == master.dtype and grad.device == master.device:
                out.append(grad)
                continue
            out.append(grad.to(master.device, master.dtype))
            del grad
            self._free_early(i)
        return out

    def _free_early(self, index: int) -> None:
        pass

    _pools: dict = {}  # comm dtype -> StagingPool

    @property
    def staging_nbytes(self) -> int:
        """Bytes of the staging slots allocated now (every communication dtype's)."""
        return sum(pool.nbytes for pool in self._pools.values())

    def abort_backward(self) -> None:
        self.grads.abort_backward()

    @property
    def syncing(self) -> bool:
        return self.grads.syncing

    def unused_names(self, units: Sequence[FlatParamUnit]) -> list[str]:
        """Names of parameters that got no gradient in the current backward."""
        return [
            name
            for bucket, unit in zip(self.grads.buckets, units)
            for name, seen in zip(unit.names, bucket.seen)
            if not seen
        ]

    @property
    def nbytes(self) -> int:
        """Bytes of gradient memory held between steps."""
        raise NotImplementedError

    def close(self) -> None:
        self.grads.remove_hooks()


class AllReduceGradients(_Reduction):
    """Gradients accumulated in persistent full-size buckets (``.grad`` views), reduced once
    per accumulation window. With ``scatter`` (stage 1: the step reads only this rank's shard)
    a bucket is reduce-scattered in place: half the bytes of an all-reduce, the same volume per
    step as DDP's with the parameters' all-gather after the step. Only the shard holds the
    average afterwards, so the parameters' ``.grad`` become None until ``zero()`` (as in
    DeepSpeed's stages 1 and 2); another backward before it (a GAN's second discriminator loss)
    first turns each bucket back into a sum to accumulate onto."""

    def __init__(
        self,
        units: Sequence[FlatParamUnit],
        precision: PrecisionPolicy,
        reductions: Sequence[UnitReduction],
        overlap: bool,
        trim: TrimEvery,
        scatter: bool = False,
        checks: CollectiveChecks = CollectiveChecks(),
    ):
        # Each unit's group and divide factor (shared with the stage, which may change factors).
        self.reductions, self._trim, self.checks = list(reductions), trim, checks
        self.grads = BucketedGradients(
            [u.params for u in units],
            self._launch,
            overlap,
            [u.layout for u in units],
            persistent=True,
            dtype=precision.grad_accum_dtype,
        )
        self._index = {id(b): i for i, b in enumerate(self.grads.buckets)}
        # A unit sharded over its group (stage 1) holds the shard of its rank there.
        self._shard_ranks = [
            r.rank if b.layout.world_size > 1 else 0 for b, r in zip(self.grads.buckets, self.reductions)
        ]
        self.shard_grads = [b.layout.shard(b.buffer(), rank) for b, rank in zip(self.grads.buckets, self._shard_ranks)]
        largest = max((u.layout.padded_numel for u in units), default=1)
        device = units[0].device if units else None
        # A unit reduced in another dtype than its gradients' goes through a staging slot of
        # that dtype (one pool per dtype).
        wires = [r.comm_dtype or precision.comm_dtype for r in self.reductions]
        casts = [w != precision.grad_accum_dtype and r.size > 1 for w, r in zip(wires, self.reductions)]
        self._pools = {w: StagingPool(2 if overlap else 1, largest, w, device) for w, cast in zip(wires, casts) if cast}
        self._cast_pools = [self._pools[w] if cast else None for w, cast in zip(wires, casts)]
        self.staging = next(iter(self._pools.values()), None)
        # In-place reduce-scatters of the buckets themselves (on gloo each receives the peers'
        # rows into a shard-sized temporary, freed when the reduction is waited for): the units
        # sharded over their whole group and reduced in their gradients' dtype.
        self._scatters = [
            scatter and not cast and r.size > 1 and b.layout.world_size == r.size
            for b, r, cast in zip(self.grads.buckets, self.reductions, casts)
        ]
        self._scattered = False  # buckets reduce-scattered since the last zero()
        self._in_flight: list = []

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        if self._scattered:
            self._restore_sums()
        super().begin_backward(boundary, no_sync)

    def _restore_sums(self) -> None:
        """Each scattered bucket back to what accumulating onto needs: this rank's reduced
        shard times the divide factor (the next reduction divides it again), zeros in the other
        ranks' parts."""
        for i, (bucket, shard) in enumerate(zip(self.grads.buckets, self.shard_grads)):
            if not self._scatters[i]:
                continue
            start = self._shard_ranks[i] * bucket.layout.shard_numel
            end = start + bucket.layout.shard_numel
            flat = bucket.buffer()
            flat.narrow(0, 0, start).zero_()
            flat.narrow(0, end, flat.numel() - end).zero_()
            shard.mul_(self.reductions[i].divide_factor)
            bucket.attach()
        self._scattered = False

    def _launch(self, bucket: GradientBucket) -> Pending | None:
        self._trim.reduced(bucket.layout.padded_numel)
        index = self._index[id(bucket)]
        spec = self.reductions[index]
        flat = bucket.buffer()
        if spec.size == 1:
            if spec.divide_factor != 1.0:
                flat.div_(spec.divide_factor)
            return None
        self._agree(bucket)
        if self._scatters[index]:
            self._scattered = True
            flat.div_(spec.divide_factor)
            bucket.free_grads()  # the rest of the bucket is the peers' to hold: no .grad shows it
            mine = bucket.layout.shard(flat, self._shard_ranks[index])
            work = collectives.reduce_scatter_into(mine, flat, group=spec.group, async_op=True)
            # Each reduction in flight holds a shard-sized receive buffer (and, on gloo, the
            # backend's copies of what it sends): two at a time, not the whole model's worth
            # until the end of backward (GPT-2 110M: +150 MiB at the embedding's backward).
            self._in_flight.append(work)
            if len(self._in_flight) > 2:
                self._in_flight.pop(0).wait()
            return work
        pool = self._cast_pools[index]
        if pool is None:
            # Dividing before the sum keeps the launch inside backward, off the critical path.
            flat.div_(spec.divide_factor)
            return collectives.all_reduce(flat, group=spec.group, async_op=True)
        slot = pool.acquire()  # reduced in another dtype: cast through a slot
        wire = slot.flat.narrow(0, 0, flat.numel())
        wire.copy_(flat).div_(spec.divide_factor)
        work = collectives.all_reduce(wire, group=spec.group, async_op=True)
        return slot.track(work, lambda: flat.copy_(wire))

    def end_backward(self) -> None:
        super().end_backward()
        self._in_flight = []

    def abort_backward(self) -> None:
        super().abort_backward()
        self._in_flight = []

    def zero(self) -> None:
        self.grads.zero()
        self._scattered = False

    @property
    def nbytes(self) -> int:
        return self.grads.nbytes


class ReduceScatterGradients(_Reduction):
    """Gradients reduce-scattered into shard gradients during every backward. ``reduced(unit)``
    is called once a unit's gradients are copied out (stage 3 releases its parameters);
    ``grad_offload`` (a ``zerotrain.offload.NvmeParamOffload``): the shard gradients live in its
    swap folder too, through a ``GradSwapper`` this reduction owns (``grad_swapper``)."""

    reduces_every_backward = True  # full gradients cannot be kept across micro-steps

    def __init__(
        self,
        units: Sequence[FlatParamUnit],
        precision: PrecisionPolicy,
        reductions: Sequence[UnitReduction],
        overlap: bool,
        trim: TrimEvery,
        slot_numel: int,
        use_reduce_scatter: bool = True,
        reduced: Callable[[FlatParamUnit], None] | None = None,
        checks: CollectiveChecks = CollectiveChecks(),
        grad_offload=None,
    ):
        # Each unit's group and divide factor (shared with the stage, which may change factors);
        # a unit is sharded over its whole group.
        self.reductions, self._trim, self.checks = list(reductions), trim, checks
        for unit, spec in zip(units, self.reductions):
            if unit.layout.world_size != spec.size:
                raise ValueError(
                    f"unit {unit.names[:1]} is sharded {unit.layout.world_size} ways but "
                    f"reduced over a group of {spec.size}; shard it over its group"
                )
        self._use_reduce_scatter = use_reduce_scatter
        self._reduced = reduced  # called once a unit's gradients are copied out (stage 3 frees it)
        self.grads = BucketedGradients(
            [u.params for u in units], self._launch, overlap, [u.layout for u in units], persistent=False
        )
        # Shard gradients live beside the shards (host memory under offload_param); the staging
        # slots, which the collectives send and receive, where the gradients are computed.
        device = units[0].device if units else None
        compute_device = units[0].layout.device if units else None
        self._grad_dtype, self._device = precision.grad_accum_dtype, device
        self._shard_numels = [u.layout.shard_numel for u in units]
        self.shard_grads = [torch.zeros(n, dtype=self._grad_dtype, device=device) for n in self._shard_numels]
        # Indices of shard gradients freed by ``zero()`` (an empty placeholder in the list, which
        # the stage shares): the next reduction writes a new one instead of adding.
        self._freed: set[int] = set()
        self._unit_of = {id(b): (u, i) for i, (b, u) in enumerate(zip(self.grads.buckets, units))}
        self._unit_of_index = {id(u): i for i, u in enumerate(units)}
        largest = max((u.layout.padded_numel for u in units), default=1)
        # Slots hold one bucket (or the largest unit, if smaller); bigger units go in chunks.
        # One bucket in four slots: up to three reductions stay in flight while backward goes on
        # (with two slots backward waited ~0.35 s per step on the 110M GPT-2).
        rows_of: dict[int, int] = {}  # per group: the backend's receive rows (gloo: a peer's each)
        for spec in self.reductions:
            if spec.size > 1 and id(spec.group) not in rows_of:
                rows_of[id(spec.group)] = collectives.reduce_scatter_scratch_rows(spec.group)
        self._scratch_rows = [rows_of.get(id(s.group), 0) if s.size > 1 else 0 for s in self.reductions]
        widest = max((s.size + rows for s, rows in zip(self.reductions, self._scratch_rows)), default=1)
        wires = [r.comm_dtype or precision.comm_dtype for r in self.reductions]
        self._pools = {
            w: StagingPool(4 if overlap else 1, min(largest, max(slot_numel, widest)), w, compute_device)
            for w in [precision.comm_dtype] + wires
        }  # one pool per dtype gradients travel in
        self.staging = self._pools[precision.comm_dtype]
        self._unit_pools = [self._pools[w] for w in wires]
        if grad_offload is not None and units:
            swapper = grad_offload.grad_swapper(dict(zip(units, self.shard_grads)), self.wait_for)
            self.grad_swapper = swapper
            for unit in units:
                swapper.add_unit(unit, write=False)  # zeros: nothing to write

    def wait_for(self, unit: FlatParamUnit) -> None:
        """Wait until ``unit``'s launched reduction has landed in its shard gradient."""
        bucket = self.grads.buckets[self._unit_of_index[id(unit)]]
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None

    def _launch(self, bucket: GradientBucket) -> Pending | None:
        """Reduce a finished unit's gradients into this rank's shard, in chunks that fit the
        staging slots (so a huge parameter, e.g. an embedding, needs no model-sized buffer)."""
        unit, index = self._unit_of[id(bucket)]
        if self.grad_swapper is not None:  # NVMe offload: the shard gradient back in memory
            self.grad_swapper.ensure(unit, dirty=True)
        fresh = index in self._freed  # freed since the step: every chunk is written, not added
        if fresh:
            self._freed.discard(index)
            self.shard_grads[index] = torch.empty(
                self._shard_numels[index], dtype=self._grad_dtype, device=self._device
            )
        spec = self.reductions[index]
        world, shard = spec.size, bucket.layout.shard_numel
        self._agree(bucket)
        # Gloo receives the peers' rows beside the slot's own (one row per peer): chunks shrink
        # so both fit, keeping the staging memory what it was.
        rows = self._scratch_rows[index] if self._use_reduce_scatter else 0
        pool = self._unit_pools[index]
        chunk = pool.chunk_numel(world + rows)
        pending = []
        for c0 in range(0, shard, chunk):
            n = min(chunk, shard - c0)
            slot = pool.acquire()
            wire = slot.flat.narrow(0, 0, n * world)
            for r in range(world):  # row r: the part of rank r's shard in this chunk, divided
                bucket.copy_grad_range(
                    wire.narrow(0, r * n, n), r * shard + c0, r * shard + c0 + n, divisor=spec.divide_factor
                )
            if world == 1:
                self._land(index, c0, wire, fresh)
                continue
            mine = wire.narrow(0, spec.rank * n, n)  # reduced in place: this rank's slice
            if self._use_reduce_scatter:
                work = collectives.reduce_scatter_into(
                    mine,
                    wire,
                    group=spec.group,
                    async_op=True,
                    scratch=slot.flat.narrow(0, n * world, n * rows) if rows else None,
                    identity=(None if self.checks.identities is None else self.checks.identities.reduce(index, c0, n)),
                )
            else:
                work = collectives.all_reduce(wire, group=spec.group, async_op=True)
            # The callback names the gradient by index: a slot keeps its last callback, which
            # must not keep a shard gradient alive after ``zero()`` freed it.
            pending.append(slot.track(work, lambda i=index, c0=c0, m=mine, fresh=fresh: self._land(i, c0, m, fresh)))
        bucket.free_grads()
        if self._reduced is not None:
            self._reduced(unit)
        self._trim.reduced(bucket.layout.padded_numel)
        return _WaitAll(pending) if pending else None

    def end_backward(self) -> None:
        super().end_backward()
        if self._frees():  # idle until the next backward's first reduction
            for pool in self._pools.values():
                pool.release_memory()

    def _land(self, index: int, start: int, reduced: torch.Tensor, fresh: bool) -> None:
        target = self.shard_grads[index].narrow(0, start, reduced.numel())
        if reduced.device != target.device:  # offload_param: reduced on the device, kept on the host
            reduced = reduced.to(target.device)
        target.copy_(reduced) if fresh else target.add_(reduced)

    def zero(self) -> None:
        """Gradients back to zero. Under ``memory_release: "eager"`` (and without NVMe gradient
        offload, which manages them itself) the shard gradients are freed instead: they would
        hold zeros through the next forward and the start of backward, where activations peak
        (110M GPT-2 stage 3: 210 MiB of the peak). The step must drop its references to them
        (``master.grad``) for the memory to go."""
        self.grads.zero()
        if self._frees():
            empty = torch.empty(0, dtype=self._grad_dtype, device=self._device)
            for i in range(len(self.shard_grads)):
                self.shard_grads[i] = empty
            self._freed = set(range(len(self.shard_grads)))
            # Those below the mmap threshold were freed on the heap, after the step's trim.
            release_freed_memory()
            return
        self.ensure_shard_grads()
        for g in self.shard_grads:
            g.zero_()

    def _frees(self) -> bool:
        return self._trim.policy.eager and self.grad_swapper is None  # the engine's policy

    def _free_early(self, index: int) -> None:
        if self._frees():
            self.shard_grads[index] = torch.empty(0, dtype=self._grad_dtype, device=self._device)
            self._freed.add(index)

    def ensure_shard_grads(self) -> None:
        for i in sorted(self._freed):
            self.shard_grads[i] = torch.zeros(self._shard_numels[i], dtype=self._grad_dtype, device=self._device)
        self._freed = set()

    @property
    def freed_numel(self) -> int:
        """Shard-gradient elements not allocated now (freed by ``zero()``, not yet reduced into)."""
        return sum(self._shard_numels[i] for i in self._freed)

    @property
    def nbytes(self) -> int:
        """Bytes of the shard gradients while held (from a unit's first reduction to the step)."""
        return sum(self._shard_numels) * self._grad_dtype.itemsize


class _WaitAll:
    """The chunks of one unit's reduction, waited for together."""

    def __init__(self, pending):
        self._pending = pending

    def wait(self) -> None:
        for p in self._pending:
            p.wait()
