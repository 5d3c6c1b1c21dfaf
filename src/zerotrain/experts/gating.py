"""DeepSpeed's MoE gates (``deepspeed.moe.sharded_moe``): ``top1gating``, ``top2gating``,
``topkgating`` and the ``TopKGate`` module, with DeepSpeed's semantics (docs/moe.md).

Every gate first computes *routes*: for each of the k choices of each token, the expert (-1 when
the capacity dropped it), its slot in that expert's buffer and its combine weight. The public
functions turn routes into DeepSpeed's dense ``(l_aux, combine_weights[S,E,C], dispatch_mask[S,E,C],
exp_counts[E])`` or, with ``sparse_routes=True``, DeepSpeed 0.19's route form ``(l_aux, capacity,
num_experts, indices[k,S], locations[k,S], gates[k,S], exp_counts)``. The layer dispatches by the
routes' indices (no one-hot einsum). Random draws (RSample's Gumbel noise, random token selection,
Jitter, top-2's second-expert sampling) are the same torch draws, in the same order, as DeepSpeed's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")


class Routes(NamedTuple):
    """One gate decision. ``capacity`` is None when it was not asked for (dropless dispatch)."""

    l_aux: Tensor
    capacity: int | None
    num_experts: int
    indices: Tensor  # [k, S] int64, -1 where the route was dropped
    locations: Tensor  # [k, S] int64, the slot in the expert's buffer (0 where dropped)
    gates: Tensor  # [k, S] fp32 combine weights (0 where dropped)
    exp_counts: Tensor  # [E] routes per expert before the capacity drops (detached)


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """``x`` times Uniform(1-epsilon, 1+epsilon) (Switch Transformer's input jitter)."""
    if epsilon == 0:
        return x
    low = torch.tensor(1.0 - epsilon, device=device)
    high = torch.tensor(1.0 + epsilon, device=device)
    return x * torch.distributions.uniform.Uniform(low=low, high=high).rsample(x.shape)


def gumbel_rsample(shape, device: torch.device) -> Tensor:
    one, zero = torch.tensor(1.0, device=device), torch.tensor(0.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _uniform(shape, device: torch.device) -> Tensor:
    low, high = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.uniform.Uniform(low=low, high=high).rsample(shape)


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """``max(ceil(S / E * capacity_factor), min_capacity)``, in fp32 as DeepSpeed's ``_capacity``."""
    value = torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor)).to(torch.int64)
    return int(torch.maximum(value, torch.tensor(min_capacity).to(torch.int64)))


def _dropless_capacity(exp_counts: Tensor, ep_group) -> int:
    """The largest expert count, the maximum over the expert-parallel group (DeepSpeed's
    ``drop_tokens=False`` capacity; no tensor parallelism here, so no rounding to it)."""
    new_capacity = torch.max(exp_counts).to(torch.int64)
    if ep_group is not None and dist.get_world_size(group=ep_group) > 1:
        from zerotrain import comm

        comm.all_reduce(new_capacity, op=comm.ReduceOp.MAX, group=ep_group)
    return int(new_capacity)


def _no_tutel(use_tutel: bool) -> None:
    if use_tutel:
        raise NotImplementedError(
            "use_tutel=True: Tutel is not supported by zerotrain; leave use_tutel=False "
            "(the dispatch is by index already)"
        )


def _check_min_capacity(num_tokens: int, min_capacity: int) -> None:
    if num_tokens < min_capacity:
        raise ValueError(
            f"min_capacity={min_capacity} is more than the {num_tokens} tokens of this batch: set "
            "min_capacity to 0 or give the MoE layer more tokens (DeepSpeed asserts the same)"
        )


def top1_routes(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group=None,
    need_capacity: bool = True,
) -> Routes:
    if noisy_gate_policy == "RSample":
        logits_w_noise = logits + gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = int(gates.shape[0]), int(gates.shape[1])
    cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)

    indices1_s = torch.argmax(logits_w_noise if noisy_gate_policy == "RSample" else gates, dim=1)
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    if used_token is not None:
        mask1 = used_token.reshape(-1, 1).to(mask1.dtype) * mask1
    exp_counts = torch.sum(mask1, dim=0).detach()

    if not drop_tokens:
        if need_capacity:
            cap = min(_dropless_capacity(exp_counts, ep_group), num_tokens)
        else:  # every token kept: the local maximum selects them all
            cap = int(torch.max(exp_counts))

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts

    mask1_rand = mask1 * _uniform(mask1.shape, logits.device) if use_rts else mask1
    _check_min_capacity(num_tokens, min_capacity)
    selection = min(cap, num_tokens)
    top_idx = torch.topk(mask1_rand, k=selection, dim=0)[1]
    mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    kept = mask1.sum(dim=1) > 0
    indices = torch.where(kept, indices1_s, torch.full_like(indices1_s, -1))
    locations = torch.sum(locations1 * mask1, dim=1)
    gates1_s = (gates * mask1.float()).sum(dim=1)  # top-1 is not renormalized
    return Routes(
        l_aux,
        cap if (drop_tokens or need_capacity) else None,
        num_experts,
        indices.unsqueeze(0),
        locations.long().unsqueeze(0),
        gates1_s.unsqueeze(0),
        exp_counts,
    )


def top2_routes(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    top2_2nd_expert_sampling: bool = True,
    need_capacity: bool = True,
) -> Routes:
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = int(gates.shape[0]), int(gates.shape[1])
    indices1_s = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    if top2_2nd_expert_sampling:  # Gumbel-max: DeepSpeed adds the noise to the logits in place
        logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)  # second choices after every first choice

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()

    # each route's slot and gate read at its own expert (a gather, not a sum over a masked [S, E]
    # product: the same values, since the other E - 1 terms are zeros)
    location1 = locations1.gather(1, indices1_s.unsqueeze(1)).squeeze(1)
    location2 = locations2.gather(1, indices2_s.unsqueeze(1)).squeeze(1)
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        kept1, kept2 = location1 < cap, location2 < cap
    else:
        cap = _dropless_capacity(exp_counts, ep_group) if need_capacity else None
        kept1 = kept2 = torch.ones_like(indices1_s, dtype=torch.bool)

    locations1_s = location1 * kept1
    locations2_s = location2 * kept2
    gates1_s = gates.gather(1, indices1_s.unsqueeze(1)).squeeze(1) * kept1
    gates2_s = gates.gather(1, indices2_s.unsqueeze(1)).squeeze(1) * kept2
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates1_s = gates1_s / denom_s
    gates2_s = gates2_s / denom_s
    idx1 = torch.where(kept1, indices1_s, torch.full_like(indices1_s, -1))
    idx2 = torch.where(kept2, indices2_s, torch.full_like(indices2_s, -1))
    return Routes(
        l_aux,
        cap,
        num_experts,
        torch.stack([idx1, idx2]),
        torch.stack([locations1_s, locations2_s]).long(),
        torch.stack([gates1_s, gates2_s]),
        exp_counts,
    )


def topk_routes(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    drop_policy: str = "probs",
    need_capacity: bool = True,
) -> Routes:
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r}: use 'probs' or 'position'")
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = int(gates.shape[0]), int(gates.shape[1])
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} must be between 1 and num_experts={num_experts}")
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach()

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k

    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            topk_masked_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            selection = min(cap, num_tokens)
            _, capacity_indices = torch.topk(topk_masked_gates, k=selection, dim=0, sorted=False)
            mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, capacity_indices, True)
            locations = torch.cumsum(mask, dim=0) - 1
        else:
            locations = torch.cumsum(mask, dim=0) - 1
            mask &= torch.lt(locations, cap)
    else:
        cap = _dropless_capacity(exp_counts, ep_group) if need_capacity else None
        locations = torch.cumsum(mask, dim=0) - 1

    gates_masked = gates * mask
    denom_s = torch.clamp(torch.sum(gates_masked, dim=-1, keepdim=True), min=torch.finfo(gates_masked.dtype).eps)
    gates_masked = gates_masked / denom_s

    route_kept = mask.gather(1, top_idx)
    indices = torch.where(route_kept, top_idx, torch.full_like(top_idx, -1))
    route_locations = locations.gather(1, top_idx) * route_kept
    route_gates = gates_masked.gather(1, top_idx)
    return Routes(
        l_aux,
        cap,
        num_experts,
        indices.t().contiguous(),
        route_locations.t().contiguous().long(),
        route_gates.t().contiguous(),
        exp_counts,
    )


def dense(routes: Routes) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DeepSpeed's ``(l_aux, combine_weights[S,E,C], dispatch_mask[S,E,C], exp_counts)``."""
    k, num_tokens = routes.indices.shape
    cap, num_experts = int(routes.capacity), routes.num_experts
    combine = routes.gates.new_zeros(num_tokens, num_experts * cap)
    kept = routes.indices >= 0
    slots = torch.where(kept, routes.indices * cap + routes.locations, torch.zeros_like(routes.indices))
    for r in range(k):  # the routes of one token go to distinct experts: no slot is written twice
        combine = combine.scatter_add(1, slots[r].unsqueeze(1), (routes.gates[r] * kept[r]).unsqueeze(1))
    combine = combine.view(num_tokens, num_experts, cap)
    return routes.l_aux, combine, combine.bool(), routes.exp_counts


def _sparse(routes: Routes) -> tuple:
    return (
        routes.l_aux,
        routes.capacity,
        routes.num_experts,
        routes.indices.to(torch.int32),
        routes.locations.to(torch.int32),
        routes.gates,
        routes.exp_counts,
    )


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group=None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
):
    """Top-1 gating (Switch): the raw softmax probability weights the output (no renormalization)."""
    _no_tutel(use_tutel)
    routes = top1_routes(
        logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens, use_rts, ep_group
    )
    return _sparse(routes) if sparse_routes else dense(routes)


def top2gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
):
    """Top-2 gating (GShard): capacity from ``2 * capacity_factor``, second choices after first ones."""
    routes = top2_routes(logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling)
    return _sparse(routes) if sparse_routes else dense(routes)


def topkgating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
):
    """Top-k gating: capacity from ``k * capacity_factor``, gates renormalized over the kept experts."""
    routes = topk_routes(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy)
    return _sparse(routes) if sparse_routes else dense(routes)


class TopKGate(nn.Module):
    """DeepSpeed's gate: ``wg = Linear(model_dim, num_experts, bias=False)`` run in fp32, then
    top-1, top-2 or top-k gating (``eval_capacity_factor`` and no noise in eval mode)."""

    wg: nn.Linear

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group=None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}: use None, 'Jitter' or 'RSample'")
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k} must be between 1 and num_experts={num_experts}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group) -> None:
        if self.ep_group is not None:
            raise RuntimeError("TopKGate already has an expert-parallel group")
        self.ep_group = ep_group

    def routes(self, input: Tensor, used_token: Tensor | None = None, need_capacity: bool = True) -> Routes:
        """The gate's decision as routes (what the layer dispatches with)."""
        input_fp32 = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            input_fp32 = multiplicative_jitter(input_fp32, device=input.device)
        logits = F.linear(input_fp32, weight=self.wg.weight.float(), bias=None)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1_routes(
                logits,
                cf,
                self.min_capacity,
                used_token,
                self.noisy_gate_policy if self.training else None,
                self.drop_tokens,
                self.use_rts,
                self.ep_group,
                need_capacity,
            )
        if self.k == 2:
            return top2_routes(
                logits,
                cf,
                self.min_capacity,
                self.drop_tokens,
                self.ep_group,
                self.top2_2nd_expert_sampling,
                need_capacity,
            )
        return topk_routes(
            logits, self.k, cf, self.min_capacity, self.drop_tokens, self.ep_group, need_capacity=need_capacity
        )

    def forward(self, input: Tensor, used_token: Tensor = None, sparse_routes: bool = False, use_tutel: bool = False):
        _no_tutel(use_tutel)
        routes = self.routes(input, used_token)
        return _sparse(routes) if sparse_routes else dense(routes)
