"""Wall-clock timers for forward, backward and step (``"wall_clock_breakdown": true``)."""

from __future__ import annotations

import time
from collections import defaultdict

from zerotrain.accelerator import Accelerator

# DeepSpeed's names, so logs and monitors read the same.
FORWARD, BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE, STEP = (
    "forward", "backward", "backward_inner", "backward_allreduce", "step")


class StepTimers:
    """Accumulates elapsed milliseconds per phase; synchronises the device around each phase so
    the numbers are device time, not kernel-launch time. Disabled timers cost nothing."""

    def __init__(self, accelerator: Accelerator, enabled: bool):
        self.enabled = enabled
        self._accelerator = accelerator
        self._started: dict[str, float] = {}
        self.elapsed_ms: dict[str, float] = defaultdict(float)
        self.step_ms: dict[str, float] = defaultdict(float)

    def start(self, name: str) -> None:
        if self.enabled:
            self._accelerator.synchronize()
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._started:
            self._accelerator.synchronize()
            ms = (time.perf_counter() - self._started.pop(name)) * 1e3
            self.elapsed_ms[name] += ms
            self.step_ms[name] += ms

    def pop(self) -> dict[str, float]:
        """The totals since the last call, then reset (the ``steps_per_print`` window)."""
        out = dict(self.elapsed_ms)
        self.elapsed_ms.clear()
        return out

    def pop_step(self) -> dict[str, float]:
        """The totals since the last ``pop_step()`` (one optimizer step, for the monitors)."""
        out = dict(self.step_ms)
        self.step_ms.clear()
        return out
