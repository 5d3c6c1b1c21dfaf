"""Named RNG states that activation checkpointing restores during recomputation.

DeepSpeed (after Megatron-LM) keeps a *tracker* of named accelerator RNG states next to the
default one: ``model_parallel_cuda_manual_seed(seed)`` seeds the default state with ``seed`` and
adds a ``"model-parallel-rng"`` state seeded with ``seed + 2718 + tensor-parallel rank``; code
that should draw from it (dropout inside tensor-parallel regions) runs under
``get_cuda_rng_tracker().fork()``. ``zerotrain.checkpointing.checkpoint`` saves the tracker's
states with the default ones and restores them for the recomputation, so a forked dropout mask
is drawn again identically.

The states are the accelerator's (``get_accelerator().get_rng_state()``): the CUDA generator on
a GPU, torch's CPU generator on the CPU. zerotrain is data-parallel only, so the
tensor-parallel rank is 0 unless an mpu passed to ``configure`` says otherwise.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from zerotrain.accelerator import get_accelerator

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_SEED_OFFSET = 2718  # DeepSpeed's/Megatron's offset between the data- and model-parallel seeds


class CudaRNGStatesTracker:
    """Named accelerator RNG states (DeepSpeed's class name; the states are on whatever
    accelerator zerotrain runs on).

    ``add(name, seed)`` creates a state from ``seed`` without disturbing the current one;
    ``fork(name)`` runs a block on that state and keeps where it ended for the next fork.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every named state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A shallow copy of the name -> state dict (the state tensors themselves are shared)."""
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the named states (as returned by ``get_states``)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; each name and seed may be added once."""
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another state")
        if name in self.states_:
            raise ValueError(f"RNG tracker: a state named {name!r} already exists")
        self.seeds_.add(seed)
        accelerator = get_accelerator()
        current = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states_[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(current)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block on state ``name``; afterwards the previous state is back and ``name``
        continues from where the block left it."""
        if name not in self.states_:
            raise KeyError(
                f"RNG tracker: no state named {name!r}; add it first "
                "(model_parallel_cuda_manual_seed(seed) adds the model-parallel one)"
            )
        accelerator = get_accelerator()
        outside = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(outside)


RNGStatesTracker = CudaRNGStatesTracker
_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's RNG tracker (DeepSpeed's name)."""
    return _TRACKER


def _tensor_parallel_rank() -> int:
    from zerotrain.recompute import settings

    mpu = settings.current().mpu
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        rank = getattr(mpu, name, None)
        if rank is not None:
            return int(rank())
    return 0


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the accelerator's default RNG with ``seed`` and reset the tracker to one
    ``"model-parallel-rng"`` state seeded with ``seed + 2718 + tensor-parallel rank`` (DeepSpeed's
    and Megatron's rule; the rank is 0 here unless the configured mpu reports another)."""
    _TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _SEED_OFFSET + _tensor_parallel_rank())


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed the model-parallel state in place with ``seed + 2718 + tensor-parallel rank``."""
    with _TRACKER.fork():
        get_accelerator().manual_seed(seed + _SEED_OFFSET + _tensor_parallel_rank())
