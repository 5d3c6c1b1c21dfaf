"""The ZeRO stages as small strategy objects over the shared core (``zero.core.ZeroStage``).

A stage decides three things; everything else (units, masters, the step, edits, loading) is the
core's and the same for all:

- how parameters are grouped into flat units (by size and backward order, or per module so a
  unit is gathered exactly when its module runs);
- how gradients are reduced (all-reduce once per accumulation window into persistent buffers, or
  reduce-scatter every backward into shards);
- whether units stay whole on every rank or are partitioned and gathered around use.

Optimizer state is sharded from stage 1 on (``shards_optimizer``).
"""

from __future__ import annotations

from torch import nn

from zerotrain.zero.partition import plan_module_units, plan_units
from zerotrain.zero.reduction import AllReduceGradients, ReduceScatterGradients


class ShardingStrategy:
    stage: int
    shards_optimizer = True
    partitions_parameters = False

    def unit_numel(self, bucket_numel: int) -> int:
        """Elements per flat unit, from the gradient bucket size."""
        return bucket_numel

    def plan(self, param_groups, module: nn.Module, unit_numel: int, has_optimizer: bool,
             leaf_of: dict | None = None):
        """``[(optimizer group index or None for frozen, [parameters])]`` in reduction order."""
        return plan_units(param_groups, unit_numel, list(module.parameters())[::-1])

    def trim_numel(self, unit_numel: int, units) -> int:
        """Gradient elements reduced between two hand-backs of freed memory in backward
        (``memory_release: "eager"``): a unit's worth."""
        return unit_numel

    def reduction(self, core, units, overlap: bool, slot_numel: int, use_reduce_scatter: bool):
        """How ``units`` (the core's trained units) reduce, each over its own group and divide
        factor (``core.reduction_of(unit)``, a ``zero.reduce_groups.UnitReduction``)."""
        return AllReduceGradients(units, core.precision, [core.reduction_of(u) for u in units],
                                  overlap, core.trim)


class Stage0(ShardingStrategy):
    """Nothing sharded: every rank steps the whole (fp32 master) model."""

    stage = 0
    shards_optimizer = False


class Stage1(ShardingStrategy):
    """Optimizer state sharded; gradients reduce-scattered once per window (each rank steps
    its shard; ``reduce_scatter: false`` all-reduces them whole instead)."""

    stage = 1

    def reduction(self, core, units, overlap: bool, slot_numel: int, use_reduce_scatter: bool):
        return AllReduceGradients(units, core.precision, [core.reduction_of(u) for u in units],
                                  overlap, core.trim, scatter=use_reduce_scatter)


class Stage2(ShardingStrategy):
    """Gradients sharded too: reduce-scattered during every backward."""

    stage = 2

    def unit_numel(self, bucket_numel: int) -> int:
        # A unit's finished full-size gradients wait for its launch, then go through staging
        # slots of one unit each (four when overlapping: one bucket in all). Quarter-bucket units
        # keep the waiting gradients small (measured: peak RSS 14 MiB lower on the 17M GPT and
        # ~45 MiB on the 110M GPT-2 than half-bucket units; docs/benchmarks.md).
        return max(1, bucket_numel // 4)

    def reduction(self, core, units, overlap: bool, slot_numel: int, use_reduce_scatter: bool):
        return ReduceScatterGradients(units, core.precision, [core.reduction_of(u) for u in units],
                                      overlap, core.trim, slot_numel, use_reduce_scatter,
                                      reduced=core.unit_reduced)


class Stage3(Stage2):
    """Parameters partitioned too: one unit per module, gathered around its use."""

    stage = 3
    partitions_parameters = True

    def plan(self, param_groups, module: nn.Module, unit_numel: int, has_optimizer: bool,
             leaf_of: dict | None = None):
        return plan_module_units(param_groups, module, all_frozen=not has_optimizer,
                                 leaf_of=leaf_of)

    def trim_numel(self, unit_numel: int, units) -> int:
        # Units are single modules: a trim after each one's reduction was ~40 malloc_trim calls
        # a backward, each handing back memory the next unit faults in again. Once per eighth
        # of the model holds the same peak (110M GPT-2: 50k fewer page faults a step, +3 MiB).
        return max(unit_numel, sum(u.layout.padded_numel for u in units) // 8)


STRATEGIES = {s.stage: s for s in (Stage0(), Stage1(), Stage2(), Stage3())}
