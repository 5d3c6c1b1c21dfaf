"""ZeRO stages 1 and 2: partitioned optimizer state (1) and gradients (2).

Both flatten the trainable parameters into ``FlatParamUnit``s and give the user's optimizer
only this rank's shards (its param groups keep their hyperparameters; only ``params`` change),
then all-gather the updated shards after each step. They differ in the gradients:

- stage 1 keeps full gradients in persistent flat buffers (as stage 0) and all-reduces them
  once per accumulation window; the optimizer reads its shard as a view;
- stage 2 keeps only a shard-sized gradient per unit: every backward reduce-scatters finished
  units through a small staging pool into the shards and frees the full-size gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerotrain.comm import collectives
from zerotrain.zero.gradient_buckets import BucketedGradients, GradientBucket
from zerotrain.zero.memory import optimizer_state_bytes, tensor_bytes
from zerotrain.zero.partition import FlatParamUnit, plan_units
from zerotrain.zero.staging import StagingPool


class PartitionedOptimizer:
    """Stage 1 or 2 over ``module``'s parameters and ``optimizer``'s param groups."""

    def __init__(self, stage: int, module: torch.nn.Module, optimizer, unit_numel: int,
                 overlap: bool = True, use_reduce_scatter: bool = True, group=None):
        if optimizer is None:
            raise ValueError(f"zero_optimization.stage={stage} partitions optimizer state, so it "
                             "needs an optimizer: add an 'optimizer' section or pass optimizer=")
        if optimizer.state:
            raise ValueError("the optimizer already holds state; ZeRO must partition it before "
                             "the first step (load checkpoints through the engine instead)")
        self.stage = stage
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.optimizer = optimizer
        backward_order = list(module.parameters())[::-1]
        plan = plan_units(optimizer.param_groups, unit_numel, backward_order)
        self.units = [FlatParamUnit(params, self.world_size, self.rank) for _, params in plan]
        for g, group_dict in enumerate(optimizer.param_groups):
            group_dict["params"] = [u.shard for (ug, _), u in zip(plan, self.units) if ug == g]
        buckets = [u.params for u in self.units]
        layouts = [u.layout for u in self.units]
        if stage == 1:
            self.grads = BucketedGradients(buckets, self._all_reduce, overlap, layouts,
                                           persistent=True)
            self.shard_grads = [b.layout.shard(b.flat, self.rank) for b in self.grads.buckets]
            self.staging = None
        else:
            self.grads = BucketedGradients(buckets, self._reduce_scatter, overlap, layouts,
                                           persistent=False)
            self.shard_grads = [torch.zeros_like(u.shard) for u in self.units]
            largest = max(u.layout.padded_numel for u in self.units)
            self.staging = StagingPool(2 if overlap else 1, largest, self.world_size,
                                       self.units[0].flat.dtype, self.units[0].flat.device)
            self._unit_of = {id(b): i for i, b in enumerate(self.grads.buckets)}
            self._use_reduce_scatter = use_reduce_scatter
        self._attach_shard_grads()

    # -- gradient reduction -------------------------------------------------------------
    def _all_reduce(self, bucket: GradientBucket):
        if self.world_size == 1:
            return None
        bucket.flat.div_(self.world_size)
        return collectives.all_reduce(bucket.flat, group=self.group, async_op=True)

    def _reduce_scatter(self, bucket: GradientBucket):
        shard_grad = self.shard_grads[self._unit_of[id(bucket)]]
        slot = self.staging.acquire()
        flat = slot.flat.narrow(0, 0, bucket.layout.padded_numel)
        bucket.gather_grads_into(flat)
        out = slot.shard.narrow(0, 0, bucket.layout.shard_numel)
        if self.world_size == 1:
            shard_grad.add_(flat)
            return None
        flat.div_(self.world_size)
        if self._use_reduce_scatter:
            work = collectives.reduce_scatter_into(out, flat, group=self.group, async_op=True)
            return slot.track(work, lambda: shard_grad.add_(out))
        work = collectives.all_reduce(flat, group=self.group, async_op=True)
        return slot.track(work, lambda: shard_grad.add_(bucket.layout.shard(flat, self.rank)))

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        # Stage 2 cannot hold full gradients across micro-steps, so it reduces every backward
        # (except under no_sync, where full local gradients accumulate until the next one).
        sync = (not no_sync) and (boundary or self.stage == 2)
        self.grads.begin_backward(sync)

    def end_backward(self) -> None:
        self.grads.end_backward()

    def abort_backward(self) -> None:
        self.grads.abort_backward()

    # -- step ---------------------------------------------------------------------------
    def _attach_shard_grads(self) -> None:
        # Re-done before every step: a user's optimizer.zero_grad() may have set them to None.
        for unit, grad in zip(self.units, self.shard_grads):
            unit.shard.grad = grad

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the full averaged gradient: local shard norms, one all-reduce."""
        squares = torch.stack(torch._foreach_norm(self.shard_grads)).square().sum()
        if self.world_size > 1:
            collectives.all_reduce(squares, group=self.group)
        return squares.sqrt()

    def scale_grads(self, factor) -> None:
        torch._foreach_mul_(self.shard_grads, factor)

    def step(self, optimizer) -> None:
        self._attach_shard_grads()
        optimizer.step()
        if self.world_size > 1:
            for work in [u.all_gather(self.group) for u in self.units]:
                work.wait()

    def zero_grad(self) -> None:
        self.grads.zero()
        if self.stage == 2:
            for g in self.shard_grads:
                g.zero_()

    # -- accounting ---------------------------------------------------------------------
    def memory_breakdown(self, module: torch.nn.Module, optimizer) -> dict[str, int]:
        grads = self.grads.nbytes if self.stage == 1 else tensor_bytes(self.shard_grads)
        return {
            "parameters": tensor_bytes(module.parameters()),
            "gradients": grads,
            "optimizer_state": optimizer_state_bytes(optimizer),
            "communication_buffers": self.staging.nbytes if self.staging else 0,
        }

    def close(self) -> None:
        self.grads.remove_hooks()

