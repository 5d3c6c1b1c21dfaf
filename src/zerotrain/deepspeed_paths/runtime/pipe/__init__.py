"""``deepspeed.runtime.pipe``: re-exports (zerotrain.pipeline, zerotrain.topology); the submodules
``topology``, ``module``, ``engine`` and ``schedule`` are attributes, loaded on first access."""

from zerotrain._lazy import lazy_attributes

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"]
SUBMODULES = ("topology", "module", "engine", "schedule")

__getattr__, __dir__ = lazy_attributes(
    __name__,
    SUBMODULES,
    names={
        "PipelineModule": "zerotrain.pipeline",
        "LayerSpec": "zerotrain.pipeline",
        "TiedLayerSpec": "zerotrain.pipeline",
        "ProcessTopology": "zerotrain.topology.grid",
    },
)
