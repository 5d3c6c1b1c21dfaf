"""``checkpoint`` / ``non_reentrant_checkpoint``: torch.utils.checkpoint plus DeepSpeed's options.

Both run ``function(*args)`` without keeping its activations and run it again in backward. They
are ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=True`` for ``checkpoint``, as
DeepSpeed's is an autograd Function; ``False`` for ``non_reentrant_checkpoint``) with:

- the RNG tracker's named states (``get_cuda_rng_tracker()``) saved at the forward and put back
  for the recomputation, next to the default CPU/accelerator states torch already restores;
- ``checkpoint_in_cpu``: the inputs torch keeps for the recomputation (the only tensors a
  checkpoint saves outside the region) go through saved-tensor hooks that copy accelerator
  tensors to host memory (pinned when the accelerator can pin) and back to their device when
  the recomputation unpacks them. Host tensors stay where they are;
- ``synchronize``: ``get_accelerator().synchronize()`` before and after the forward and the
  recomputation;
- ``profile``: the forward's and the recomputation's wall time, logged per call on rank 0 and
  summed in :func:`profile_totals` (the accelerator is synchronized around each timing).

At ZeRO stage 3 the recomputation runs the modules' forward hooks again, which gather their
partitioned parameters (zerotrain.zero.stage3 keeps them gathered until their gradients are
reduced).
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from zerotrain.accelerator import get_accelerator
from zerotrain.log import log_rank0
from zerotrain.recompute import settings as _settings
from zerotrain.recompute.rng import get_cuda_rng_tracker

_totals = {
    "forward_calls": 0,
    "forward_seconds": 0.0,
    "recompute_calls": 0,
    "recompute_seconds": 0.0,
    "inputs_to_host_bytes": 0,
}


def profile_totals() -> dict[str, float]:
    """Counts and seconds since the last ``reset_profile_totals()``: checkpointed forwards and
    recomputations (timed only with ``profile``), and bytes of inputs moved to the host by
    ``checkpoint_in_cpu``."""
    return dict(_totals)


def reset_profile_totals() -> None:
    """Zero :func:`profile_totals`."""
    for key in _totals:
        _totals[key] = 0 if key.endswith(("calls", "bytes")) else 0.0


def checkpoint(function, *args, **kwargs):
    """Checkpoint ``function(*args, **kwargs)`` (DeepSpeed's ``deepspeed.checkpointing.checkpoint``).

    Reentrant, as DeepSpeed's: gradients reach parameters used inside only when at least one
    tensor argument requires grad (torch warns otherwise); use :func:`non_reentrant_checkpoint`
    for a region whose inputs need no gradient (e.g. the first layer of a frozen base). Tensor
    keyword arguments take part in autograd like positional ones.
    """
    return _run(function, args, kwargs, reentrant=True)


def non_reentrant_checkpoint(function, *args, **kwargs):
    """Checkpoint ``function(*args, **kwargs)`` with torch's non-reentrant checkpoint (DeepSpeed's
    ``non_reentrant_checkpoint``): works when no input requires grad, and with ``.grad()``."""
    return _run(function, args, kwargs, reentrant=False)


def _run(function, args: tuple, kwargs: dict, reentrant: bool):
    options = _settings.current()
    region = _Region(function, options)
    if reentrant and kwargs:
        # torch's reentrant checkpoint takes positional arguments only: pass keyword values
        # positionally and rebuild the call inside.
        names, count = tuple(kwargs), len(args)
        inner = region

        def region(*all_args):  # noqa: F811 (the wrapped region)
            return inner(*all_args[:count], **dict(zip(names, all_args[count:])))

        args, kwargs = args + tuple(kwargs.values()), {}
    with _InputsOnHost() if options.checkpoint_in_cpu else contextlib.nullcontext():
        return torch_checkpoint.checkpoint(region, *args, use_reentrant=reentrant, preserve_rng_state=True, **kwargs)


class _Region:
    """``function`` as checkpoint calls it: the first call is the forward, later calls are
    recomputations, which run on the RNG tracker states the forward started from."""

    def __init__(self, function, options: _settings.Settings):
        self.function = function
        self.options = options
        self.calls = 0
        self.tracker_states: dict[str, Any] | None = None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        tracker = get_cuda_rng_tracker()
        if self.calls == 1:
            self.tracker_states = tracker.get_states()
            return self._timed("forward", args, kwargs)
        outside = tracker.get_states()
        tracker.set_states(copy.copy(self.tracker_states))
        try:
            return self._timed("recompute", args, kwargs)
        finally:
            tracker.set_states(outside)

    def _timed(self, phase: str, args, kwargs):
        options = self.options
        accelerator = get_accelerator()
        if options.synchronize or options.profile:
            accelerator.synchronize()
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            # also when torch stops a non-reentrant recomputation early (it raises inside it
            # once every tensor backward needs has been recomputed)
            if options.synchronize or options.profile:
                accelerator.synchronize()
            _totals[f"{phase}_calls"] += 1
            if options.profile:
                seconds = time.perf_counter() - start
                _totals[f"{phase}_seconds"] += seconds
                log_rank0(
                    "zerotrain.checkpointing: %s of %s took %.3f ms",
                    phase,
                    getattr(self.function, "__qualname__", type(self.function).__name__),
                    seconds * 1e3,
                )


class _InputsOnHost(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of accelerator devices live in host memory until they are unpacked.

    Around a checkpoint call only the region's inputs are saved under these hooks: the region's
    own activations are saved under torch's checkpoint hooks (inner hooks win) or not at all
    (the reentrant forward runs without grad)."""

    def __init__(self):
        def pack(tensor: torch.Tensor):
            if _on_host(tensor):
                return None, tensor
            _totals["inputs_to_host_bytes"] += tensor.numel() * tensor.element_size()
            return tensor.device, _to_host(tensor)

        def unpack(packed):
            device, tensor = packed
            return tensor if device is None else tensor.to(device, non_blocking=tensor.is_pinned())

        super().__init__(pack, unpack)


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy, pinned when the accelerator can pin (so the copy back can be asynchronous)."""
    pin = get_accelerator().name != "cpu" and not tensor.is_sparse
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
    host.copy_(tensor, non_blocking=pin)
    return host
