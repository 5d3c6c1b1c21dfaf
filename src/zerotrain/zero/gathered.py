"""``zerotrain.zero.GatheredParameters``: make partitioned parameters whole inside a block."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from zerotrain.comm import collectives
from zerotrain.zero import registry
from zerotrain.memory_release import release_freed_memory
from zerotrain.zero.init import _keep_shard, is_partitioned, materialize


class GatheredParameters(contextlib.ContextDecorator):
    """Make partitioned parameters whole inside the block (every rank must enter it).

    With ``modifier_rank`` set, that rank's values of *every* listed parameter are broadcast on
    exit: partitioned ones become the partitioned values, whole ones (stage 3 keeps parameters
    below ``stage3_param_persistence_threshold`` whole; stages 0-2 keep all) are overwritten on
    every rank. In both cases the optimizer's fp32 master weights take the new values (untouched
    elements keep their fp32 precision).

    ``fwd_module`` is accepted for DeepSpeed compatibility and needs nothing here: a parameter
    read by a module it does not belong to is gathered on access during forward anyway.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        # None entries and repeats are skipped, as in DeepSpeed: transformers'
        # resize_token_embeddings passes [weight, bias-or-None, weight, bias-or-None].
        self.params = []
        for p in (params if enabled and params is not None else ()):
            if p is not None and all(p is not q for q in self.params):
                self.params.append(p)
        if modifier_rank is not None and dist.is_initialized():
            world = dist.get_world_size()
            if not 0 <= modifier_rank < world:
                raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank}): the world "
                                 f"has ranks 0..{world - 1}")
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
                collectives.broadcast(p.data, src=self.modifier_rank)
            with torch.no_grad():
                for p in self._whole:
                    unit = registry.unit_of(p)
                    group = unit.process_group if unit is not None else None
                    collectives.broadcast(p.detach(), src=self._global(group), group=group)
                    # A collective's write is invisible to the version counter by which the
                    # engine notices edits (and copies them into its fp32 masters at the step).
                    increment_version(p)
        for unit in self._units:
            unit.coordinator.release(unit)
        for p in self._init_params:
            _keep_shard(p, dist.get_world_size(), dist.get_rank())
        if self._init_params:
            # The whole parameters just freed sit in malloc's heap: without handing them back,
            # loading a model module by module (from_pretrained under zero.Init) grows each
            # rank's resident size to the full model.
            release_freed_memory()
        self._units, self._init_params, self._whole = [], [], []  # reusable as a decorator
        return False

    def _global(self, group) -> int:
        """``modifier_rank`` is a rank of the parameters' data-parallel group."""
        return self.modifier_rank if group is None else dist.get_global_rank(group, self.modifier_rank)
