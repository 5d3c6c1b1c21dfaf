"""Progressive layer dropping (PLD): the theta schedule, the engine's part, and a ready stack of
switchable transformer blocks. docs/pld.md; DeepSpeed's path is
``zerotrain.runtime.progressive_layer_drop``."""

from zerotrain.pld.blocks import SwitchableBlocks, keep_probabilities
from zerotrain.pld.schedule import ProgressiveLayerDrop, theta_at

__all__ = ["ProgressiveLayerDrop", "SwitchableBlocks", "keep_probabilities", "theta_at"]
