"""DeepSpeed's gates (zerotrain.experts.gating, re-exported as zerotrain.moe.sharded_moe) against a
straightforward reference written here from DeepSpeed's definitions (docs/moe.md): capacity
``max(ceil(S / E * k * capacity_factor), min_capacity)``, which tokens each expert keeps, slots,
combine weights, ``l_aux`` and ``exp_counts``; deterministic mode (no random token selection, no
noise, no second-expert sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from zerotrain.experts.gating import TopKGate, capacity, top1gating, top2gating, topkgating


def _reference(logits, k, capacity_factor, min_capacity, drop_tokens=True, drop_policy="probs"):
    """Loops over tokens and experts: DeepSpeed's gating spelled out."""
    gates = torch.softmax(logits.double(), dim=1)
    S, E = gates.shape
    if k == 1:
        choices = [[int(gates[s].argmax())] for s in range(S)]
    elif k == 2:
        choices = []
        for s in range(S):
            first = int(gates[s].argmax())
            rest = gates[s].clone()
            rest[first] = -1
            choices.append([first, int(rest.argmax())])
    else:
        choices = [sorted(range(E), key=lambda e: -float(gates[s, e]))[:k] for s in range(S)]
    exp_counts = [sum(e in c for c in choices) for e in range(E)]
    if drop_tokens:
        cap = max(math.ceil(S / E * capacity_factor * k), min_capacity)
    else:
        cap = max(exp_counts) if k > 1 else min(max(exp_counts), S)

    # Slots: top-1/top-k fill in token order; top-2 puts every second choice after all first ones.
    slot = {}
    kept = set()
    for e in range(E):
        if k == 2:
            order = [(s, 0) for s in range(S) if choices[s][0] == e] + [(s, 1) for s in range(S) if choices[s][1] == e]
            for position, (s, _r) in enumerate(order):
                if position < cap:
                    kept.add((s, e))
                    slot[(s, e)] = position
        else:
            tokens = [s for s in range(S) if e in choices[s]]
            if k > 2 and drop_policy == "probs":
                keep = set(sorted(tokens, key=lambda s: -float(gates[s, e]))[:cap])
            elif k == 1:
                # Without random token selection DeepSpeed keeps torch.topk of the expert's 0/1
                # column: which of the equal entries it returns is torch's choice, not the first ones.
                column = torch.tensor([int(choices[s][0] == e) for s in range(S)])
                keep = {int(i) for i in torch.topk(column, k=min(cap, S)).indices if column[i]}
            else:  # 'position': the first ones
                keep = set(tokens[:cap])
            for position, s in enumerate(sorted(keep)):
                kept.add((s, e))
                slot[(s, e)] = position
    combine = torch.zeros(S, E, cap, dtype=torch.float64)
    for s in range(S):
        mine = [e for e in choices[s] if (s, e) in kept]
        denom = 1.0 if k == 1 else max(sum(float(gates[s, e]) for e in mine), torch.finfo(torch.float32).eps)
        for e in mine:
            combine[s, e, slot[(s, e)]] = float(gates[s, e]) / denom

    me = gates.mean(0)
    if k == 1:
        ce = torch.tensor([sum(c[0] == e for c in choices) / S for e in range(E)], dtype=torch.float64)
        l_aux = float((me * ce).sum() * E)
    elif k == 2:
        ce = torch.tensor([sum(c[0] == e for c in choices) / S for e in range(E)], dtype=torch.float64)
        l_aux = float((me * ce).mean() * E * E)
    else:
        ce = torch.tensor([exp_counts[e] / S for e in range(E)], dtype=torch.float64)
        l_aux = float((me * ce).mean() * E * E / k)
    return l_aux, combine, exp_counts, cap


def _gate(logits, k, cf, min_cap, drop_tokens=True, drop_policy="probs"):
    if k == 1:
        return top1gating(logits, cf, min_cap, drop_tokens=drop_tokens, use_rts=False)
    if k == 2:
        return top2gating(logits, cf, min_cap, drop_tokens=drop_tokens, top2_2nd_expert_sampling=False)
    return topkgating(logits, k, cf, min_cap, drop_tokens=drop_tokens, drop_policy=drop_policy)


CASES = [
    (k, cf, min_cap, S, E)
    for k in (1, 2, 3)
    for (cf, min_cap, S, E) in [(1.0, 1, 20, 4), (0.5, 0, 24, 6), (0.3, 2, 17, 5), (2.0, 4, 12, 4)]
]


@pytest.mark.parametrize("k,cf,min_cap,S,E", CASES)
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_gating_equals_reference(k, cf, min_cap, S, E, drop_tokens):
    torch.manual_seed(1000 * k + S + E)
    logits = torch.randn(S, E) * 2
    l_aux, combine, dispatch, counts = _gate(logits, k, cf, min_cap, drop_tokens)
    ref_l_aux, ref_combine, ref_counts, ref_cap = _reference(logits, k, cf, min_cap, drop_tokens)
    assert combine.shape == (S, E, ref_cap)
    torch.testing.assert_close(combine.double(), ref_combine, atol=1e-6, rtol=0)
    assert torch.equal(dispatch, ref_combine > 0)
    assert counts.tolist() == ref_counts
    assert float(l_aux) == pytest.approx(ref_l_aux, abs=1e-6)
    if drop_tokens:
        # the drops are real: some case per k loses tokens, and no kept token is lost by dispatch
        assert int(dispatch.sum()) == sum(1 for s in range(S) for e in range(E) if ref_combine[s, e].sum() > 0)
    else:
        assert int(dispatch.sum()) == k * S  # dropless: every route kept


def test_cases_drop_tokens():
    # The parameter grid above really exercises capacity drops for every k.
    for k in (1, 2, 3):
        dropped = 0
        for kk, cf, min_cap, S, E in CASES:
            if kk != k:
                continue
            torch.manual_seed(1000 * k + S + E)
            logits = torch.randn(S, E) * 2
            dropped += k * S - int(_gate(logits, k, cf, min_cap)[2].sum())
        assert dropped > 0, k


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_topk_drop_policies(policy):
    torch.manual_seed(7)
    logits = torch.randn(30, 5)
    _, combine, _, _ = topkgating(logits, 3, 0.4, 0, drop_policy=policy)
    _, ref, _, _ = _reference(logits, 3, 0.4, 0, drop_policy=policy)
    torch.testing.assert_close(combine.double(), ref, atol=1e-6, rtol=0)


def test_capacity_is_deepspeeds():
    assert capacity(20, 4, 1.0, 1) == 5
    assert capacity(20, 4, 1.0, 8) == 8
    assert capacity(17, 5, 0.6, 0) == 3  # ceil(2.04)
    assert capacity(24, 6, 2 * 0.5, 0) == 4


def test_sparse_routes_match_dense():
    torch.manual_seed(3)
    logits = torch.randn(16, 4)
    for k in (1, 2, 3):
        fn = {
            1: lambda **kw: top1gating(logits, 0.5, 0, use_rts=False, **kw),
            2: lambda **kw: top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False, **kw),
            3: lambda **kw: topkgating(logits, 3, 0.5, 0, **kw),
        }[k]
        l_aux, combine, _, counts = fn()
        l2, cap, E, idx, loc, gates, counts2 = fn(sparse_routes=True)
        assert idx.shape == (k, 16) and idx.dtype == torch.int32 and E == 4 and cap == combine.shape[2]
        rebuilt = torch.zeros_like(combine)
        for r in range(k):
            for s in range(16):
                if idx[r, s] >= 0:
                    rebuilt[s, idx[r, s], loc[r, s]] += gates[r, s]
        torch.testing.assert_close(rebuilt, combine)
        assert torch.equal(counts, counts2) and float(l2) == float(l_aux)


def test_gate_module_eval_capacity_and_bad_input():
    torch.manual_seed(0)
    gate = TopKGate(8, 4, k=1, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0, use_rts=False)
    x = torch.randn(16, 8)
    assert gate(x)[1].shape[2] == 2  # ceil(16 / 4 * 0.5)
    gate.eval()
    assert gate(x)[1].shape[2] == 8  # eval_capacity_factor
    logits = torch.nn.functional.linear(x, gate.wg.weight)
    torch.testing.assert_close(gate(x)[1], top1gating(logits, 2.0, 0, use_rts=False)[1])
    with pytest.raises(ValueError, match="min_capacity=32"):
        top1gating(torch.randn(16, 4), 1.0, 32)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(8, 4, noisy_gate_policy="Gaussian")
    with pytest.raises(NotImplementedError, match="use_tutel"):
        top1gating(torch.randn(16, 4), 1.0, 0, use_tutel=True)


def test_gate_gradient_flows_through_combine_weights():
    torch.manual_seed(1)
    logits = torch.randn(12, 3, requires_grad=True)
    _, combine, _, _ = top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False)
    (combine * torch.randn_like(combine)).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


# --- Against DeepSpeed 0.19.8 itself -------------------------------------------------------------
# The cases (logits, gate, arguments, torch seed before the call) are in deepspeed_gating_cases.py;
# the values in deepspeed_gating_expected.py are what DeepSpeed 0.19.8 (torch 2.13.0 CPU) returned, written by
#     DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/experts/deepspeed_gating_cases.py \
#         > tests/experts/deepspeed_gating_expected.py
# Random token selection, RSample and top-2's second-expert sampling draw from torch's generator in
# the same order in both libraries, so the seeded cases are reproducible.
from tests.experts.deepspeed_gating_expected import DEEPSPEED_CASES  # noqa: E402


@pytest.mark.parametrize("name", sorted(DEEPSPEED_CASES))
def test_gating_equals_deepspeed(name):
    from tests.experts.deepspeed_gating_cases import CASES, logits_of

    gate, S, E, kwargs, seed = CASES[name]
    kwargs = dict(kwargs)
    if "used_token" in kwargs:
        kwargs["used_token"] = torch.tensor(kwargs["used_token"])
    if seed is not None:
        torch.manual_seed(seed)
    fn = {"top1": top1gating, "top2": top2gating, "topk": topkgating}[gate]
    l_aux, combine, dispatch, counts = fn(torch.tensor(logits_of(name, S, E)), **kwargs)
    want = DEEPSPEED_CASES[name]
    assert combine.shape == (S, E, want["capacity"])
    assert counts.tolist() == want["exp_counts"]
    assert float(l_aux) == pytest.approx(want["l_aux"], rel=1e-6)
    assert dispatch.nonzero().tolist() == want["dispatch"]
    expected = torch.zeros(S, E, want["capacity"])
    for s, e, c, w in want["combine"]:
        expected[s, e, c] = w
    torch.testing.assert_close(combine, expected, atol=1e-6, rtol=0)


def test_deepspeed_cases_drop_tokens():
    # the capacity cases really drop routes (dispatch has fewer entries than k * S) and the
    # dropless ones keep them all
    from tests.experts.deepspeed_gating_cases import CASES

    for name, (gate, S, _E, kwargs, _) in CASES.items():
        k = {"top1": 1, "top2": 2}.get(gate, kwargs.get("k"))
        routes = k * (sum(kwargs["used_token"]) if "used_token" in kwargs else S)
        kept = len(DEEPSPEED_CASES[name]["dispatch"])
        if kwargs.get("drop_tokens", True) is False:
            assert kept == routes, name
        elif "drops" in name or "rsample" in name:
            assert kept < routes, name
