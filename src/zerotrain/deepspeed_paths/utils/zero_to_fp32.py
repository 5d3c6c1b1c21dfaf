"""``deepspeed.utils.zero_to_fp32`` under its DeepSpeed path: consolidate a ZeRO checkpoint into
whole fp32 weights (see ``zerotrain.checkpoint.zero_to_fp32`` and docs/checkpoint.md)."""

from zerotrain.checkpoint.zero_to_fp32 import (  # noqa: F401
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]
