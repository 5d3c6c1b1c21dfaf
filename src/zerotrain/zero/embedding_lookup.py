"""Stage 3's embedding lookup from the shards: an ``nn.Embedding`` whose table is one partitioned
unit looks its rows up where they live instead of all-gathering the whole table.

Every rank gathers every rank's token ids (8 bytes a token), copies the rows, or parts of rows, that
fall in its own shard of the flat table into a zeroed ``[ranks x tokens, width]`` buffer, and
a reduce-scatter sums those buffers and hands each rank its own tokens' rows. Every element is
owned by exactly one rank, so the sum adds zeros only: the result is the table's rows, bit for
bit. It moves ``ranks x tokens x width`` elements instead of the table (GPT-2's tied 50257 x 768
embedding against 2 x 2048 x 768 for two ranks of 4 x 512 tokens: 12x less), and is used only
while that stays under a quarter of the table; larger batches gather the table as before.

Backward reads no weights: the gradient is the table's dense gradient, accumulated against the
parameter's shape (the coordinator gives the parameter its shape over a storage of 0 bytes).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from zerotrain.comm import collectives

# The lookup's buffer (ranks x tokens x width) at most this share of the table; beyond it the
# table is gathered: a large batch moves more than the table, and holds its partial rows.
MAX_SHARE = 0.25


def reads_no_weights(module: nn.Module) -> bool:
    """Modules whose backward reads no parameter values: ``nn.Embedding`` with its own forward."""
    return isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward


class Lookups:
    """The embeddings a stage-3 coordinator looks up from the shards, ``{module: its unit}``:
    their forward is ``forward`` below until ``restore()``. ``group_of(unit)``: the group the
    unit is sharded over; ``attach_empty(unit)``: give its parameters their shapes over 0 bytes;
    ``identity_of(unit)``: what a gather of the unit is called (``collectives.Identity``, or
    None), which the count exchange carries, so a rank that skipped the embedding (a
    rank-dependent branch) is named as for a gather."""

    def __init__(self, candidates: dict, group_of, attach_empty, identity_of):
        self._group_of, self._attach_empty, self._identity_of = group_of, attach_empty, identity_of
        self.units = {m: unit for m, unit in candidates.items() if _plain_table(m, unit)}
        self._patched = list(self.units)
        for m in self._patched:
            m.forward = functools.partial(self.forward, m)

    def __contains__(self, module) -> bool:
        return module in self.units

    def forward(self, module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        unit = self.units.get(module)
        if unit is not None and unit.gathered:
            # Gathered already (inside GatheredParameters over the whole model, for generation
            # with the hooks removed): read the table, exchanging nothing.
            return nn.Embedding.forward(module, ids)
        if unit is not None and eligible(unit):  # alike on every rank
            counts = token_counts(ids, unit, self._group_of(unit), self._identity_of(unit))
            if worthwhile(counts, unit):
                self._attach_empty(unit)
                return lookup(module, ids, unit, counts, self._group_of(unit))
        # Not eligible, or a batch too large for the lookup (a position embedding's small
        # table): gathered from now on, so the counts are not exchanged for nothing. Every rank
        # decides alike, from everyone's counts.
        self.units.pop(module, None)
        return nn.Embedding.forward(module, ids)  # reading the weight gathers it

    def restore(self) -> None:
        """nn.Embedding's own forward back on every module."""
        for m in self._patched:
            vars(m).pop("forward", None)
        self.units, self._patched = {}, []


def _plain_table(module: nn.Module, unit) -> bool:
    """An ``nn.Embedding`` with its own forward (no other forward installed on it), no
    ``max_norm`` renormalising the table in place, dense gradients, alone in its unit."""
    return (
        reads_no_weights(module)
        and "forward" not in vars(module)
        and module.max_norm is None
        and not module.sparse
        and len(unit.params) == 1
        and unit.params[0] is module._parameters.get("weight")
    )


def eligible(unit) -> bool:
    """The unit is resharded, and its shard in memory on the device it computes on (not on
    NVMe, not offloaded to the host): known once the stage is built, so checked at a forward."""
    return unit.resharded and unit.param_swapper is None and unit.device == unit.layout.device


def token_counts(ids: torch.Tensor, unit, group, identity=None) -> list[int]:
    """Every rank's number of token ids (ranks may differ: the last batch, other lengths)."""
    counts = torch.zeros(unit.layout.world_size, dtype=torch.long, device=ids.device)
    collectives.all_gather_into(counts, torch.tensor([ids.numel()], device=ids.device), group=group, identity=identity)
    return counts.tolist()


def worthwhile(counts: list[int], unit) -> bool:
    """Whether the lookup's buffer stays under ``MAX_SHARE`` of the table (same answer on every
    rank: the counts are everyone's)."""
    width = unit.layout.slots[0].shape[1]
    return len(counts) * max(counts) * width <= MAX_SHARE * unit.layout.numel


def lookup(module: nn.Module, ids: torch.Tensor, unit, counts: list[int], group) -> torch.Tensor:
    """``module(ids)`` from the shards (its weight already has its shape, unfilled). The weight
    is taken from the unit: reading ``module.weight`` in a forward would gather it."""
    shard = unit.master if unit.derived else unit.shard
    return _ShardedEmbedding.apply(
        ids,
        unit.params[0],
        shard.detach(),
        unit.shard_rank,
        unit.layout.shard_numel,
        counts,
        group,
        -1 if module.padding_idx is None else module.padding_idx,
        module.scale_grad_by_freq,
    )


def owned_rows(
    shard: torch.Tensor, start: int, rows: int, width: int, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[len(ids), width]``: each id's row where it lies in ``shard`` (the table's flat elements
    ``[start, start + len(shard))``), zeros elsewhere. Only the first and last row can be cut by
    the shard's edges; the rows in between are one view."""
    out = torch.zeros(ids.numel(), width, dtype=dtype, device=shard.device)
    end = min(start + shard.numel(), rows * width)
    if end <= start:
        return out  # this shard holds only padding
    first, stop = -(-start // width), end // width  # the whole rows: [first, stop)
    if stop > first:
        body = shard.narrow(0, first * width - start, (stop - first) * width).view(stop - first, width)
        at = ((ids >= first) & (ids < stop)).nonzero().squeeze(1)
        out[at] = body.index_select(0, ids[at] - first).to(dtype)
    for row in {start // width, (end - 1) // width}:
        if first <= row < stop:
            continue
        lo, hi = max(start, row * width), min(end, (row + 1) * width)
        at = (ids == row).nonzero().squeeze(1)
        out[at, lo - row * width : hi - row * width] = shard[lo - start : hi - start].to(dtype)
    return out


class _ShardedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, shard, rank, shard_numel, counts, group, padding_idx, scale_grad_by_freq):
        rows, width = weight.shape
        world, most = len(counts), max(counts)
        mine = torch.full((most,), -1, dtype=torch.long, device=ids.device)
        mine[: ids.numel()] = ids.reshape(-1)
        everyone = torch.empty(world * most, dtype=torch.long, device=ids.device)
        collectives.all_gather_into(everyone, mine, group=group)
        partial = owned_rows(shard, rank * shard_numel, rows, width, everyone, weight.dtype)
        out = torch.empty(most * width, dtype=weight.dtype, device=ids.device)
        collectives.reduce_scatter_into(out, partial.view(-1), group=group)
        ctx.save_for_backward(ids)
        ctx.rows, ctx.padding_idx, ctx.scale_grad_by_freq = rows, padding_idx, scale_grad_by_freq
        return out.view(most, width)[: counts[rank]].view(*ids.shape, width)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight_grad = torch.ops.aten.embedding_dense_backward(
            grad, ids, ctx.rows, ctx.padding_idx, ctx.scale_grad_by_freq
        )
        return None, weight_grad, None, None, None, None, None, None, None
