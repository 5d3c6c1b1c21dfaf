"""How the optimizer step is split into calls over parts of the units (the peak of a 16-bit step
is every fp32 gradient copy and the optimizer's temporaries held together)."""

from __future__ import annotations

import functools
import inspect

import torch


def plan_step_chunks(shard_numels: list[int]) -> list[list[int]]:
    """Consecutive indices into ``shard_numels`` grouped into chunks of at most an eighth of
    their sum, or the largest one where that is bigger (also the estimator's step transient)."""
    budget = max(max(shard_numels, default=0), sum(shard_numels) // 8)
    chunks: list[list[int]] = [[]]
    numel = 0
    for i, size in enumerate(shard_numels):
        if chunks[-1] and numel + size > budget:
            chunks.append([])
            numel = 0
        chunks[-1].append(i)
        numel += size
    return chunks


@functools.cache
def steps_per_parameter(optimizer_class: type[torch.optim.Optimizer]) -> bool:
    """Whether the class's ``step()`` is one of the built-in steps that keep state per
    parameter and pass over parameters without a gradient, so several calls in one training
    step, each over some of the parameters, equal one call over all (a subclass overriding
    ``step`` is not assumed to)."""
    from zerotrain.optim.fused_adam import FusedAdam
    from zerotrain.optim.lion import Lion

    known = (
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.SGD,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adadelta,
        FusedAdam,
        Lion,
    )
    step = inspect.unwrap(optimizer_class.step)
    return any(step is inspect.unwrap(cls.step) for cls in known)
