"""DeepSpeed's Adam classes with its constructor arguments, on torch's Adam kernels (importable
from ``zerotrain.ops.adam``, DeepSpeed's path).

``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
weight_decay=0.0, amsgrad=False, set_grad_none=True)`` and ``DeepSpeedCPUAdam(model_params, lr=1e-3,
bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True,
fp32_optimizer_states=True)``.

Both are ``torch.optim.Adam`` subclasses (decoupled weight decay when ``adam_w_mode``) whose
groups also carry ``bias_correction``, and every group steps through torch's kernel: ``fused``
where torch has one for the device (CPU and CUDA; 6-8x faster than ``foreach`` on CPU, see
docs/compat.md), else torch's default. torch's Adam always corrects the bias, so a group with
``bias_correction=False`` is stepped with its learning rate, epsilon and decoupled decay rescaled
for the step ``t`` (``bc1 = 1 - b1**t``, ``bc2 = 1 - b2**t``):

    lr' = lr * bc1 / sqrt(bc2),  eps' = eps / sqrt(bc2),  wd' = wd * lr / lr'

which turns torch's ``p -= lr'/bc1 * m / (sqrt(v)/sqrt(bc2) + eps')`` (after
``p *= 1 - lr'*wd'``) into the uncorrected ``p -= lr * m / (sqrt(v) + eps)`` (after
``p *= 1 - lr*wd``). ``amsgrad`` uses the running maximum of ``v``; DeepSpeed's kernels reject it,
torch supports it, so do we.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adam import adam as adam_functional


def _fused_devices() -> list[str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def _pick_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """``fused=True`` when every parameter is a floating tensor on a device torch's fused Adam
    supports (fastest on CPU too: docs/compat.md), else torch's default (foreach)."""
    devices = _fused_devices()
    if params and all(p.is_floating_point() and p.device.type in devices for p in params):
        return {"fused": True}
    return {}


def _params_of(groups) -> list[torch.Tensor]:
    out = []
    for group in groups:
        out.extend(group["params"] if isinstance(group, dict) else [group])
    return out


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam`` (``from deepspeed.ops.adam import FusedAdam``) on torch's Adam.

    ``adam_w_mode=True`` (the default) decays weights decoupled, like AdamW; False adds
    ``weight_decay * p`` to the gradient (L2). ``bias_correction=False`` drops Adam's bias
    correction. ``set_grad_none`` makes ``zero_grad()`` set gradients to None (else zero them).
    ``amsgrad=True`` is supported (DeepSpeed's kernel raises for it).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ):
        params = list(params)
        if not params:
            raise ValueError("FusedAdam got an empty parameter list")
        # Given group dicts are kept, not copied (as torch optimizers do): accelerate builds
        # DeepSpeedCPUAdam(optimizer.param_groups) and keeps stepping its scheduler over those
        # dicts, so their "lr" must be the one this optimizer reads.
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        kernel = _pick_kernel(_params_of(groups))
        self._default_bias_correction = bool(bias_correction)  # read by add_param_group below
        self._kernel = kernel
        self.adam_w_mode = bool(adam_w_mode)
        super().__init__(
            groups,
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=bool(adam_w_mode),
            **kernel,
        )
        self.defaults["bias_correction"] = bool(bias_correction)
        self.set_grad_none = bool(set_grad_none)

    def add_param_group(self, param_group: dict) -> None:
        param_group.setdefault("bias_correction", self._default_bias_correction)
        # Optimizer-wide choices win over keys a group brings from another torch optimizer (its
        # lr, betas, eps, weight_decay, amsgrad are the group's own, as in DeepSpeed).
        param_group["decoupled_weight_decay"] = self.adam_w_mode
        if self._kernel.get("fused"):
            param_group["fused"], param_group["foreach"] = True, None
        else:
            param_group["fused"] = None
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Set gradients to None (``set_grad_none``, DeepSpeed's default) or to zero."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step for every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if not params:
                continue
            beta1, beta2 = group["betas"]
            kwargs = dict(
                amsgrad=group["amsgrad"],
                has_complex=has_complex,
                beta1=beta1,
                beta2=beta2,
                maximize=group["maximize"],
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
            lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if group["bias_correction"]:
                adam_functional(*lists, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], **kwargs)
                continue
            # Parameters that missed steps (no gradient) are at other step counts: one call each.
            counts = torch.stack([s.detach().reshape(()).float().cpu() for s in steps]).tolist()
            for count in sorted(set(counts)):
                chosen = [i for i, c in enumerate(counts) if c == count]
                lr, eps, wd = _uncorrected(
                    float(group["lr"]),
                    group["eps"],
                    group["weight_decay"],
                    group["decoupled_weight_decay"],
                    beta1,
                    beta2,
                    count + 1,
                )
                adam_functional(
                    *([x[i] for i in chosen] if x else x for x in lists), lr=lr, eps=eps, weight_decay=wd, **kwargs
                )
        return loss


def _uncorrected(
    lr: float, eps: float, weight_decay: float, decoupled: bool, beta1: float, beta2: float, step: float
) -> tuple[float, float, float]:
    """lr, eps and weight decay that make torch's bias-corrected step at ``step`` equal the
    uncorrected one (module docstring)."""
    bc1, sqrt_bc2 = 1 - beta1**step, math.sqrt(1 - beta2**step)
    lr_adjusted = lr * bc1 / sqrt_bc2
    if decoupled and lr_adjusted:
        weight_decay = weight_decay * lr / lr_adjusted
    return lr_adjusted, eps / sqrt_bc2, weight_decay


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` (its AVX kernel for offloaded optimizer states) on torch's
    fused CPU Adam. Parameters must be on the CPU, as DeepSpeed requires.

    ``adamw_mode`` (this class's spelling) selects decoupled weight decay.
    ``fp32_optimizer_states=False`` (keep moments in a 16-bit parameter's dtype) is not supported:
    torch keeps Adam's moments in the parameter's dtype always, so stepping 16-bit parameters with
    ``fp32_optimizer_states=True`` (the default) is refused too. Building it over 16-bit
    parameters is allowed (accelerate does, over a bf16 ``zero.Init`` model): handed to
    ``zerotrain.initialize``, the engine points its groups at fp32 master weights before any
    step, as DeepSpeed's engine does.
    """

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ):
        model_params = list(model_params)
        for p in _params_of(model_params):
            if p.device.type != "cpu":
                raise ValueError(
                    f"DeepSpeedCPUAdam: a parameter is on {p.device}, but this optimizer "
                    "steps on the CPU; use FusedAdam for accelerator parameters, or "
                    "zero_optimization.offload_optimizer to keep the states on the CPU"
                )
        if not fp32_optimizer_states:
            raise ValueError(
                "DeepSpeedCPUAdam: fp32_optimizer_states=False (16-bit moments) is not "
                "supported; leave it True (moments in fp32, the default)"
            )
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adamw_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            set_grad_none=True,
        )
        self.fp32_optimizer_states = True

    @torch.no_grad()
    def step(self, closure=None):
        """As FusedAdam's; every parameter stepped must be fp32 (see the class docstring)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dtype != torch.float32:
                    raise ValueError(
                        f"DeepSpeedCPUAdam: a parameter is {p.dtype}; it keeps fp32 moments "
                        "(fp32_optimizer_states) only for fp32 parameters here. Let "
                        "zerotrain.initialize take the optimizer (its engine steps fp32 master "
                        "weights for fp16/bf16 training), or use FusedAdam for 16-bit parameters"
                    )
        return super().step(closure)
