"""Saving model weights (and, later, full training state)."""

from zerotrain.checkpoint.model16 import full_state_dict, save_16bit_model

__all__ = ["full_state_dict", "save_16bit_model"]
