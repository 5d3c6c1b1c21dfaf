"""DeepSpeed's ``"optimizer": {"type": "Muon"}``: Muon on hidden matrices, AdamW on the rest.

A parameter with at least 2 dimensions whose name holds neither "embed" nor "lm_head" gets Muon
(``param.use_muon``, DeepSpeed's rule); the others AdamW. Groups are named ``muon-params`` and
``adam-params`` (``groupN-...`` when the caller passed several groups).

Muon's update orthogonalizes each parameter's whole momentum matrix (Newton-Schulz), so it cannot
run on a flat shard alone. Under ZeRO the momentum stays sharded (its update is elementwise) and
ZeRO's ``ZeroStage`` attaches a ``full_matrix`` function to each Muon shard (``attach_full_matrix``):
it all-gathers the unit's pre-orthogonalization update, orthogonalizes every matrix in it and
returns this rank's slice. On whole 2-D parameters (fp32 stage 0) the update is orthogonalized in
place. Both paths run the same arithmetic, so a sharded run equals an unsharded one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
CONFIG_KEYS = set(MUON_KEYS + ADAM_KEYS) | {"muon_lr", "adam_lr", "per_head_muon"}
# Each half's defaults where neither the config nor the group sets a value (DeepSpeed's).
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule: matrices (>= 2 dims) outside embeddings and the output head."""
    lowered = name.lower()
    return param.dim() >= 2 and "embed" not in lowered and "lm_head" not in lowered


def _standard(x: torch.Tensor, steps: int) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz on a wide matrix, in bf16 (torch.optim.Muon's)."""
    a, b, c = NS_COEFFICIENTS
    x = x.bfloat16()
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def _gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The same polynomial iterated on the small Gram matrix R = X X^T (n x n) instead of X
    (n x m), with one restart, in fp32: fewer FLOPs on wide matrices, same result up to rounding."""
    a, b, c = NS_COEFFICIENTS
    x = x.float()
    x = x / x.norm().clamp(min=1e-7)
    n, m = x.shape
    if m <= n:  # no saving on square matrices: the standard iteration, in fp32
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x
    restart = 2
    r, q = x @ x.mT, None
    for i in range(steps):
        if i == restart:
            x, q = q @ x, None
            r = x @ x.mT
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal().add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return q @ x


def orthogonalize(update: torch.Tensor, method: str) -> tuple[torch.Tensor, float]:
    """Newton-Schulz orthogonalization of a matrix (more dims are flattened after the first),
    in ``update``'s dtype, and its learning-rate factor sqrt(max(1, rows/cols)) (so updates of tall
    and wide matrices have the same RMS; applied as ``alpha``, as torch.optim.Muon does)."""
    shape = update.shape
    g = update.reshape(shape[0], -1)
    tall = g.size(0) > g.size(1)
    x = g.mT if tall else g
    x = (_gram if method == "gram" else _standard)(x, NS_STEPS)
    x = x.mT if tall else x
    scale = math.sqrt(g.size(0) / g.size(1)) if tall else 1.0
    return x.to(update.dtype).reshape(shape), scale


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon (nesterov momentum, orthogonalized) on groups with ``use_muon``, torch's AdamW on the
    others (its fused kernel where the parameters allow; it shares this optimizer's state)."""

    def __init__(self, param_groups: list[dict]):
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError('MuonWithAuxAdam: every param group needs "use_muon": True or False')
            for key, value in (MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS).items():
                group.setdefault(key, value)
            if group["use_muon"] and group["ns_method"] not in NS_METHODS:
                raise ValueError(
                    f"optimizer Muon: ns_method {group['ns_method']!r}; use one of {', '.join(NS_METHODS)}"
                )
            if not group["use_muon"]:
                group["betas"] = tuple(group["betas"])
        super().__init__(param_groups, {})
        self._full_matrix: dict[int, Callable] = {}
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adam = None
        if adam_groups:
            params = [p for g in adam_groups for p in g["params"]]
            fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
            self._adam = torch.optim.AdamW([dict(g) for g in adam_groups], fused=fused or None)
            for group, own in zip(adam_groups, self._adam.param_groups):
                for key, value in own.items():
                    group.setdefault(key, value)

    def attach_full_matrix(self, shard: torch.Tensor, full_matrix: Callable):
        """``full_matrix(update_shard, ns_method)`` -> ``(orthogonalized update sliced like the
        shard, [(start, numel, lr factor)] of each matrix's piece in it)`` (``ZeroStage``'s;
        zero/muon_shards.py)."""
        self._full_matrix[id(shard)] = full_matrix

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
        if self._adam is not None:
            # The AdamW sees this optimizer's groups and state (a changed lr reaches it).
            self._adam.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adam.state = self.state
            self._adam.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        # Every parameter is stepped, a missing gradient as zeros: under ZeRO each step issues
        # the same all-gathers on every rank.
        beta, lr = group["momentum"], group["lr"]
        for p in group["params"]:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - beta)
            update = grad.lerp(buf, beta)  # nesterov
            full_matrix = self._full_matrix.get(id(p))
            if full_matrix is not None:  # a flat shard: (start, numel, factor) per matrix piece
                update, pieces = full_matrix(update, group["ns_method"])
            elif p.dim() >= 2:
                update, scale = orthogonalize(update, group["ns_method"])
                pieces = [(0, p.numel(), scale)]
            else:
                raise RuntimeError(
                    "Muon got a 1-D tensor with no full-matrix function: a flat shard "
                    "ZeRO did not register (attach_full_matrix)"
                )
            p.mul_(1 - lr * group["weight_decay"])
            flat_p, flat_u = p.view(-1), update.reshape(-1)
            for start, numel, scale in pieces:
                flat_p.narrow(0, start, numel).add_(flat_u.narrow(0, start, numel), alpha=-lr * scale)


def build_muon(params, named_parameters, opt_params: dict) -> MuonWithAuxAdam:
    """The config's Muon: ``params`` (tensors or group dicts) split into Muon and AdamW halves by
    ``uses_muon`` (tagged as ``param.use_muon``); ``muon_lr``/``adam_lr`` override ``lr`` per half,
    a group's own values override both."""
    kwargs = dict(opt_params or {})
    unknown = sorted(set(kwargs) - CONFIG_KEYS)
    if unknown:
        raise ValueError(f"optimizer Muon: unknown parameter(s) {unknown}; known: {sorted(CONFIG_KEYS)}")
    if kwargs.get("per_head_muon"):
        raise NotImplementedError(
            "optimizer.params.per_head_muon: per-head orthogonalization of attention "
            "projections is not implemented; remove it (each matrix is orthogonalized whole)"
        )
    names = {id(p): n for n, p in named_parameters}
    items = list(params)
    groups = [dict(g) for g in items if isinstance(g, dict)]
    loose = [p for p in items if not isinstance(p, dict)]
    if loose or not groups:
        groups.append({"params": loose})
    halves = ((True, "muon", MUON_KEYS, "muon_lr"), (False, "adam", ADAM_KEYS, "adam_lr"))
    out = []
    for index, group in enumerate(groups):
        trainable = [p for p in group["params"] if p.requires_grad]
        for p in trainable:
            if id(p) not in names:
                raise ValueError(
                    "optimizer Muon: a parameter in model_parameters is not one of the model's; "
                    "Muon picks each parameter's half by its name in the model"
                )
            p.use_muon = uses_muon(names[id(p)], p)
        for use_muon, label, keys, lr_key in halves:
            half = [p for p in trainable if p.use_muon is use_muon]
            if not half:
                continue
            settings = {k: kwargs[k] for k in keys if k in kwargs}
            if lr_key in kwargs:
                settings["lr"] = kwargs[lr_key]
            settings.update({k: v for k, v in group.items() if k in keys})
            prefix = group.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append(dict(params=half, use_muon=use_muon, name=name, **settings))
    return MuonWithAuxAdam(out)
