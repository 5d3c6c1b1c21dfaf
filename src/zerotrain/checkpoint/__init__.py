"""Saving and loading model weights and full training state.

- ``model16``: whole-model weights in the training dtype (``engine.save_16bit_model``);
- ``format``: the checkpoint layout and a torch-only reader (copied into every checkpoint);
- ``layout``/``save``/``load``/``training_state``/``stateful``: ``engine.save_checkpoint`` and
  ``engine.load_checkpoint`` (sharded, atomic, resharding by parameter name);
- ``zero_to_fp32``: streaming consolidation (``zerotrain consolidate``) and DeepSpeed's
  ``get_fp32_state_dict_from_zero_checkpoint`` / ``load_state_dict_from_zero_checkpoint``.
"""

from zerotrain.checkpoint.format import CheckpointError
from zerotrain.checkpoint.model16 import full_state_dict, save_16bit_model
from zerotrain.checkpoint.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "CheckpointError",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "full_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "save_16bit_model",
]
