"""Every collective zerotrain issues goes through this module's functions (DeepSpeed's
``deepspeed.comm`` calls): each is the method of the group's ``Collectives`` object
(``zerotrain.comm.group``), which numbers the call in its group, runs it through the hooks (the
comms logger, the group's own, hang diagnosis) and picks the transport form
(``zerotrain.comm.transport``: gloo's send/recv forms and their identity headers, NCCL's
single-tensor collectives). These functions never change: the comms logger is a hook, not a
replacement of them.
"""

from __future__ import annotations

import torch

from zerotrain.comm.group import Collectives
from zerotrain.comm.transport import GLOO_FORMS, HEADER_LEN, CollectiveMismatch, Identity, ReduceOp, gloo_form


def last_seq(group=None) -> int:
    """The sequence number of the last collective issued on ``group`` by this rank."""
    return Collectives.of(group).seq


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """In-place all-reduce of ``tensor``."""
    return Collectives.of(group).all_reduce(tensor, op=op, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """In-place broadcast of ``tensor`` from global rank ``src``."""
    return Collectives.of(group).broadcast(tensor, src=src, async_op=async_op)


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False, identity: Identity | None = None
):
    """Gather every rank's ``shard`` into the flat ``output`` (rank r's shard at ``r * shard.numel()``).

    ``shard`` may be this rank's slice of ``output`` itself (no copy is made then). With an
    ``identity`` (gloo's send/recv form; ignored by the other forms) waiting raises
    ``CollectiveMismatch`` when a peer's collective has another identity. A group with a codec
    sends its encoded payloads (``zerotrain.comm.codec``)."""
    return Collectives.of(group).all_gather_into(output, shard, async_op=async_op, identity=identity)


def reduce_scatter_into(
    output: torch.Tensor,
    flat: torch.Tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    scratch: torch.Tensor | None = None,
    identity: Identity | None = None,
):
    """Reduce ``flat`` across ranks and keep this rank's contiguous slice in ``output``.

    ``flat`` is used as scratch space: its contents are undefined afterwards. Passing this rank's
    slice of ``flat`` as ``output`` avoids a copy (and NCCL then reduces in place). On gloo the
    peers' rows are received into ``scratch`` (:func:`reduce_scatter_scratch_rows` rows of
    ``output``'s size; allocated per call when not given) and summed when the work is waited for.
    ``identity``: as for :func:`all_gather_into`."""
    return Collectives.of(group).reduce_scatter_into(
        output, flat, op=op, async_op=async_op, scratch=scratch, identity=identity
    )


def reduce_scatter_scratch_rows(group=None) -> int:
    """Shard-sized rows of scratch space a reduce-scatter on ``group`` receives into (pass them
    as ``scratch`` to :func:`reduce_scatter_into` to avoid an allocation per call): one per peer
    on gloo, none on backends that reduce in place."""
    return Collectives.of(group).reduce_scatter_scratch_rows()


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op: bool = False,
):
    """``torch.distributed.all_to_all_single``: rows of ``input`` go to each rank by
    ``input_split_sizes`` (even when None), ``output`` receives ``output_split_sizes`` rows from each."""
    return Collectives.of(group).all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, async_op=async_op
    )


def barrier(group=None) -> None:
    Collectives.of(group).barrier()


__all__ = [
    "ReduceOp",
    "Identity",
    "CollectiveMismatch",
    "HEADER_LEN",
    "GLOO_FORMS",
    "gloo_form",
    "last_seq",
    "all_reduce",
    "broadcast",
    "all_gather_into",
    "reduce_scatter_into",
    "reduce_scatter_scratch_rows",
    "all_to_all_single",
    "barrier",
    "Collectives",
]
