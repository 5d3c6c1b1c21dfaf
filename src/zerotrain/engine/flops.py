"""The engine's side of the ``flops_profiler`` section (zerotrain.monitor.flops).

While ``global_steps == profile_step`` (DeepSpeed's numbering: 0 is the first step, so the
default 1 profiles the second), the first rank of the engine's data group counts every forward
of the step; at the step's end it prints the profile (or writes ``output_file``). From then on the
step log adds the achieved TFLOPS per device, ``(3 + recompute_fwd_factor) x`` the profiled
forward FLOPs per step over the window's time, and MFU against the device's peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from zerotrain.monitor.flops import FlopsProfiler

if TYPE_CHECKING:
    from zerotrain.accelerator.base import Accelerator
    from zerotrain.config.schema import ZeroTrainConfig
    from zerotrain.engine.timers import StepTimers
    from zerotrain.precision.policy import PrecisionPolicy
    from zerotrain.topology import Topology


class EngineFlops:
    """Mixed into ``ZeroTrainEngine``; needs its config, module, topology, timers and step counts."""

    # What this mixin reads of ZeroTrainEngine (set in its __init__; annotations only).
    _config: ZeroTrainConfig
    module: nn.Module
    accelerator: Accelerator
    precision: PrecisionPolicy
    topology: Topology
    dp_world_size: int
    global_steps: int
    _timers: StepTimers

    if TYPE_CHECKING:

        def train_batch_size(self) -> int: ...

        def train_micro_batch_size_per_gpu(self) -> int: ...

    def _init_flops_profiler(self) -> None:
        section = self._flops_section = self._config.flops_profiler  # read once
        self.flops_profiler = None
        self._flops_per_step: float | None = None  # this rank's forward+backward FLOPs of one step
        self._flops_clean_from = 0  # first window start (a step count) without the profiled step
        if not section.enabled:
            return
        self.flops_profiler = FlopsProfiler(self.module, self, section.recompute_fwd_factor)
        self._flops_peak = (
            section.peak_tflops * 1e12
            if section.peak_tflops
            else self.accelerator.peak_flops(self.precision.param_dtype)
        )

    def _flops_forward_begin(self) -> bool:
        """Start (or go on) counting when this forward belongs to the profiled step."""
        profiler = self.flops_profiler
        if (
            profiler is None
            or self.global_steps != self._flops_section.profile_step
            or not self.topology.is_first("data")
        ):
            return False
        if profiler.started:
            profiler.resume_profile()
        else:
            # the phase times accumulate until the monitors take them: keep where the step began
            self._flops_times_before = dict(self._timers.step_ms)
            profiler.start_profile()
        return True

    def _flops_forward_end(self) -> None:
        profiler = self.flops_profiler
        assert profiler is not None  # called only after _flops_forward_begin returned True
        profiler.stop_profile()

    def _flops_step_done(self) -> None:
        """At the end of the profiled step (its times are in): print the profile, keep the
        step's FLOPs for the step log, forget the counts."""
        profiler = self.flops_profiler
        if profiler is None or not profiler.started:
            return
        section = self._flops_section
        times = None
        if self._timers.enabled:
            times = {k: v - self._flops_times_before.get(k, 0.0) for k, v in self._timers.step_ms.items()}
        profiler.run_facts = {
            "world_size": self.topology.world_size,
            "dp_size": self.dp_world_size,
            "micro_batch": self.train_micro_batch_size_per_gpu(),
            "samples_per_step": self.train_batch_size(),
            "times_ms": times,
            "peak_flops": self._flops_peak,
        }
        profiler.print_model_profile(
            profile_step=self.global_steps - 1,
            module_depth=section.module_depth,
            top_modules=section.top_modules,
            detailed=section.detailed,
            output_file=section.output_file,
        )
        self._flops_per_step = (3 + profiler.recompute_fwd_factor) * profiler.get_total_flops()
        self._flops_clean_from = self.global_steps
        profiler.end_profile()

    def _flops_log_suffix(self, steps: int, seconds: float) -> str:
        """``, TFLOPS=x, MFU=y%`` for a step-log window of ``steps`` steps ending now, once the
        profile is known and when the window does not hold the profiled (slowed) step."""
        if self._flops_per_step is None or self.global_steps - steps < self._flops_clean_from or seconds <= 0:
            return ""
        achieved = self._flops_per_step * steps / seconds
        mfu = f"{100 * achieved / self._flops_peak:.2f}%" if self._flops_peak else "n/a"
        return f", TFLOPS={achieved / 1e12:.4g}, MFU={mfu}"
