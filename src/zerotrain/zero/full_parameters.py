"""Every parameter whole, one unit at a time: what an RL loop hands to an inference engine.

RL trainers copy the trained weights into a generation server (vLLM, SGLang) after each step.
Gathering the whole model first needs it all in memory at once; gathering parameter by parameter
(``GatheredParameters([p])`` in a loop, what OpenRLHF does) gathers each stage-3 unit once for
every parameter it holds. ``named_full_parameters`` gathers each unit once, the next one in
flight while the caller consumes this one, and releases each as soon as the caller moves on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from zerotrain.zero import registry
from zerotrain.zero.interface import TrainsModule

if TYPE_CHECKING:
    from zerotrain.zero.partition import FlatParamUnit
    from zerotrain.zero.stage3 import ParameterCoordinator


def named_full_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every parameter of ``model`` (an engine or its module), whole
    and in the training dtype.

    At ZeRO-3 the tensors are views of a gathered unit: use (copy, send) each before asking for
    the next unit's, since a unit is released when the iteration moves past it. Parameters come
    unit by unit, in the order of each unit's first parameter (module order); tied parameters
    once, under their first name. Collective at ZeRO-3: every rank of the engine's group iterates
    to the end (or stops at the same place). Below stage 3 the parameters are whole already and
    are yielded as they are.
    """
    module = model.module if isinstance(model, TrainsModule) else model
    groups: dict[FlatParamUnit | str, list[tuple[str, torch.Tensor]]] = {}
    for name, param in module.named_parameters():
        unit = registry.unit_of(param)
        key = unit if unit is not None and unit.resharded and unit.coordinator is not None else name
        groups.setdefault(key, []).append((name, param))
    units = [key for key in groups if not isinstance(key, str)]
    ahead = iter(units[1:])
    started: set = set()  # units this iteration gathers (and so releases); others were gathered already
    try:
        for key, members in groups.items():
            if isinstance(key, str):
                yield from ((name, param.detach()) for name, param in members)
                continue
            if not key.gathered:
                started.add(key)
            _coordinator(key).fetch(key)  # waits for it when it is in flight
            following = next(ahead, None)
            if following is not None and _coordinator(following).start_fetch(following):
                started.add(following)
            yield from ((name, param.detach()) for name, param in members)
            if key in started:
                started.discard(key)
                _coordinator(key).release(key)
    finally:  # closed early: what is still gathered, or in flight, is released
        for unit in started:
            _coordinator(unit).release(unit)


def _coordinator(unit: FlatParamUnit) -> ParameterCoordinator:
    """The coordinator of a unit grouped above (only units with one are)."""
    assert unit.coordinator is not None
    return unit.coordinator
