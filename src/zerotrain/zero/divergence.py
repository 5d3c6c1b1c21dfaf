"""Stage 3: every rank must gather and reduce the same units in the same order — checked.

A model whose control flow differs between ranks (``if rank == 0: x = self.extra(x)`` with a
partitioned ``extra``) makes the ranks issue different collectives: one gathers ``extra`` while
the other gathers the next module. Unchecked, gloo then sums or gathers the wrong buffers
silently (units of equal size) or aborts the process ("Received data size doesn't match").

Each stage-3 gather and gradient reduce-scatter therefore carries an identity (kind, unit index,
chunk, elements per rank) in the collective itself (``zerotrain.comm.collectives.Identity``: a
32-byte header beside the data, checked before the data is used; no extra collective, no extra
round trip). The first disagreement raises ``CollectiveMismatch`` on every rank, naming what
each rank was doing.

``ZEROTRAIN_CHECK_COLLECTIVES=0`` turns the check off; ``=1`` adds the older, slower agreement
check (``zero.agreement``: a small all-gather before every collective, also on backends where
identities are not carried: NCCL and gloo's ``all_reduce`` form).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerotrain.comm.collectives import CollectiveMismatch, Identity
from zerotrain.zero.partition import FlatParamUnit

if TYPE_CHECKING:
    from zerotrain.zero.agreement import CollectiveAgreement

GATHER, REDUCE = 1, 2
_VERBS = {GATHER: "gathered", REDUCE: "reduced the gradients of"}


def identity_checks_enabled() -> bool:
    """On unless ``ZEROTRAIN_CHECK_COLLECTIVES`` is 0 / false / off."""
    return os.environ.get("ZEROTRAIN_CHECK_COLLECTIVES", "").strip().lower() not in ("0", "false", "off", "no")


def module_name(unit: FlatParamUnit) -> str:
    """The module a unit's parameters belong to: their names' common prefix ('' for the root)."""
    parts = [name.split(".")[:-1] for name in unit.names]
    common = parts[0]
    for p in parts[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


class UnitIdentities:
    """The identities of a stage-3 engine's unit collectives (built once, reused every step).

    ``gathered``: the units the coordinator gathers (by position); ``reduced``: the trained
    units whose gradients are reduce-scattered (by bucket index)."""

    def __init__(self, gathered: Sequence[FlatParamUnit], reduced: Sequence[FlatParamUnit], stage: int = 3):
        self.stage = stage
        self._units = {GATHER: list(gathered), REDUCE: list(reduced)}
        self._gather = [Identity((GATHER, i, 0, u.layout.shard_numel), self._explain) for i, u in enumerate(gathered)]
        self._reduce: dict[tuple[int, int, int], Identity] = {}

    def gather(self, index: int) -> Identity:
        return self._gather[index]

    def reduce(self, index: int, start: int, numel: int) -> Identity:
        """The reduce-scatter of elements ``[start, start + numel)`` of every rank's shard of
        trained unit ``index``'s gradients."""
        key = (index, start, numel)
        identity = self._reduce.get(key)
        if identity is None:
            identity = self._reduce[key] = Identity((REDUCE, index, start, numel), self._explain)
        return identity

    # -- the message ---------------------------------------------------------------------
    def describe(self, code: tuple) -> str:
        kind, index = code[0], code[1]
        units = self._units.get(kind)
        if units is None or not 0 <= index < len(units):
            return f"issued an unknown collective {code}"
        unit = units[index]
        name = module_name(unit)
        names = ", ".join(unit.names[:3]) + (", ..." if len(unit.names) > 3 else "")
        what = f"unit '{name}' ({names})" if name else f"unit {index} ({names})"
        if kind == REDUCE and code[3] != unit.layout.shard_numel:
            what += f" elements {code[2]}-{code[2] + code[3]} of each shard"
        return f"{_VERBS[kind]} {what}"

    def _explain(self, codes: list) -> CollectiveMismatch:
        groups: dict[tuple, list[int]] = {}
        for rank, code in enumerate(codes):
            groups.setdefault(code, []).append(rank)
        parts = []
        for code, ranks in groups.items():
            who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            parts.append(f"{who} {self.describe(code)}")
        said = ", ".join(parts[:-1]) + " while " + parts[-1] if len(parts) > 1 else parts[0]
        return CollectiveMismatch(
            f"stage {self.stage}: {said} -- every rank must run the same modules in the same "
            f"order at ZeRO stage {self.stage} (a module called on some ranks only, e.g. under "
            "`if rank == 0:`, or a loss that uses a module's output on some ranks only). Run "
            "it on every rank (with a dummy input where its result is not needed, and multiply "
            "an unwanted result by 0 rather than leaving it out of the loss), or keep its "
            "parameters whole with zero_optimization.stage3_param_persistence_threshold above "
            "their size. The engine cannot continue after this error."
        )


@dataclass(frozen=True)
class CollectiveChecks:
    """What a stage's unit collectives are checked with, given to its reduction and its
    stage-3 coordinator: ``identities`` (a ``UnitIdentities``, stage 3 unless turned off),
    carried in each gather and reduce-scatter; ``agreement`` (a ``zero.agreement``
    ``CollectiveAgreement``, with ``ZEROTRAIN_CHECK_COLLECTIVES=1``), run before each."""

    identities: UnitIdentities | None = None
    agreement: CollectiveAgreement | None = None
