"""Lion against a plain-Python reference implementation."""

import random

import pytest
import torch

from zerotrain.optim import Lion


def sign(x):
    return (x > 0) - (x < 0)


def reference_lion(values, grads_per_step, lr, beta1, beta2, weight_decay):
    """Element-wise Lion on Python floats, straight from the paper's pseudo-code."""
    params, momentum = list(values), [0.0] * len(values)
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            direction = sign(beta1 * momentum[i] + (1 - beta1) * g)
            params[i] = params[i] * (1 - lr * weight_decay) - lr * direction
            momentum[i] = beta2 * momentum[i] + (1 - beta2) * g
    return params, momentum


def random_values(rng, count):
    return [rng.uniform(-1, 1) for _ in range(count)]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_matches_reference_over_several_steps(weight_decay):
    rng = random.Random(0)
    settings = [dict(lr=0.01, betas=(0.9, 0.99)), dict(lr=0.003, betas=(0.8, 0.95))]
    start = [random_values(rng, 6), random_values(rng, 4)]
    grads = [[random_values(rng, len(values)) for _ in range(7)] for values in start]
    # Exact zeros exercise sign(0) = 0 (no step, decay only) in both implementations.
    grads[0][0][:2] = [0.0, 0.0]

    tensors = [torch.nn.Parameter(torch.tensor(v, dtype=torch.float64)) for v in start]
    groups = [{"params": [t], **s} for t, s in zip(tensors, settings)]
    optimizer = Lion(groups, weight_decay=weight_decay)
    for step in range(7):
        for t, g in zip(tensors, grads):
            t.grad = torch.tensor(g[step], dtype=torch.float64)
        optimizer.step()

    for t, values, g, s in zip(tensors, start, grads, settings):
        want_p, want_m = reference_lion(values, g, s["lr"], *s["betas"], weight_decay)
        assert t.detach().tolist() == pytest.approx(want_p, abs=1e-12)
        assert optimizer.state[t]["exp_avg"].tolist() == pytest.approx(want_m, abs=1e-12)


def test_lion_defaults_and_validation():
    optimizer = Lion([torch.nn.Parameter(torch.zeros(1))])
    assert {k: optimizer.defaults[k] for k in ("lr", "betas", "weight_decay")} == {
        "lr": 1e-4,
        "betas": (0.9, 0.99),
        "weight_decay": 0.0,
    }
    for bad in ({"lr": -1.0}, {"betas": (0.9, 1.0)}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError):
            Lion([torch.nn.Parameter(torch.zeros(1))], **bad)


def test_lion_closure_skips_params_without_grad_and_round_trips_state():
    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = Lion([used, unused], lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = (used * torch.tensor([1.0, -1.0])).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 0.0
    assert used.tolist() == pytest.approx([0.9, 1.1]) and unused.tolist() == [1.0, 1.0]
    restored = Lion([torch.nn.Parameter(used.detach().clone()), torch.nn.Parameter(torch.ones(2))], lr=0.1)
    restored.load_state_dict(optimizer.state_dict())
    assert restored.state[restored.param_groups[0]["params"][0]]["exp_avg"].tolist() == pytest.approx([0.01, -0.01])


def test_lion_rejects_sparse_gradients():
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Lion([param]).step()
