"""Pipeline parallelism's model description: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``
and DeepSpeed's partitioning (``deepspeed.pipe``'s names; ``zerotrain.pipe`` and
``zerotrain.runtime.pipe.module`` re-export them).

``LayerSpec``/``TiedLayerSpec`` (specs.py) describe layers; ``PipelineModule`` (module.py) splits
them among the stages (partition.py), builds this stage's, ties shared layers across stages
(tied.py) and saves/loads per-layer files (layer_files.py).
"""

from __future__ import annotations

from zerotrain.pipeline.hf import from_hf_causal_lm, hf_state_dict  # HF causal LMs (pipeline/hf.py)
from zerotrain.pipeline.module import PipelineModule
from zerotrain.pipeline.partition import partition_balanced, partition_uniform
from zerotrain.pipeline.specs import LayerSpec, PipelineError, TiedLayerSpec

__all__ = [
    "PipelineModule",
    "LayerSpec",
    "TiedLayerSpec",
    "PipelineError",
    "partition_uniform",
    "partition_balanced",
    "from_hf_causal_lm",
    "hf_state_dict",
]
