"""zerotrain.ops.adam (DeepSpeed's FusedAdam / DeepSpeedCPUAdam) against Adam's formula."""

from __future__ import annotations

import copy

import pytest
import torch

from zerotrain.ops.adam import DeepSpeedCPUAdam, FusedAdam


def reference_adam(p, grads, lr, betas, eps, wd, adam_w_mode, bias_correction, amsgrad):
    """Adam written out in float64, one step per gradient in ``grads``."""
    p = p.double().clone()
    m, v, vmax = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if wd and adam_w_mode:
            p = p * (1 - lr * wd)
        elif wd:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = torch.maximum(vmax, v)
        second = vmax if amsgrad else v
        if bias_correction:
            m_hat, v_hat = m / (1 - b1**t), second / (1 - b2**t)
        else:
            m_hat, v_hat = m, second
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


def _run(optimizer_cls, groups_kwargs, steps=6, **kwargs):
    torch.manual_seed(0)
    params = [torch.randn(37, requires_grad=True), torch.randn(5, 3, requires_grad=True)]
    grads = [[torch.randn_like(p) * 0.1 for _ in range(steps)] for p in params]
    start = [p.detach().clone() for p in params]
    groups = [{"params": [p], **gk} for p, gk in zip(params, groups_kwargs)]
    opt = optimizer_cls(groups, **kwargs)
    for s in range(steps):
        for p, g in zip(params, grads):
            p.grad = g[s].clone()
        opt.step()
    return opt, params, start, grads


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_adam_matches_the_formula(bias_correction, adam_w_mode, amsgrad):
    betas, eps, wd = (0.8, 0.95), 1e-6, 0.05
    group_lrs = [1e-2, 3e-3]  # per-group lr, as param groups allow
    opt, params, start, grads = _run(
        FusedAdam,
        [{"lr": lr} for lr in group_lrs],
        bias_correction=bias_correction,
        adam_w_mode=adam_w_mode,
        amsgrad=amsgrad,
        betas=betas,
        eps=eps,
        weight_decay=wd,
    )
    for p, p0, g, lr in zip(params, start, grads, group_lrs):
        expected = reference_adam(p0, g, lr, betas, eps, wd, adam_w_mode, bias_correction, amsgrad)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
        # The two formulas differ enough that mixing them up fails the check above.
        other = reference_adam(p0, g, lr, betas, eps, wd, adam_w_mode, not bias_correction, amsgrad)
        assert (other - expected).abs().max() > 1e-3


def test_bias_correction_can_differ_per_group():
    opt, params, start, grads = _run(FusedAdam, [{"bias_correction": False}, {}], lr=1e-2)
    for p, p0, g, corrected in zip(params, start, grads, (False, True)):
        expected = reference_adam(p0, g, 1e-2, (0.9, 0.999), 1e-8, 0.0, True, corrected, False)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)


def test_defaults_kernel_and_zero_grad():
    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([p])
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert group["bias_correction"] and group["decoupled_weight_decay"] and opt.adam_w_mode
    assert group["fused"]  # torch's fused CPU kernel: the fastest here (docs/compat.md)
    p.grad = torch.ones(4)
    opt.zero_grad()
    assert p.grad is None
    keep = FusedAdam([p], set_grad_none=False)
    p.grad = torch.ones(4)
    keep.zero_grad()
    assert torch.equal(p.grad, torch.zeros(4))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert opt.param_groups[1]["bias_correction"] is True


def test_state_dict_round_trip_continues_identically():
    _, params, _, _ = _run(FusedAdam, [{}, {}], steps=2, bias_correction=False)
    opt = FusedAdam([{"params": params}], lr=1e-2, bias_correction=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    clone = [p.detach().clone().requires_grad_() for p in params]
    restored = FusedAdam([{"params": clone}], lr=1e-2, bias_correction=False)
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch shares tensors otherwise
    for a, b in zip(params, clone):
        a.grad, b.grad = torch.full_like(a, 0.5), torch.full_like(b, 0.5)
    opt.step()
    restored.step()
    for a, b in zip(params, clone):
        assert torch.equal(a.detach(), b.detach())


def test_cpu_adam_takes_deepspeeds_arguments():
    betas, wd = (0.9, 0.99), 0.1
    opt, params, start, grads = _run(
        DeepSpeedCPUAdam, [{}, {}], lr=5e-3, betas=betas, weight_decay=wd, adamw_mode=False, bias_correction=False
    )
    for p, p0, g in zip(params, start, grads):
        expected = reference_adam(p0, g, 5e-3, betas, 1e-8, wd, False, False, False)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="fp32_optimizer_states=False"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))], fp32_optimizer_states=False)
    # Built over 16-bit parameters (accelerate does, over a bf16 zero.Init model; the engine then
    # points the groups at fp32 masters); stepping them is refused, naming what to do.
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = DeepSpeedCPUAdam([half])
    half.grad = torch.ones_like(half)
    with pytest.raises(ValueError, match="bfloat16.*zerotrain.initialize"):
        opt.step()


def test_uncorrected_group_with_parameters_at_different_steps():
    # The second parameter has no gradient at step 2, so the two are then one step apart.
    torch.manual_seed(1)
    a, b = torch.randn(6, requires_grad=True), torch.randn(4, requires_grad=True)
    a0, b0 = a.detach().clone(), b.detach().clone()
    grads_a = [torch.randn(6) for _ in range(4)]
    grads_b = [torch.randn(4) for _ in range(4)]
    opt = FusedAdam([a, b], lr=1e-2, bias_correction=False, weight_decay=0.1)
    for s in range(4):
        a.grad = grads_a[s].clone()
        b.grad = None if s == 1 else grads_b[s].clone()
        opt.step()
    expected_b = reference_adam(
        b0, [g for s, g in enumerate(grads_b) if s != 1], 1e-2, (0.9, 0.999), 1e-8, 0.1, True, False, False
    )
    torch.testing.assert_close(b.detach().double(), expected_b, rtol=1e-5, atol=1e-6)
    expected_a = reference_adam(a0, grads_a, 1e-2, (0.9, 0.999), 1e-8, 0.1, True, False, False)
    torch.testing.assert_close(a.detach().double(), expected_a, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # the AdamW never steps
@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
def test_given_param_groups_are_shared_as_torch_optimizers_do(cls):
    # accelerate: DeepSpeedCPUAdam(torch_optimizer.param_groups, ...) and then a scheduler built
    # over the torch optimizer keeps writing "lr" into those group dicts (issue 29 item 1).
    torch.manual_seed(0)
    a, b = torch.randn(5, requires_grad=True), torch.randn(3, requires_grad=True)
    a0, b0 = a.detach().clone(), b.detach().clone()
    original = torch.optim.AdamW(
        [{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=1e-2, betas=(0.8, 0.99)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(original, lambda step: [0.0, 1.0, 0.5][min(step, 2)])
    kwargs = {"adamw_mode": True} if cls is DeepSpeedCPUAdam else {"adam_w_mode": True}
    opt = cls(original.param_groups, lr=1e-2, weight_decay=0.1, **kwargs)
    assert all(mine is theirs for mine, theirs in zip(opt.param_groups, original.param_groups))
    used, grads = [], [[torch.randn(5), torch.randn(3)] for _ in range(3)]
    for step in range(3):
        a.grad, b.grad = grads[step][0].clone(), grads[step][1].clone()
        used.append([g["lr"] for g in opt.param_groups])
        opt.step()
        scheduler.step()
    assert used == [[0.0, 0.0], [1e-2, 1e-2], [5e-3, 5e-3]]
    # Each group keeps its own betas / weight decay; the lr schedule applies per step.
    for p, p0, g, wd in ((a, a0, [x[0] for x in grads], 0.1), (b, b0, [x[1] for x in grads], 0.0)):
        expected = p0.double()
        m = v = torch.zeros_like(expected)
        for t, (lr, grad) in enumerate(zip([0.0, 1e-2, 5e-3], g), start=1):
            grad = grad.double()
            expected = expected * (1 - lr * wd)
            m, v = 0.8 * m + 0.2 * grad, 0.99 * v + 0.01 * grad * grad
            expected = expected - lr * (m / (1 - 0.8**t)) / ((v / (1 - 0.99**t)).sqrt() + 1e-8)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-7)
