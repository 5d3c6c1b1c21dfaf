"""``PipelineModule``: DeepSpeed's pipeline-parallel model description (``deepspeed.pipe``).

Every rank builds the same ``PipelineModule(layers, num_stages=... | topology=...)`` after
``zerotrain.init_distributed()``. The layers are split among the pipeline stages (``parts``,
DeepSpeed's partitioning); each rank builds and holds only its stage's layers, registered under
their global index (``"3"``: state-dict keys ``3.weight`` as in DeepSpeed) and moved to the
accelerator device of ``LOCAL_RANK``. ``forward(x)`` runs the local layers in order; the
pipeline engine moves activations between stages.

Tied layers (``TiedLayerSpec``) live in ``pipeline/tied.py``, the per-layer checkpoint files in
``pipeline/layer_files.py``; both are mixed into ``PipelineModule`` under DeepSpeed's method names.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from zerotrain.pipeline.layer_files import LayerFiles
from zerotrain.pipeline.partition import VIRTUAL_LAYOUTS, partition_balanced, partition_uniform, rank_virtual_stages
from zerotrain.pipeline.specs import LayerSpec, TiedLayerSpec
from zerotrain.pipeline.tied import TiedLayers
from zerotrain.recompute import checkpoint as _default_checkpoint
from zerotrain.recompute import non_reentrant_checkpoint
from zerotrain.seeding import set_random_seed
from zerotrain.topology import PipeDataParallelTopology, PipelineParallelGrid
from zerotrain.topology.process_rank import process_world_size

__all__ = ["PipelineModule", "PARTITION_METHODS"]

PARTITION_METHODS = ("parameters", "uniform", "type:<regex>")

# Megatron-DeepSpeed's model classes whose transformer layers DeepSpeed always checkpoints.
_GPT_PIPES = ("GPTModelPipe", "GPT2ModelPipe")


def layer_name(layer) -> str:
    """The name DeepSpeed prints for a layer: a spec's class, a module's class, a function's
    ``__name__``, else ``str(layer)``."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return layer.__class__.__name__
    return getattr(layer, "__name__", str(layer))


class PipelineModule(TiedLayers, LayerFiles, nn.Module):
    """Layers split among pipeline stages (DeepSpeed's ``PipelineModule``).

    - ``layers``: an iterable (``nn.Sequential``, list) of ``nn.Module`` (already built: every
      rank holds it whole until the stage keeps its own), ``LayerSpec`` (built only on its stage),
      ``TiedLayerSpec``, or any callable (``lambda x: x.flatten(1)``). Each layer's input and
      output is a tensor or a tuple of tensors.
    - ``num_stages`` or ``topology``: a ``ProcessTopology`` with a ``"pipe"`` axis; by default
      ``PipeDataParallelTopology(num_stages, world // num_stages)``.
    - ``loss_fn(outputs, labels)``: the loss the engine computes on the last stage.
    - ``seed_layers``: seed ``base_seed + layer_idx`` before building each layer (the weights
      then do not depend on the number of stages) and ``base_seed * (micro_offset + 1) +
      layer_idx`` before running it (``micro_offset`` counts forwards); ``seed_fn`` replaces
      ``set_random_seed``.
    - ``partition_method``: ``"parameters"`` (balance trainable parameter counts, building every
      ``LayerSpec`` once on every rank to count), ``"uniform"`` (layer counts) or
      ``"type:<regex>"`` (balance the layers whose class name matches, case-insensitively).
    - ``activation_checkpoint_interval=k``: checkpoint each run of ``k`` local layers with
      ``activation_checkpoint_func`` when the run has parameters (or, with
      ``checkpointable_layers``, when all its classes are listed).
    - ``dynamic_shape``: activations may change shape between micro-batches (read by the engine).
    - ``virtual_stages=V`` (zerotrain): the layers are split into ``num_stages * V`` parts
      (virtual stages, by ``partition_method``) and rank ``r`` holds parts ``r, r + P, r + 2P,
      ...`` (torch's looped layout), each run by ``chunk(c)``; for the interleaved schedules
      (``"pipeline": {"schedule": "interleaved_1f1b" | "looped_bfs" | "zero_bubble"}``). Layers
      keep their global index (state-dict keys, layer files) whatever V is.
    - ``virtual_layout="v"`` (zerotrain, with ``virtual_stages=2``): rank ``r`` holds parts
      ``r`` and ``2P - 1 - r`` instead (a V: the first and last part both on rank 0), as torch's
      V-shaped schedules need (``"pipeline": {"schedule": "zbv" | "dualpipev"}``).
    """

    def __init__(
        self,
        layers,
        num_stages=None,
        topology=None,
        loss_fn=None,
        seed_layers=False,
        seed_fn=None,
        base_seed=1234,
        partition_method="parameters",
        activation_checkpoint_interval=0,
        activation_checkpoint_func=_default_checkpoint,
        checkpointable_layers=None,
        dynamic_shape=False,
        virtual_stages=1,
        virtual_layout="looped",
    ):
        super().__init__()
        self._layer_specs = list(layers)
        self._validate(num_stages, topology, partition_method, activation_checkpoint_interval, checkpointable_layers)
        if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
            raise ValueError(
                f"PipelineModule: virtual_stages must be a positive int (model chunks per "
                f"pipeline rank), got {virtual_stages!r}"
            )
        if virtual_layout not in VIRTUAL_LAYOUTS:
            raise ValueError(f"PipelineModule: virtual_layout={virtual_layout!r} is not one of {list(VIRTUAL_LAYOUTS)}")
        if virtual_layout == "v" and virtual_stages != 2:
            raise ValueError(
                f"PipelineModule: virtual_layout='v' places 2 virtual stages per rank (r and "
                f"2P-1-r); set virtual_stages=2 (got {virtual_stages})"
            )
        self.virtual_stages = virtual_stages
        self.virtual_layout = virtual_layout
        self.micro_offset = 0
        self.loss_fn = loss_fn
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.dynamic_shape = dynamic_shape
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpoint_parallel_write_pipeline = False  # DeepSpeed's engine sets it from the config

        # Ranks and groups: the grid's topology over the whole world.
        if topology is None:
            world = process_world_size()
            if world % num_stages:
                raise RuntimeError(
                    f"PipelineModule: num_stages={num_stages} does not divide the world size "
                    f"{world}; choose num_stages among the divisors of {world}"
                )
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        self._grid = PipelineParallelGrid(topology=topology)
        self.global_rank = self._grid.get_global_rank()
        self.world_size = self._grid.world_size
        self.stage_id = self._grid.get_stage_id()
        from zerotrain.comm import get_local_rank

        self.local_rank = get_local_rank()
        self._log(
            f"SEED_LAYERS={self.seed_layers} BASE_SEED={self.base_seed} "
            f"SEED_FN={getattr(self.seed_fn, '__name__', None)}"
        )

        self._num_layers = len(self._layer_specs)
        self._local_start = 0
        self._local_stop = None
        self._partition_layers(method=partition_method)

        self.forward_funcs = []  # one per local layer, in global order (see _local_layers)
        self.fwd_map = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs = {}
        self._checkpointable_cache = (None, [])  # (interval, one bool per block)
        self._build()
        from zerotrain.accelerator import get_accelerator

        self.to(get_accelerator().device_name(self.local_rank))
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    # -- checks (before any process group exists, so every rank fails alike) ------------------
    def _validate(self, num_stages, topology, method, interval, checkpointable_layers) -> None:
        if num_stages is None and topology is None:
            raise RuntimeError(
                "PipelineModule: must provide num_stages or topology, e.g. PipelineModule(layers, num_stages=2)"
            )
        if topology is not None:
            if "pipe" not in topology.get_axis_names():
                raise ValueError(
                    f"PipelineModule: the topology's axes {topology.get_axis_names()} have no "
                    "'pipe' axis; use PipeDataParallelTopology(num_pp, num_dp)"
                )
            if topology.world_size() != process_world_size():
                raise ValueError(
                    f"PipelineModule: the topology has {topology.world_size()} ranks but the world "
                    f"has {process_world_size()}; make the product of its dims the world size (call "
                    "zerotrain.init_distributed() first on every rank)"
                )
            if num_stages is not None and num_stages != topology.get_dim("pipe"):
                raise ValueError(
                    f"PipelineModule: num_stages={num_stages} but the topology has "
                    f"{topology.get_dim('pipe')} pipe stages; pass one of the two"
                )
        elif not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
            raise ValueError(f"PipelineModule: num_stages must be a positive int, got {num_stages!r}")
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, PipelineModule):
                raise NotImplementedError(
                    f"PipelineModule: layer {idx} is a PipelineModule; nesting them is not supported "
                    "(RECURSIVE BUILD NOT YET IMPLEMENTED): pass its layers in the outer list instead"
                )
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(
                    f"PipelineModule: layer {idx} ({layer!r}) is not an nn.Module, a LayerSpec "
                    "or a callable; wrap it in one of these"
                )
        if not isinstance(method, str) or not (
            method.lower() in ("parameters", "uniform", "profile") or method.lower().startswith("type:")
        ):
            raise NotImplementedError(
                f"PipelineModule: partition_method={method!r} is not implemented; "
                f"use one of {', '.join(PARTITION_METHODS)}"
            )
        if method.lower() == "profile":
            raise NotImplementedError(
                "PipelineModule: partition_method='profile' is not implemented (as in "
                "DeepSpeed); use 'parameters', 'uniform' or 'type:<regex>'"
            )
        if not isinstance(interval, int) or interval < 0:
            raise ValueError(f"PipelineModule: activation_checkpoint_interval must be an int >= 0, got {interval!r}")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError(
                "PipelineModule: checkpointable_layers must be a list of class names, got "
                f"{type(checkpointable_layers).__name__}"
            )

    def _log(self, message: str) -> None:
        # Once per job: the topology's first rank (every coordinate 0).
        if not any(self._grid.topology_.coord):
            from zerotrain.log import logger

            logger.info(message)

    # -- partitioning ------------------------------------------------------------------------
    def _count_layer_params(self) -> list[int]:
        """Trainable parameters per layer; builds each ``LayerSpec`` once (DeepSpeed does, on
        every rank, which also draws from the random generators as DeepSpeed's build does)."""
        counts = [0] * len(self._layer_specs)
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, LayerSpec):
                layer = layer.build()
            if isinstance(layer, nn.Module):
                counts[idx] = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        return counts

    def _find_layer_type(self, pattern: str) -> list[int]:
        regex = re.compile(pattern, re.IGNORECASE)
        found = [
            idx
            for idx, layer in enumerate(self._layer_specs)
            if (isinstance(layer, (LayerSpec, nn.Module)) or hasattr(layer, "__name__"))
            and regex.search(layer_name(layer))
        ]
        if not found:
            names = sorted({layer_name(layer) for layer in self._layer_specs})
            raise RuntimeError(
                f"PipelineModule: partition_method 'type:{pattern}' matches no layer class "
                f"(classes: {', '.join(names)}); change the regex"
            )
        return found

    def _partition_layers(self, method: str = "uniform") -> None:
        # With virtual stages ``parts`` splits the layers into num_stages * V virtual stages.
        stages = self.num_stages * self.virtual_stages
        self._log(f"Partitioning pipeline stages with method {method}")
        method = method.lower()
        if method == "uniform":
            self.parts = partition_uniform(num_items=len(self._layer_specs), num_parts=stages)
        elif method == "parameters":
            self.parts = partition_balanced(weights=self._count_layer_params(), num_parts=stages)
        else:  # "type:<regex>" (_validate refused the rest)
            weights = [0] * len(self._layer_specs)
            for idx in self._find_layer_type(method.split(":", 1)[1]):
                weights[idx] = 1
            self.parts = partition_balanced(weights=weights, num_parts=stages)
        for stage in range(stages):
            start, stop = self.parts[stage], self.parts[stage + 1]
            lines = [f"stage={stage} layers={stop - start}"]
            if self.virtual_stages > 1:
                rank = self.rank_of_virtual_stage(stage)
                chunk = self.virtual_stages_of_rank(rank).index(stage)
                lines[0] += f" (rank {rank}, chunk {chunk})"
            lines += [f"    {idx:2d}: {layer_name(self._layer_specs[idx])}" for idx in range(start, stop)]
            self._log("\n".join(lines))
        if self.loss_fn is not None:
            self._log(f"  loss: {getattr(self.loss_fn, '__name__', self.loss_fn.__class__.__name__)}")
        if self.virtual_stages == 1:
            self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])
        else:
            self._set_chunks()

    def _set_bounds(self, start=None, stop=None) -> None:
        """This stage's layers: ``self._layer_specs[start:stop]``."""
        self._local_start = start
        self._local_stop = stop
        self._local_layers = list(range(start, stop))
        self._chunk_ranges = [(0, stop - start)]

    def _set_chunks(self) -> None:
        """With virtual stages: this rank's chunk ``c`` holds virtual stage
        ``virtual_stages_of_rank(rank)[c]`` (``c * P + rank`` looped; ``rank``, ``2P - 1 - rank``
        in a V); ``_local_layers`` lists their layers' global indices in order (not contiguous),
        and ``_local_start``/``_local_stop`` span them (code reading a contiguous range must use
        ``_local_layers``)."""
        self._local_layers, self._chunk_ranges = [], []
        for vstage in self.virtual_stages_of_rank(self.stage_id):
            lo = len(self._local_layers)
            self._local_layers += range(self.parts[vstage], self.parts[vstage + 1])
            self._chunk_ranges.append((lo, len(self._local_layers)))
        held = self.virtual_stages_of_rank(self.stage_id)
        self._local_start = self.parts[min(held)]
        self._local_stop = self.parts[max(held) + 1]

    def virtual_stages_of_rank(self, rank: int) -> list[int]:
        """The virtual stages pipe rank ``rank`` holds, one per chunk (``[rank]`` when V = 1)."""
        return rank_virtual_stages(rank, self.num_stages, self.virtual_stages, self.virtual_layout)

    def rank_of_virtual_stage(self, vstage: int) -> int:
        """The pipe rank holding virtual stage ``vstage`` (the layout's inverse)."""
        p = self.num_stages
        if self.virtual_layout == "v":
            return vstage if vstage < p else 2 * p - 1 - vstage
        return vstage % p

    def owns_layer(self, layer_idx: int) -> bool:
        """Whether global layer ``layer_idx`` is one of this rank's (any chunk)."""
        return layer_idx in self._local_layers

    def local_to_global(self, local_layer_idx: int) -> int:
        """The global index of ``forward_funcs[local_layer_idx]``."""
        return self._local_layers[local_layer_idx]

    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage (pipe rank) holding global layer ``layer_idx``."""
        return self.rank_of_virtual_stage(self.virtual_stage_owner(layer_idx))

    def virtual_stage_owner(self, layer_idx: int) -> int:
        """The virtual stage holding global layer ``layer_idx`` (the stage when V = 1)."""
        if not 0 <= layer_idx < self._num_layers:
            raise IndexError(f"stage_owner: layer {layer_idx} is outside 0..{self._num_layers - 1}")
        for stage in range(len(self.parts) - 1):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")

    # -- building ----------------------------------------------------------------------------
    def _seed(self, seed: int) -> None:
        (self.seed_fn or set_random_seed)(seed)

    def _build(self) -> None:
        for layer_idx in self._local_layers:
            layer = self._layer_specs[layer_idx]
            if self.seed_layers:
                self._seed(self.base_seed + layer_idx)
            if isinstance(layer, nn.Module):
                self._add_layer(layer_idx, layer)
            elif isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, LayerSpec):
                self._add_layer(layer_idx, layer.build())
            else:  # a function: no state, called in forward
                self.forward_funcs.append(layer)
        # Every pipeline parameter starts as this stage's own (not a replica): the 16-bit
        # optimizers and the gradient norm count it; tied replicas are marked in tied.py.
        for p in self.parameters():
            p.ds_pipe_replicated = False

    def _add_layer(self, layer_idx: int, module: nn.Module) -> None:
        name = str(layer_idx)
        self.forward_funcs.append(module)
        self.fwd_map[name] = len(self.forward_funcs) - 1
        self.add_module(name, module)

    # -- forward -----------------------------------------------------------------------------
    def _is_checkpointable(self, funcs) -> bool:
        if self.activation_checkpoint_func is not non_reentrant_checkpoint and self.__class__.__name__ in _GPT_PIPES:
            # Megatron's GPT pipes: the transformer layers (not the embedding, whose input needs
            # no grad, which only the non-reentrant checkpoint handles).
            return all(
                "ParallelTransformerLayerPipe" in f.__class__.__name__
                or (self.checkpointable_layers is not None and f.__class__.__name__ in self.checkpointable_layers)
                for f in funcs
            )
        if self.checkpointable_layers is not None:
            return all(f.__class__.__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def _checkpointable_blocks(self, lo: int = 0, hi: int | None = None) -> list[bool]:
        """Per block of ``interval`` layers of ``forward_funcs[lo:hi]`` (one chunk's)."""
        interval = self.activation_checkpoint_interval
        hi = len(self.forward_funcs) if hi is None else hi
        key = (interval, lo, hi)
        if self._checkpointable_cache[0] != key:
            blocks = [
                self._is_checkpointable(self.forward_funcs[s : min(s + interval, hi)]) for s in range(lo, hi, interval)
            ]
            self._checkpointable_cache = (key, blocks)
        return self._checkpointable_cache[1]

    def _range_func(self, start: int, end: int, micro_offset: int):
        """Run local layers ``start:end`` (DeepSpeed's ``exec_range_func``): one argument
        passes through as is, several arrive as a tuple (a checkpoint unpacks tuples)."""

        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for idx, layer in enumerate(self.forward_funcs[start:end]):
                self.curr_layer = self._local_layers[start + idx]
                if self.seed_layers:
                    self._seed(self.base_seed * micro_offset + self.curr_layer)
                x = layer(x)
            return x

        return run

    def forward(self, forward_input, chunk: int | None = None):
        """Run the local layers (with virtual stages: chunk ``chunk``'s, see ``chunk()``)."""
        if chunk is None:
            if self.virtual_stages > 1:
                raise ValueError(
                    f"PipelineModule(virtual_stages={self.virtual_stages}).forward: this rank holds "
                    f"{self.virtual_stages} chunks; run one with forward(x, chunk=c) or chunk(c)(x)"
                )
            chunk = 0
        lo, n = self._chunk_ranges[chunk]
        # The micro-batch's seed offset, captured now so a checkpoint's recomputation reseeds alike;
        # each chunk runs once per micro-batch, so chunk 0 counts them.
        if chunk == 0:
            self.micro_offset += 1
        offset = self.micro_offset + 1
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._range_func(lo, n, offset)(forward_input)
        x = forward_input
        for start, checkpointable in zip(range(lo, n, interval), self._checkpointable_blocks(lo, n)):
            end = min(start + interval, n)
            args = x if isinstance(x, tuple) else (x,)
            run = self._range_func(start, end, offset)
            x = self.activation_checkpoint_func(run, *args) if checkpointable else run(*args)
        return x

    def chunk(self, index: int) -> nn.Module:
        """Chunk ``index`` of this rank's virtual stages (``virtual_stages_of_rank(rank)[index]``)
        as a module: its ``parameters()`` are the chunk's (a tied module in several chunks is in each),
        its forward runs the chunk's layers. Not registered under the PipelineModule."""
        if not 0 <= index < self.virtual_stages:
            raise IndexError(f"PipelineModule.chunk({index}): this rank holds chunks 0..{self.virtual_stages - 1}")
        lo, hi = self._chunk_ranges[index]
        modules = []
        for local in range(lo, hi):
            spec = self._layer_specs[self._local_layers[local]]
            if isinstance(spec, TiedLayerSpec):  # also the occurrences run through forward_fn
                modules.append(self.tied_modules[spec.key])
            elif isinstance(self.forward_funcs[local], nn.Module):
                modules.append(self.forward_funcs[local])
        return _Chunk(self, index, modules)

    def set_checkpoint_interval(self, interval: int) -> None:
        if not isinstance(interval, int) or interval < 0:
            raise ValueError(f"set_checkpoint_interval: interval must be an int >= 0, got {interval!r}")
        self.activation_checkpoint_interval = interval

    # -- DeepSpeed's accessors ---------------------------------------------------------------
    def topology(self):
        """The ``ProcessTopology`` of the job."""
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self._topo.get_dim("pipe")

    def get_additional_losses(self):
        """Model-specific losses to report, ``{"name": value}``, or None (DeepSpeed's hook)."""
        return None

    def compile(self, *args, **kwargs) -> None:
        """``torch.compile`` each local layer (modules in place, functions replaced)."""
        for idx, layer in enumerate(self.forward_funcs):
            if isinstance(layer, nn.Module):
                layer.compile(*args, **kwargs)
            else:
                self.forward_funcs[idx] = torch.compile(layer, *args, **kwargs)


class _Chunk(nn.Module):
    """One chunk of a ``PipelineModule`` with virtual stages (``PipelineModule.chunk``)."""

    def __init__(self, parent: PipelineModule, index: int, modules: list):
        super().__init__()
        self.layers = nn.ModuleList(modules)  # a tied module used by several layers appears once
        self.index = index
        self.__dict__["_parent"] = parent  # not a submodule: its parameters are the whole rank's

    @property
    def loss_fn(self):
        return self._parent.loss_fn

    def forward(self, forward_input):
        return self._parent(forward_input, chunk=self.index)
