"""``deepspeed.runtime.pipe``: re-exports (zerotrain.pipeline, zerotrain.topology)."""

from zerotrain.pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from zerotrain.topology import ProcessTopology

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"]
