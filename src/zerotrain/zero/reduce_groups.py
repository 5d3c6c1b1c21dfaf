"""Per-unit reduction groups and divide factors, and the gradient norm over every group.

Every gradient unit (a flat unit of a ``ZeroStage``, a bucket of fp32 stage 0) carries a
``UnitReduction``: the process group its gradients are reduced over and the factor the sum is
divided by (FSDP2's ``set_gradient_divide_factor``). The default is the engine's data group and
its size, an average; a factor of 1 sums, and a unit over another group (experts' expert-data
group, which must lie within the data group) may divide by something other than that group's
size.

The gradient norm (and with it the fp16 overflow decision) counts every element of the model's
gradient once across the job. Each rank adds the squares it *owns*: a gradient shard is owned by
the rank holding it (shards of one unit are disjoint); a gradient replicated over its unit's
group is owned by that group's first rank. The owned squares are summed over the data group
(skipped when every unit is replicated over the whole data group: each rank then already holds
its replica's total) and then over the ranks holding distinct parameters
(``Topology.distinct_group``: the pipeline stages and model slices of one replica). A NaN or inf
on any rank makes the result non-finite on every rank (0 x inf is NaN), so all skip together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zerotrain.comm import collectives

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass
class UnitReduction:
    """Where one unit's gradients are reduced (``group``: its ``size`` ranks, this one at
    ``rank``), what their sum is divided by (``divide_factor``) and, when not the stage's
    communication dtype, the dtype they travel in (``comm_dtype``: torch_autocast's
    lower-precision-safe modules)."""

    group: ProcessGroup | None
    size: int
    rank: int
    divide_factor: float
    comm_dtype: torch.dtype | None = None

    @classmethod
    def over(cls, group, divide_factor: float | None = None, comm_dtype: torch.dtype | None = None) -> UnitReduction:
        """Over ``group`` (None: the world), averaging unless ``divide_factor`` is given."""
        if dist.is_initialized():
            size, rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            size, rank = 1, 0
        factor = float(size) if divide_factor is None else check_divide_factor(divide_factor)
        return cls(group, size, rank, factor, comm_dtype)


def check_divide_factor(factor) -> float:
    """``factor`` as a float, or a one-line ValueError naming what is wrong."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        raise ValueError(f"set_gradient_divide_factor: factor must be a number, got {factor!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"set_gradient_divide_factor: factor must be a finite number > 0, got {factor!r} "
            "(1 sums the gradients, the group size averages them)"
        )
    return value


def counted_in_norm(param) -> bool:
    """False for a parameter marked ``ds_pipe_replicated`` (DeepSpeed's mark of a tied copy
    whose gradient another rank holding distinct parameters counts)."""
    return not getattr(param, "ds_pipe_replicated", False)


def global_norm(
    norms: Sequence[torch.Tensor],
    reductions: Sequence[UnitReduction],
    sharded: Sequence[bool],
    data_group,
    data_size: int,
    distinct_group,
    device,
    counted: Sequence[bool] | None = None,
) -> torch.Tensor:
    """fp32 L2 norm of the whole model's gradient from each unit's local norm on this rank.

    ``norms[i]``: the L2 norm of unit i's gradient as this rank holds it; ``sharded[i]``: whether
    that is this rank's disjoint shard of the unit (else the whole gradient, replicated over
    ``reductions[i].group``); ``counted[i]`` False: a tied copy counted elsewhere. Collective
    over the data group (when some unit is not replicated over all of it) and over
    ``distinct_group`` (when not None): every rank of both calls it."""
    owns_part = [s and r.size > 1 for r, s in zip(reductions, sharded)]
    need_data = data_size > 1 and any(own or r.size < data_size for own, r in zip(owns_part, reductions))
    counted = [True] * len(norms) if counted is None else list(counted)
    if norms:
        squares = torch.stack([n.to(torch.float32) for n in norms]).square()
        # A replicated gradient counts at its group's first rank only (when the data group
        # sums), a tied copy nowhere here; 0 x inf is NaN, so an overflow still shows.
        weights = [
            1.0 if c and (own or r.rank == 0 or not need_data) else 0.0
            for own, r, c in zip(owns_part, reductions, counted)
        ]
        if not all(weights):
            squares = squares * torch.tensor(weights, dtype=torch.float32, device=squares.device)
        total = squares.sum()
    else:
        total = torch.zeros((), dtype=torch.float32)
    # Gradients may live in host memory (offload_param): NCCL reduces device tensors.
    total = total.to(device)
    if need_data:
        collectives.all_reduce(total, group=data_group)
    if distinct_group is not None:
        collectives.all_reduce(total, group=distinct_group)
    return total.sqrt()


def split_by_reduction(plan, reduce_group_of, data_group) -> tuple[list, list, list]:
    """``plan`` (``[(optimizer group, [parameters])]``) with each planned unit split so every
    unit's parameters share one reduction and one ``counted_in_norm``; that reduction per unit
    (None: the data group's) and whether the norm counts it.

    ``reduce_group_of(param)`` returns a ``UnitReduction`` (parameters returning the same object
    share units) or None; its group must lie within the data group."""
    if reduce_group_of is None and all(counted_in_norm(p) for _, params in plan for p in params):
        return list(plan), [None] * len(plan), [True] * len(plan)
    out, specs, counts, checked = [], [], [], set()
    data_ranks = {0} if not dist.is_initialized() else set(dist.get_process_group_ranks(data_group or dist.group.WORLD))
    for g, params in plan:
        by_spec: dict[tuple, tuple[UnitReduction | None, list]] = {}
        for p in params:
            spec = reduce_group_of(p) if reduce_group_of is not None else None
            if spec is not None and not isinstance(spec, UnitReduction):
                raise TypeError(f"reduce_group_of must return a UnitReduction or None, got {type(spec).__name__}")
            if spec is not None and id(spec) not in checked:
                checked.add(id(spec))
                ranks = (
                    set(dist.get_process_group_ranks(spec.group or dist.group.WORLD)) if dist.is_initialized() else {0}
                )
                if not ranks <= data_ranks:
                    raise ValueError(
                        f"a unit's reduction group {sorted(ranks)} is not within the data group "
                        f"{sorted(data_ranks)}; reduce over a subgroup of the data group"
                    )
            by_spec.setdefault((id(spec), counted_in_norm(p)), (spec, []))[1].append(p)
        for (_, counted), (spec, members) in by_spec.items():
            out.append((g, members))
            specs.append(spec)
            counts.append(counted)
    return out, specs, counts
