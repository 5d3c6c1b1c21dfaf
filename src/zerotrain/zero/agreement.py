"""Checking that every rank issues the same ZeRO collective (``ZEROTRAIN_CHECK_COLLECTIVES=1``).

Gathers and reductions of units are collectives every rank must issue in the same order. A model
whose control flow differs between ranks (a partitioned module run on one rank only) breaks that:
without a check the ranks pair up different collectives, which hangs, aborts in gloo ("Received
data size doesn't match") or — when two units have the same size — silently sums the wrong
buffers. With the check on, each gather and reduction is preceded by a tiny all-gather of what
the rank is about to do, and the first disagreement raises on every rank, naming the units each
rank was at. It costs one small collective per unit collective, so it is a debugging switch.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from zerotrain.comm import collectives as comm

_KINDS = ("gather", "reduce")


def checking_enabled() -> bool:
    return os.environ.get("ZEROTRAIN_CHECK_COLLECTIVES", "0") not in ("", "0", "false", "False")


class CollectiveAgreement:
    """Verifies ``(kind, unit index)`` across the ranks of ``group`` before a unit collective.

    ``group`` is the very group the unit collectives run over (the stage's: the engine's data
    group), so the check pairs the same ranks as the collectives it guards; a disagreement names
    those ranks by their global rank (two engines on disjoint groups name their own ranks)."""

    def __init__(self, group, describe: Callable[[str, int], str], device=None):
        self.group = group
        self.describe = describe
        self.device = device
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        # Global rank of each group position (None is the world: positions are global ranks).
        self.ranks = (
            dist.get_process_group_ranks(group)
            if dist.is_initialized() and group is not None
            else list(range(self.world))
        )

    def check(self, kind: str, index: int) -> None:
        if self.world == 1:
            return
        mine = torch.tensor([_KINDS.index(kind), index], dtype=torch.int64, device=self.device)
        every = mine.new_empty(self.world * mine.numel())
        comm.all_gather_into(every, mine, group=self.group)
        seen = [tuple(int(v) for v in row) for row in every.view(self.world, -1).tolist()]
        if len(set(seen)) > 1:
            ranks = ", ".join(f"rank {self.ranks[r]} {self._what(k, i)}" for r, (k, i) in enumerate(seen))
            raise RuntimeError(
                "ZeRO ranks diverged: they are about to run different collectives ("
                + ranks
                + "). The model's control flow differs between ranks; run the same modules on "
                "every rank (e.g. with zero inputs), or keep the branch's parameters whole below "
                "stage3_param_persistence_threshold"
            )

    def _what(self, kind: int, index: int) -> str:
        name = _KINDS[kind]
        return f"{name}s {self.describe(name, index)}"
