"""A parameter ``zero.Init`` partitioned: the records it carries (its slice, layout, how and over
which group it was partitioned), keeping this rank's slice of a whole parameter and gathering it
whole again. ``Init`` (zero/init.py) and its placeholder mode (zero/placeholder_mode.py) build on
these; ``GatheredParameters`` and ``initialize`` use them directly."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.accelerator import get_accelerator
from zerotrain.comm import collectives
from zerotrain.zero.flat import FlatLayout
from zerotrain.zero.partition import shard_alignment

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_SHARD = "_zerotrain_shard"  # this rank's slice of an Init-partitioned parameter
_LAYOUT = "_zerotrain_layout"  # its FlatLayout (shape, padding)
_OWNER = "_zerotrain_owner"  # id of the module it was first partitioned in (eviction groups)
_PARTITIONING = "_zerotrain_partitioning"  # how it was partitioned (kept while it is whole)


class Partitioning(NamedTuple):
    """How ``Init`` partitioned a parameter: over ``group`` (None: the world), with the slices
    in host memory (``host``), page-locked (``pin``)."""

    group: ProcessGroup | None = None
    host: bool = False
    pin: bool = False


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a parameter partitioned by ``Init`` and not yet taken over by ``initialize``."""
    return hasattr(param, _SHARD)


def full_numel(param: torch.Tensor) -> int:
    """``param``'s element count whole (an ``Init``-partitioned placeholder holds none)."""
    layout = getattr(param, _LAYOUT, None)
    return layout.numel if is_partitioned(param) and layout is not None else param.numel()


def partitioning_of(param: torch.Tensor) -> Partitioning | None:
    """How ``Init`` partitioned ``param`` (also while it is gathered whole), or None."""
    return getattr(param, _PARTITIONING, None)


def group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: the world)."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def check_member(group, what: str) -> None:
    """Raise naming ``what`` when this process is not a member of ``group``."""
    if group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise ValueError(
            f"{what}: this process is not in the group (ranks {group_ranks(group)}); call it on the group's ranks only"
        )


# -- zerotrain's own code handles placeholders directly (the mode passes it through) ---------
class _OwnCodeDepth:
    """Nesting of zerotrain's own calls that handle placeholders themselves: above zero, the
    placeholder mode passes every call through and Init's constructor wrappers stand aside.
    ``shutdown_init_context`` holds one level for as long as the context is shut down. (An
    object, so that the modules that raise and read it share one count.)"""

    def __init__(self) -> None:
        self.depth = 0


own_code = _OwnCodeDepth()


@contextlib.contextmanager
def _own_code():
    own_code.depth += 1
    try:
        yield
    finally:
        own_code.depth -= 1


@torch.no_grad()
def _keep_shard(param: nn.Parameter, how: Partitioning) -> None:
    """Keep only this rank's slice of a whole ``param`` (no padded full-size temporary) among
    ``how.group``'s ranks; in host memory with ``how.host`` (parameter offload), page-locked with
    ``how.pin``. The parameter records ``how``."""
    with _own_code():
        world, rank = dist.get_world_size(how.group), dist.get_rank(how.group)
        layout = FlatLayout([param], world, shard_alignment(param.dtype))
        start, end = layout.shard_range(rank)
        host, pin = how.host, how.pin
        device = torch.device("cpu") if host else param.device  # host memory is torch's "cpu"
        shard = torch.zeros(layout.shard_numel, dtype=param.dtype, device=device)
        flat = param.data.reshape(-1)
        if start < flat.numel():
            shard[: min(end, flat.numel()) - start].copy_(flat[start:end])
        if host and pin and device != param.device:
            shard = get_accelerator().pin_memory(shard)
        setattr(param, _SHARD, shard)
        setattr(param, _LAYOUT, layout)
        setattr(param, _PARTITIONING, how)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


_OWN_GROUP = object()


@torch.no_grad()
def materialize(param: nn.Parameter, group=_OWN_GROUP) -> None:
    """Gather an Init-partitioned parameter back into a whole tensor (a collective of the group
    it was partitioned over). ``group``: the data-parallel group the caller works over (None:
    the world), which must hold the same ranks (else ValueError naming both); left out, the
    parameter's own group."""
    with _own_code():
        layout: FlatLayout = getattr(param, _LAYOUT)
        own = getattr(param, _PARTITIONING).group
        if group is not _OWN_GROUP and group is not own and dist.is_initialized():
            theirs, mine = group_ranks(group), group_ranks(own)
            if sorted(theirs) != sorted(mine):
                raise ValueError(
                    f"a parameter of shape {tuple(layout.slots[0].shape)} was partitioned by "
                    f"zero.Init over ranks {mine}, but the engine's data-parallel group is ranks "
                    f"{theirs}: pass the engine's group to zero.Init(data_parallel_group=...)"
                )
        shard = getattr(param, _SHARD).to(param.device)  # the model may have moved since Init
        flat = layout.empty(dtype=shard.dtype, device=shard.device, zero=False)
        collectives.all_gather_into(flat, shard, group=own)
        # A view, not a copy: the padding (under world * alignment elements) is not worth a
        # second whole-size temporary.
        param.data = flat.narrow(0, 0, layout.numel).view(layout.slots[0].shape)
        delattr(param, _SHARD)
        delattr(param, _LAYOUT)


@torch.no_grad()
def _broadcast_and_keep_shard(param: nn.Parameter, how: Partitioning) -> None:
    """Broadcast the first rank of ``how.group``'s values of a whole ``param``; keep this rank's
    slice as ``how`` says."""
    src = dist.get_global_rank(how.group, 0) if how.group is not None else 0
    collectives.broadcast(param.data, src=src, group=how.group)
    _keep_shard(param, how)


def _taken_over(param: torch.Tensor) -> bool:
    """True once an engine's unit holds ``param`` (initialize has taken it over)."""
    from zerotrain.zero import registry

    return registry.unit_of(param) is not None
