"""The engine's checkpointed components: what ``engine.checkpoint_components()`` declares.

Each is a torch ``Stateful`` (``zerotrain.checkpoint.stateful``) under the key its state has in a
checkpoint, in the format's order; checkpoints iterate them and read nothing else of the engine's
small state. Built from the engine's public attributes on each call, so a scheduler or dataloader
set after ``initialize`` (``set_dataloader``) is the one saved.
"""

from __future__ import annotations

from zerotrain.checkpoint.stateful import COUNTER_NAMES, COUNTERS, DATALOADER, LOSS_SCALER, LR_SCHEDULER, PLD, Stateful
from zerotrain.pld.engine import PLDCheckpointState


class StepCounters:
    """The engine's step counters (``global_steps``, ``global_samples``, ``skipped_steps``,
    ``micro_steps``) as one ``Stateful``."""

    def __init__(self, engine):
        self._engine = engine

    def state_dict(self) -> dict[str, int]:
        engine = self._engine
        return {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "micro_steps": engine.micro_steps,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        engine = self._engine
        values = {name: int(state_dict[name]) for name in COUNTER_NAMES if name in state_dict}
        engine.global_steps = values.get("global_steps", engine.global_steps)
        engine.global_samples = values.get("global_samples", engine.global_samples)
        engine.skipped_steps = values.get("skipped_steps", engine.skipped_steps)
        engine.micro_steps = values.get("micro_steps", engine.micro_steps)


def engine_components(engine) -> dict[str, Stateful]:
    """``{checkpoint key: Stateful}`` of ``engine``: its counters and loss scaler always; its LR
    scheduler when it has state (``Stateful``); its training dataloader when its position can be
    restored (a ``Stateful`` loader over a sampler: not one over an ``IterableDataset``); progressive
    layer dropping when it is on (theta; derived from the step for a checkpoint without it)."""
    components: dict[str, Stateful] = {COUNTERS: StepCounters(engine), LOSS_SCALER: engine.loss_scaler}
    if isinstance(engine.lr_scheduler, Stateful):
        components[LR_SCHEDULER] = engine.lr_scheduler
    loader = engine.training_dataloader
    if isinstance(loader, Stateful) and getattr(loader, "sampler", None) is not None:
        components[DATALOADER] = loader
    if engine.progressive_layer_drop is not None:
        components[PLD] = PLDCheckpointState(engine.progressive_layer_drop, lambda: engine.global_steps)
    return components


__all__ = ["StepCounters", "engine_components"]
