"""The partitioning core every ZeRO stage shares (stage 0 in 16-bit, stages 1-3).

Trainable parameters are flattened into ``FlatParamUnit``s, planned by the stage strategy. The
user's optimizer keeps its param groups and hyperparameters, but its ``params`` become this
rank's shards: the shards of the flat parameter buffers themselves in fp32 (no second copy), or
fp32 master copies of them when the model trains in fp16/bf16 (``Placement`` decides where those
live). Gradients are reduced by the strategy's reduction; after each step the updated shards are
all-gathered (stages 1-2) or gathered when next used (stage 3's partitioned units).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.accelerator import get_accelerator
from zerotrain.memory_release import ReleasePolicy
from zerotrain.offload.aio import DiskActivity
from zerotrain.offload.placement import Placement
from zerotrain.precision import PrecisionPolicy
from zerotrain.zero import nvme, offload_states, parameter_offload, registry
from zerotrain.zero.agreement import CollectiveAgreement, checking_enabled
from zerotrain.zero.divergence import UnitIdentities, identity_checks_enabled
from zerotrain.zero.init import full_numel, is_partitioned, materialize
from zerotrain.zero.interface import ShardedState, StageInterface
from zerotrain.zero.leaves import leaf_of
from zerotrain.zero.memory import optimizer_state_bytes, tensor_bytes
from zerotrain.zero.module_state import load_module_state
from zerotrain.zero.muon_shards import attach_muon
from zerotrain.zero.partition import FlatParamUnit, outside_optimizer
from zerotrain.zero.persistent import merge_persistent
from zerotrain.zero.reduce_groups import UnitReduction, check_divide_factor, global_norm, split_by_reduction
from zerotrain.zero.stage0 import ReplicatedGradients
from zerotrain.zero.stage3 import ParameterCoordinator
from zerotrain.zero.step_chunks import plan_step_chunks, steps_per_parameter
from zerotrain.zero.strategy import ShardingStrategy

_log = logging.getLogger("zerotrain")


@dataclass(frozen=True)
class StageOptions:
    """The stage-independent settings of ``zero_optimization`` the core reads."""

    unit_numel: int
    overlap: bool = True
    use_reduce_scatter: bool = True
    ignore_unused_parameters: bool = True
    param_persistence_threshold: int = 0
    prefetch_numel: int = 0
    max_live_numel: int | None = None
    leaf_modules: tuple = ()  # stage 3: modules whose subtree is one unit (zero/leaves.py)


class ZeroStage(StageInterface):
    """The training state of ``module``'s parameters for one strategy.

    ``optimizer`` may be None at stage 3 (an engine used for inference): every parameter is then
    partitioned and gathered for use, and nothing is stepped."""

    def __init__(self, strategy: ShardingStrategy, module: nn.Module, optimizer,
                 options: StageOptions, precision: PrecisionPolicy = PrecisionPolicy(),
                 group=None, placement: Placement = Placement(),
                 memory_release: ReleasePolicy | None = None, norm_group=None,
                 reduce_group_of=None):
        _check_optimizer(strategy.stage, optimizer)
        self.strategy = strategy
        # This engine's memory_release policy (None: the environment's or the stage's default).
        self.memory_release = (memory_release if memory_release is not None
                               else ReleasePolicy(None, strategy.stage))
        self.precision = precision
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        shard_world, self.shard_rank = ((self.world_size, self.rank) if strategy.shards_optimizer
                                        else (1, 0))

        param_groups = optimizer.param_groups if optimizer is not None else []
        # Trainable parameters no optimizer group holds: kept whole, their gradients averaged
        # like DDP's (so they neither grow every step nor differ between ranks).
        outside = outside_optimizer(param_groups, module) if optimizer is not None else []
        leaves = leaf_of(module, options.leaf_modules)
        plan = strategy.plan(param_groups, module, options.unit_numel, optimizer is not None,
                             leaf_of=leaves)
        # ``reduce_group_of(param)``: a ``UnitReduction`` for parameters reduced over another
        # group than the data group (or with another divide factor); units never mix them.
        plan, plan_specs, plan_counted = split_by_reduction(plan, reduce_group_of, group)
        persistent = [False] * len(plan)  # stage 3: small units stay whole, merged (zero/persistent.py)
        if strategy.partitions_parameters:
            plan, plan_specs, plan_counted, persistent = merge_persistent(
                plan, plan_specs, plan_counted, options.param_persistence_threshold,
                options.unit_numel, full_numel)
        self._mixed_groups = any(spec is not None for spec in plan_specs)
        name_of = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            name_of.setdefault(id(p), name)
        self.placement = placement
        self.offload = None  # NVMe: zerotrain.offload.NvmeOptimizerOffload
        self.disk_activity = DiskActivity()  # wall time of this stage's swap I/O (every swapper)
        self._io_busy_since, self._io_busy_s = 0.0, 0.0
        self.param_offload = None  # NVMe: zerotrain.offload.NvmeParamOffload
        if placement.nvme is not None and optimizer is not None:
            self.offload = nvme.optimizer_offload(placement, plan, optimizer, shard_world, self.rank,
                                         precision, self.disk_activity, plan_specs)
        self.units = []
        try:
            if placement.param_nvme is not None and strategy.partitions_parameters:
                self.param_offload = nvme.param_offload(placement, plan, shard_world, self.rank,
                                                         precision, self.offload,
                                                         self.disk_activity, plan_specs)
            unit_specs, unit_counted = {}, {}
            unit_groups: dict[int, object] = {}  # unit index -> the group it is sharded over
            for (g, params), spec, counted, whole in zip(plan, plan_specs, plan_counted, persistent):  # one unit at a time:
                # with zero.Init only one is ever whole
                for p in params:
                    if is_partitioned(p):
                        materialize(p, group)
                world, rank = shard_world, self.shard_rank  # sharded over its own group
                if spec is not None:
                    world, rank = (spec.size, spec.rank) if strategy.shards_optimizer else (1, 0)
                    # Stage 3 gathers it over that group too (experts: their expert-data group).
                    unit_groups[len(self.units)] = spec.group
                unit = FlatParamUnit(params, world, rank, precision.param_dtype,
                                     names=[name_of[id(p)] for p in params], group=g)
                unit_specs[id(unit)], unit_counted[id(unit)] = spec, counted
                master = None
                if unit.trained and placement.separate_master(unit.shard, precision.mixed):
                    master = placement.master_for(unit.shard)  # fp32, copied before the cast
                if self.offload is not None and unit.trained:
                    self.offload.swapper.add_unit(unit, master)  # written out; not kept
                else:
                    unit.master = master
                if strategy.partitions_parameters and not whole:
                    unit.reshard()
                unit.cast(precision.param_dtype)
                if unit.resharded:  # offload_param: the shard lives in host memory
                    unit.shard = placement.place_shard(unit.shard)
                    if self.param_offload is not None:  # ... or on disk
                        self.param_offload.swapper.add_unit(unit)
                    elif unit.shard_derivable:
                        unit.derive_shard_from_master()
                self.units.append(unit)
            self._unit_groups = {self.units[i]: g for i, g in unit_groups.items()}
        except BaseException:
            for offload in (self.offload, self.param_offload):
                if offload is not None:
                    offload.close()
            raise
        self.trained = [u for u in self.units if u.trained]
        # Each trained unit's reduction group and divide factor (zero/reduce_groups.py): the data
        # group, averaged. ``norm_group``: the ranks holding distinct parameters beside this
        # replica (``Topology.distinct_group``), which the gradient norm also sums over.
        # A copy per unit: units sharing one ``reduce_group_of`` answer still take their own divide
        # factor (``set_gradient_divide_factor(units=...)``).
        self._reductions = {id(u): (dataclasses.replace(unit_specs[id(u)]) if unit_specs[id(u)] else
                                    UnitReduction(group, self.world_size, self.rank, float(self.world_size)))
                            for u in self.trained}
        self.norm_group = norm_group
        # False for units of tied copies (``ds_pipe_replicated``) another rank's norm counts.
        self._counted = [unit_counted[id(u)] for u in self.trained]
        self.trim = self.memory_release.trim_every(
            strategy.trim_numel(options.unit_numel, self.units))
        # The trained units in the groups a 16-bit step casts and steps together (see step()).
        self._chunk_plan = plan_step_chunks([u.layout.shard_numel for u in self.trained])
        if self.offload is not None:  # the optimizer steps the swapped chunks
            self.masters = []
            for g, group_dict in enumerate(param_groups):
                group_dict["params"] = self.offload.swapper.params_of_group(g)
        else:
            self.masters = [u.master if u.master is not None else u.shard for u in self.trained]
            for g, group_dict in enumerate(param_groups):
                group_dict["params"] = [m for u, m in zip(self.trained, self.masters) if u.group == g]
        if optimizer is not None and hasattr(optimizer, "attach_full_matrix"):  # Muon: whole matrices
            attach_muon(optimizer, self.trained, self.masters, param_groups, self._reductions,
                        offloaded=self.offload is not None or placement.master_device is not None)
        self._optimizer = optimizer
        if optimizer is not None:  # its groups now hold shards: a new group would not be one
            optimizer.add_param_group = _refuse_add_param_group

        for p in outside:
            p.data = p.data.to(precision.param_dtype)
        self.outside = (ReplicatedGradients(outside, options.unit_numel, options.overlap, group,
                                            norm_group)
                        if outside else None)
        self.coordinator = None
        self.reduction = strategy.reduction(self, self.trained, options.overlap,
                                            options.unit_numel, options.use_reduce_scatter)
        self.shard_grads = self.reduction.shard_grads
        self.require_all_gradients = strategy.shards_optimizer and not options.ignore_unused_parameters
        if strategy.partitions_parameters:
            self.coordinator = ParameterCoordinator(
                module, [u for u in self.units if u.resharded], group,
                prefetch_numel=options.prefetch_numel, max_live_numel=options.max_live_numel,
                leaf_of=leaves, memory_release=self.memory_release, unit_groups=self._unit_groups)
            if self.param_offload is not None:  # reads go ahead along the recorded order
                self.coordinator.param_swapper = self.param_offload.swapper
                if self.offload is not None:
                    self.offload.swapper.param_swapper = self.param_offload.swapper
        self.grad_swapper = None
        if self.param_offload is not None and self.trained and self.offload is not None:
            self.grad_swapper = self.param_offload.grad_swapper(
                dict(zip(self.trained, self.shard_grads)), self._wait_reduction)
            for unit in self.trained:
                self.grad_swapper.add_unit(unit, write=False)  # zeros: nothing to write
            self.reduction.before_reduce = lambda unit: self.grad_swapper.ensure(unit, dirty=True)
            self.offload.swapper.grad_swapper = self.grad_swapper
        registry.register(self.units, group, deepspeed_attributes=strategy.partitions_parameters,
                          unit_groups=self._unit_groups)
        if self.coordinator is not None:  # DeepSpeed's hook handles, which RL trainers reach
            parameter_offload.attach(optimizer, self.coordinator, module)
        if self.coordinator is not None and identity_checks_enabled():
            # Rank-dependent control flow raises on every rank, naming the units (stage 3 only:
            # below it, reductions launch in a fixed order and nothing is gathered in between).
            identities = UnitIdentities(self.coordinator.units, self.trained, strategy.stage)
            self.coordinator.identities = identities
            self.reduction.identities = identities
        if checking_enabled():
            agreement = CollectiveAgreement(group, self._describe_unit, self._compute_device)
            self.reduction.agreement = agreement
            if self.coordinator is not None:
                self.coordinator.agreement = agreement

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

    @property
    def _compute_device(self) -> torch.device:
        """Where the model computes (the collectives' device): the units' full buffers', not
        their shards' (in host memory under offload_param)."""
        return self.units[0].layout.device if self.units else get_accelerator().device()

    def _wait_reduction(self, unit: FlatParamUnit) -> None:
        """Wait until ``unit``'s launched gradient reduction has landed in its shard gradient."""
        bucket = self.reduction.grads.buckets[self.trained.index(unit)]
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None

    def _describe_unit(self, kind: str, index: int) -> str:
        units = self.coordinator.units if kind == "gather" else self.trained
        if not 0 <= index < len(units):
            return f"unit {index}"
        names = units[index].names
        return f"unit {index} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"

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
            raise ValueError(f"set_gradient_divide_factor: {len(unknown)} of the units are not trained "
                             "units of this stage; pass units from sharded_state().units that have a group")
        for unit in chosen:
            self._reductions[id(unit)].divide_factor = factor
        if units is None and self.outside is not None:
            self.outside.set_gradient_divide_factor(factor)

    def unit_reduced(self, unit: FlatParamUnit) -> None:
        """A unit's gradients are copied out: backward needs its full parameters no more."""
        if self.coordinator is not None and unit.resharded:
            self.coordinator.release(unit)

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
            raise NotImplementedError("accumulated_grad at ZeRO stage 3: parameters are partitioned and "
                                      "their gradients reduced in every backward; use stage 0, 1 or 2")
        for grads in (self.reduction.grads, self.outside.grads if self.outside is not None else None):
            grad = grads.accumulated_grad(param) if grads is not None else None
            if grad is not None:
                return grad
        raise ValueError(f"accumulated_grad: a parameter of shape {tuple(param.shape)} is not one of "
                         "this stage's; pass a parameter of the engine's module")

    def _check_every_parameter_used(self) -> None:
        """``ignore_unused_parameters: false``: fail where DeepSpeed does, naming the culprits."""
        unused = self.reduction.unused_names(self.trained)
        if unused:
            self.abort_backward()
            raise RuntimeError(
                f"{len(unused)} trainable parameters got no gradient in this backward "
                f"({', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}) and "
                "zero_optimization.ignore_unused_parameters is false: use them in forward, "
                "freeze them (requires_grad=False), or set ignore_unused_parameters to true")

    # -- step ---------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """fp32 L2 norm of the whole reduced gradient, every unit's group and the ranks holding
        distinct parameters included (inf/NaN if any of them overflowed)."""
        if self.grad_swapper is not None:  # evicted gradients: the norm kept when written out
            norms = [self.grad_swapper.norm_of(u) for u in self.trained]
        else:
            self.reduction.ensure_shard_grads()  # freed since the step, no backward reduced them
            norms = torch._foreach_norm(self.shard_grads, 2, dtype=torch.float32) if self.shard_grads else []
        sharded = [u.layout.world_size > 1 for u in self.trained]
        return global_norm(norms, [self._reductions[id(u)] for u in self.trained], sharded,
                           self.group, self.world_size, self.norm_group, self._compute_device,
                           self._counted)

    def step(self, optimizer, grad_scale: float = 1.0) -> None:
        """Update the weights from the gradients multiplied by ``grad_scale`` (loss-scale and
        clipping factors, applied once here)."""
        if optimizer is None:
            raise RuntimeError("engine.step(): this engine has no optimizer (initialize() got "
                               "none and the config has no 'optimizer' section)")
        if self.offload is not None:  # chunk by chunk through the swap files
            edited = {u for u in self.trained if u.edited_since_recorded()}
            for unit in self.trained:
                unit.record_versions()  # edits are adopted per chunk from the 16-bit shard
            self.reduction.ensure_shard_grads()  # freed since the step, no backward reduced them
            self.offload.swapper.step(optimizer, self.shard_grads, grad_scale, edited)
            if self.param_offload is not None:  # this step's reads and writes of shards
                self._param_io = self.param_offload.swapper.take_stats()
            if self.grad_swapper is not None:
                self._grad_io = self.grad_swapper.take_stats()
            self._io_busy_s = self.disk_activity.busy_s - self._io_busy_since
            self._io_busy_since = self.disk_activity.busy_s
            _log.debug("offload: %s", self.offload_stats())
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
                    if unit.master is not None and not unit.derived:
                        unit.shard.data.copy_(master.detach())
                    master.grad = None  # gradients live for the step only (zero_grad may free them)
        if self.strategy.shards_optimizer:
            # Stage 3's partitioned units are gathered when next used; the rest right away, each
            # over the group it is sharded over.
            for work in [u.all_gather(self._reductions[id(u)].group) for u in self.trained
                         if not u.resharded and u.layout.world_size > 1]:
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
        if any(u.master is not None for u in self.trained) and steps_per_parameter(type(optimizer)):
            return self._chunk_plan
        return [list(range(len(self.trained)))]

    def adopt_edits(self) -> None:
        """Make in-place edits to the module's (16-bit) parameters since the last step the
        truth: copied into the fp32 masters, so the step continues from them (see
        docs/engine.md, "the training state")."""
        for unit in self.trained:
            unit.adopt_edits()

    def named_optimizer_state(self, optimizer) -> dict[str, list[tuple[int, dict]]]:
        """This rank's optimizer state by parameter name: for each parameter with elements in
        this rank's shards, ``[(start, {key: flat slice})]`` where ``start`` is the slice's
        first element within the flattened parameter, and each tensor-valued state entry shaped
        like the shard is sliced to the parameter's part (scalars such as ``step`` are passed
        as they are). What checkpoints save to reload by name on any world size or stage."""
        out: dict[str, list[tuple[int, dict]]] = {}
        if self.offload is not None:
            for unit, start, state in self.offload.swapper.iter_state():
                spec = self._reductions[id(unit)]
                for piece in unit.layout.shard_pieces(spec.rank if unit.layout.world_size > 1 else 0):
                    lo = max(piece.shard_start, start)
                    hi = min(piece.shard_start + piece.numel, start + state["numel"])
                    if lo >= hi:
                        continue
                    sliced = {k: (v.narrow(0, lo - start, hi - lo) if torch.is_tensor(v) and
                                  v.dim() == 1 and v.numel() == state["numel"] else v)
                              for k, v in state["state"].items()}
                    out.setdefault(unit.names[piece.slot.index], []).append(
                        (piece.param_start + lo - piece.shard_start, sliced))
            return out
        for unit, master in zip(self.trained, self.masters):
            state = optimizer.state.get(master, {})
            spec = self._reductions[id(unit)]
            for piece in unit.layout.shard_pieces(spec.rank if unit.layout.world_size > 1 else 0):
                sliced = {}
                for key, value in state.items():
                    if torch.is_tensor(value) and value.shape == master.shape:
                        sliced[key] = value.narrow(0, piece.shard_start, piece.numel)
                    else:
                        sliced[key] = value
                name = unit.names[piece.slot.index]
                out.setdefault(name, []).append((piece.param_start, sliced))
        return out

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
    def offload_stats(self) -> dict:
        """NVMe offload, last step (zerotrain.zero.nvme.offload_stats); empty without it."""
        return nvme.offload_stats(self)

    def memory_breakdown(self, module: nn.Module, optimizer) -> dict[str, int]:
        grads = (self.reduction.nbytes if self.grad_swapper is None  # else: the resident ones
                 else tensor_bytes(self.shard_grads) + self.reduction.grads.nbytes)
        if self.outside is not None:
            grads += self.outside.grads.nbytes
        masters = tensor_bytes(self.masters) if self.precision.mixed else 0
        shards = [u.shard for u in self.units if u.resharded and not u.derived]
        gathered = {id(p) for u in self.units if u.resharded and u.gathered for p in u.params}
        persistent = [p for p in module.parameters() if id(p) not in gathered]
        out = {
            "parameters": tensor_bytes(persistent) + tensor_bytes(shards),
            "master_parameters": masters,
            "gradients": grads,
            "optimizer_state": optimizer_state_bytes(optimizer),
            "communication_buffers": self.reduction.staging_nbytes,
        }
        if self.offload is not None:  # what the swapper holds in memory (disk: offload_stats)
            out["offload_buffers"] = self.offload.swapper.buffer_nbytes
        if self.param_offload is not None:  # "parameters" counts the resident shards only
            out["offload_buffers"] = (out.get("offload_buffers", 0)
                                      + self.param_offload.swapper.buffer_nbytes)
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


def _check_optimizer(stage: int, optimizer) -> None:
    what = f"zero_optimization.stage={stage}" if stage else "fp16/bf16 training"
    if optimizer is None and stage != 3:
        raise ValueError(f"{what} keeps the optimizer's state partitioned, so it needs an "
                         "optimizer: add an 'optimizer' section or pass optimizer=")
    if optimizer is not None and optimizer.state:
        raise ValueError("the optimizer already holds state; ZeRO must partition it before the "
                         "first step (load checkpoints through the engine instead)")


def _refuse_add_param_group(param_group) -> None:
    raise RuntimeError(
        "optimizer.add_param_group after zerotrain.initialize: ZeRO has flattened and "
        "partitioned the optimizer's parameters into units at initialize, so a group added "
        "later would be stepped whole and never reduced. Put every parameter group in the "
        "optimizer before initialize (a group with lr=0 can be unfrozen later by raising its lr)")


