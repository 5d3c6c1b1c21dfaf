"""The protocol an engine's checkpointed components follow, and the keys their state has on disk.

Each part of the engine with state besides tensors (the step counters, the loss scaler, the LR
scheduler, the dataloader position, progressive layer dropping) is a torch ``Stateful``
(``torch.distributed.checkpoint.stateful``'s protocol: ``state_dict()`` and
``load_state_dict(state_dict)``; :class:`Stateful` here). The engine declares them, by the key their state has in a
checkpoint's per-rank state file, in ``engine.checkpoint_components()``; a save stores each
one's ``state_dict()`` under its key (``training_state.capture_engine``) and a load hands each
component the state stored under its key (``training_state.restore_engine``). Neither reads the
engine's attributes: a component the engine does not declare (no scheduler, PLD off) is neither
saved nor loaded.

A component whose state a checkpoint may lack (one written by DeepSpeed, or before the feature
was on) and that can then still be set to what the uninterrupted run would hold is a
:class:`DerivedWhenAbsent`; any other component keeps its own state when its key is absent.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

#: Keys of the components' states in the ``engine`` entry of a per-rank state file, in the order
#: they are saved and restored (counters first: other components' defaults derive from them).
COUNTERS = "counters"
LOSS_SCALER = "loss_scaler"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
PLD = "pld"
KEYS = (COUNTERS, LOSS_SCALER, LR_SCHEDULER, DATALOADER, PLD)

#: The engine's step counters, in the ``counters`` state.
COUNTER_NAMES = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


@runtime_checkable
class Stateful(Protocol):
    """torch's ``torch.distributed.checkpoint.stateful.Stateful``, member for member (a test
    compares them). Declared here rather than imported: importing ``torch.distributed.checkpoint``
    costs about two seconds (it loads DTensor and FSDP) in every process that imports the engine.
    Being a structural protocol, anything that is one is the other."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


Components = Mapping[str, Stateful]


class DerivedWhenAbsent(abc.ABC):
    """A ``Stateful`` component that sets itself when a checkpoint holds no state for it."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def load_absent(self) -> None:
        """Called instead of ``load_state_dict`` when the checkpoint lacks this component's
        state (after the components before it in :data:`KEYS` were restored)."""


def check_components(components: Components) -> None:
    """Every component is ``Stateful`` under a known key, in :data:`KEYS`'s order (an engine's
    declaration that breaks this would change the on-disk format)."""
    names = list(components)
    unknown = [n for n in names if n not in KEYS]
    if unknown:
        raise ValueError(
            f"checkpoint components {unknown}: the checkpoint format has no key for them (known: {list(KEYS)})"
        )
    if names != [k for k in KEYS if k in components]:
        raise ValueError(f"checkpoint components {names} are not in the format's order {list(KEYS)}")
    for name, component in components.items():
        if not isinstance(component, Stateful):
            raise TypeError(
                f"checkpoint component {name!r} ({type(component).__name__}) has no state_dict()/load_state_dict()"
            )


__all__ = [
    "COUNTERS",
    "COUNTER_NAMES",
    "Components",
    "DATALOADER",
    "DerivedWhenAbsent",
    "KEYS",
    "LOSS_SCALER",
    "LR_SCHEDULER",
    "PLD",
    "Stateful",
    "check_components",
]
