"""The accelerator interface: DeepSpeed's ``DeepSpeedAccelerator`` method for method, plus the
few names zerotrain itself uses (``name``, ``communication_backend``, ``device()``).

Scripts written for DeepSpeed call ``get_accelerator().device_name()``, ``manual_seed_all()``,
``memory_allocated()``, ... ; the CPU and CUDA classes implement each of them on torch. What a
method means on a device that lacks the concept (streams on CPU, say) follows DeepSpeed's CPU
accelerator, which is documented per method in docs/compat.md.
"""

from __future__ import annotations

import abc
import contextlib
import os

import torch


class Accelerator(abc.ABC):
    """One device kind (``name``: ``"cpu"`` or ``"cuda"``) and its communication backend."""

    name: str = ""
    supports_nvtx_domain = False

    def __init__(self) -> None:
        self._compile_backend = "inductor"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # -- zerotrain's own API -------------------------------------------------------------
    @property
    def communication_backend(self) -> str:
        """The torch.distributed backend for this device (``gloo`` on CPU, ``nccl`` on CUDA)."""
        return self.communication_backend_name()

    @staticmethod
    def local_rank() -> int:
        """This process's ``LOCAL_RANK`` (0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    # -- device --------------------------------------------------------------------------
    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """True when work is finished once the call returns (CPU), so host timers measure it."""

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    @abc.abstractmethod
    def device_name(self, device_index: int | None = None) -> str: ...

    @abc.abstractmethod
    def device(self, device_index: int | None = None) -> torch.device:
        """The ``torch.device`` of ``device_index`` (default: this process's local rank)."""

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None: ...

    @abc.abstractmethod
    def current_device(self) -> int: ...

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for queued device work, so host timers measure the device (no-op on CPU)."""

    @abc.abstractmethod
    def is_available(self) -> bool: ...

    # -- random number generators ---------------------------------------------------------
    def random(self):
        """torch's ``torch.random`` module (DeepSpeed returns it on every device)."""
        return torch.random

    @abc.abstractmethod
    def manual_seed(self, seed: int): ...

    @abc.abstractmethod
    def manual_seed_all(self, seed: int): ...

    @abc.abstractmethod
    def initial_seed(self) -> int: ...

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor: ...

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator: ...

    # -- memory --------------------------------------------------------------------------
    @abc.abstractmethod
    def empty_cache(self) -> None: ...

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int: ...

    def memory_cached(self, device_index: int | None = None) -> int:
        """Old name of ``memory_reserved``."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Old name of ``max_memory_reserved``."""
        return self.max_memory_reserved(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    # -- dtypes --------------------------------------------------------------------------
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool: ...

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool: ...

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Dense peak FLOPS of one device for matmuls in ``dtype`` (MFU's denominator); None
        where it is not known (the CPU: cores, vector units and clocks vary too much)."""
        return None

    def supported_dtypes(self) -> list[torch.dtype]:
        """fp32 always, then fp16 and bf16 where this device computes them."""
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    # -- tensors -------------------------------------------------------------------------
    def _tensor_factory(self, dtype: torch.dtype):
        device = self.device_name()

        def make(*args, **kwargs):
            return torch.tensor(*args, dtype=dtype, device=device, **kwargs)

        return make

    @property
    def BFloat16Tensor(self):  # noqa: N802 (DeepSpeed's names)
        return self._tensor_factory(torch.bfloat16)

    @property
    def ByteTensor(self):  # noqa: N802
        return self._tensor_factory(torch.uint8)

    @property
    def DoubleTensor(self):  # noqa: N802
        return self._tensor_factory(torch.float64)

    @property
    def FloatTensor(self):  # noqa: N802
        return self._tensor_factory(torch.float32)

    @property
    def HalfTensor(self):  # noqa: N802
        return self._tensor_factory(torch.float16)

    @property
    def IntTensor(self):  # noqa: N802
        return self._tensor_factory(torch.int32)

    @property
    def LongTensor(self):  # noqa: N802
        return self._tensor_factory(torch.int64)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self.name

    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor: ...

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """DeepSpeed frees its native pinned buffers here; torch's pinned tensors are freed
        with the tensor, so there is nothing to do (DeepSpeed returns None too)."""
        return None

    # -- misc ----------------------------------------------------------------------------
    @abc.abstractmethod
    def communication_backend_name(self) -> str: ...

    def lazy_call(self, callback):
        return callback()

    def range_push(self, msg: str, domain=None, category=None) -> None:
        """Open a profiler range (NVTX on CUDA; a ``record_function`` range on CPU)."""
        return None

    def range_pop(self, domain=None) -> None:
        return None

    def is_triton_supported(self) -> bool:
        return False

    def prefer_triton_grouped_mm(self) -> bool:
        return False

    def export_envs(self) -> list[str]:
        """Prefixes of environment variables a multi-node launcher forwards (``NCCL`` on CUDA)."""
        return []

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the ``torch.compile`` backend; it must be one torch knows."""
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"compile backend {backend!r} is not supported on {self.name}; choose one of {known}")
        self._compile_backend = backend

    def build_extension(self):
        """torch's ``BuildExtension`` (for user C++ extensions)."""
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    # DeepSpeed's op builders JIT-compile its own C++/CUDA kernels; zerotrain has none.
    def op_builder_dir(self):
        raise NotImplementedError(_NO_OP_BUILDERS)

    def create_op_builder(self, class_name: str):
        raise NotImplementedError(f"{class_name}: {_NO_OP_BUILDERS}")

    def get_op_builder(self, class_name: str):
        raise NotImplementedError(f"{class_name}: {_NO_OP_BUILDERS}")

    # -- graphs (CUDA graphs; on CPU the work simply runs eagerly, as in DeepSpeed) -------
    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        return None


_NO_OP_BUILDERS = (
    "zerotrain has no compiled DeepSpeed ops (op builders); it runs torch's kernels. Use "
    "zerotrain.ops.adam.FusedAdam / DeepSpeedCPUAdam instead of FusedAdamBuilder / CPUAdamBuilder"
)
