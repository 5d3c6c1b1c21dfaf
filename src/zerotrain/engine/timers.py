"""Wall-clock timers for forward, backward and step (``"wall_clock_breakdown": true``), and
DeepSpeed's ``ThroughputTimer`` (``engine.tput_timer``; ``deepspeed.utils.timer`` re-exports it):
samples per second over optimizer steps. ``start()`` when a micro-step begins,
``stop(global_step=True)`` when the step that ends an accumulation window is done; the first
``start_step`` steps (warm-up) are not timed. ``avg_samples_per_sec()`` is ``batch_size`` over the
mean time of the timed steps."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from zerotrain.accelerator import Accelerator

# DeepSpeed's names, so logs and monitors read the same.
FORWARD, BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE, STEP = (
    "forward",
    "backward",
    "backward_inner",
    "backward_allreduce",
    "step",
)


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


class ThroughputTimer:
    """DeepSpeed's throughput timer. ``config`` may be None (enabled, synchronized) or any object
    with ``enabled`` and ``synchronized`` attributes (DeepSpeed's ``timers.throughput``)."""

    def __init__(
        self,
        config=None,
        batch_size: int | None = 1,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], None] | None = None,
    ):
        self.enabled = getattr(config, "enabled", True)
        self.synchronized = getattr(config, "synchronized", True)
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        if logging_fn is None:
            from zerotrain.log import logger

            logging_fn = logger.info
        self.logging = logging_fn
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._seen_global_steps: int | None = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def _sync(self) -> None:
        if self.synchronized:
            from zerotrain.accelerator import get_accelerator

            get_accelerator().synchronize()

    def start(self) -> None:
        if not self.enabled:
            return
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self._sync()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self._sync()
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
                    self._report()
                self.step_elapsed_time = 0.0

    def _report(self) -> None:
        from zerotrain.accelerator import get_accelerator

        accelerator = get_accelerator()
        self.logging(
            f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}, "
            f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
            f"CurrSamplesPerSec={self.batch_size / max(self.step_elapsed_time, 1e-12)}, "
            f"MemAllocated={round(accelerator.memory_allocated() / 1024**3, 2)}GB, "
            f"MaxMemAllocated={round(accelerator.max_memory_allocated() / 1024**3, 2)}GB"
        )
        if self.monitor_memory:
            import psutil

            self.logging(
                f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                f"global_step={self.global_step_count}, vm %: {psutil.virtual_memory().percent}, "
                f"swap %: {psutil.swap_memory().percent}"
            )

    def avg_samples_per_sec(self) -> float:
        """``batch_size`` / mean seconds per timed step; ``-inf`` before any step was timed."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)

    def observe_forward(self, global_steps: int) -> None:
        """Drive the timer from forward calls alone (what ``engine.tput_timer`` does): a forward
        that sees ``global_steps`` grown since the previous one ends the previous window (its
        step included) and starts the next, so a step's time runs from the first forward of its
        window to the first forward of the next one."""
        if self._seen_global_steps is not None and global_steps > self._seen_global_steps:
            self.stop(global_step=True, report_speed=False)
        self._seen_global_steps = global_steps
        if not self.started:
            self.start()
