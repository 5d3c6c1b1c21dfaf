"""The token exchange of expert parallelism, shared by zerotrain's MoE layer (``layer.py``,
dropless and capacity-padded dispatch) and the expert-parallel Hugging Face experts (``hf.py``).

``_AllToAll`` is ``all_to_all_single`` as an autograd function. ``dropless_exchange`` is the whole
dropless round trip: both callers route each (token, expert) pair to the rank that owns the
expert and back, and differ only in how they sort their routes and how they run the local
experts, so those two stay with the callers and the collectives live here once. They go through
``zerotrain.comm`` (the group's ``Collectives`` object), so the comms logger and hang diagnosis see them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zerotrain.comm import collectives as comm


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with (possibly uneven) splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any, group, input: Tensor, output_splits: list[int] | None = None, input_splits: list[int] | None = None
    ) -> Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        input = input.contiguous()
        if output_splits is None:
            output = torch.empty_like(input)
        else:
            output = input.new_empty((sum(output_splits),) + tuple(input.shape[1:]))
        comm.all_to_all_single(output, input, output_splits, input_splits, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor):
        grad = _AllToAll.apply(ctx.group, grad_output.contiguous(), ctx.input_splits, ctx.output_splits)
        return None, grad, None, None


@dataclass
class DroplessResult:
    """What ``dropless_exchange`` returns: one output row per sent row, in the sent order, and the
    seconds spent in the outbound and the return all-to-all (None without an exchange)."""

    out: Tensor
    dispatch_s: float | None = None
    combine_s: float | None = None


def dropless_exchange(
    rows: Sequence[Tensor],
    expert_of_row: Tensor,
    num_experts: int,
    ep_size: int,
    group,
    run_local_experts: Callable[[list[Tensor], Tensor, Tensor], Tensor],
) -> DroplessResult:
    """Send each row to the rank owning its expert, run the local experts there, send the outputs back.

    ``rows``: tensors with one row per route, the routes sorted (stably) by global expert;
    they travel together (e.g. the hidden states and their routing weights), in this order.
    ``expert_of_row``: the sorted global expert of each row (expert ``e`` lives on rank
    ``e // (num_experts / ep_size)`` of ``group``).

    The per-expert row counts (``bincount``) go first through an equal all-to-all of the
    ``[ep_size, local experts]`` count table, so each rank learns how many rows it gets from whom;
    then each of ``rows`` goes through an uneven all-to-all (autograd: the backward is the reverse
    exchange; the counts carry no gradient). The received rows are ordered
    ``[source rank][local expert][route]``, not grouped by expert, so
    ``run_local_experts(received, local_expert_of_row, received_counts)`` gets each received row's
    local expert id and the ``[ep_size, local experts]`` table of received counts, and returns one
    output row per received row in the received order; those travel back by the reverse uneven
    all-to-all. With ``ep_size == 1`` nothing is exchanged (``group`` may be None).

    Every rank of ``group`` calls this in the same order: the collectives are the counts, then each
    of ``rows``, then the output. Only the routed rows travel (no capacity padding).
    """
    num_local_experts = num_experts // ep_size
    counts = torch.bincount(expert_of_row, minlength=num_experts).view(ep_size, num_local_experts)
    dispatch_s = combine_s = None
    if ep_size > 1:
        received_counts = torch.empty_like(counts)
        comm.all_to_all_single(received_counts, counts, group=group)
        input_splits = counts.sum(1).tolist()
        output_splits = received_counts.sum(1).tolist()
        start = time.perf_counter()
        received = [_AllToAll.apply(group, r, output_splits, input_splits) for r in rows]
        dispatch_s = time.perf_counter() - start
    else:
        received_counts, received = counts, list(rows)
    local_of_row = torch.arange(num_local_experts, device=counts.device).repeat(ep_size)
    local_of_row = torch.repeat_interleave(local_of_row, received_counts.reshape(-1))
    out = run_local_experts(received, local_of_row, received_counts)
    if ep_size > 1:
        start = time.perf_counter()
        out = _AllToAll.apply(group, out, input_splits, output_splits)
        combine_s = time.perf_counter() - start
    return DroplessResult(out, dispatch_s, combine_s)
