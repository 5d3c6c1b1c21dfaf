"""The Lion optimizer (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms")."""

import torch
from torch.optim import Optimizer


class Lion(Optimizer):
    """Lion: sign-of-interpolated-momentum updates with decoupled weight decay.

    Per step, for each parameter ``p`` with gradient ``g`` and momentum ``m``::

        p *= 1 - lr * weight_decay
        p -= lr * sign(beta1 * m + (1 - beta1) * g)
        m  = beta2 * m + (1 - beta2) * g

    Args:
        params: iterable of tensors or param-group dicts.
        lr (float): learning rate. Default 1e-4.
        betas (tuple[float, float]): interpolation (beta1) and momentum (beta2) factors.
            Default (0.9, 0.99).
        weight_decay (float): decoupled weight decay. Default 0.0.
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid betas: {betas}; expected two values in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param, group):
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError("Lion does not support sparse gradients")
        state = self.state[param]
        if not state:
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        exp_avg = state["exp_avg"]
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        update = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
        if group["weight_decay"] != 0:
            param.mul_(1.0 - lr * group["weight_decay"])
        param.add_(update, alpha=-lr)
        exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
