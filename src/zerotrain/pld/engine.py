"""Progressive layer dropping in the engine: a mixin of ``ZeroTrainEngine`` (DeepSpeed's names).

DeepSpeed's behaviour, kept exactly: the forward gets ``progressive_layer_drop=True,
pld_theta=theta`` only while the module is in training mode; at an accumulation boundary,
``update_state(global_steps)`` runs before the step increments ``global_steps``, so step s's
forward sees theta(s - 1) and ``get_pld_theta()`` after step s is theta(s). zerotrain also saves
theta in checkpoints (:class:`PLDCheckpointState`, a component the engine declares) and binds
``SwitchableBlocks``. A pipeline engine refuses the section (it calls its stages itself, with no
``pld_theta``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torch import nn

from zerotrain.checkpoint.stateful import DerivedWhenAbsent
from zerotrain.pld.blocks import SwitchableBlocks
from zerotrain.pld.schedule import ProgressiveLayerDrop, theta_at

if TYPE_CHECKING:
    from zerotrain.config.schema import ZeroTrainConfig
    from zerotrain.zero.interface import StageInterface


class EnginePLD:
    """``progressive_layer_drop`` (the schedule or None), ``get_pld_theta`` and the config
    accessors ``pld_enabled``, ``pld_params``, ``pld_theta``, ``pld_gamma``."""

    progressive_layer_drop: ProgressiveLayerDrop | None = None
    _pld_stacks: list = []

    # What this mixin reads of ZeroTrainEngine (set in its __init__; annotations only).
    _config: ZeroTrainConfig
    module: nn.Module
    global_steps: int
    micro_steps: int

    if TYPE_CHECKING:

        @property
        def zero_stage_object(self) -> StageInterface: ...

    def _init_pld(self) -> None:
        """Build the schedule from the config and bind the module's ``SwitchableBlocks``."""
        if self.pld_enabled():  # the pipeline engine refuses the section before this (check_pipeline_config)
            self.progressive_layer_drop = ProgressiveLayerDrop(theta=self.pld_theta(), gamma=self.pld_gamma())
        engine = weakref.ref(self)  # the module must not keep the engine alive

        def micro_steps() -> int:
            live = engine()
            assert live is not None  # the stacks draw while their engine trains them
            return live.micro_steps

        self._pld_stacks = [m for m in self.module.modules() if isinstance(m, SwitchableBlocks)]
        for index, stack in enumerate(self._pld_stacks):
            stack.bind(micro_steps, index)

    def _pld_forward_kwargs(self) -> dict:
        """DeepSpeed's ``kwargs.update(pld.get_state())``: only while the module is training."""
        pld = self.progressive_layer_drop
        training = pld is not None and self.module.training
        coordinator = self.zero_stage_object.parameter_coordinator if self._pld_stacks else None
        if coordinator is not None:
            # Stage 3 prefetches along the last pass's order: tell it now which blocks this pass
            # drops (the stacks will draw the same, from the same micro-step), before the first
            # gather, so that none of them is gathered ahead of a use that never comes.
            theta = float(pld.get_theta()) if pld is not None and training else 1.0
            coordinator.skip_prefetch(
                [
                    block
                    for stack in self._pld_stacks
                    if theta < 1.0
                    for block, keep in zip(stack, stack.draw(theta))
                    if not keep
                ]
            )
        return pld.get_state() if pld is not None and training else {}

    def _pld_at_boundary(self) -> None:
        """Before the step core's ``model_step`` increments ``global_steps`` (DeepSpeed's order)."""
        if self.progressive_layer_drop is not None:
            self.progressive_layer_drop.update_state(self.global_steps)

    def get_pld_theta(self):
        """The current keep ratio theta; None when progressive layer dropping is off."""
        return None if self.progressive_layer_drop is None else self.progressive_layer_drop.get_theta()

    def pld_enabled(self) -> bool:
        return bool(self._config.progressive_layer_drop.enabled)

    def pld_params(self):
        """The section without ``enabled`` (DeepSpeed: False when the section is absent)."""
        if "progressive_layer_drop" not in self._config.model_fields_set:
            return False
        return self._config.progressive_layer_drop.model_dump(exclude={"enabled"})

    def pld_theta(self) -> float:
        return self._config.progressive_layer_drop.theta

    def pld_gamma(self) -> float:
        return self._config.progressive_layer_drop.gamma


class PLDCheckpointState(DerivedWhenAbsent):
    """The schedule's theta as a checkpointed component of the engine (``Stateful``): as saved,
    else (a checkpoint without it, as DeepSpeed writes) the value the uninterrupted run would hold
    after ``global_steps()`` steps (restored before it: the counters come first)."""

    def __init__(self, schedule: ProgressiveLayerDrop, global_steps):
        self.schedule, self.global_steps = schedule, global_steps

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.schedule.load_state_dict(state_dict)

    def load_absent(self) -> None:
        steps, pld = self.global_steps(), self.schedule
        pld.current_theta = theta_at(steps - 1, pld.theta, pld.gamma) if steps > 0 else 1.0
