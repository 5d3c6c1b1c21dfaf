"""Every collective zerotrain issues goes through this module.

One place picks the right torch API for the installed version (torch 2.13 renamed
``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single``; older torch only has the old
names) and the fastest form per backend: on gloo, gathering into a list of views of the output
and reduce-scattering a list of views ran faster than the single-tensor forms. Timeouts come from
the process group (see ``zerotrain.comm.distributed.default_timeout``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """In-place all-reduce of ``tensor``."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """In-place broadcast of ``tensor`` from global rank ``src``."""
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``shard`` into the flat ``output`` (rank r's shard at ``r * shard.numel()``)."""
    world = dist.get_world_size(group)
    if output.numel() != shard.numel() * world:
        raise ValueError(
            f"all_gather_into: output has {output.numel()} elements, expected "
            f"{world} x {shard.numel()}"
        )
    if _is_gloo(group):
        views = list(output.view(world, -1).unbind(0))
        return dist.all_gather(views, shard.reshape(-1), group=group, async_op=async_op)
    return _all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, flat: torch.Tensor, op=ReduceOp.SUM, group=None,
                        async_op: bool = False):
    """Reduce ``flat`` across ranks and keep this rank's contiguous slice in ``output``."""
    world = dist.get_world_size(group)
    if flat.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter_into: input has {flat.numel()} elements, expected "
            f"{world} x {output.numel()}"
        )
    if _is_gloo(group):
        views = list(flat.view(world, -1).unbind(0))
        return dist.reduce_scatter(output, views, op=op, group=group, async_op=async_op)
    return _reduce_scatter_single(output, flat, op=op, group=group, async_op=async_op)


def barrier(group=None) -> None:
    dist.barrier(group=group)
