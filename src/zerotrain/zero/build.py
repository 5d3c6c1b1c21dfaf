"""Building a ZeRO stage object, each part given its dependencies when it is constructed.

``build_zero_stage`` turns the config into a stage object: ``ReplicatedGradients`` (fp32 stage
0, engines without an optimizer below stage 3) or a ``ZeroStage`` from ``build_sharded_stage``,
which makes the stage's parts in dependency order, nothing wired in after construction:

1. the plan: which parameters make which unit, each unit's reduction group (experts, autocast);
2. the NVMe swap folders, checked against the planned units' sizes;
3. the units, their fp32 masters placed (``Placement``) or written to the swap files;
4. the optimizer's param groups rewritten onto the masters;
5. the collective checks (``CollectiveChecks``) over the units;
6. stage 3's ``ParameterCoordinator`` (with the parameter swapper and the checks);
7. the gradient reduction (with the coordinator's release, the gradient swap folder and the
   checks; it owns the gradient swapper);
8. the swap statistics over the swappers; the registry; then ``ZeroStage`` over all of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from zerotrain.accelerator import get_accelerator
from zerotrain.config.optimizer_check import check_zero_optimizer
from zerotrain.memory_release import ReleasePolicy, release_freed_memory
from zerotrain.offload.aio import DiskActivity
from zerotrain.offload.placement import Placement
from zerotrain.optim.expert_groups import expert_parameters
from zerotrain.precision import PrecisionPolicy
from zerotrain.precision.autocast import resolve_safe_modules, safe_module_names
from zerotrain.zero import nvme, parameter_offload, registry
from zerotrain.zero.agreement import CollectiveAgreement, checking_enabled
from zerotrain.zero.divergence import CollectiveChecks, UnitIdentities, identity_checks_enabled
from zerotrain.zero.init import full_numel, is_partitioned, materialize
from zerotrain.zero.leaves import leaf_modules, leaf_of
from zerotrain.zero.muon_shards import attach_muon
from zerotrain.zero.partition import FlatParamUnit, outside_optimizer
from zerotrain.zero.persistent import merge_persistent
from zerotrain.zero.reduce_groups import UnitReduction, split_by_reduction
from zerotrain.zero.stage0 import ReplicatedGradients
from zerotrain.zero.stage3 import ParameterCoordinator
from zerotrain.zero.step_chunks import plan_step_chunks
from zerotrain.zero.strategy import STRATEGIES, ShardingStrategy
from zerotrain.zero.zero_stage import ZeroStage, check_optimizer, refuse_add_param_group


@dataclass(frozen=True)
class StageOptions:
    """The stage-independent settings of ``zero_optimization`` a ``ZeroStage`` is built with."""

    unit_numel: int
    overlap: bool = True
    use_reduce_scatter: bool = True
    ignore_unused_parameters: bool = True
    param_persistence_threshold: int = 0
    prefetch_numel: int = 0
    max_live_numel: int | None = None
    leaf_modules: tuple = ()  # stage 3: modules whose subtree is one unit (zero/leaves.py)


# Without an explicit reduce_bucket_size, buckets hold 25 MiB (DDP's size): DeepSpeed's default
# of 5e8 elements is larger than most models, which leaves nothing to overlap with backward and
# costs a model-sized buffer.
DEFAULT_BUCKET_BYTES = 25 * 2**20


def bucket_numel(zero_config, element_size: int) -> int:
    """Elements per gradient bucket / parameter unit."""
    keys = ["reduce_bucket_size"] + (["allgather_bucket_size"] if zero_config.stage else [])
    explicit = [int(getattr(zero_config, k)) for k in keys if k in zero_config.model_fields_set]
    return max(1, min(explicit)) if explicit else DEFAULT_BUCKET_BYTES // element_size


def expert_reductions(module, topology):
    """``reduce_group_of`` for ``module``'s expert parameters (DeepSpeed's ``allreduce = False``
    with ``group_name = "ep_size_N"``): their gradients are summed over ``topology``'s
    expert-data-parallel group of that size and divided by the data-parallel size, as DeepSpeed
    divides them (each expert already received, through the all-to-all's backward, the gradients
    of every token routed to it from its expert-parallel group); None without expert parameters.
    """
    if topology is None:
        return None
    experts = expert_parameters(module, topology.data_size)
    if not experts:
        return None
    specs = {
        size: UnitReduction.over(topology.expert_groups(size).expert_data_group, divide_factor=topology.data_size)
        for size in sorted(set(experts.values()))
    }
    named = dict(module.named_parameters())
    by_param = {id(named[name]): specs[size] for name, size in experts.items()}
    return lambda param: by_param.get(id(param))


def autocast_reductions(module, config, precision: PrecisionPolicy, group):
    """``reduce_group_of`` for the parameters of ``torch_autocast.lower_precision_safe_modules``
    (modules of exactly those classes, as DeepSpeed matches them): reduced over the data group in
    the autocast dtype; None when autocast is off or no module matches."""
    if precision.autocast_dtype is None:
        return None
    classes = tuple(resolve_safe_modules(safe_module_names(config.torch_autocast)))
    safe = {id(p) for m in module.modules() if type(m) in classes for p in m.parameters(recurse=False)}
    if not safe:
        return None
    spec = UnitReduction.over(group, comm_dtype=precision.autocast_dtype)
    return lambda param: spec if id(param) in safe else None


def _first_of(*choosers):
    """The first non-None answer of several ``reduce_group_of`` functions (None ones skipped)."""
    choosers = [c for c in choosers if c is not None]
    if not choosers:
        return None
    if len(choosers) == 1:
        return choosers[0]
    return lambda param: next((spec for spec in (c(param) for c in choosers) if spec is not None), None)


def build_zero_stage(config, module, optimizer, precision: PrecisionPolicy, group=None, norm_group=None, topology=None):
    """The stage object for ``config.zero_optimization.stage`` over ``module``'s parameters,
    sharded over the data-parallel ``group`` (None: the world). ``norm_group``: the ranks
    holding distinct parameters beside this replica (``Topology.distinct_group``), which the
    gradient norm and the overflow decision also sum over. ``topology``: the engine's, whose
    expert groups reduce expert parameters (``expert_reductions``; None: every parameter is
    dense).

    With 16-bit precision the module's parameters and buffers end up in that dtype."""
    release = ReleasePolicy(config.memory_release, config.zero_optimization.stage)  # this engine's
    release.configure_allocator()
    zero = config.zero_optimization
    strategy = STRATEGIES[zero.stage]
    if not strategy.partitions_parameters:  # zero.Init was used without stage 3: make it whole
        for p in module.parameters():
            if is_partitioned(p):
                materialize(p, group)
    params = [p for p in module.parameters() if p.requires_grad]
    reduce_group_of = expert_reductions(module, topology)
    numel = bucket_numel(zero, precision.param_dtype.itemsize)
    overlap = zero.effective_overlap_comm
    if (zero.stage == 0 and not precision.mixed) or (optimizer is None and zero.stage < 3):
        # Stage 0 in fp32: the user's optimizer steps the module's own parameters (any
        # optimizer works, shape-dependent ones included). Without an optimizer there is no
        # state to partition (an engine for inference, a frozen reference model).
        module.to(precision.param_dtype)
        return ReplicatedGradients(
            params, numel, overlap=overlap, group=group, norm_group=norm_group, reduce_group_of=reduce_group_of
        )
    # Without an explicit stage3_prefetch_bucket_size, prefetch one bucket ahead: DeepSpeed's
    # 5e7-element default gathers half of a 110M model ahead of use.
    prefetch = int(zero.prefetch_bucket_size) if "prefetch_bucket_size" in zero.model_fields_set else numel
    options = StageOptions(
        unit_numel=strategy.unit_numel(numel),
        overlap=overlap,
        use_reduce_scatter=zero.reduce_scatter,
        ignore_unused_parameters=zero.ignore_unused_parameters,
        param_persistence_threshold=int(zero.param_persistence_threshold),
        prefetch_numel=prefetch,
        max_live_numel=int(zero.max_live_parameters),
        leaf_modules=(tuple(leaf_modules(module, zero)) if strategy.partitions_parameters else ()),
    )
    if optimizer is not None:  # which optimizers may step flat shards (config's rule)
        check_zero_optimizer(config, optimizer)
    from zerotrain.offload import build_placement  # offload settings -> where state lives

    # Expert parameters keep their expert-data reduction; other lower-precision-safe ones travel
    # in the autocast dtype (DeepSpeed does this at stages 1-3; stage 0 reduces in fp32).
    reduce_group_of = _first_of(reduce_group_of, autocast_reductions(module, config, precision, group))
    stage = build_sharded_stage(
        strategy,
        module,
        optimizer,
        options,
        precision,
        group=group,
        placement=build_placement(config),
        memory_release=release,
        norm_group=norm_group,
        reduce_group_of=reduce_group_of,
    )
    for p in module.parameters():  # parameters outside every unit stay whole
        if is_partitioned(p):
            materialize(p, group)
    module.to(precision.param_dtype)  # frozen parameters and floating buffers
    # The module's original parameters (copied into flat units, or cast) have just been freed:
    # hand that memory back to the OS instead of leaving it in glibc's heap for the whole run.
    release_freed_memory()
    return stage


def build_sharded_stage(
    strategy: ShardingStrategy,
    module,
    optimizer,
    options: StageOptions,
    precision: PrecisionPolicy = PrecisionPolicy(),
    group=None,
    placement: Placement = Placement(),
    memory_release: ReleasePolicy | None = None,
    norm_group=None,
    reduce_group_of=None,
) -> ZeroStage:
    """The ``ZeroStage`` of ``strategy`` over ``module``'s parameters, sharded over ``group``.

    ``optimizer`` may be None at stage 3 (an engine used for inference): every parameter is then
    partitioned and gathered for use, and nothing is stepped. ``reduce_group_of(param)``: a
    ``UnitReduction`` for parameters reduced over another group than ``group`` (or with another
    divide factor), else None; units never mix them. ``norm_group``: the ranks holding distinct
    parameters beside this replica (``Topology.distinct_group``), which the gradient norm also
    sums over."""
    check_optimizer(strategy.stage, optimizer)
    # This engine's memory_release policy (None: the environment's or the stage's default).
    release = memory_release if memory_release is not None else ReleasePolicy(None, strategy.stage)
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    shard_world, shard_rank = (world_size, rank) if strategy.shards_optimizer else (1, 0)
    param_groups = optimizer.param_groups if optimizer is not None else []
    # Trainable parameters no optimizer group holds: kept whole, their gradients averaged like
    # DDP's (so they neither grow every step nor differ between ranks).
    outside = outside_optimizer(param_groups, module) if optimizer is not None else []
    leaves = leaf_of(module, options.leaf_modules)
    plan = _plan(strategy, module, param_groups, optimizer is not None, options, leaves, reduce_group_of, group)

    activity = DiskActivity()  # wall time of this stage's swap I/O (every swapper)
    offload = param_offload = None
    if placement.nvme is not None and optimizer is not None:
        offload = nvme.optimizer_offload(
            placement, plan.params, optimizer, shard_world, rank, precision, activity, plan.specs
        )
    try:
        if placement.param_nvme is not None and strategy.partitions_parameters:
            param_offload = nvme.param_offload(
                placement, plan.params, shard_world, rank, precision, offload, activity, plan.specs
            )
        units, specs, counted, unit_groups = _build_units(
            strategy, plan, module, group, precision, placement, shard_world, shard_rank, offload, param_offload
        )
    except BaseException:
        for opened in (offload, param_offload):
            if opened is not None:
                opened.close()
        raise
    trained = [u for u in units if u.trained]
    # Each trained unit's reduction group and divide factor (zero/reduce_groups.py): the data
    # group, averaged. A copy per unit: units sharing one ``reduce_group_of`` answer still take
    # their own divide factor (``set_gradient_divide_factor(units=...)``).
    reductions = {
        id(u): (
            dataclasses.replace(specs[id(u)])
            if specs[id(u)]
            else UnitReduction(group, world_size, rank, float(world_size))
        )
        for u in trained
    }
    trim = release.trim_every(strategy.trim_numel(options.unit_numel, units))
    masters = _hand_masters_to_optimizer(optimizer, param_groups, trained, offload, placement, reductions)
    for p in outside:
        p.data = p.data.to(precision.param_dtype)
    outside_grads = (
        ReplicatedGradients(outside, options.unit_numel, options.overlap, group, norm_group) if outside else None
    )

    gathered = [u for u in units if u.resharded]
    checks = _collective_checks(strategy, units, gathered, trained, group)
    coordinator = None
    if strategy.partitions_parameters:
        coordinator = ParameterCoordinator(
            module,
            gathered,
            group,
            prefetch_numel=options.prefetch_numel,
            max_live_numel=options.max_live_numel,
            leaf_of=leaves,
            memory_release=release,
            unit_groups=unit_groups,
            param_swapper=param_offload.swapper if param_offload is not None else None,
            checks=checks,
        )
    grad_offload = param_offload if param_offload is not None and offload is not None else None
    reduction = strategy.reduction(
        trained,
        precision,
        [reductions[id(u)] for u in trained],
        trim,
        options.overlap,
        options.unit_numel,
        options.use_reduce_scatter,
        checks,
        reduced=coordinator.release_reduced if coordinator is not None else None,
        grad_offload=grad_offload,
    )
    swap_statistics = (
        nvme.SwapStatistics(offload, param_offload, reduction.grad_swapper, activity) if offload is not None else None
    )

    registry.register(units, group, deepspeed_attributes=strategy.partitions_parameters, unit_groups=unit_groups)
    if coordinator is not None:  # DeepSpeed's hook handles, which RL trainers reach
        parameter_offload.attach(optimizer, coordinator, module)
    return ZeroStage(
        strategy=strategy,
        precision=precision,
        memory_release=release,
        group=group,
        world_size=world_size,
        norm_group=norm_group,
        shard_rank=shard_rank,
        units=units,
        masters=masters,
        reductions=reductions,
        counted=[counted[id(u)] for u in trained],
        reduction=reduction,
        coordinator=coordinator,
        outside=outside_grads,
        optimizer=optimizer,
        require_all_gradients=strategy.shards_optimizer and not options.ignore_unused_parameters,
        step_chunks=plan_step_chunks([u.layout.shard_numel for u in trained]),
        offload=offload,
        param_offload=param_offload,
        disk_activity=activity,
        swap_statistics=swap_statistics,
    )


@dataclass(frozen=True)
class _Plan:
    """The planned units: ``params`` ``[(optimizer group or None, [parameters])]``; per unit
    its ``UnitReduction`` or None (``specs``), whether the gradient norm counts it (``counted``)
    and, at stage 3, whether it stays whole (``persistent``)."""

    params: list
    specs: list
    counted: list
    persistent: list


def _plan(strategy, module, param_groups, has_optimizer, options, leaves, reduce_group_of, group) -> _Plan:
    plan = strategy.plan(param_groups, module, options.unit_numel, has_optimizer, leaf_of=leaves)
    plan, specs, counted = split_by_reduction(plan, reduce_group_of, group)
    persistent = [False] * len(plan)  # stage 3: small units stay whole, merged (zero/persistent.py)
    if strategy.partitions_parameters:
        plan, specs, counted, persistent = merge_persistent(
            plan, specs, counted, options.param_persistence_threshold, options.unit_numel, full_numel
        )
    return _Plan(plan, specs, counted, persistent)


def _build_units(
    strategy, plan: _Plan, module, group, precision, placement, shard_world, shard_rank, offload, param_offload
):
    """The units, one at a time (with zero.Init only one is ever whole): flattened, their fp32
    master placed or written to the swap files, resharded and cast; with each unit's
    ``UnitReduction`` and counted flag (by ``id``) and the group a unit is gathered over where
    it is not ``group``."""
    name_of: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), name)
    units: list[FlatParamUnit] = []
    specs, counted, unit_groups = {}, {}, {}
    for (g, params), spec, is_counted, whole in zip(plan.params, plan.specs, plan.counted, plan.persistent):
        for p in params:
            if is_partitioned(p):
                materialize(p, group)
        world, rank = shard_world, shard_rank  # sharded over its own group
        if spec is not None:
            world, rank = (spec.size, spec.rank) if strategy.shards_optimizer else (1, 0)
        unit = FlatParamUnit(
            params, world, rank, precision.param_dtype, names=[name_of[id(p)] for p in params], group=g
        )
        if spec is not None:  # stage 3 gathers it over that group too (experts: expert-data)
            unit_groups[unit] = spec.group
        specs[id(unit)], counted[id(unit)] = spec, is_counted
        master = None
        if unit.trained and placement.separate_master(unit.shard, precision.mixed):
            master = placement.master_for(unit.shard)  # fp32, copied before the cast
        if offload is not None and unit.trained:
            offload.swapper.add_unit(unit, master)  # written out; not kept
        else:
            unit.master = master
        if strategy.partitions_parameters and not whole:
            unit.reshard()
        unit.cast(precision.param_dtype)
        if unit.resharded:  # offload_param: the shard lives in host memory
            unit.shard = placement.place_shard(unit.shard)
            if param_offload is not None:  # ... or on disk
                param_offload.swapper.add_unit(unit)
            elif unit.shard_derivable:
                unit.derive_shard_from_master()
        units.append(unit)
    return units, specs, counted, unit_groups


def _hand_masters_to_optimizer(optimizer, param_groups, trained, offload, placement, reductions):
    """Rewrite the optimizer's param groups onto what it steps: each trained unit's fp32 master,
    else its shard (or, with NVMe offload, the swapper's chunks). Returns the masters."""
    if offload is not None:  # the optimizer steps the swapped chunks
        masters = []
        for g, group_dict in enumerate(param_groups):
            group_dict["params"] = offload.swapper.params_of_group(g)
    else:
        masters = [u.master if u.master is not None else u.shard for u in trained]
        for g, group_dict in enumerate(param_groups):
            group_dict["params"] = [m for u, m in zip(trained, masters) if u.group == g]
    if optimizer is not None and hasattr(optimizer, "attach_full_matrix"):  # Muon: whole matrices
        attach_muon(
            optimizer,
            trained,
            masters,
            param_groups,
            reductions,
            offloaded=offload is not None or placement.master_device is not None,
        )
    if optimizer is not None:  # its groups now hold shards: a new group would not be one
        optimizer.add_param_group = refuse_add_param_group
    return masters


def _collective_checks(strategy, units, gathered, trained, group) -> CollectiveChecks:
    """Stage 3: rank-dependent control flow raises on every rank, naming the units (below it,
    reductions launch in a fixed order and nothing is gathered in between); with
    ``ZEROTRAIN_CHECK_COLLECTIVES=1`` an agreement check before every unit collective too."""
    identities = (
        UnitIdentities(gathered, trained, strategy.stage)
        if strategy.partitions_parameters and identity_checks_enabled()
        else None
    )
    agreement = None
    if checking_enabled():
        # The collectives' device: where the units' full buffers are, not their shards (in host
        # memory under offload_param).
        device = units[0].layout.device if units else get_accelerator().device()
        agreement = CollectiveAgreement(group, _describer(gathered, trained), device)
    return CollectiveChecks(identities, agreement)


def _describer(gathered, trained):
    def describe(kind: str, index: int) -> str:
        units = gathered if kind == "gather" else trained
        if not 0 <= index < len(units):
            return f"unit {index}"
        names = units[index].names
        return f"unit {index} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"

    return describe
