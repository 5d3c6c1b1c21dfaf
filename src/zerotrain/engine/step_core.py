"""``StepCore``: the train-step bookkeeping both engines hold (``engine._core``), by composition.

``ZeroTrainEngine`` drives it from ``forward``/``backward``/``step``, the pipeline engine from
``train_batch``; neither inherits the other's loop. The core owns:

- the counters (``global_steps``, ``global_samples``, ``micro_steps``, ``skipped_steps``: the
  engines' attributes of those names are views of them) and the batch shape it counts samples by;
- the accumulation boundary, with ``set_gradient_accumulation_boundary``'s override;
- the factor a backward multiplies the loss by (loss scale over the accumulation steps);
- the model step: gradient norm, the skip-on-overflow decision, clipping, the stage's optimizer
  step, the loss scaler's update, the LR scheduler; what the last ``step()`` did (``StepOutcome``);
- the training state (``TrainingState``) and the misuse it refuses;
- the step log (the window's losses, the ``steps_per_print`` line, monitors, MoE statistics).

It reads its settings (clipping, ``steps_per_print``, the batch shape) once, at construction;
``set_train_batch_size``/``set_train_micro_batch_size`` change the shape through ``resize``.
"""

from __future__ import annotations

import contextlib
import enum
import math
import time
import weakref
from dataclasses import dataclass

import torch

from zerotrain.engine.timers import STEP
from zerotrain.log import log_rank0
from zerotrain.offload import describe_stats


class TrainingState(enum.Enum):
    """Where the engine is in its loop (FSDP2's ``TrainingState`` is the model). Between passes it
    is ``IDLE`` or, inside ``engine.no_sync()``, ``NO_SYNC`` (backwards accumulate without
    reducing; ``step()`` is refused); during a pass it is that pass's phase, after which the state
    between passes comes back."""

    IDLE = "idle"
    NO_SYNC = "no_sync"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEPPING = "stepping"


class StepOutcome(enum.Enum):
    """What the last ``step()`` (or ``train_batch()``) did; ``was_step_applied()`` is ``APPLIED``."""

    NONE = "none"  # no step yet
    ACCUMULATED = "accumulated"  # no accumulation boundary: the micro-step was counted, nothing updated
    APPLIED = "applied"  # the optimizer updated the weights
    SKIPPED = "skipped"  # fp16 overflow: gradients dropped, weights, optimizer and LR kept


_PHASES = (TrainingState.FORWARD, TrainingState.BACKWARD, TrainingState.STEPPING)

STEP_IN_NO_SYNC = (
    "engine.step() was called inside engine.no_sync(): gradients there are not "
    "reduced across ranks; leave the no_sync() block before stepping"
)
NO_SYNC_REENTERED = "engine.no_sync() is not re-entrant"


@dataclass
class StepSettings:
    """What the core reads from the config, once."""

    gradient_clipping: float
    steps_per_print: int | None
    train_batch_size: int
    micro_batch_size: int
    accumulation_steps: int

    @classmethod
    def from_config(cls, config) -> StepSettings:
        return cls(
            gradient_clipping=config.gradient_clipping or 0.0,
            steps_per_print=config.steps_per_print,
            train_batch_size=config.train_batch_size,
            micro_batch_size=config.train_micro_batch_size_per_gpu,
            accumulation_steps=config.gradient_accumulation_steps,
        )


class StepCore:
    """One engine's step bookkeeping. ``engine`` is held weakly: its public ``optimizer`` and
    ``lr_scheduler`` are read at each step (a framework may replace them), and the monitors and
    MoE statistics are handed the engine, as they expect."""

    def __init__(
        self,
        engine,
        settings: StepSettings,
        *,
        zero,
        loss_scaler,
        check_overflow: bool,
        optimizer_surface,
        timers,
        monitor,
        topology,
        moe_stats=None,
    ):
        self._engine = weakref.ref(engine)
        self.settings = settings
        self._zero = zero
        self._loss_scaler = loss_scaler
        self._check_overflow = check_overflow
        self._surface = optimizer_surface
        self._timers = timers
        self._monitor = monitor
        self._topology = topology
        self._moe_stats = moe_stats
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.boundary_override: bool | None = None  # set_gradient_accumulation_boundary's value
        self.outcome = StepOutcome.NONE
        self.global_grad_norm: float | None = None
        self._between = TrainingState.IDLE  # IDLE or NO_SYNC
        self._phase: TrainingState | None = None  # FORWARD, BACKWARD or STEPPING while one runs
        self.window_losses: list[torch.Tensor] = []
        self.last_log = (time.perf_counter(), 0)  # (time, global_samples) of the last step line

    # -- state ------------------------------------------------------------------------------
    @property
    def state(self) -> TrainingState:
        return self._phase if self._phase is not None else self._between

    @property
    def in_no_sync(self) -> bool:
        return self._between is TrainingState.NO_SYNC

    @contextlib.contextmanager
    def phase(self, state: TrainingState):
        """``state`` for the block (a forward, a backward, the optimizer step), then the state
        before it."""
        if state not in _PHASES:
            raise ValueError(f"phase({state}): one of {', '.join(s.name for s in _PHASES)}")
        outer = self._phase
        self._phase = state
        try:
            yield
        finally:
            self._phase = outer

    def begin_phase(self, state: TrainingState) -> None:
        """A phase whose end comes from elsewhere (a backward the engine did not start, ended by
        autograd's callback): ``end_phase`` ends it."""
        self._phase = state

    def end_phase(self, state: TrainingState) -> None:
        if self._phase is state:
            self._phase = None

    @contextlib.contextmanager
    def no_sync(self):
        if self.in_no_sync:
            raise RuntimeError(NO_SYNC_REENTERED)
        self._between = TrainingState.NO_SYNC
        try:
            yield
        finally:
            self._between = TrainingState.IDLE

    def check_can_step(self) -> None:
        if self.in_no_sync:
            raise RuntimeError(STEP_IN_NO_SYNC)

    # -- accumulation window ----------------------------------------------------------------
    @property
    def accumulation_steps(self) -> int:
        return self.settings.accumulation_steps

    @property
    def train_batch_size(self) -> int:
        return self.settings.train_batch_size

    def resize(self, train_batch_size: int, micro_batch_size: int, accumulation_steps: int) -> None:
        self.settings.train_batch_size = train_batch_size
        self.settings.micro_batch_size = micro_batch_size
        self.settings.accumulation_steps = accumulation_steps

    def is_boundary(self) -> bool:
        """True when the current micro-step ends an accumulation window (or the override says so)."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.accumulation_steps == 0

    def backward_factor(self, scale_wrt_gas: bool = True, loss_scaled: bool = False) -> float:
        """What a backward multiplies the loss by: the loss scale (undone at the step; not when
        ``engine.scale`` applied it already) over the accumulation steps."""
        factor = 1.0 if loss_scaled else self._loss_scaler.loss_scale
        if scale_wrt_gas and self.accumulation_steps > 1:
            factor /= self.accumulation_steps
        return factor

    def count_micro_steps(self, n: int = 1) -> None:
        self.micro_steps += n

    def record_loss(self, loss: torch.Tensor) -> None:
        """A loss of the current window, for the step line's mean."""
        self.window_losses.append(loss.detach())

    # -- the model step ---------------------------------------------------------------------
    def model_step(self, lr_kwargs: dict | None = None) -> None:
        """Update the weights from the window's reduced gradients: the norm (when clipping or
        fp16's overflow check needs it), a skip when it is not finite, else unscale and clip in
        one factor, the optimizer, the loss scaler and the LR scheduler. Counts the step; timed as
        the ``step`` phase of ``wall_clock_breakdown``."""
        self._timers.start(STEP)
        try:
            self._model_step(lr_kwargs)
        finally:
            self._timers.stop(STEP)

    def _model_step(self, lr_kwargs: dict | None) -> None:
        engine = self._engine()
        assert engine is not None  # the engine drives its own step: it is alive
        clip = self.settings.gradient_clipping
        scale = self._loss_scaler.loss_scale
        norm = math.nan  # measured below whenever read: by clipping or the overflow check
        if clip > 0 or self._check_overflow:
            norm = float(self._zero.grad_norm()) / scale
        self.global_steps += 1
        self.global_samples += self.train_batch_size
        if self._check_overflow and not math.isfinite(norm):
            self._skip(scale)
            return
        self.global_grad_norm = norm if clip > 0 else None
        grad_scale = 1.0 / scale  # unscale once, together with clipping
        if clip > 0:
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                grad_scale *= coef
        with self.phase(TrainingState.STEPPING):
            self._zero.step(engine.optimizer, grad_scale)
        self._zero.zero_grad()
        self._loss_scaler.update(overflow=False)
        self._surface.set_overflow(False)
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step(**(lr_kwargs or {}))
        self.outcome = StepOutcome.APPLIED

    def _skip(self, scale: float) -> None:
        """Gradients overflowed on some rank: drop them, keep weights, optimizer and LR."""
        self._zero.zero_grad()
        self._loss_scaler.update(overflow=True)
        self._surface.set_overflow(True)
        self.skipped_steps += 1
        self.global_grad_norm = None
        self.outcome = StepOutcome.SKIPPED
        log_rank0(
            "OVERFLOW! Skipping step %d. Attempted loss scale: %g, reducing to %g",
            self.global_steps,
            scale,
            self._loss_scaler.loss_scale,
            topology=self._topology,
        )

    # -- the step log -----------------------------------------------------------------------
    def restart_log_window(self) -> None:
        """Forget the window's losses and time it from now (after a checkpoint is loaded)."""
        self.window_losses = []
        self.last_log = (time.perf_counter(), self.global_samples)

    def log_step(self) -> None:
        """After a step: the monitors, the MoE statistics and, every ``steps_per_print`` steps, the
        step line (mean loss of the window, samples/s, TFLOPS once profiled), the NVMe swap line and
        the phase times."""
        engine = self._engine()
        assert engine is not None  # the engine logs its own step: it is alive
        every = self.settings.steps_per_print
        losses, self.window_losses = self.window_losses, []
        if self._monitor.enabled:
            self._monitor.write_step(engine, losses)
        if self._moe_stats is not None:  # per-layer expert counts, drop rate and l_aux
            self._moe_stats.step_done(engine, bool(every and self.global_steps % every == 0))
        if not every or self.global_steps % every:
            return
        now = time.perf_counter()
        then, samples = self.last_log
        self.last_log = (now, self.global_samples)
        rate = (self.global_samples - samples) / max(now - then, 1e-9)
        loss = float(torch.stack(losses).mean()) if losses else float("nan")
        lr = ", ".join(f"{v:.6g}" for v in engine.get_lr())
        flops = engine._flops_log_suffix((self.global_samples - samples) // self.train_batch_size, now - then)
        log_rank0(
            "step=%d, skipped=%d, lr=[%s], loss=%.4f, samples/sec=%.2f%s",
            self.global_steps,
            self.skipped_steps,
            lr,
            loss,
            rate,
            flops,
            topology=self._topology,
        )
        offload = describe_stats(self._zero.statistics(engine.module, engine.optimizer).offload)
        if offload:  # NVMe offload: the last step's swap I/O and the disk footprint
            log_rank0(offload, topology=self._topology)
        if self._timers.enabled:
            times = self._timers.pop()
            log_rank0("time (ms) | " + " | ".join(f"{k}: {v:.2f}" for k, v in times.items()), topology=self._topology)
