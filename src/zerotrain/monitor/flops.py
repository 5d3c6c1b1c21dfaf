"""FLOPs profiler: DeepSpeed's ``FlopsProfiler`` and ``get_model_profile``, counting with torch's
``torch.utils.flop_counter.FlopCounterMode`` (``zerotrain.profiling.flops_profiler`` re-exports
them under DeepSpeed's path).

torch's counter sees every aten op of the forward and counts the ops it has formulas for: matrix
products (``mm``, ``addmm``, ``bmm``, ``baddbmm``), convolutions and the fused attention kernels,
at 2 FLOPs per multiply-accumulate. Elementwise work (activations, norms, softmax, adds) is not
counted, so the figure is the model's matmul FLOPs, the one MFU is defined over (DeepSpeed's own
counting adds elementwise ops, a little under 1% more on a small GPT-2). MACs are FLOPs / 2.

Each module's share is the counter's total taken at its forward pre-hook and again at its forward
hook (nested calls and repeated calls add up); its latency is the time between the two, the
device synchronised at both on accelerators with queued kernels, as DeepSpeed does.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from zerotrain.monitor.flops_report import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    write_report,
)

__all__ = [
    "FlopsProfiler",
    "get_model_profile",
    "number_to_string",
    "flops_to_string",
    "macs_to_string",
    "params_to_string",
    "duration_to_string",
]


def _param_count(module: nn.Module) -> int:
    # A ZeRO-3 parameter is a placeholder between gathers; ds_numel is its whole size.
    return sum(int(getattr(p, "ds_numel", None) or p.numel()) for p in module.parameters())


def _torch_formulas_for_unlisted_kernels() -> dict:
    """torch's own attention formulas for the CPU flash-attention kernels, which its counter's
    table leaves out (``F.scaled_dot_product_attention`` runs them on CPU without grad; with
    grad on it decomposes into the ``bmm``s the counter does count)."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    kernels = {
        "_scaled_dot_product_flash_attention_for_cpu": flop_counter.sdpa_flop,
        "_scaled_dot_product_flash_attention_for_cpu_backward": flop_counter.sdpa_backward_flop,
    }

    def as_registered(formula):  # the registry's formulas already take tensors (shape_wrapper)
        def count(*args, **kwargs):
            return formula(*args, **kwargs)

        count._get_raw = True
        return count

    return {
        getattr(aten, name): as_registered(formula)
        for name, formula in kernels.items()
        if hasattr(aten, name) and getattr(aten, name) not in flop_counter.flop_registry
    }


class FlopsProfiler:
    """Forward FLOPs, MACs, parameters and latency of ``model`` and each of its modules.

    ``start_profile()`` begins counting (and forgets earlier counts), ``stop_profile()`` stops
    (counts are kept; ``resume_profile()``, zerotrain's, counts on into the same totals),
    ``print_model_profile(...)`` prints, ``end_profile()`` drops everything. ``ds_engine`` (the
    training engine) adds the run's figures to the printout; ``recompute_fwd_factor`` is the share
    of the forward that activation checkpointing recomputes in backward (0 to 1)."""

    def __init__(self, model: nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.run_facts: dict | None = None  # set by the engine before printing: sizes, phase times, peak
        self._counter = None
        self._handles: list = []
        self._open: dict[int, list[tuple[int, float]]] = {}
        self._ignore: tuple = ()
        self._total = None
        self.reset_profile()

    # -- counting ---------------------------------------------------------------------------
    def start_profile(self, ignore_list=None) -> None:
        """Count the forwards from now on, from zero. Modules whose type is in ``ignore_list``
        get no row of their own (their FLOPs stay in their parent's)."""
        self.stop_profile()
        self.reset_profile()
        self._ignore = tuple(ignore_list or ())
        self.started = True
        self._attach()

    def resume_profile(self) -> None:
        """Count on after ``stop_profile()`` without forgetting (several micro-batches of a step)."""
        if not self.started:
            raise RuntimeError("FlopsProfiler.resume_profile() before start_profile()")
        if self._counter is None:
            self._attach()

    def stop_profile(self) -> None:
        """Stop counting; what was counted stays readable until ``end_profile()``."""
        if self._counter is not None:
            self._global = self._total()
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open = {}

    def reset_profile(self) -> None:
        """Forget what was counted (``module_flops``/``module_duration`` by module name, ``""``
        the model itself; ``forwards``: the model's forward calls); counting goes on if it was on."""
        counting = self._counter is not None
        if counting:
            self.stop_profile()
        self.module_flops: dict[str, int] = {}
        self.module_duration: dict[str, float] = {}
        self.forwards = 0
        self._global = 0
        if counting:
            self._attach()

    def end_profile(self) -> None:
        self.stop_profile()
        self.reset_profile()
        self.started = False

    def _attach(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        from zerotrain.accelerator import get_accelerator

        accelerator = get_accelerator()
        counter = FlopCounterMode(display=False, custom_mapping=_torch_formulas_for_unlisted_kernels())
        base = self._global  # counts before this attach (resume_profile)

        def total() -> int:
            return base + sum(counter.flop_counts["Global"].values())

        def pre_hook(module, _args):
            accelerator.synchronize()
            self._open.setdefault(id(module), []).append((total(), time.perf_counter()))

        def make_post_hook(name):
            def post_hook(module, _args, _output):
                accelerator.synchronize()
                stack = self._open.get(id(module))
                if not stack:  # entered before the profile started
                    return
                flops0, t0 = stack.pop()
                self.module_flops[name] = self.module_flops.get(name, 0) + total() - flops0
                self.module_duration[name] = self.module_duration.get(name, 0.0) + time.perf_counter() - t0
                if module is self.model:
                    self.forwards += 1

            return post_hook

        for name, module in self.model.named_modules():
            if name and self._ignore and isinstance(module, self._ignore):
                continue
            self._handles.append(module.register_forward_pre_hook(pre_hook))
            self._handles.append(module.register_forward_hook(make_post_hook(name), always_call=True))
        counter.__enter__()
        self._counter = counter
        self._total = total

    # -- results ----------------------------------------------------------------------------
    def get_total_flops(self, as_string: bool = False):
        """Forward FLOPs counted so far (the model's, and any op run under the counter)."""
        flops = self._total() if self._counter is not None else self._global
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        macs = self.get_total_flops() // 2  # every op the counter counts is 2 FLOPs per MAC
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False):
        """Seconds spent in the model's forward while profiling."""
        duration = self.module_duration.get("", 0.0)
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False):
        params = _param_count(self.model)
        return params_to_string(params) if as_string else params

    def module_rows(self) -> list[tuple[str, nn.Module, int, int, float]]:
        """``(name, module, params, flops, seconds)`` of every profiled module, in model order. A
        module never called itself (a ModuleList) gets the sum of its children's, as in DeepSpeed."""
        named = [
            (name, module)
            for name, module in self.model.named_modules()
            if not (name and self._ignore and isinstance(module, self._ignore))
        ]
        flops, seconds = dict(self.module_flops), dict(self.module_duration)
        for name, module in reversed(named):  # children before parents
            if name not in flops:
                children = [f"{name}.{child}" if name else child for child, _ in module.named_children()]
                flops[name] = sum(flops.get(c, 0) for c in children)
                seconds[name] = sum(seconds.get(c, 0.0) for c in children)
        return [(name, module, _param_count(module), flops[name], seconds[name]) for name, module in named]

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> str | None:
        """Print the profile (or write it to ``output_file``): the summary with ``fwd flops per
        GPU:``, the ``top_modules`` largest modules at each depth up to ``module_depth`` (-1: all)
        and, with ``detailed``, every module. Returns the text; None before ``start_profile()``."""
        if not self.started:
            return None
        return write_report(self, profile_step, module_depth, top_modules, detailed, output_file)


def get_model_profile(
    model: nn.Module,
    input_shape: tuple | None = None,
    args=(),
    kwargs=None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules=None,
    mode: str = "forward",
):
    """Profile one forward (``mode="forward"``) or ``model.generate`` call (``"generate"``) after
    ``warm_up`` unprofiled ones; returns ``(flops, macs, params)``, as strings with ``as_string``.
    ``input_shape`` makes one input tensor of that shape (in the model's dtype and device)."""
    if not isinstance(model, nn.Module):
        raise TypeError("get_model_profile: model must be a torch.nn.Module")
    if mode not in ("forward", "generate"):
        raise ValueError(f'get_model_profile: mode must be "forward" or "generate", got {mode!r}')
    kwargs = dict(kwargs or {})
    args = list(args)
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError("get_model_profile: input_shape must be a non-empty tuple")
        first = next(model.parameters(), None)
        args = [
            torch.ones(
                input_shape,
                dtype=first.dtype if first is not None else None,
                device=first.device if first is not None else None,
            )
        ]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, args or kwargs")
    call = model if mode == "forward" else model.generate
    model.eval()
    profiler = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            call(*args, **kwargs)
        profiler.start_profile(ignore_list=ignore_modules)
        try:
            call(*args, **kwargs)
        finally:
            profiler.stop_profile()
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    if print_profile:
        profiler.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    profiler.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
