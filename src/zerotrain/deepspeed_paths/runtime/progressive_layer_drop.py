"""``deepspeed.runtime.progressive_layer_drop`` under DeepSpeed's path (zerotrain.pld)."""

from zerotrain.pld.schedule import ProgressiveLayerDrop

__all__ = ["ProgressiveLayerDrop"]
