"""``deepspeed.runtime.pipe.module``: re-exports of zerotrain.pipeline."""

from zerotrain.pipeline import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineError"]
