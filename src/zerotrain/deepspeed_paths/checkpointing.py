"""``deepspeed.checkpointing``: activation recompute under DeepSpeed's name (implemented in
``zerotrain.recompute``; zerotrain's training-state checkpoints are ``zerotrain.checkpoint``)."""

from zerotrain import recompute as _recompute
from zerotrain.recompute import *  # noqa: F403 - every public name, under DeepSpeed's path

__all__ = list(_recompute.__all__)
