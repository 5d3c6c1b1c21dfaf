"""Which unit holds a parameter, without patching state onto the parameter.

``GatheredParameters`` and the DeepSpeed-compatible ``ds_*`` views look parameters up here. The
registry holds parameters weakly; an engine registers its units at build and unregisters them in
``destroy()``.

Stage-3 parameters also carry DeepSpeed's public read-outs, which scripts test to decide what to
gather: ``ds_id``, ``ds_numel``, ``ds_shape``, ``ds_status`` (``ZeroParamStatus``), ``ds_tensor``
(this rank's part of the parameter), ``ds_active_sub_modules`` (zero/parameter_offload.py) and the
method ``partition_numel()`` (that part's element count). They are set at build, ``ds_status`` is kept current by the
unit, and ``destroy()`` removes them all.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Process-wide on purpose (docs/design.md, "Process-wide state"). ``_unit_of`` answers for bare
# parameters (``GatheredParameters(params)`` and the ``ds_*`` views get no engine); it is keyed by
# the parameter (identity: tensors compare elementwise, so a plain WeakKeyDictionary cannot hold
# them), so engines over different parameters never see each other's entries.
_unit_of = WeakIdKeyDictionary()
# ``ds_id``s are unique across the process, as DeepSpeed's (a class-wide counter in its
# zero.Init): a script holding two engines (a GAN) can key by ds_id without collisions. Nothing
# in zerotrain decides by them: not checkpoints (keyed by name), not the cross-rank checks.
_next_id = itertools.count()
# Whole parameters an engine replicates over a group without units (fp32 stage 0): the group
# ``GatheredParameters(modifier_rank=...)`` broadcasts them over.
_replicated_over = WeakIdKeyDictionary()
DS_ATTRIBUTES = ("ds_id", "ds_numel", "ds_shape", "ds_status", "ds_tensor", "ds_active_sub_modules", "partition_numel")


def register(units: Sequence, group=None, deepspeed_attributes: bool = False, unit_groups: dict | None = None) -> None:
    """``units`` are sharded over ``group``, or over ``unit_groups[unit]`` where given (expert
    units: their expert-data group); ``GatheredParameters`` gathers and broadcasts over it."""
    for unit in units:
        unit.process_group = (unit_groups or {}).get(unit, group)
        for p in unit.params:
            _unit_of[p] = unit
        if deepspeed_attributes:
            unit.expose_deepspeed_attributes(_next_id)


def unregister(units: Sequence) -> None:
    for unit in units:
        for p in unit.params:
            if _unit_of.get(p) is unit:
                del _unit_of[p]
            for name in DS_ATTRIBUTES:
                if name in vars(p):
                    delattr(p, name)


def register_replicated(params: Sequence, group) -> None:
    """``params`` are whole on every rank of ``group`` (an engine without units)."""
    for p in params:
        _replicated_over[p] = group


def unregister_replicated(params: Sequence, group) -> None:
    for p in params:
        if p in _replicated_over and _replicated_over[p] is group:
            del _replicated_over[p]


def replicated_group(param: torch.Tensor):
    """The group ``param`` is replicated over by an engine without units; None if none is."""
    return _replicated_over.get(param)


def unit_of(param: torch.Tensor):
    """The engine unit that holds ``param``, or None."""
    return _unit_of.get(param)
