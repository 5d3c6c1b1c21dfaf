"""``deepspeed.runtime.pipe.topology``: re-exports of zerotrain.topology."""

from zerotrain.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid"]
