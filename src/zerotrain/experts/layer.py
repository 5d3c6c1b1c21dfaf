"""DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``, ``sharded_moe.MOELayer``, ``experts.Experts``)
with expert parallelism over the topology's ``ep_size_N`` groups (docs/moe.md).

Dispatch is by the gate's route indices. With ``drop_tokens=True`` each expert gets DeepSpeed's
capacity-padded ``[ep_size, num_local_experts, C, M]`` buffer through an equal-split all-to-all
(the ranks first agree on C: a rank with another token count is a one-line error, not a hang).
With ``drop_tokens=False`` (dropless) only the routed tokens travel, by an uneven all-to-all
(``zerotrain.experts.exchange.dropless_exchange``, shared with the HF experts of ``hf.py``), and
each local expert runs on exactly its tokens: the outputs equal DeepSpeed's capacity-padded ones
for experts that act on each token alone (Linear, MLPs).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zerotrain import comm
from zerotrain.experts.exchange import _AllToAll, dropless_exchange
from zerotrain.experts.gating import NOISY_GATE_POLICIES, Routes, TopKGate


def _expert_output(out):
    return out[0] if isinstance(out, tuple) else out  # DeepSpeed ignores a returned bias


class Experts(nn.Module):
    """The local experts: ``deepspeed_experts``, copies of ``expert`` whose parameters are marked
    ``allreduce = False`` and ``group_name = expert_group_name`` (what ``is_moe_param`` tests)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: Tensor) -> Tensor:
        """DeepSpeed's: chunk dim 1 (one chunk per local expert), run each, concatenate."""
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs = [_expert_output(expert(chunk)) for chunk, expert in zip(chunks, self.deepspeed_experts)]
        return torch.cat(outputs, dim=1)


class MOELayer(nn.Module):
    """Gate, dispatch (all-to-all over the expert-parallel group), local experts, combine.
    ``l_aux`` and ``exp_counts`` of the last forward stay on the module, as in DeepSpeed."""

    def __init__(
        self,
        gate: nn.Module,
        experts: nn.Module,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        if use_tutel:
            raise NotImplementedError(
                "use_tutel=True: Tutel is not supported by zerotrain; leave use_tutel=False "
                "(the dispatch is by index already)"
            )
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        self.l_aux = None
        self.exp_counts = None
        self.capacity = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _exchanges(self) -> bool:
        return self.ep_size > 1

    def _clock(self, start: float) -> float:
        return self._ms(time.perf_counter() - start)

    def _ms(self, seconds: float) -> float:
        """An all-to-all's time for DeepSpeed's ``time_falltoall``/``time_salltoall`` (ms; 0 when
        ``wall_clock_breakdown`` is off)."""
        return seconds * 1000.0 if self.wall_clock_breakdown else 0.0

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        began = time.perf_counter()
        d_model = input[0].shape[-1]
        x = input[0].reshape(-1, d_model)
        used_token = input[1] if len(input) > 1 else None
        drop = getattr(self.gate, "drop_tokens", True)
        if self._exchanges() and self.ep_group is None:
            raise RuntimeError(
                f"MOELayer with ep_size={self.ep_size} has no expert-parallel group: build it "
                "through the MoE layer (MoE.set_deepspeed_parallelism())"
            )
        routes = self.gate.routes(x, used_token, need_capacity=drop)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        self.capacity = routes.capacity  # None in dropless mode (zerotrain.experts.stats reads it)
        if drop:
            combined = self._capacity_dispatch(x, routes)
        else:
            combined = self._dropless_dispatch(x, routes)
        self.time_moe = self._clock(began)
        return combined.reshape(input[0].shape)

    # -- capacity-padded (DeepSpeed's layout) -------------------------------------------------
    def _capacity_dispatch(self, x: Tensor, routes: Routes) -> Tensor:
        num_tokens, d_model = x.shape
        num_experts, cap = routes.num_experts, int(routes.capacity)
        flat = routes.indices.reshape(-1)
        kept = flat >= 0
        # each route's row in the flat [E * C] buffer (-1 where the capacity dropped it)
        slot_of_route = torch.where(kept, flat * cap + routes.locations.reshape(-1), torch.full_like(flat, -1))
        # the buffer is one gather from x by each slot's token: no [routes, M] copy of x, and
        # index_select saves only its index for backward (index_copy would save its source)
        token_of_slot = torch.full((num_experts * cap,), -1, dtype=torch.long, device=x.device)
        tokens = torch.arange(num_tokens, device=x.device).repeat(routes.indices.shape[0])
        token_of_slot.scatter_(0, slot_of_route[kept], tokens[kept])
        dispatched = _gather_rows(x, token_of_slot).view(num_experts, cap, d_model)
        if self._exchanges():
            self._agree_on_capacity(cap, num_tokens)
            start = time.perf_counter()
            dispatched = _AllToAll.apply(self.ep_group, dispatched)
            self.time_falltoall = self._clock(start)
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched).reshape(self.ep_size * self.num_local_experts, -1, d_model)
        if self._exchanges():
            start = time.perf_counter()
            expert_output = _AllToAll.apply(self.ep_group, expert_output)
            self.time_salltoall = self._clock(start)
        return _combine(expert_output.reshape(num_experts * cap, d_model), slot_of_route, routes.gates)

    def _agree_on_capacity(self, cap: int, num_tokens: int) -> None:
        mine = torch.tensor([cap, num_tokens], dtype=torch.int64)
        every = torch.empty(self.ep_size * 2, dtype=torch.int64)
        comm.all_gather_into(every, mine, group=self.ep_group)
        caps = every.view(-1, 2)
        if bool((caps[:, 0] != cap).any()):
            raise ValueError(
                f"MoE capacities differ across the expert-parallel group {self.ep_group_name} "
                f"(tokens per rank {caps[:, 1].tolist()} give capacities {caps[:, 0].tolist()}): "
                "give every rank the same number of tokens, or use drop_tokens=False"
            )

    # -- dropless: only routed tokens travel ----------------------------------------------------
    def _dropless_dispatch(self, x: Tensor, routes: Routes) -> Tensor:
        num_tokens, d_model = x.shape
        num_experts = routes.num_experts
        flat = routes.indices.reshape(-1)
        kept = flat >= 0
        experts = flat[kept]
        order = torch.sort(experts, stable=True)[1]
        experts = experts[order]
        route_of_row = torch.arange(flat.numel(), device=x.device)[kept][order]
        tokens = route_of_row % num_tokens
        send = x.index_select(0, tokens)

        def run_local_experts(received: list[Tensor], local_of_row: Tensor, received_counts: Tensor) -> Tensor:
            # received: [source rank][local expert][tokens]; regroup by local expert
            perm = torch.sort(local_of_row, stable=True)[1]
            grouped = received[0].index_select(0, perm).split(received_counts.sum(0).tolist())
            outputs = [_expert_output(expert(chunk)) for chunk, expert in zip(grouped, self.experts.deepspeed_experts)]
            return torch.cat(outputs, dim=0).index_select(0, torch.argsort(perm))

        group = self.ep_group if self._exchanges() else None
        done = dropless_exchange([send], experts, num_experts, self.ep_size, group, run_local_experts)
        if done.dispatch_s is not None:
            self.time_falltoall, self.time_salltoall = self._ms(done.dispatch_s), self._ms(done.combine_s)
        out = done.out
        row_of_route = torch.full_like(flat, -1)
        row_of_route[route_of_row] = torch.arange(route_of_row.numel(), device=x.device)
        return _combine(out, row_of_route, routes.gates)


def _gather_rows(source: Tensor, rows: Tensor) -> Tensor:
    """``source[rows]`` with zero rows where ``rows`` is -1. The zeros are written in place on the
    gathered copy (index_select's backward needs only the index), so nothing else is allocated."""
    gathered = source.index_select(0, rows.clamp(min=0))
    empty = (rows < 0).nonzero().squeeze(1)
    if empty.numel():
        gathered.index_fill_(0, empty, 0)
    return gathered


def _combine(rows: Tensor, row_of_route: Tensor, gates: Tensor) -> Tensor:
    """Each token's output: the sum over its k routes of ``gates[r, s] * rows[row_of_route[r * S + s]]``
    (a dropped route, row -1, adds zero), in fp32 (the gates' dtype), returned in the rows' dtype.
    Summing a [k, S, M] block keeps only the gathered rows for backward (the gates' gradient),
    where an index_add would also save its weighted source."""
    k, num_tokens = gates.shape
    routed = _gather_rows(rows, row_of_route).to(gates.dtype).view(k, num_tokens, rows.shape[1])
    return (routed * gates.unsqueeze(2)).sum(0).to(rows.dtype)


class MoE(nn.Module):
    """DeepSpeed's ``MoE`` layer: ``forward(hidden_states, used_token=None)`` returns
    ``(output, l_aux, exp_counts)``. The expert-parallel group is the topology's ``ep_size_N``
    group, built on the first forward (or ``set_deepspeed_parallelism``): every rank must build
    its MoE layers in the same order. The topology is the one given (``topology=``, or
    ``set_topology``: ``initialize`` hands every MoE layer its engine's); DeepSpeed's constructor
    has no such argument, so without one the layer takes the process's current topology
    (``zerotrain.topology.current()``, what DeepSpeed's global groups answer from)."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        topology=None,
    ) -> None:
        super().__init__()
        if use_tutel:
            raise NotImplementedError(
                "MoE(use_tutel=True): Tutel is not supported by zerotrain; leave "
                "use_tutel=False (the dispatch is by index already)"
            )
        if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} must be a positive multiple of ep_size={ep_size}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"MoE: noisy_gate_policy={noisy_gate_policy!r}: use None, 'Jitter' or 'RSample'")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        self._groups_ready = False
        self._topology = topology

    def set_topology(self, topology) -> None:
        """Take the expert-parallel group from ``topology`` (an engine's) from the next forward on."""
        self._topology = topology
        self._groups_ready = False

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        self._create_process_groups(use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self._groups_ready:
            return
        if dist.is_available() and dist.is_initialized():
            topology = self._topology
            if topology is None:  # DeepSpeed's MoE(...) takes no topology: the process's current one
                from zerotrain.topology import current

                topology = current()
            groups = topology.expert_groups(self.ep_size, use_data_before_expert_parallel_)
            self.deepspeed_moe._set_ep_group(groups.expert_group)
        elif self.ep_size > 1:
            raise RuntimeError(
                f"MoE(ep_size={self.ep_size}) needs torch.distributed initialized "
                "(zerotrain.init_distributed() or zerotrain launch)"
            )
        self._groups_ready = True

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        self._create_process_groups()
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = _expert_output(self.mlp(hidden_states))
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
