"""``deepspeed.checkpointing``: activation recompute under DeepSpeed's name (implemented in
``zerotrain.recompute``; zerotrain's training-state checkpoints are ``zerotrain.checkpoint``)."""

from zerotrain.recompute import (
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    profile_totals,
    reset,
    reset_profile_totals,
    set_num_layers,
)

__all__ = [
    "checkpoint",
    "non_reentrant_checkpoint",
    "configure",
    "is_configured",
    "reset",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "partition_activations_in_checkpoint",
    "set_num_layers",
    "profile_totals",
    "reset_profile_totals",
]
