"""The progressive layer dropping schedule over time: DeepSpeed's ``ProgressiveLayerDrop``.

theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar, where theta_bar is ``theta`` (the floor
it decays to) and t the engine's global step at the accumulation boundary. Zhang and He,
"Accelerating Training of Transformer-Based Language Models with Progressive Layer Dropping",
NeurIPS 2020 (arXiv 2010.13369). DeepSpeed removed PLD in 2026; zerotrain keeps it (docs/pld.md).
"""

from __future__ import annotations

import math

import numpy as np

from zerotrain.log import log_rank0


class ProgressiveLayerDrop:
    """Holds the current keep ratio theta; the engine advances it at every optimizer step.

    Same names and numbers as DeepSpeed's: ``theta`` is the floor theta_bar, ``gamma`` the decay
    rate; ``current_theta`` starts at 1.0 (keep every layer) and ``update_state(global_step)``
    sets it to the formula's value at that step (a numpy float64, as DeepSpeed's)."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        check_theta_gamma(theta, gamma)
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0
        log_rank0("Enabled progressive layer dropping (theta = %s)", self.theta)

    def get_state(self) -> dict:
        """The keyword arguments the engine passes to the model's forward while training."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self):
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = theta_at(global_step, self.theta, self.gamma)

    # -- checkpoints (zerotrain; DeepSpeed does not save theta) -------------------------
    def state_dict(self) -> dict:
        return {"current_theta": float(self.current_theta)}

    def load_state_dict(self, state: dict) -> None:
        self.current_theta = np.float64(state["current_theta"])


def theta_at(step: int, theta_bar: float, gamma: float) -> np.float64:
    """theta(step) = (1 - theta_bar) * exp(-gamma * step) + theta_bar, computed as DeepSpeed does."""
    return (1.0 - theta_bar) * np.exp(-gamma * step) + theta_bar


def check_theta_gamma(theta, gamma) -> None:
    """One-line errors for values the schedule cannot use (the config's own check says the same)."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0.0 < theta <= 1.0:
        raise ValueError(
            f"progressive_layer_drop.theta must be > 0 and <= 1 (the keep ratio theta "
            f"decays to; the paper uses 0.5), got {theta!r}"
        )
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not (math.isfinite(gamma) and gamma >= 0.0):
        raise ValueError(
            f"progressive_layer_drop.gamma must be a finite number >= 0 (the decay rate; "
            f"the paper uses 0.001), got {gamma!r}"
        )
