"""ZeRO stages. Every stage shares the flat-buffer core (``zero.flat``, ``zero.partition``) and
the gradient buckets (``zero.gradient_buckets``); a stage differs only in what it shards."""

from __future__ import annotations

from zerotrain.config.optimizer_check import check_zero_optimizer
from zerotrain.optim.expert_groups import expert_parameters
from zerotrain.memory_release import ReleasePolicy, release_freed_memory
from zerotrain.precision import PrecisionPolicy
from zerotrain.precision.autocast import resolve_safe_modules, safe_module_names
from zerotrain.zero.gathered import GatheredParameters
from zerotrain.zero.init import Init, is_partitioned, materialize
from zerotrain.zero.leaves import leaf_modules
from zerotrain.zero.core import StageOptions, ZeroStage
from zerotrain.zero.strategy import STRATEGIES
from zerotrain.zero.stage0 import ReplicatedGradients
from zerotrain.zero.reduce_groups import UnitReduction
from zerotrain.zero.parameter_offload import register_external_parameter, unregister_external_parameter
from zerotrain.zero.full_parameters import named_full_parameters

__all__ = ["Init", "GatheredParameters", "build_zero_stage", "named_full_parameters", "register_external_parameter",
           "unregister_external_parameter"]

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
    specs = {size: UnitReduction.over(topology.expert_groups(size).expert_data_group,
                                      divide_factor=topology.data_size)
             for size in sorted(set(experts.values()))}
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


def build_zero_stage(config, module, optimizer, precision: PrecisionPolicy, group=None,
                     norm_group=None, topology=None):
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
        return ReplicatedGradients(params, numel, overlap=overlap, group=group, norm_group=norm_group,
                                   reduce_group_of=reduce_group_of)
    # Without an explicit stage3_prefetch_bucket_size, prefetch one bucket ahead: DeepSpeed's
    # 5e7-element default gathers half of a 110M model ahead of use.
    prefetch = (int(zero.prefetch_bucket_size) if "prefetch_bucket_size" in zero.model_fields_set
                else numel)
    options = StageOptions(unit_numel=strategy.unit_numel(numel), overlap=overlap,
                           use_reduce_scatter=zero.reduce_scatter,
                           ignore_unused_parameters=zero.ignore_unused_parameters,
                           param_persistence_threshold=int(zero.param_persistence_threshold),
                           prefetch_numel=prefetch, max_live_numel=int(zero.max_live_parameters),
                           leaf_modules=(tuple(leaf_modules(module, zero))
                                         if strategy.partitions_parameters else ()))
    if optimizer is not None:  # which optimizers may step flat shards (config's rule)
        check_zero_optimizer(config, optimizer)
    from zerotrain.offload import build_placement  # offload settings -> where state lives

    # Expert parameters keep their expert-data reduction; other lower-precision-safe ones travel
    # in the autocast dtype (DeepSpeed does this at stages 1-3; stage 0 reduces in fp32).
    reduce_group_of = _first_of(reduce_group_of, autocast_reductions(module, config, precision, group))
    stage = ZeroStage(strategy, module, optimizer, options, precision, group=group,
                      placement=build_placement(config), memory_release=release,
                      norm_group=norm_group, reduce_group_of=reduce_group_of)
    for p in module.parameters():  # parameters outside every unit stay whole
        if is_partitioned(p):
            materialize(p, group)
    module.to(precision.param_dtype)  # frozen parameters and floating buffers
    # The module's original parameters (copied into flat units, or cast) have just been freed:
    # hand that memory back to the OS instead of leaving it in glibc's heap for the whole run.
    release_freed_memory()
    return stage
