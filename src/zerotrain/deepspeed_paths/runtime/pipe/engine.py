"""``deepspeed.runtime.pipe.engine``: re-exports (zerotrain.engine.pipeline_engine)."""

from zerotrain.engine.pipeline_engine import PipelineEngine
from zerotrain.pipeline.specs import PipelineError

__all__ = ["PipelineEngine", "PipelineError"]
