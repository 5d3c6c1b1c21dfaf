"""Expert parameters (``deepspeed.moe.utils`` re-exports these): tell expert parameters apart
and give them their own optimizer groups.

A parameter is an expert parameter when it carries ``allreduce = False`` (DeepSpeed's MoE layer
marks its experts so, with ``group_name`` naming their expert-parallel group; so does
zerotrain's, ``zerotrain.experts``). Without expert parameters every function returns its input's
groups unchanged; parameters marked by hand are split exactly as DeepSpeed splits them. ``initialize`` trains
expert parameters at every ZeRO stage, with or without NVMe offload (``expert_parameters`` checks
their ``ep_size_N`` names; ``zero.build_zero_stage`` shards and reduces them over their
expert-data-parallel group) and refuses them where that is not supported yet
(``refuse_unsupported_experts``: pipelines).
"""

from __future__ import annotations

import re
from typing import Any

import torch

# DeepSpeed's default cap on the elements of one expert optimizer group.
DEFAULT_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (``param.allreduce`` is False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """``(shared, expert)`` lists, keeping the order of ``params``."""
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """The gradients of ``group``'s parameters (those that have one) as ``(shared, expert)``,
    each cast to its parameter's dtype."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_different_moe_groups_for_optimizer(
    param_groups, max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE
) -> list[dict[str, Any]]:
    """Move expert parameters out of each group into groups of their own, one per (group, expert
    group name), marked ``"moe": True`` and holding at most ``max_group_size`` elements each.

    ``param_groups`` is a dict, a tuple or a list of group dicts (DeepSpeed's accepted forms);
    the result is a list. Without expert parameters it holds the same groups, unchanged. Groups
    that hold expert parameters need a ``"name"`` (DeepSpeed keys the new groups by it).
    """
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups must be a dict or a list/tuple of dicts, got {type(param_groups).__name__}")
    expert_groups: list[dict[str, Any]] = []
    for group in param_groups:
        by_name: dict[str, list] = {}
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
            else:
                dense.append(p)
        if not by_name:
            continue
        if "name" not in group:
            raise ValueError(
                "a param group holding expert parameters needs a 'name' key "
                "(e.g. {'params': ..., 'name': 'dense-params'})"
            )
        group["params"] = dense
        for name, params in by_name.items():
            template = {**group, "name": name, "moe": True}
            for chunk in _chunks(params, max_group_size):
                expert_groups.append({**template, "params": chunk})
    return param_groups + expert_groups


def _chunks(params: list, max_numel) -> list[list]:
    if max_numel is None:
        return [params]
    chunks, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > max_numel:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    return chunks + [current] if current else chunks


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]]:
    """Param groups ready for an optimizer: a list of parameters becomes one ``dense-params``
    group and is split; a list of groups is split unless it already has MoE groups."""
    if not isinstance(model_parameters, list) or not model_parameters:
        raise TypeError("model_parameters must be a non-empty list of parameters or param-group dicts")
    if isinstance(model_parameters[0], dict):
        if any("moe" in g for g in model_parameters):
            return model_parameters
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})


def expert_markers(param: torch.Tensor) -> str | None:
    """DeepSpeed's expert markers on ``param`` as ``"allreduce=False, group_name='ep_size_2'"``
    (whichever it carries), or None for an ordinary parameter."""
    found = []
    if hasattr(param, "allreduce") and not param.allreduce:
        found.append("allreduce=False")
    if hasattr(param, "group_name"):
        found.append(f"group_name={param.group_name!r}")
    return ", ".join(found) or None


_GROUP_NAME = re.compile(r"ep_size_([1-9][0-9]*)")


def expert_ep_size(name: str, param: torch.Tensor, data_size: int) -> int:
    """The expert-parallel size N of expert parameter ``name`` (its ``group_name``
    ``"ep_size_N"``), or a one-line ValueError naming it when the name is missing, malformed or N
    does not divide the data-parallel size."""
    group_name = getattr(param, "group_name", None)
    if group_name is None:
        raise ValueError(
            f"parameter {name!r} has allreduce=False but no group_name: set "
            "param.group_name = 'ep_size_N' (N: the expert-parallel size)"
        )
    match = _GROUP_NAME.fullmatch(str(group_name))
    if match is None:
        raise ValueError(
            f"parameter {name!r}: group_name={group_name!r} is not of the form 'ep_size_N' "
            "(N: the expert-parallel size, as deepspeed.moe names its groups)"
        )
    ep_size = int(match.group(1))
    if data_size % ep_size:
        raise ValueError(
            f"parameter {name!r}: group_name={group_name!r} needs ep_size {ep_size} to divide "
            f"the data-parallel size {data_size}; pick an ep_size that divides it"
        )
    return ep_size


def expert_parameters(model: torch.nn.Module, data_size: int) -> dict[str, int]:
    """``{name: ep_size}`` for every trainable expert parameter of ``model`` (``allreduce`` False;
    a ``group_name`` alone is DeepSpeed's dense parameter), checked by ``expert_ep_size``."""
    return {
        name: expert_ep_size(name, p, data_size)
        for name, p in model.named_parameters()
        if p.requires_grad and is_moe_param(p)
    }


def refuse_unsupported_experts(experts: dict[str, int], model: torch.nn.Module, pipeline: bool) -> None:
    """A one-line NotImplementedError naming the first expert parameter where experts are not
    supported yet: a ``PipelineModule`` (every ZeRO stage and NVMe offload take them)."""
    if not experts or not pipeline:
        return
    name = next(iter(experts))
    markers = expert_markers(dict(model.named_parameters())[name])
    raise NotImplementedError(
        f"parameter {name!r} carries DeepSpeed's expert markers ({markers}): expert "
        "parameters in a PipelineModule are not supported yet; train the MoE model "
        "without pipelining (any ZeRO stage)"
    )
