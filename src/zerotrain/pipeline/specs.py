"""``LayerSpec`` and ``TiedLayerSpec``: layers a ``PipelineModule`` builds only on the stage that
owns them (``deepspeed.pipe``'s names), and DeepSpeed's ``PipelineError``."""

from __future__ import annotations

from torch import nn

from zerotrain.topology.process_rank import process_rank

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineError"]


class PipelineError(Exception):
    """Errors about pipeline-parallel modules (DeepSpeed's name)."""


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 4, 8, bias=False).build()`` returns
    ``nn.Linear(4, 8, bias=False)``."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        # DeepSpeed's LayerSpec.global_rank: the process's global rank (-1 before
        # torch.distributed), only tagging build()'s log line; specs are made before any engine
        # or topology exists, and describing a layer must not build one (a collective).
        self.global_rank = process_rank()

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """Construct the layer."""
        if log:
            from zerotrain.log import logger

            logger.info("RANK=%d building %r", self.global_rank, self)
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` weights are shared by every spec with the same ``key``.

    The module is built once per stage holding an occurrence of ``key``; each later occurrence
    runs ``forward_fn(module, x)`` (``module(x)`` when ``forward_fn`` is None). ``tied_weight_attr``
    is an attribute name, a list of them, or dotted paths (``"lm.weight"``): the tensors kept
    equal across stages."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
