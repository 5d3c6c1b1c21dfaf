"""DeepSpeed's MoE layer (zerotrain.experts.layer, re-exported as zerotrain.moe.layer.MoE).

- One process: the layer equals DeepSpeed's dense formulation written here (one-hot einsums over
  the gate's combine weights), outputs and every gradient, k=1,2,3, with and without drops, PR-MoE.
- Two gloo ranks, ep_size=2 (one expert per rank, and two): outputs, l_aux and the gradients of the
  gate and of each expert equal a single-process ep_size=1 layer holding every expert, run on each
  rank's tokens; ep_size=1 on two ranks; dropless with different token counts per rank (uneven
  all-to-all); capacity-padded with different token counts is a one-line error on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zerotrain.experts.gating import top1gating, top2gating, topkgating
from zerotrain.testing import run_on_ranks

HIDDEN = 6


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, 10)
        self.fc2 = nn.Linear(10, HIDDEN)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _moe(num_experts, ep_size, k, drop_tokens=True, seed=0, **kw):
    """A layer with distinct random expert weights; ep_size>1 keeps only this rank's experts
    (loaded from the ep_size=1 layer's state dict, global expert ids renamed to local ones)."""
    from zerotrain.moe.layer import MoE

    torch.manual_seed(seed)
    full = MoE(
        HIDDEN,
        _MLP(),
        num_experts=num_experts,
        ep_size=1,
        k=k,
        min_capacity=0,
        capacity_factor=0.6,
        drop_tokens=drop_tokens,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        **kw,
    )
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    if ep_size == 1:
        return full, copy.deepcopy(full)
    import torch.distributed as dist

    from zerotrain.topology import current

    local = MoE(
        HIDDEN,
        _MLP(),
        num_experts=num_experts,
        ep_size=ep_size,
        k=k,
        min_capacity=0,
        capacity_factor=0.6,
        drop_tokens=drop_tokens,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        **kw,
    )
    n_local = num_experts // ep_size
    ep_rank = current().expert_groups(ep_size).expert_rank if dist.is_initialized() else 0
    prefix = "deepspeed_moe.experts.deepspeed_experts."
    state = {}
    for key, value in full.state_dict().items():
        if key.startswith(prefix):
            index, rest = key[len(prefix) :].split(".", 1)
            if ep_rank * n_local <= int(index) < (ep_rank + 1) * n_local:
                state[f"{prefix}{int(index) - ep_rank * n_local}.{rest}"] = value
        else:
            state[key] = value
    local.load_state_dict(state)
    return full, local


def _dense_reference(moe, x):
    """DeepSpeed's dense MOELayer: einsum dispatch, every expert on its [C, M] buffer, einsum combine."""
    gate = moe.deepspeed_moe.gate
    flat = x.reshape(-1, HIDDEN)
    logits = nn.functional.linear(flat.float(), gate.wg.weight.float())
    cf = gate.capacity_factor
    if gate.k == 1:
        l_aux, combine, dispatch, counts = top1gating(
            logits, cf, gate.min_capacity, drop_tokens=gate.drop_tokens, use_rts=False
        )
    elif gate.k == 2:
        l_aux, combine, dispatch, counts = top2gating(
            logits, cf, gate.min_capacity, drop_tokens=gate.drop_tokens, top2_2nd_expert_sampling=False
        )
    else:
        l_aux, combine, dispatch, counts = topkgating(
            logits, gate.k, cf, gate.min_capacity, drop_tokens=gate.drop_tokens
        )
    dispatched = torch.einsum("sec,sm->ecm", dispatch.to(flat.dtype), flat)
    outs = torch.stack([expert(dispatched[e]) for e, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts)])
    out = torch.einsum("sec,ecm->sm", combine, outs).reshape(x.shape)
    if moe.use_residual:
        coef = torch.softmax(moe.coefficient(x), dim=-1)
        out = out * coef[..., 0:1] + moe.mlp(x) * coef[..., 1:]
    return out, l_aux, counts


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("use_residual", [False, True])
def test_layer_equals_dense_reference(k, drop_tokens, use_residual):
    moe, _ = _moe(4, 1, k, drop_tokens, seed=k, use_residual=use_residual)
    torch.manual_seed(99)
    x = torch.randn(3, 7, HIDDEN)
    target = torch.randn(3, 7, HIDDEN)
    results = []
    for run in (lambda: moe(x), lambda: _dense_reference(moe, x)):
        moe.zero_grad()
        xi = x.clone().requires_grad_(True)
        x_saved = x
        x = xi
        out, l_aux, counts = run()
        ((out - target).square().mean() + 0.1 * l_aux).backward()
        results.append((out.detach(), float(l_aux.detach()), counts.tolist(), xi.grad.clone(), _grads(moe)))
        x = x_saved
    (o1, l1, c1, gx1, g1), (o2, l2, c2, gx2, g2) = results
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=1e-5)
    assert l1 == pytest.approx(l2, abs=1e-7) and c1 == c2
    torch.testing.assert_close(gx1, gx2, atol=1e-6, rtol=1e-5)
    assert g1.keys() == g2.keys()
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.fixture
def without_process_group():
    """This test checks the layer without torch.distributed: a group an earlier test left in this
    process (zerotrain.init_distributed() makes a world of one) is destroyed first."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_expert_markers_and_names(without_process_group):
    from zerotrain.moe.experts import Experts
    from zerotrain.moe.layer import MoE
    from zerotrain.moe.utils import is_moe_param

    moe = MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=4, ep_size=2, use_residual=True)
    assert isinstance(moe.deepspeed_moe.experts, Experts)
    experts = [n for n, p in moe.named_parameters() if is_moe_param(p)]
    assert experts == [f"deepspeed_moe.experts.deepspeed_experts.{i}.{w}" for i in range(2) for w in ("weight", "bias")]
    assert {p.group_name for p in moe.deepspeed_moe.experts.parameters()} == {"ep_size_2"}
    assert not is_moe_param(moe.deepspeed_moe.gate.wg.weight) and not is_moe_param(moe.mlp.weight)
    assert sorted(k for k in moe.state_dict() if "experts" not in k) == [
        "coefficient.bias",
        "coefficient.weight",
        "deepspeed_moe.gate.wg.weight",
        "mlp.bias",
        "mlp.weight",
    ]
    with pytest.raises(ValueError, match="num_experts=3 must be a positive multiple of ep_size=2"):
        MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=3, ep_size=2)
    with pytest.raises(NotImplementedError, match="use_tutel"):
        MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=2, use_tutel=True)
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        moe(torch.randn(8, HIDDEN))


# --- two ranks ---------------------------------------------------------------------------------


def _step(moe, x, target):
    moe.zero_grad()
    x = x.clone().requires_grad_(True)
    out, l_aux, counts = moe(x)
    ((out - target).square().sum() + 0.1 * l_aux).backward()
    return out.detach(), float(l_aux.detach()), counts.tolist(), x.grad


def _tokens(rank, n):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, HIDDEN, generator=g), torch.randn(n, HIDDEN, generator=g)


def _expert_parallel(cases):
    """For each (num_experts, ep_size, k, drop_tokens, tokens per rank): this rank's layer against
    the ep_size=1 layer run on every rank's tokens here."""
    import torch.distributed as dist

    from zerotrain.comm.distributed import init_distributed
    from zerotrain.topology import current

    init_distributed()
    rank = current().rank("data")
    world = current().size("data")
    failures = []
    for num_experts, ep_size, k, drop_tokens, counts in cases:
        full, local = _moe(num_experts, ep_size, k, drop_tokens, seed=num_experts + k)
        n_local = num_experts // ep_size
        ep_rank = current().expert_groups(ep_size).expert_rank
        x, target = _tokens(rank, counts[rank])
        out, l_aux, exp_counts, gx = _step(local, x, target)
        gate_grad = local.deepspeed_moe.gate.wg.weight.grad.clone()
        expert_grads = _grads(local.deepspeed_moe.experts)
        # experts: each rank's copy has its own tokens' gradient; summed over the expert-data group
        # (the ranks holding the same experts: the world at ep_size=1, this rank alone at ep_size=2)
        for grad in expert_grads.values():
            dist.all_reduce(grad, group=current().expert_groups(ep_size).expert_data_group)
        # the reference: every expert here, each rank's tokens in turn (the gate decides per rank)
        ref = []
        full.zero_grad()
        for r in range(world):
            xr, tr = _tokens(r, counts[r])
            xr.requires_grad_(True)
            o, la, c = full(xr)
            ((o - tr).square().sum() + 0.1 * la).backward()
            if r == rank:
                ref = (
                    o.detach(),
                    float(la.detach()),
                    c.tolist(),
                    xr.grad.clone(),
                    full.deepspeed_moe.gate.wg.weight.grad.clone(),
                )
        ref_out, ref_l_aux, ref_counts, ref_gx, _ = ref
        # the gate is dense: its gradient here is this rank's tokens only; summed over ranks it is the reference's
        summed = gate_grad.clone()
        dist.all_reduce(summed)
        label = f"E={num_experts} ep={ep_size} k={k} drop={drop_tokens} tokens={counts}"
        checks = [
            ("output", out, ref_out),
            ("input grad", gx, ref_gx),
            ("gate grad summed", summed, full.deepspeed_moe.gate.wg.weight.grad),
        ]
        for name, grad in expert_grads.items():
            index, rest = name.split(".", 2)[1], name.split(".", 2)[2]
            global_name = f"deepspeed_experts.{ep_rank * n_local + int(index)}.{rest}"
            checks.append((name, grad, dict(full.deepspeed_moe.experts.named_parameters())[global_name].grad))
        for what, got, want in checks:
            if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
                failures.append(f"{label}: {what} differs by {(got - want).abs().max().item():.3g}")
        if abs(l_aux - ref_l_aux) > 1e-6 or exp_counts != ref_counts:
            failures.append(f"{label}: l_aux {l_aux} vs {ref_l_aux}, counts {exp_counts} vs {ref_counts}")
        if len(expert_grads) != 4 * n_local:
            failures.append(f"{label}: {len(expert_grads)} expert gradients, expected {4 * n_local}")
    # a capacity-padded layer with different token counts per rank: an error on every rank, no hang
    _, local = _moe(2, 2, 1, True, seed=5)
    try:
        local(torch.randn(8 + 4 * rank, HIDDEN))
        failures.append("different token counts with drop_tokens=True did not raise")
    except ValueError as error:
        message = str(error)
        if "capacities differ" not in message or "drop_tokens=False" not in message or "\n" in message:
            failures.append(f"unclear message: {message}")
    return failures


CASES = [
    (2, 2, 1, True, (12, 12)),  # one expert per rank, top-1 with drops
    (2, 2, 2, True, (12, 12)),  # top-2 with drops
    (2, 2, 1, False, (12, 12)),  # dropless
    (2, 2, 2, False, (11, 5)),  # dropless, different token counts: uneven all-to-all
    (4, 2, 3, True, (10, 10)),  # two experts per rank, top-3
    (4, 2, 2, False, (9, 14)),  # two experts per rank, dropless, uneven
    (2, 1, 1, True, (12, 12)),  # ep_size=1 on two ranks: every expert local
    (4, 1, 2, False, (7, 12)),
]


def test_expert_parallel_equals_one_process():
    results = run_on_ranks(_expert_parallel, world_size=2, args=(CASES,), timeout=300, comm_timeout=60)
    assert results == [[], []], results
