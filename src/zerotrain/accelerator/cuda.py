"""CUDA GPUs as the accelerator: ``cuda:<local rank>`` per process, NCCL for collectives.

Every method is the matching ``torch.cuda`` call, as in DeepSpeed's CUDA accelerator.
"""

from __future__ import annotations

import os

import torch

from zerotrain.accelerator.base import Accelerator

# Dense (no sparsity) 16-bit tensor-core peaks from NVIDIA's data sheets, TFLOPS; first match
# of the marker in torch.cuda.get_device_name() wins (so "H100 PCIe" before "H100").
_PEAK_16BIT_TFLOPS = (
    ("H200", {torch.bfloat16: 989.4, torch.float16: 989.4}),
    ("H100 PCIe", {torch.bfloat16: 756.0, torch.float16: 756.0}),
    ("H100", {torch.bfloat16: 989.4, torch.float16: 989.4}),
    ("A100", {torch.bfloat16: 312.0, torch.float16: 312.0}),
    ("L40S", {torch.bfloat16: 362.05, torch.float16: 362.05}),
    ("V100", {torch.float16: 125.0}),
)


class CUDAAccelerator(Accelerator):
    """DeepSpeed's CUDA accelerator on ``torch.cuda``; NCCL is the communication backend."""

    name = "cuda"
    supports_nvtx_domain = False  # no nvtx domains: ranges go through torch.cuda.nvtx

    # -- device --------------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return False

    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        """``cuda:<device_index>``, or ``cuda:<LOCAL_RANK>`` when no index is given."""
        return torch.device("cuda", self.local_rank() if device_index is None else device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def communication_backend_version(self):
        return torch.cuda.nccl.version()

    # -- random number generators ---------------------------------------------------------
    def manual_seed(self, seed: int):
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # -- streams and events --------------------------------------------------------------
    @property
    def Stream(self):  # noqa: N802
        return torch.cuda.Stream

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):  # noqa: N802
        return torch.cuda.Event

    # -- memory --------------------------------------------------------------------------
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        """Free bytes on the device as the driver sees them (other processes included)."""
        free, _total = torch.cuda.mem_get_info(device_index)
        return free

    # -- dtypes --------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """The data sheet's dense bf16/fp16 tensor-core peak of this device, for the devices
        listed in ``_PEAK_16BIT_TFLOPS``; None for others and for fp32 (whose peak depends on
        whether TF32 is allowed)."""
        if dtype not in (torch.float16, torch.bfloat16) or not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
        for marker, peaks in _PEAK_16BIT_TFLOPS:
            if marker in name:
                tflops = peaks.get(dtype)
                return tflops * 1e12 if tflops else None
        return None

    def is_fp16_supported(self) -> bool:
        """Compute capability 7.0 or newer (6.x with ``DS_ALLOW_DEPRECATED_FP16=1``), as DeepSpeed."""
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    # -- tensors, misc -------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """A page-locked copy of ``tensor`` for fast, asynchronous host-device copies."""
        return tensor.pin_memory()

    def communication_backend_name(self) -> str:
        return "nccl"

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback)

    def range_push(self, msg: str, domain=None, category=None) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None) -> None:
        torch.cuda.nvtx.range_pop()

    def is_triton_supported(self) -> bool:
        if not self.is_available():
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return torch.cuda.get_device_capability()[0] >= 8

    def export_envs(self) -> list[str]:
        return ["NCCL"]

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        graph.replay()
