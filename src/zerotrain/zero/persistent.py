"""Stage 3's persistent units: those below ``stage3_param_persistence_threshold`` elements.

A persistent unit stays whole on every rank (nothing gathers or releases it around its module),
so its module-sized granularity buys nothing: it would only cost one reduce-scatter in every
backward and one all-gather after every step (GPT-2: two LayerNorm units a block, and every
block of a narrow model). They are merged here, per optimizer group and reduction, into units
of up to ``unit_numel`` elements, as stage 2 buckets its gradients (DeepSpeed's stage 3 also
reduces persistent parameters' gradients in its shared buckets).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn


def merge_persistent(
    plan: Sequence[tuple],
    specs: Sequence,
    counted: Sequence[bool],
    threshold: int,
    unit_numel: int,
    numel_of: Callable[[nn.Parameter], int],
):
    """``plan`` (``[(optimizer group, [parameters])]`` in the order backward completes the units,
    with each unit's reduction ``specs`` and norm flag ``counted``) with its units under
    ``threshold`` elements merged. Returns the new plan, specs, counted flags, and per unit
    whether it stays whole (decided before merging: a merged unit may pass the threshold).

    A merged unit takes the place of its last member: reductions launch strictly in plan order,
    and a merged unit is complete only when its last member's gradients are (placed at its first
    member, it would hold back every unit after it, and those units' gathered parameters, to the
    end of backward). Units that differ in group, reduction or norm flag never mix.

    A merged unit holds at most an eighth of the model (and ``unit_numel``): its reduction is
    what frees its full gradients and, under ``memory_release: "eager"``, hands backward's freed
    memory back (once per eighth of the model reduced). A model whose every unit is under the
    threshold, merged into one unit, reduced nothing until the end of backward and kept the
    whole backward's freed recomputed activations resident (12 small GPT-2 blocks with
    activation checkpointing: +20-60 MiB of peak per step)."""
    numels = [sum(numel_of(p) for p in params) for _, params in plan]
    unit_numel = max(1, min(unit_numel, sum(numels) // 8))
    entries = []  # [position, (group, params), spec, counted, whole]
    open_units: dict[tuple, tuple[list, int]] = {}  # (group, reduction, counted) -> (entry, numel)
    for position, ((g, params), spec, count, numel) in enumerate(zip(plan, specs, counted, numels)):
        if numel >= threshold or not params:
            entries.append([position, (g, list(params)), spec, count, False])
            continue
        key = (g, id(spec), count)
        entry, size = open_units.get(key, (None, 0))
        if entry is None or size + numel > unit_numel:
            entry, size = [position, (g, []), spec, count, True], 0
            entries.append(entry)
        entry[0] = position
        entry[1][1].extend(params)
        open_units[key] = (entry, size + numel)
    entries.sort(key=lambda e: e[0])
    return ([e[1] for e in entries], [e[2] for e in entries], [e[3] for e in entries], [e[4] for e in entries])
