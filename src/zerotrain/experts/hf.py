"""Expert parallelism for Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, ...).

transformers 5 keeps a sparse-MoE block's experts in one fused module (``MixtralExperts``,
``Qwen2MoeExperts``, ``DeepseekV3Experts``: 3-D parameters ``gate_up_proj[E, 2I, H]``,
``down_proj[E, H, I]``), called by the block as ``experts(hidden, top_k_index, top_k_weights)``
after HF's own router. ``expert_parallel`` leaves the block and its router alone (so the router
logits that ``output_router_logits=True`` records, and the load-balancing loss built from them,
are HF's) and turns each experts module into its expert-parallel form:

- the module keeps rows ``[r * E/ep, (r + 1) * E/ep)`` of each expert parameter (``r``: the rank's
  place in its expert-parallel group), sliced from the full init so every rank agrees, under the
  same parameter names; the slices carry DeepSpeed's markers (``allreduce = False``,
  ``group_name = "ep_size_<ep>"``), so the engine sums their gradients over the expert-data group;
- its forward sends every (token, chosen expert) pair, with its routing weight, to the rank owning
  the expert (uneven ``all_to_all_single`` over the expert-parallel group: dropless, as HF's block;
  ``zerotrain.experts.exchange.dropless_exchange``, shared with zerotrain's MoE layer),
  runs HF's own experts forward there on the local experts, and sends the weighted outputs back,
  where each token sums its routes.

``gather_expert_state_dict`` puts the full expert tensors back together (a state dict the
unsharded model loads); ``shard_expert_state_dict`` slices a full one for the sharded model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from zerotrain.comm import collectives as comm
from zerotrain.experts.exchange import dropless_exchange


@dataclass
class _ExpertShard:
    """Where one experts module's slice sits: its expert-parallel group and the global experts it holds."""

    groups: Any  # the topology's ExpertGroups (holds its process groups weakly); None: ep_size 1
    ep_size: int
    ep_rank: int
    num_experts: int  # experts in the whole model's block
    num_local_experts: int
    param_names: tuple

    @property
    def group(self):
        return self.groups.expert_group

    @property
    def first(self) -> int:
        return self.ep_rank * self.num_local_experts


_EP_CLASSES: dict[type, type] = {}


def _is_hf_experts(module: nn.Module) -> bool:
    """transformers' fused experts: a class wrapped by ``use_experts_implementation`` (it sets
    ``_is_expert_parallel``), ``num_experts`` experts stacked on dim 0 of each own parameter."""
    if not hasattr(module, "_is_expert_parallel") or not isinstance(getattr(module, "num_experts", None), int):
        return False
    own = list(module.named_parameters(recurse=False))
    return bool(own) and all(p.dim() >= 1 and p.shape[0] == module.num_experts for _, p in own)


def _shard_of(module: nn.Module) -> _ExpertShard | None:
    return module.__dict__.get("_zerotrain_expert_shard")


def expert_shard(module: nn.Module) -> _ExpertShard | None:
    """Where ``module``'s expert rows sit (its expert-parallel group and ranks, the global
    expert count, its parameter names), if ``expert_parallel`` sharded it; else None. Checkpoints
    name the rows by it."""
    return _shard_of(module)


def expert_modules(model: nn.Module) -> list[tuple]:
    """``(name, module)`` of every Hugging Face fused experts module in ``model``, sharded or not."""
    return [(name, m) for name, m in model.named_modules() if _shard_of(m) is not None or _is_hf_experts(m)]


def expert_parallel(model: nn.Module, ep_size: int, topology=None) -> list[str]:
    """Spread the experts of every sparse-MoE block of the Hugging Face ``model`` over
    ``ep_size`` ranks (in place; returns the experts modules' names).

    The groups are ``topology.expert_groups(ep_size)`` (``initialize`` passes its engine's; the
    default, ``Topology.build()``, is the world as data parallelism), DeepSpeed's ``ep_size_N``
    layout, the one the engine reduces expert gradients with. Every rank must call this on the same model
    (same seed: the slices are cut from each rank's full init), in the same order."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"expert_parallel: ep_size={ep_size!r} must be a positive integer")
    found = [(name, m) for name, m in model.named_modules() if _is_hf_experts(m)]
    done = [name for name, m in model.named_modules() if _shard_of(m) is not None]
    if done:
        raise ValueError(
            f"expert_parallel: {type(model).__name__} is already expert-parallel ({done[0]}); "
            "call expert_parallel once per model"
        )
    if not found:
        raise ValueError(
            f"expert_parallel: no Hugging Face fused experts module (e.g. MixtralExperts) in "
            f"{type(model).__name__}; it needs a transformers>=5 MoE model (Mixtral, Qwen-MoE, DeepSeek)"
        )
    for name, m in found:
        if m.num_experts % ep_size:
            raise ValueError(
                f"expert_parallel: ep_size={ep_size} must divide the {m.num_experts} experts of "
                f"{name} ({type(m).__name__}); choose a divisor of the expert count"
            )
    if topology is None:
        from zerotrain.topology import Topology

        topology = Topology.build()
    if ep_size > 1 and not topology.distributed:
        raise RuntimeError(
            f"expert_parallel(ep_size={ep_size}) needs torch.distributed initialized "
            "(zerotrain.init_distributed() or zerotrain launch)"
        )
    groups = topology.expert_groups(ep_size) if topology.distributed else None
    ep_rank = groups.expert_rank if groups is not None else 0
    for _name, m in found:
        local = m.num_experts // ep_size
        names = tuple(n for n, _ in m.named_parameters(recurse=False))
        for pname in names:
            full = getattr(m, pname)
            piece = nn.Parameter(
                full.detach()[ep_rank * local : (ep_rank + 1) * local].clone(), requires_grad=full.requires_grad
            )
            piece.allreduce = False
            piece.group_name = f"ep_size_{ep_size}"
            setattr(m, pname, piece)
        m.__dict__["_zerotrain_expert_shard"] = _ExpertShard(groups, ep_size, ep_rank, m.num_experts, local, names)
        m.num_experts = local  # HF's forward (run on the local experts) sizes its one-hot by it
        m.__class__ = _expert_parallel_class(type(m))
    return [name for name, _ in found]


def _expert_parallel_class(cls: type) -> type:
    """``cls`` with the dispatching forward (one subclass per HF class, FSDP2's pattern): the
    module stays an instance of HF's class, so HF's weight init and output capture still match."""
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (_ExpertParallelForward, cls), {})
    return _EP_CLASSES[cls]


class _ExpertParallelForward:
    """The forward of an expert-parallel HF experts module (mixed in before HF's class)."""

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        shard: _ExpertShard = self.__dict__["_zerotrain_expert_shard"]
        num_tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.sort(flat, stable=True)[1]  # routes grouped by global expert
        experts = flat.index_select(0, order)
        tokens = torch.div(order, k, rounding_mode="floor")
        send = hidden_states.index_select(0, tokens)
        send_weights = top_k_weights.reshape(-1).index_select(0, order)

        def run_local_experts(received: list[Tensor], local_ids: Tensor, received_counts: Tensor) -> Tensor:
            # received rows: [source rank][local expert][routes]; each row is one route (k = 1).
            rows, weights = received
            return super(_ExpertParallelForward, self).forward(rows, local_ids.unsqueeze(1), weights.unsqueeze(1))

        group = shard.group if shard.ep_size > 1 else None
        out = dropless_exchange(
            [send, send_weights], experts, shard.num_experts, shard.ep_size, group, run_local_experts
        ).out
        return out.new_zeros(num_tokens, out.shape[-1]).index_add(0, tokens, out)


def _gather_rows(tensor: Tensor, shard: _ExpertShard) -> Tensor:
    if shard.ep_size == 1:
        return tensor.detach().clone()
    gathered = tensor.new_empty((shard.ep_size * tensor.shape[0],) + tuple(tensor.shape[1:]))
    comm.all_gather_into(gathered.view(-1), tensor.detach().reshape(-1), group=shard.group)
    return gathered


def gather_expert_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every expert tensor gathered whole over its expert-parallel
    group (all experts, HF's names and shapes): what the unsharded model loads, or
    ``save_pretrained(state_dict=...)`` writes. A collective: every rank of the group calls it.
    Parameters a ZeRO-3 engine partitioned are gathered first (copies, on every rank)."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        return _with_whole_experts(model, model.state_dict())
    from zerotrain.zero import GatheredParameters

    with GatheredParameters(partitioned):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return _with_whole_experts(model, state)


def _sharded_expert_params(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, _ExpertShard]]:
    """``(state dict key, module, parameter name, shard)`` of every sharded expert parameter, in
    module order (the order every rank gathers them in)."""
    for name, module in model.named_modules():
        shard = _shard_of(module)
        if shard is None:
            continue
        for pname in shard.param_names:
            yield (f"{name}.{pname}" if name else pname), module, pname, shard


def _with_whole_experts(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    for key, module, pname, shard in _sharded_expert_params(model):
        state[key] = _gather_rows(getattr(module, pname), shard)
    return state


def shard_expert_state_dict(model: nn.Module, full_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A full (unsharded) state dict cut to this rank's experts: ``model.load_state_dict`` of an
    expert-parallel ``model`` takes the result."""
    state = dict(full_state)
    for key, _, _, shard in _sharded_expert_params(model):
        if key not in state:
            continue
        rows = state[key]
        if rows.shape[0] != shard.num_experts:
            raise ValueError(
                f"shard_expert_state_dict: {key} has {rows.shape[0]} experts, the model "
                f"{shard.num_experts}; pass the full (unsharded) state dict"
            )
        state[key] = rows[shard.first : shard.first + shard.num_local_experts]
    return state
