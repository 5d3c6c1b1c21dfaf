"""Ranks and process groups: one ``Topology`` per engine (pipe x data x model, expert groups),
DeepSpeed's ``ProcessTopology`` family and ``PipelineParallelGrid`` (docs/design.md, "Topology")."""

from zerotrain.topology.grid import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from zerotrain.topology.pipeline_grid import PipelineParallelGrid
from zerotrain.topology.process_wide import current, set_current
from zerotrain.topology.topology import AXES, ExpertGroups, Topology

__all__ = [
    "AXES",
    "ExpertGroups",
    "Topology",
    "ProcessTopology",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "current",
    "set_current",
]
