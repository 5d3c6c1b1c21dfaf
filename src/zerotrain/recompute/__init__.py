"""Activation recompute ("activation checkpointing"): drop a block's activations in forward and
recompute them in backward. Not to be confused with training-state checkpoints (zerotrain.checkpoint).

Scripts reach it under DeepSpeed's name, ``deepspeed.checkpointing`` (zerotrain.checkpointing, a
re-export in deepspeed_paths/)::

    import zerotrain.checkpointing as checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")   # or keyword options
    hidden = checkpointing.checkpoint(block, hidden, mask)             # in the model's forward

Built on ``torch.utils.checkpoint``; docs/activation_checkpointing.md says what each option does
here. Hugging Face models need none of this: ``model.gradient_checkpointing_enable()`` uses
torch's checkpoint directly and works at every ZeRO stage.
"""

from zerotrain.recompute.recompute import checkpoint, non_reentrant_checkpoint, profile_totals, reset_profile_totals
from zerotrain.recompute.rng import (
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
)
from zerotrain.recompute.settings import (
    configure,
    is_configured,
    partition_activations_in_checkpoint,
    reset,
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
