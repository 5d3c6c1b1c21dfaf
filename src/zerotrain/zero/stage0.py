"""ZeRO stage 0: plain data parallelism.

Every rank holds the whole model, all gradients and the whole optimizer state. Gradients are
averaged (or divided by ``set_gradient_divide_factor``'s factor) with bucketed all-reduces
launched during backward (overlapping the rest of it), and only in the backward pass that ends an
accumulation window.
"""

from __future__ import annotations

import torch

from zerotrain.accelerator import get_accelerator
from zerotrain.comm import collectives
from zerotrain.zero import registry
from zerotrain.zero.flat import split_into_buckets
from zerotrain.zero.gradient_buckets import BucketedGradients, GradientBucket, Pending
from zerotrain.zero.interface import ShardedState, StageInterface, StageStatistics
from zerotrain.zero.memory import optimizer_state_bytes, optimizer_state_tensors, tensor_bytes
from zerotrain.zero.reduce_groups import UnitReduction, check_divide_factor, counted_in_norm, global_norm


class ReplicatedGradients(StageInterface):
    """Stage 0 in fp32; the engine drives it through ``StageInterface``, as every stage.

    The user's optimizer runs untouched on the model's own parameters (so any optimizer works,
    shape-dependent ones included). 16-bit training at stage 0 goes through
    ``zero.zero_stage.ZeroStage`` instead, which keeps the fp32 master weights."""

    stage = 0

    def __init__(
        self, params, bucket_numel: int, overlap: bool = True, group=None, norm_group=None, reduce_group_of=None
    ):
        self.group = group
        # The ranks holding distinct parameters (pipeline stages, model slices) the gradient
        # norm also sums over (``Topology.distinct_group``); None: this replica's alone.
        self.norm_group = norm_group
        spec = UnitReduction.over(group)
        self.world_size = spec.size
        self.params = [p for p in params if p.requires_grad]
        # Buckets never mix reductions (``reduce_group_of(param)``: a ``UnitReduction`` for a
        # parameter reduced over another group, experts' expert-data group; None: the data
        # group, averaged) nor tied copies another rank's norm counts (``ds_pipe_replicated``),
        # which go in buckets of their own. Reverse registration order approximates the order
        # backward produces gradients.
        classes: dict[tuple, tuple] = {}
        for p in self.params:
            other = reduce_group_of(p) if reduce_group_of is not None else None
            if other is not None and not isinstance(other, UnitReduction):
                raise TypeError(f"reduce_group_of must return a UnitReduction or None, got {type(other).__name__}")
            classes.setdefault((not counted_in_norm(p), id(other)), (other, []))[1].append(p)
        buckets, self._counted, self.reductions = [], [], []
        for (tied, _), (other, members) in sorted(classes.items(), key=lambda item: item[0][0]):
            chunk = split_into_buckets(members[::-1], bucket_numel)
            buckets += list(chunk)
            self._counted += [not tied] * len(chunk)
            # Each bucket's group and divide factor (zero/reduce_groups.py), a copy per bucket.
            base = other if other is not None else spec
            self.reductions += [UnitReduction(base.group, base.size, base.rank, base.divide_factor) for _ in chunk]
        self._other_groups = any(other is not None for other, _ in classes.values())
        self.grads = BucketedGradients(buckets, self._all_reduce, overlap)
        self._index = {id(b): i for i, b in enumerate(self.grads.buckets)}
        # GatheredParameters(modifier_rank=...) broadcasts these over their group, not the world.
        self._registered = []
        for (_, _), (other, members) in classes.items():
            reg_group = other.group if other is not None else group
            registry.register_replicated(members, reg_group)
            self._registered.append((members, reg_group))

    def _all_reduce(self, bucket: GradientBucket) -> Pending | None:
        spec = self.reductions[self._index[id(bucket)]]
        flat = bucket.buffer()
        # Dividing before the sum keeps the launch inside backward, off the critical path.
        if spec.divide_factor != 1.0:
            flat.div_(spec.divide_factor)
        if spec.size == 1:
            return None
        return collectives.all_reduce(flat, group=spec.group, async_op=True)

    def set_gradient_divide_factor(self, factor: float, units=None) -> None:
        """Divide every bucket's reduced sum by ``factor`` instead of the group size (1: sum).
        Here the buckets are the units; ``units`` must be None."""
        if units is not None:
            raise ValueError(
                "set_gradient_divide_factor(units=...): fp32 stage 0 has no flat units; "
                "pass units=None to set the factor of every gradient bucket"
            )
        factor = check_divide_factor(factor)
        for spec in self.reductions:
            spec.divide_factor = factor

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        # Replicated gradients can wait: reduce once per accumulation window.
        self.grads.begin_backward(sync=boundary and not no_sync)

    def end_backward(self) -> None:
        self.grads.end_backward()

    def abort_backward(self) -> None:
        self.grads.abort_backward()

    def accumulated_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """``param``'s view of its bucket (its ``.grad``); None where it takes no gradient."""
        if not param.requires_grad:
            return None
        grad = self.grads.accumulated_grad(param)
        if grad is None:
            raise ValueError(
                f"accumulated_grad: a parameter of shape {tuple(param.shape)} is not "
                "one of this stage's; pass a parameter of the engine's module"
            )
        return grad

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the (already reduced, replicated) gradients over every rank holding
        distinct parameters: each replica holds the same, so only ``norm_group`` sums."""
        flats = self.grads.flats()
        norms = torch._foreach_norm(flats, 2, dtype=torch.float32) if flats else []
        device = flats[0].device if flats else get_accelerator().device()
        return global_norm(
            norms,
            self.reductions,
            [False] * len(norms),
            self.group,
            self.world_size,
            self.norm_group,
            device,
            self._counted,
        )

    def step(self, optimizer, grad_scale: float = 1.0) -> None:
        """Update from the gradients multiplied by ``grad_scale`` (the clipping factor)."""
        if grad_scale != 1.0:
            torch._foreach_mul_(self.grads.flats(), grad_scale)
        if optimizer is None:
            raise RuntimeError(
                "engine.step(): this engine has no optimizer (initialize() got "
                "none and the config has no 'optimizer' section)"
            )
        optimizer.step()

    def load_module_state(self, module: torch.nn.Module, state_dict, strict: bool = True):
        """The module's parameters are the training state here: load them in place."""
        from zerotrain.zero.module_state import load_module_state

        return load_module_state(module, state_dict, [], strict)

    def adopt_edits(self) -> None:
        """Nothing to do: the optimizer steps the module's own parameters."""

    def zero_grad(self) -> None:
        self.grads.zero()

    @property
    def parameter_coordinator(self) -> None:
        return None  # nothing is partitioned

    def sharded_state(self) -> ShardedState:
        """No units: the module's own parameters (and the optimizer's state keyed by them) are
        the training state (expert parameters too: zerotrain.checkpoint.experts names them)."""
        return ShardedState()

    def state_tensors(self, module: torch.nn.Module, optimizer) -> dict[str, list[torch.Tensor]]:
        """The module's own parameters are what the optimizer steps: hp and lp are the same."""
        params: list[torch.Tensor] = list(module.parameters())
        return {
            "optim_states": optimizer_state_tensors(optimizer),
            "hp_params": params,
            "lp_params": params,
            "lp_grads": self.grads.flats(),
            "contiguous_grad_buffer": [],
        }

    def empty_partition_cache(self) -> None:
        """Nothing is partitioned: nothing is gathered."""

    def statistics(self, module: torch.nn.Module, optimizer) -> StageStatistics:
        """Bytes held by category; nothing is offloaded or gathered at fp32 stage 0."""
        return StageStatistics(
            memory={
                "parameters": tensor_bytes(module.parameters()),
                "gradients": self.grads.nbytes,
                "optimizer_state": optimizer_state_bytes(optimizer),
                "communication_buffers": 0,
            }
        )

    def close(self) -> None:
        self.grads.remove_hooks()
        for members, reg_group in self._registered:
            registry.unregister_replicated(members, reg_group)
