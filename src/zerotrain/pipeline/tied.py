"""Tied layers across pipeline stages (``TiedLayerSpec``): one value, gradients summed.

A tied key (say the embedding, used by the first stage and again as the output head by the last)
is built once on every stage holding an occurrence, into ``tied_modules[key]``. For each key and
each data (and model) coordinate there is one process group over the ranks of the stages that
hold it, created by the module's topology (``Topology.tied_group``); every rank creates every
group, in sorted key order, as ``new_group`` requires. On all
but the group's lowest rank the replica's parameters carry ``ds_pipe_replicated = True``, so the
gradient norm and the 16-bit optimizers count the tied weights once.

- at build, and after loading: the lowest rank's weights are broadcast to the others;
- after the last micro-batch's backward (the engine calls ``allreduce_tied_weight_gradients``
  with its ZeRO stage's ``accumulated_grad`` before its gradient reduction and step): the
  gradients are summed over the group where the stage accumulates them (``.grad``, or the fp32
  buffer of 16-bit weights), so every copy takes the same step and stays equal.

With one stage there is nothing to tie across and no group is built.
"""

from __future__ import annotations

import torch

from zerotrain.pipeline.specs import TiedLayerSpec

__all__ = ["TiedLayers"]


def _recursive_getattr(module, attr_name: str):
    """``module.linear.weight`` for ``"linear.weight"``."""
    value = module
    for item in attr_name.split("."):
        value = getattr(value, item)
    return value


class TiedLayers:
    """``PipelineModule``'s tied-layer methods (DeepSpeed's names)."""

    _recursive_getattr = staticmethod(_recursive_getattr)

    def _index_tied_modules(self) -> dict:
        """``{key: {"ranks", "group", "weight_attr", "module"}}`` for the keys this rank holds."""
        tied_comms = {}
        if self._topo.get_dim("pipe") == 1:
            return tied_comms
        specs = self._layer_specs
        keys = sorted({s.key for s in specs if isinstance(s, TiedLayerSpec)}, key=str)
        grid = self._grid
        for key in keys:
            stages = sorted(
                {self.stage_owner(idx) for idx, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and s.key == key}
            )
            for dp in range(grid.get_data_parallel_world_size()):
                for mp in range(grid.get_slice_parallel_world_size()):
                    ranks = [grid.stage_to_global(stage_id=s, data=dp, model=mp) for s in stages]
                    group = grid.topology_.tied_group(ranks, key)
                    if self.global_rank not in ranks:
                        continue
                    if key not in self.tied_modules:
                        raise RuntimeError(
                            f"tied layer {key!r}: rank {self.global_rank} is in its group but did not build it"
                        )
                    tied_comms[key] = {
                        "ranks": ranks,
                        "group": group,
                        "weight_attr": self.tied_weight_attrs[key],
                        "module": self.tied_modules[key],
                    }
                    replica = self.global_rank != min(ranks)
                    for p in self.tied_modules[key].parameters():
                        p.ds_pipe_replicated = replica
        return tied_comms

    def _tied_weights(self, key: str, comm: dict):
        for attr_name in comm["weight_attr"]:
            yield attr_name, self._recursive_getattr(self.tied_modules[key], attr_name)

    def _synchronize_tied_weights(self) -> None:
        """Every tied replica takes the value of the group's lowest rank."""
        from zerotrain import comm as zcomm

        for key, comm in self.tied_comms.items():
            for _, weight in self._tied_weights(key, comm):
                with torch.no_grad():
                    zcomm.broadcast(weight.data, src=min(comm["ranks"]), group=comm["group"])

    def allreduce_tied_weight_gradients(self, grad_of=None) -> None:
        """Sum each tied weight's gradient over its tied group (a replica with no gradient takes
        part with zeros, so the collective always matches). ``grad_of(weight)``: the tensor
        holding the weight's accumulated gradient (the engine passes its ZeRO stage's
        ``accumulated_grad``: with fp32 accumulation of 16-bit weights it is not ``.grad``);
        default ``weight.grad``. Weights it returns None for (frozen) are left out."""
        from zerotrain import comm as zcomm

        for key, comm in self.tied_comms.items():
            for _, weight in self._tied_weights(key, comm):
                if grad_of is not None:
                    grad = grad_of(weight)
                    if grad is None:
                        continue
                else:
                    if weight.grad is None:
                        weight.grad = torch.zeros_like(weight)
                    grad = weight.grad
                zcomm.all_reduce(grad, group=comm["group"])

    def get_tied_weights_and_groups(self) -> list:
        """``[(weight, group), ...]`` for every tied weight this rank holds."""
        return [
            (weight, comm["group"])
            for key, comm in self.tied_comms.items()
            for _, weight in self._tied_weights(key, comm)
        ]
