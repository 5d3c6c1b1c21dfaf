"""The ZeRO stages as small strategy objects for ``zero.zero_stage.ZeroStage``.

A stage decides three things; everything else (units, masters, the step, edits, loading) is
``ZeroStage``'s and the same for all:

- how parameters are grouped into flat units (by size and backward order, or per module so a
  unit is gathered exactly when its module runs);
- how gradients are reduced (all-reduce once per accumulation window into persistent buffers, or
  reduce-scatter every backward into shards);
- whether units stay whole on every rank or are partitioned and gathered around use.

Optimizer state is sharded from stage 1 on (``shards_optimizer``).
"""

from __future__ import annotations

from torch import nn

from zerotrain.zero.divergence import CollectiveChecks
from zerotrain.zero.partition import plan_module_units, plan_units
from zerotrain.zero.reduction import AllReduceGradients, ReduceScatterGradients


class ShardingStrategy:
    stage: int
    shards_optimizer = True
    partitions_parameters = False

    def unit_numel(self, bucket_numel: int) -> int:
        """Elements per flat unit, from the gradient bucket size."""
        return bucket_numel

    def plan(self, param_groups, module: nn.Module, unit_numel: int, has_optimizer: bool, leaf_of: dict | None = None):
        """``[(optimizer group index or None for frozen, [parameters])]`` in reduction order."""
        return plan_units(param_groups, unit_numel, list(module.parameters())[::-1])

    def trim_numel(self, unit_numel: int, units) -> int:
        """Gradient elements reduced between two hand-backs of freed memory in backward
        (``memory_release: "eager"``): a unit's worth."""
        return unit_numel

    def reduction(
        self,
        units,
        precision,
        reductions,
        trim,
        overlap: bool,
        slot_numel: int,
        use_reduce_scatter: bool,
        checks: CollectiveChecks,
        reduced=None,
        grad_offload=None,
    ):
        """How ``units`` (the stage's trained units) reduce, each over its own group and divide
        factor (``reductions``: a ``zero.reduce_groups.UnitReduction`` per unit). Stages 2-3:
        ``reduced(unit)`` once a unit's gradients are copied out, ``grad_offload`` the
        ``NvmeParamOffload`` whose folder also holds the gradient shards (or None)."""
        return AllReduceGradients(units, precision, reductions, overlap, trim, checks=checks)


class Stage0(ShardingStrategy):
    """Nothing sharded: every rank steps the whole (fp32 master) model."""

    stage = 0
    shards_optimizer = False


class Stage1(ShardingStrategy):
    """Optimizer state sharded; gradients reduce-scattered once per window (each rank steps
    its shard; ``reduce_scatter: false`` all-reduces them whole instead)."""

    stage = 1

    def reduction(
        self,
        units,
        precision,
        reductions,
        trim,
        overlap: bool,
        slot_numel: int,
        use_reduce_scatter: bool,
        checks: CollectiveChecks,
        reduced=None,
        grad_offload=None,
    ):
        return AllReduceGradients(
            units, precision, reductions, overlap, trim, scatter=use_reduce_scatter, checks=checks
        )


class Stage2(ShardingStrategy):
    """Gradients sharded too: reduce-scattered during every backward."""

    stage = 2

    def unit_numel(self, bucket_numel: int) -> int:
        # A unit's finished full-size gradients wait for its launch, then go through staging
        # slots of one unit each (four when overlapping: one bucket in all). Quarter-bucket units
        # keep the waiting gradients small (measured: peak RSS 14 MiB lower on the 17M GPT and
        # ~45 MiB on the 110M GPT-2 than half-bucket units; docs/benchmarks.md).
        return max(1, bucket_numel // 4)

    def reduction(
        self,
        units,
        precision,
        reductions,
        trim,
        overlap: bool,
        slot_numel: int,
        use_reduce_scatter: bool,
        checks: CollectiveChecks,
        reduced=None,
        grad_offload=None,
    ):
        return ReduceScatterGradients(
            units,
            precision,
            reductions,
            overlap,
            trim,
            slot_numel,
            use_reduce_scatter,
            reduced=reduced,
            checks=checks,
            grad_offload=grad_offload,
        )


class Stage3(Stage2):
    """Parameters partitioned too: one unit per module, gathered around its use."""

    stage = 3
    partitions_parameters = True

    def plan(self, param_groups, module: nn.Module, unit_numel: int, has_optimizer: bool, leaf_of: dict | None = None):
        return plan_module_units(param_groups, module, all_frozen=not has_optimizer, leaf_of=leaf_of)

    def trim_numel(self, unit_numel: int, units) -> int:
        # Units are single modules: a trim after each one's reduction was ~40 malloc_trim calls
        # a backward, each handing back memory the next unit faults in again. Once per eighth
        # of the model holds the same peak (110M GPT-2: 50k fewer page faults a step, +3 MiB).
        return max(unit_numel, sum(u.layout.padded_numel for u in units) // 8)


STRATEGIES = {s.stage: s for s in (Stage0(), Stage1(), Stage2(), Stage3())}
