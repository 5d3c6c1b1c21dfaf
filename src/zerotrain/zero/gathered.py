"""``zerotrain.zero.GatheredParameters``: make partitioned parameters whole inside a block."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from zerotrain.comm import collectives
from zerotrain.memory_release import release_freed_memory
from zerotrain.zero import registry
from zerotrain.zero.partitioned_param import _keep_shard, is_partitioned, materialize, partitioning_of


class GatheredParameters(contextlib.ContextDecorator):
    """Make partitioned parameters whole inside the block (every rank must enter it).

    With ``modifier_rank`` set, that rank's values of *every* listed parameter are broadcast on
    exit: partitioned ones become the partitioned values, whole ones (stage 3 keeps parameters
    below ``stage3_param_persistence_threshold`` whole; stages 0-2 keep all) are overwritten on
    every rank. In both cases the optimizer's fp32 master weights take the new values (untouched
    elements keep their fp32 precision).

    ``modifier_rank`` is a rank *within the data-parallel group* the parameters are partitioned
    over, as in DeepSpeed: an engine unit's group (``initialize(data_parallel_group=...)``), the
    group ``zero.Init(data_parallel_group=...)`` partitioned a parameter over, the world for
    parameters of neither. Gathers, broadcasts and re-partitioning all run over that group.

    ``fwd_module`` is accepted for DeepSpeed compatibility and needs nothing here: a parameter
    read by a module it does not belong to is gathered on access during forward anyway.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        # None entries and repeats are skipped, as in DeepSpeed: transformers'
        # resize_token_embeddings passes [weight, bias-or-None, weight, bias-or-None].
        self.params: list[torch.Tensor] = []
        for p in params if enabled and params is not None else ():
            if p is not None and all(p is not q for q in self.params):
                self.params.append(p)
        if modifier_rank is not None and dist.is_initialized():
            for group in {id(g): g for g in map(_group_of, self.params)}.values():
                size = dist.get_world_size(group)
                if not 0 <= modifier_rank < size:
                    where = "the world" if group is None else "the parameters' data-parallel group"
                    raise ValueError(
                        f"GatheredParameters(modifier_rank={modifier_rank}): "
                        f"modifier_rank is a rank within {where}, which has ranks "
                        f"0..{size - 1}"
                    )
        self.modifier_rank = modifier_rank
        self._units: list = []
        self._init_params: list = []
        self._whole: list = []

    def __enter__(self):
        for p in self.params:
            unit = registry.unit_of(p)
            if unit is not None and unit.resharded:
                if all(unit is not u for u in self._units):
                    self._units.append(unit)
            elif is_partitioned(p):
                self._init_params.append(p)
            elif all(p is not q for q in self._whole):
                self._whole.append(p)
        for unit in self._units:  # all in flight at once, then each waited for
            unit.coordinator.start_fetch(unit)
        for unit in self._units:
            unit.coordinator.fetch(unit)
        for p in self._init_params:
            materialize(p)
        return self

    def __exit__(self, *exc):
        if self.modifier_rank is not None and dist.is_initialized():
            for unit in self._units:
                group = unit.process_group
                collectives.broadcast(unit.flat, src=self._global(group), group=group)
                unit.adopt_full_values()
            for p in self._init_params:
                group = partitioning_of(p).group
                collectives.broadcast(p.data, src=self._global(group), group=group)
            with torch.no_grad():
                for p in self._whole:
                    group = _group_of(p)
                    collectives.broadcast(p.detach(), src=self._global(group), group=group)
                    # A collective's write is invisible to the version counter by which the
                    # engine notices edits (and copies them into its fp32 masters at the step).
                    increment_version(p)
        for unit in self._units:
            unit.coordinator.release(unit)
        for p in self._init_params:
            _keep_shard(p, partitioning_of(p))  # over its group, in its place, as zero.Init did
        if self._init_params:
            # The whole parameters just freed sit in malloc's heap: without handing them back,
            # loading a model module by module (from_pretrained under zero.Init) grows each
            # rank's resident size to the full model.
            release_freed_memory()
        self._units, self._init_params, self._whole = [], [], []  # reusable as a decorator
        return False

    def _global(self, group) -> int:
        """``modifier_rank`` as the global rank torch's collectives take."""
        assert self.modifier_rank is not None  # only a modifying exit broadcasts
        return self.modifier_rank if group is None else dist.get_global_rank(group, self.modifier_rank)


def _group_of(param: torch.Tensor):
    """The data-parallel group ``param`` is partitioned (or, whole, replicated) over: its engine
    unit's, else zero.Init's, else the group an engine without units (fp32 stage 0) replicates it
    over, else None (the world)."""
    unit = registry.unit_of(param)
    if unit is not None:
        return unit.process_group
    how = partitioning_of(param)
    if how is not None:
        return how.group
    return registry.replicated_group(param)  # fp32 stage 0's whole parameters, else None
