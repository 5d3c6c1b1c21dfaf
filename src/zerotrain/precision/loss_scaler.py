"""Loss scaling for fp16 training (DeepSpeed's rules and config names).

Dynamic scaling (``"loss_scale": 0``) starts at ``2**initial_scale_power``. An overflow (inf or
NaN anywhere in the gradients, on any rank) skips the step; the scale is divided by 2 once
``hysteresis`` overflows have used up the tolerance, never going below ``min_loss_scale``. After
``loss_scale_window`` steps without overflow the scale doubles and the tolerance is refilled
(with ``consecutive_hysteresis`` it is refilled after every clean step instead).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("zerotrain")

MIN_SCALE_MESSAGE = (
    "fp16 gradients keep overflowing at the minimum loss scale {scale}: steps are being skipped. "
    'Remedies: train in bf16 ("bf16": {{"enabled": true}}), lower the learning rate, or lower '
    "fp16.min_loss_scale; set fp16.raise_error_at_min_scale to stop the run instead."
)


class LossScaler:
    """A fixed scale (``loss_scale > 0`` in the config, or 1.0 for bf16/fp32)."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome."""

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler(LossScaler):
    """Raises the scale while gradients stay finite, lowers it on overflow."""

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = False,
    ):
        super().__init__(init_scale)
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.hysteresis = max(1, hysteresis)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        self.last_overflow_iter = self.cur_iter
        if self.cur_hysteresis > 1:
            self.cur_hysteresis -= 1
            return
        if self.cur_scale <= self.min_scale:
            message = MIN_SCALE_MESSAGE.format(scale=self.cur_scale)
            if self.raise_error_at_min_scale:
                raise FloatingPointError(message)
            logger.warning(message)
        self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_hysteresis = self.hysteresis
            self.cur_scale *= self.scale_factor

    def state_dict(self) -> dict:
        return {
            "cur_scale": self.cur_scale,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
