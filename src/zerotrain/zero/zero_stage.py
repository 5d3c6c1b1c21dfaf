"""``ZeroStage``: the training state of 16-bit stage 0 and stages 1-3, built by zero/build.py.

Trainable parameters are flattened into ``FlatParamUnit``s, planned by the stage strategy. The
user's optimizer keeps its param groups and hyperparameters, but its ``params`` become this
rank's shards: the shards of the flat parameter buffers themselves in fp32 (no second copy), or
fp32 master copies of them when the model trains in fp16/bf16 (``Placement`` decides where those
live). Gradients are reduced by the strategy's reduction; after each step the updated shards are
all-gathered (stages 1-2) or gathered when next used (stage 3's partitioned units).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from zerotrain.accelerator import get_accelerator
from zerotrain.memory_release import ReleasePolicy
from zerotrain.precision import PrecisionPolicy
from zerotrain.zero import offload_states, parameter_offload, registry
from zerotrain.zero.interface import ShardedState, StageInterface, StageStatistics
from zerotrain.zero.memory import optimizer_state_bytes, tensor_bytes
from zerotrain.zero.module_state import load_module_state
from zerotrain.zero.named_state import named_optimizer_state
from zerotrain.zero.partition import FlatParamUnit
from zerotrain.zero.reduce_groups import UnitReduction, check_divide_factor, global_norm
from zerotrain.zero.stage3 import ParameterCoordinator
from zerotrain.zero.step_chunks import steps_per_parameter
from zerotrain.zero.strategy import ShardingStrategy

_log = logging.getLogger("zerotrain")


class ZeroStage(StageInterface):
    """The training state of a module's parameters for one strategy, over the parts
    ``zero.build.build_sharded_stage`` made (each given its own dependencies there).

    ``units``: every ``FlatParamUnit`` (trained and frozen); ``masters``: what the optimizer
    steps for each trained unit (its fp32 master or its shard; empty with NVMe offload, whose
    swapper holds them); ``reductions``: each trained unit's ``UnitReduction`` by ``id`` (shared
    with ``reduction``); ``counted``: per trained unit, whether the gradient norm counts it
    (False for tied copies another rank counts); ``reduction``: the strategy's gradient
    reduction; ``coordinator``: stage 3's ``ParameterCoordinator``; ``outside``: the
    ``ReplicatedGradients`` of trainable parameters no optimizer group holds; ``step_chunks``:
    the trained units' indices in the groups a 16-bit step casts and steps together;
    ``offload``/``param_offload``: NVMe swap folders, ``swap_statistics`` their numbers."""

    def __init__(
        self,
        *,
        strategy: ShardingStrategy,
        precision: PrecisionPolicy,
        memory_release: ReleasePolicy,
        group,
        world_size: int,
        norm_group,
        shard_rank: int,
        units: list[FlatParamUnit],
        masters: list,
        reductions: dict[int, UnitReduction],
        counted: list[bool],
        reduction,
        coordinator: ParameterCoordinator | None,
        outside,
        optimizer,
        require_all_gradients: bool,
        step_chunks: list[list[int]],
        offload=None,
        param_offload=None,
        disk_activity=None,
        swap_statistics=None,
    ):
        self.strategy, self.precision, self.memory_release = strategy, precision, memory_release
        self.group, self.world_size, self.norm_group = group, world_size, norm_group
        self.shard_rank = shard_rank
        self.units = units
        # Where the model computes (the collectives' device): the units' full buffers', not
        # their shards' (in host memory under offload_param).
        self._compute_device = units[0].layout.device if units else get_accelerator().device()
        self.trained = [u for u in units if u.trained]
        self.masters = masters
        self._reductions, self._counted = reductions, counted
        self.reduction = reduction
        self.shard_grads = reduction.shard_grads  # the list the reduction keeps current
        self.grad_swapper = reduction.grad_swapper
        self.coordinator = coordinator
        self.outside = outside
        self._optimizer = optimizer
        self.require_all_gradients = require_all_gradients
        self._chunk_plan = step_chunks
        self.offload, self.param_offload = offload, param_offload
        self.disk_activity = disk_activity  # wall time of this stage's swap I/O (every swapper)
        self.swap_statistics = swap_statistics

    @property
    def stage(self) -> int:
        return self.strategy.stage

    @property
    def parameter_coordinator(self) -> ParameterCoordinator | None:
        return self.coordinator

    def sharded_state(self) -> ShardedState:
        swapper = self.offload.swapper if self.offload is not None else None
        # Units reduced over another group are sharded over it: shard_rank is the data group's;
        # zerotrain.checkpoint.experts finds an expert unit's (its expert-data rank) by name.
        return ShardedState(tuple(self.units), self.shard_rank, swapper)

    # -- backward -----------------------------------------------------------------------
    @property
    def grads(self):
        """The gradient buckets (one per trained unit)."""
        return self.reduction.grads

    def reduction_of(self, unit: FlatParamUnit) -> UnitReduction:
        """Where ``unit``'s gradients are reduced and what their sum is divided by."""
        return self._reductions[id(unit)]

    def set_gradient_divide_factor(self, factor: float, units=None) -> None:
        """Divide the reduced gradient sums of ``units`` (default: every trained unit, and the
        parameters outside the optimizer) by ``factor`` instead of their group's size: 1 sums,
        the group size averages (FSDP2's ``set_gradient_divide_factor``)."""
        factor = check_divide_factor(factor)
        chosen = self.trained if units is None else list(units)
        unknown = [u for u in chosen if id(u) not in self._reductions]
        if unknown:
            raise ValueError(
                f"set_gradient_divide_factor: {len(unknown)} of the units are not trained "
                "units of this stage; pass units from sharded_state().units that have a group"
            )
        for unit in chosen:
            self._reductions[id(unit)].divide_factor = factor
        if units is None and self.outside is not None:
            self.outside.set_gradient_divide_factor(factor)

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        self.reduction.begin_backward(boundary, no_sync)
        if self.outside is not None:
            self.outside.begin_backward(boundary, no_sync)
        # What forward freed (its temporaries, the loss computation's) goes back to the OS
        # before backward allocates gradients beside the saved activations.
        self.memory_release.before_backward()
        if self.coordinator is not None:
            self.coordinator.begin_backward()

    def end_backward(self) -> None:
        if self.require_all_gradients and self.reduction.syncing:
            self._check_every_parameter_used()
        try:
            self.reduction.end_backward()
            if self.outside is not None:
                self.outside.end_backward()
        finally:
            if self.coordinator is not None:
                self.coordinator.end_backward()

    def abort_backward(self) -> None:
        self.reduction.abort_backward()
        if self.outside is not None:
            self.outside.abort_backward()
        if self.coordinator is not None:
            self.coordinator.end_backward()

    def accumulated_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s view of its unit's fp32/16-bit accumulation buffer (stages 0-1), or its
        ``.grad`` (stage 2, until the window's reduction); None where it takes no gradient."""
        if not param.requires_grad:
            return None
        if self.coordinator is not None:
            raise NotImplementedError(
                "accumulated_grad at ZeRO stage 3: parameters are partitioned and "
                "their gradients reduced in every backward; use stage 0, 1 or 2"
            )
        for grads in (self.reduction.grads, self.outside.grads if self.outside is not None else None):
            grad = grads.accumulated_grad(param) if grads is not None else None
            if grad is not None:
                return grad
        raise ValueError(
            f"accumulated_grad: a parameter of shape {tuple(param.shape)} is not one of "
            "this stage's; pass a parameter of the engine's module"
        )

    def _check_every_parameter_used(self) -> None:
        """``ignore_unused_parameters: false``: fail where DeepSpeed does, naming the culprits."""
        unused = self.reduction.unused_names(self.trained)
        if unused:
            self.abort_backward()
            raise RuntimeError(
                f"{len(unused)} trainable parameters got no gradient in this backward "
                f"({', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}) and "
                "zero_optimization.ignore_unused_parameters is false: use them in forward, "
                "freeze them (requires_grad=False), or set ignore_unused_parameters to true"
            )

    # -- step ---------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """fp32 L2 norm of the whole reduced gradient, every unit's group and the ranks holding
        distinct parameters included (inf/NaN if any of them overflowed)."""
        norms: Sequence[torch.Tensor]
        if self.grad_swapper is not None:  # evicted gradients: the norm kept when written out
            norms = [self.grad_swapper.norm_of(u) for u in self.trained]
        else:
            self.reduction.ensure_shard_grads()  # freed since the step, no backward reduced them
            norms = torch._foreach_norm(self.shard_grads, 2, dtype=torch.float32) if self.shard_grads else []
        sharded = [u.layout.world_size > 1 for u in self.trained]
        return global_norm(
            norms,
            [self._reductions[id(u)] for u in self.trained],
            sharded,
            self.group,
            self.world_size,
            self.norm_group,
            self._compute_device,
            self._counted,
        )

    def step(self, optimizer, grad_scale: float = 1.0) -> None:
        """Update the weights from the gradients multiplied by ``grad_scale`` (loss-scale and
        clipping factors, applied once here)."""
        if optimizer is None:
            raise RuntimeError(
                "engine.step(): this engine has no optimizer (initialize() got "
                "none and the config has no 'optimizer' section)"
            )
        if self.offload is not None:  # chunk by chunk through the swap files
            edited = {u for u in self.trained if u.edited_since_recorded()}
            for unit in self.trained:
                unit.record_versions()  # edits are adopted per chunk from the 16-bit shard
            self.reduction.ensure_shard_grads()  # freed since the step, no backward reduced them
            self.offload.swapper.step(
                optimizer,
                self.shard_grads,
                grad_scale,
                edited,
                grad_swapper=self.grad_swapper,
                param_swapper=self.param_offload.swapper if self.param_offload is not None else None,
            )
            self.swap_statistics.step_done()  # this step's reads and writes, the disk's busy time
            _log.debug("offload: %s", self.swap_statistics.as_dict())
        else:
            self.adopt_edits()
            self.reduction.ensure_shard_grads()  # freed since the step, no backward reduced them
            for chunk in self._step_chunks(optimizer):
                masters = [self.masters[i] for i in chunk]
                for master, grad in zip(masters, self.reduction.grads_for(masters, chunk)):
                    master.grad = grad  # cast to the master's dtype and device where they differ
                if grad_scale != 1.0:
                    torch._foreach_mul_([m.grad for m in masters], grad_scale)
                optimizer.step()
                for i in chunk:
                    unit, master = self.trained[i], self.masters[i]
                    if unit.master is not None and unit.shard is not None:  # not derived
                        unit.shard.data.copy_(master.detach())
                    master.grad = None  # gradients live for the step only (zero_grad may free them)
        if self.strategy.shards_optimizer:
            # Stage 3's partitioned units are gathered when next used; the rest right away, each
            # over the group it is sharded over.
            for work in [
                u.all_gather(self._reductions[id(u)].group)
                for u in self.trained
                if not u.resharded and u.layout.world_size > 1
            ]:
                work.wait()
        # The step's temporaries (fp32 copies of 16-bit gradients, the optimizer's foreach
        # intermediates) were freed on the heap: return them before the next forward needs
        # memory, so the peak is not their retained pages plus the activations.
        self.memory_release.between_phases()

    def _step_chunks(self, optimizer) -> list[list[int]]:
        """The trained units' indices in the groups the optimizer steps one call at a time.

        Where the masters are copies (16-bit training, or masters on another device), each
        gradient is cast into a new fp32 tensor for the step: stepping all at once holds every
        one of them (and the optimizer's temporaries) together, which was the peak of a bf16
        step. An optimizer known to keep per-parameter state and skip parameters without a
        gradient then steps one chunk (``plan_step_chunks``) at a time (bf16 GPT-2 110M stage 3:
        peak 1505 -> 1442 MiB, now in backward). Otherwise one call steps everything."""
        # mypy sees a class's __hash__ as an unbound method, so a class is not Hashable to it
        if any(u.master is not None for u in self.trained) and steps_per_parameter(type(optimizer)):  # type: ignore[arg-type]
            return self._chunk_plan
        return [list(range(len(self.trained)))]

    def adopt_edits(self) -> None:
        """Make in-place edits to the module's (16-bit) parameters since the last step the
        truth: copied into the fp32 masters, so the step continues from them (see
        docs/engine.md, "the training state")."""
        for unit in self.trained:
            unit.adopt_edits()

    def named_optimizer_state(self, optimizer) -> dict[str, list[tuple[int, dict]]]:
        """This rank's optimizer state by parameter name (``zero.named_state``)."""
        swapper = self.offload.swapper if self.offload is not None else None
        return named_optimizer_state(optimizer, self.trained, self.masters, self._reductions, swapper)

    def load_module_state(self, module: nn.Module, state_dict, strict: bool = True):
        """Whole-model weights into every unit's shard, master and whole parameters."""
        return load_module_state(module, state_dict, self.units, strict)

    def zero_grad(self) -> None:
        if self.grad_swapper is not None:  # every gradient shard back to zeros, out of memory
            self.grad_swapper.discard_all()
            self.reduction.grads.zero()
        else:
            self.reduction.zero()
        if self.outside is not None:
            self.outside.zero_grad()

    # -- offload_states / empty_partition_cache ----------------------------------------------
    def state_tensors(self, module: nn.Module, optimizer) -> dict[str, list[torch.Tensor]]:
        return offload_states.core_state_tensors(self, optimizer)

    def empty_partition_cache(self) -> None:
        if self.coordinator is not None:
            self.coordinator.empty_cache()

    # -- accounting ---------------------------------------------------------------------
    def statistics(self, module: nn.Module, optimizer) -> StageStatistics:
        return StageStatistics(
            memory=self._memory_breakdown(module, optimizer),
            offload=self.swap_statistics.as_dict() if self.swap_statistics is not None else {},
            gathers=self.coordinator.gather_statistics() if self.coordinator is not None else None,
        )

    def _memory_breakdown(self, module: nn.Module, optimizer) -> dict[str, int]:
        grads = (
            self.reduction.nbytes
            if self.grad_swapper is None  # else: the resident ones
            else tensor_bytes(self.shard_grads) + self.reduction.grads.nbytes
        )
        if self.outside is not None:
            grads += self.outside.grads.nbytes
        masters = tensor_bytes(self.masters) if self.precision.mixed else 0
        shards = [u.shard for u in self.units if u.resharded and u.shard is not None]  # not derived
        gathered = {id(p) for u in self.units if u.resharded and u.gathered for p in u.params}
        persistent = [p for p in module.parameters() if id(p) not in gathered]
        out = {
            "parameters": tensor_bytes(persistent) + tensor_bytes(shards),
            "master_parameters": masters,
            "gradients": grads,
            "optimizer_state": optimizer_state_bytes(optimizer),
            "communication_buffers": self.reduction.staging_nbytes,
        }
        if self.offload is not None:  # what the swapper holds in memory (disk: statistics().offload)
            out["offload_buffers"] = self.offload.swapper.buffer_nbytes
        if self.param_offload is not None:  # "parameters" counts the resident shards only
            out["offload_buffers"] = out.get("offload_buffers", 0) + self.param_offload.swapper.buffer_nbytes
        if self.coordinator is not None:
            element = self.units[0].dtype.itemsize
            out["gathered_parameters"] = self.coordinator.live_numel * element
            out["peak_gathered_parameters"] = self.coordinator.peak_live_numel * element
            out["gather_pool"] = self.coordinator.pool_nbytes  # released buffers kept for reuse
        return out

    def close(self) -> None:
        """Remove hooks and patches; stage 3 gathers every unit back into whole parameters,
        so the module is a plain module again (evaluable, saveable, usable by a new engine)."""
        self.reduction.close()
        if self._optimizer is not None and "add_param_group" in vars(self._optimizer):
            del self._optimizer.add_param_group
        if self.outside is not None:
            self.outside.close()
        if self.coordinator is not None:
            parameter_offload.detach(self._optimizer, self.coordinator.module)
            self.coordinator.close()  # restores whole parameters and the modules' dicts
        if self.param_offload is not None:
            self.param_offload.swapper.restore_all()  # shards in memory again, then files go
            self.param_offload.close()
        if self.offload is not None:
            self.offload.close()  # the swap files go; the optimizer state with them
        registry.unregister(self.units)


def check_optimizer(stage: int, optimizer) -> None:
    what = f"zero_optimization.stage={stage}" if stage else "fp16/bf16 training"
    if optimizer is None and stage != 3:
        raise ValueError(
            f"{what} keeps the optimizer's state partitioned, so it needs an "
            "optimizer: add an 'optimizer' section or pass optimizer="
        )
    if optimizer is not None and optimizer.state:
        raise ValueError(
            "the optimizer already holds state; ZeRO must partition it before the "
            "first step (load checkpoints through the engine instead)"
        )


def refuse_add_param_group(param_group) -> None:
    raise RuntimeError(
        "optimizer.add_param_group after zerotrain.initialize: ZeRO has flattened and "
        "partitioned the optimizer's parameters into units at initialize, so a group added "
        "later would be stepped whole and never reduced. Put every parameter group in the "
        "optimizer before initialize (a group with lr=0 can be unfrozen later by raising its lr)"
    )
