"""The CPU as an accelerator: one "device" per process, gloo for collectives.

Memory figures are the process's resident set size (psutil), as in DeepSpeed's CPU accelerator;
``empty_cache()`` returns the allocator's freed pages to the OS.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import sys
import time

import torch

from zerotrain.accelerator.base import Accelerator


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``getrusage``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class HostEvent:
    """``Event`` for a synchronized device: ``record()`` notes the host clock, which is when the
    work before it finished, because CPU kernels complete before they return."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream=None) -> None:
        self._recorded_at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds from this event to ``end_event`` (both must have been recorded)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time: record() both events first")
        return (end_event._recorded_at - self._recorded_at) * 1e3


class CPUAccelerator(Accelerator):
    """DeepSpeed's CPU accelerator on torch; gloo is the communication backend."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._ranges: list = []
        # After reset_peak_memory_stats the kernel's peak (which cannot be reset without
        # affecting the whole process) no longer applies; the peak is then the largest RSS seen
        # by this object's memory calls since the reset, as DeepSpeed's CPU accelerator does.
        self._sampled_peak: int | None = None

    # -- device --------------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> int:
        return self.local_rank()

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """Processes on this node (``LOCAL_SIZE`` / ``LOCAL_WORLD_SIZE`` from the launcher), else 1:
        on CPU each rank is one "device"."""
        for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            if int(os.environ.get(key, "0") or 0) > 0:
                return int(os.environ[key])
        return 1

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def is_available(self) -> bool:
        return True

    # -- random number generators ---------------------------------------------------------
    def manual_seed(self, seed: int):
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return torch.default_generator

    # -- streams and events --------------------------------------------------------------
    @property
    def Stream(self):  # noqa: N802
        """torch's CPU stream (work runs in order on the host; waits are no-ops)."""
        return torch.cpu.Stream

    def stream(self, stream):
        return torch.cpu.stream(stream) if stream is not None else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None):
        return torch.cpu.current_stream()

    def default_stream(self, device_index: int | None = None):
        return torch.cpu.current_stream()

    @property
    def Event(self):  # noqa: N802
        return HostEvent

    # -- memory --------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """Return the C allocator's freed pages to the OS (``malloc_trim``)."""
        from zerotrain.memory_release import release_freed_memory

        release_freed_memory()

    def _rss(self) -> int:
        import psutil

        rss = psutil.Process().memory_info().rss
        if self._sampled_peak is not None:
            self._sampled_peak = max(self._sampled_peak, rss)
        return rss

    def _peak(self) -> int:
        rss = self._rss()
        if self._sampled_peak is not None:
            return self._sampled_peak
        return max(peak_rss_bytes(), rss)

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Resident set size of this process, in bytes."""
        return self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak resident set size: since the process started, or (after
        ``reset_peak_memory_stats``) the largest RSS these calls have seen since."""
        return self._peak()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._peak()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        import psutil

        self._sampled_peak = psutil.Process().memory_info().rss

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        """DeepSpeed's CPU keys: ``allocated_bytes.all.current`` / ``.peak`` (RSS)."""
        return {"allocated_bytes.all.current": self._rss(), "allocated_bytes.all.peak": self._peak()}

    def total_memory(self, device_index: int | None = None) -> int:
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        import psutil

        return psutil.virtual_memory().available

    # -- dtypes --------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return _computes_in(torch.bfloat16)

    def is_fp16_supported(self) -> bool:
        """Whether torch computes fp16 on this CPU (matmul and layer norm). DeepSpeed answers
        from oneDNN's hardware fp16 support instead and so refuses fp16 on most CPUs;
        zerotrain trains fp16 on any CPU torch can run it on (slowly without native fp16)."""
        return _computes_in(torch.float16)

    # -- tensors, misc -------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """Pinning is for fast copies to an accelerator; with none, the tensor is returned as is
        (as DeepSpeed's CPU accelerator does)."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def communication_backend_name(self) -> str:
        return "gloo"

    def range_push(self, msg: str, domain=None, category=None) -> None:
        """Open a ``torch.profiler`` range named ``msg`` (closed by ``range_pop``)."""
        scope = torch.autograd.profiler.record_function(msg)
        scope.__enter__()
        self._ranges.append(scope)

    def range_pop(self, domain=None) -> None:
        if self._ranges:
            self._ranges.pop().__exit__(None, None, None)


@functools.cache
def _computes_in(dtype: torch.dtype) -> bool:
    try:
        a = torch.ones(4, 4, dtype=dtype)
        torch.nn.functional.layer_norm(a @ a, (4,))
    except RuntimeError:
        return False
    return True
