"""``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` (zerotrain.pipeline)."""

from zerotrain.pipeline import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineError"]
