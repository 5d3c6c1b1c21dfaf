"""A ``PipelineModule``'s weights as DeepSpeed's per-layer files.

``<dir>/layer_{idx:02d}-model_states.pt`` holds global layer ``idx``'s ``state_dict()`` (with a
model axis, ``layer_05-model_01-model_states.pt``: ``ProcessTopology.get_rank_repr``). Functions
have no file but keep their index. A tied module is saved under each index where it runs as
itself (an occurrence with a ``forward_fn`` has no file, as in DeepSpeed).

Because files are named by GLOBAL layer index, a directory written with one number of stages
loads with any other: each stage reads the files of the layers it owns. Files hold plain state
dicts of tensors, written to a temporary name and renamed into place, and are read with
``torch.load(weights_only=True)`` (nothing else is unpickled).
"""

from __future__ import annotations

import glob
import os

import torch
from torch import nn

from zerotrain.pipeline.partition import partition_uniform
from zerotrain.pipeline.specs import TiedLayerSpec

__all__ = ["LayerFiles"]


def _frozen_names(layer) -> list[str]:
    return [n for n, p in layer.named_parameters() if not p.requires_grad]


def _save_atomically(state: dict, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class LayerFiles:
    """``PipelineModule``'s checkpoint methods (DeepSpeed's names)."""

    def ckpt_prefix(self, checkpoints_path, tag) -> str:
        """``<path>/<tag>/module-pipe_XX[-model_XX]``: a prefix for this rank's files (the data
        axis is left out: replicas hold the same weights)."""
        topo = self._grid._topo
        coord = topo.get_coord(rank=self.global_rank)
        name = "module" + "".join(
            f"-{axis}_{getattr(coord, axis):02d}" for axis in topo.get_axis_names() if axis != "data"
        )
        return os.path.join(checkpoints_path, str(tag), name)

    def ckpt_layer_path(self, ckpt_dir, local_layer_idx: int) -> str:
        """The file of local layer ``local_layer_idx`` (named by its global index)."""
        idx = self.local_to_global(local_layer_idx)
        path = os.path.join(ckpt_dir, f"layer_{idx:02d}")
        rank_repr = self._grid._topo.get_rank_repr(rank=self.global_rank)
        if rank_repr != "":
            path += f"-{rank_repr}"
        return path + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx: int) -> list[str]:
        """Every file of local layer ``local_layer_idx`` (one per model slice), sorted."""
        return self._global_layer_files(ckpt_dir, self.local_to_global(local_layer_idx))

    @staticmethod
    def _global_layer_files(ckpt_dir, idx: int) -> list[str]:
        pattern = os.path.join(glob.escape(str(ckpt_dir)), f"layer_{idx:02d}-*model_states.pt")
        return sorted(glob.glob(pattern))

    def save_state_dict(self, save_dir, checkpoint_engine=None, exclude_frozen_params=False) -> None:
        """Write this stage's layer files into ``save_dir``. Data rank 0 writes them all (with
        ``checkpoint_parallel_write_pipeline`` the stage's data ranks split the layers)."""
        dp_rank, dp_size = self._grid.data_parallel_id, self._grid.data_parallel_size
        num_layers = len(self.forward_funcs)
        if getattr(self, "checkpoint_parallel_write_pipeline", False):
            offsets = partition_uniform(num_layers, dp_size)
            start, end = offsets[dp_rank], offsets[dp_rank + 1]
        elif dp_rank != 0:
            return
        else:
            start, end = 0, num_layers
        if checkpoint_engine is not None and hasattr(checkpoint_engine, "makedirs"):
            checkpoint_engine.makedirs(save_dir, exist_ok=True)
        else:
            os.makedirs(save_dir, exist_ok=True)
        for idx in range(start, end):
            layer = self.forward_funcs[idx]
            if not isinstance(layer, nn.Module):  # functions, tied forward_fn occurrences
                continue
            state = layer.state_dict()
            if exclude_frozen_params:
                for name in _frozen_names(layer):
                    state.pop(name, None)
            # Clones: a view would drag its whole storage into the file.
            state = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in state.items()}
            path = self.ckpt_layer_path(save_dir, idx)
            if checkpoint_engine is not None:
                checkpoint_engine.save(state, path)
            else:
                _save_atomically(state, path)

    def _read_layer_file(self, files: list[str], checkpoint_engine):
        slices = self._grid.get_slice_parallel_world_size()
        if len(files) == 1:
            path = files[0]
        elif len(files) == slices:
            path = files[self._grid.get_slice_parallel_rank()]
        else:
            raise RuntimeError(
                f"{len(files)} files for one layer ({files[0]} ...) but the model axis has "
                f"{slices} slices; load with the model-parallel size it was saved with"
            )
        if checkpoint_engine is not None:
            return path, checkpoint_engine.load(path, map_location="cpu")
        return path, torch.load(path, map_location="cpu", weights_only=True)

    def load_state_dir(self, load_dir, checkpoint_engine=None, strict=True) -> None:
        """Load this stage's layers from ``load_dir`` by global layer index (any number of
        stages may have written it), then make the tied replicas equal again."""
        tied_loaded = set()
        local_specs = [self._layer_specs[i] for i in self._local_layers]
        for idx, layer in enumerate(self.forward_funcs):
            if not isinstance(layer, nn.Module):
                continue
            files = self.ckpt_layer_path_list(load_dir, idx)
            if not files:
                raise FileNotFoundError(
                    f"load_state_dir: no file layer_{self.local_to_global(idx):02d}-*model_states.pt in "
                    f"{load_dir}; pass the checkpoint's tag folder, as save_state_dict wrote it"
                )
            _, state = self._read_layer_file(files, checkpoint_engine)
            layer.load_state_dict(state, strict=strict)
            spec = local_specs[idx]
            if isinstance(spec, TiedLayerSpec):
                tied_loaded.add(spec.key)
        self._load_unsaved_tied(load_dir, tied_loaded, checkpoint_engine, strict)
        self._synchronize_tied_weights()

    def _load_unsaved_tied(self, load_dir, loaded: set, checkpoint_engine, strict) -> None:
        # A tied module that runs here only through forward_fn has no file of its own index:
        # take the file of another occurrence of its key (any stage may have written one).
        for key, module in self.tied_modules.items():
            if key in loaded:
                continue
            for idx, spec in enumerate(self._layer_specs):
                if isinstance(spec, TiedLayerSpec) and spec.key == key:
                    files = self._global_layer_files(load_dir, idx)
                    if files:
                        module.load_state_dict(self._read_layer_file(files, checkpoint_engine)[1], strict=strict)
                        break
