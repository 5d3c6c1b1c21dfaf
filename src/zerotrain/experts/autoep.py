"""DeepSpeed's AutoEP config section, ``"expert_parallel": {"enabled": true, "autoep_size": N}``:
``zerotrain.initialize`` spreads the fused experts of a Hugging Face MoE model over ``N`` ranks
with ``zerotrain.experts.expert_parallel`` (docs/moe.md).

DeepSpeed (``deepspeed/module_inject/auto_ep_config.py``) swaps each MoE block for its own
router and grouped-GEMM experts and takes many options for that. zerotrain keeps HF's block and
router and finds the fused experts modules by class, so only ``enabled`` and ``autoep_size`` mean
something here; DeepSpeed's other keys pass at their DeepSpeed default and raise otherwise,
naming them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# DeepSpeed 0.19.8's parse_autoep_config defaults of the keys zerotrain does not implement.
_DEEPSPEED_DEFAULTS = {
    "expert_tensor_parallel_size": 1,
    "validate_folding_routing": False,
    "async_split_plan": False,
    "preset_model": None,
    "moe_layer_pattern": None,
    "expert_pattern": None,
    "router_pattern": None,
    "use_grouped_mm": True,
    "disable_triton_grouped_mm": False,
    "route_norm": None,
    "route_scale": 1.0,
    "score_apply": "auto",
    "combine_impl": "auto",
    "row_weighting_impl": "auto",
    "gate_up_impl": "separate",
    "comm_backend": "comm",
    "comm_num_sm": 12,
    "comm_qp_margin": 4,
    "comm_max_tokens_per_rank": 0,
    "num_expert_groups": None,
    "num_limited_groups": None,
    "score_func": "auto",
    "top_k": "auto",
    "load_balance_coeff": None,
    "routed_scaling_factor": "auto",
    "expert_w1": None,
    "expert_w2": None,
    "num_experts_attr": None,
    "top_k_attr": None,
    "has_shared_experts": None,
    "shared_experts_pattern": None,
    "shared_experts_gate_pattern": None,
    "expert_activation": None,
}
_SUPPORTED = ("enabled", "autoep_size")


def autoep_size(section: Any) -> int | None:
    """``autoep_size`` of an enabled ``expert_parallel`` config section, None when it is absent
    or disabled; a one-line ValueError naming the field otherwise."""
    if section is None or section is False:
        return None
    if not isinstance(section, dict):
        raise ValueError(
            f'expert_parallel: expected an object like {{"enabled": true, "autoep_size": 2}}, got {section!r}'
        )
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"expert_parallel.enabled: expected true or false, got {enabled!r}")
    if not enabled:
        return None
    unknown = sorted(k for k in section if k not in _SUPPORTED and k not in _DEEPSPEED_DEFAULTS and k != "expert_w3")
    if unknown:
        raise ValueError(
            f"expert_parallel: unknown key(s) {', '.join(unknown)}; zerotrain reads "
            f"{', '.join(_SUPPORTED)} (and DeepSpeed's other AutoEP keys at their defaults)"
        )
    changed = sorted(
        k for k, v in section.items() if k == "expert_w3" or (k in _DEEPSPEED_DEFAULTS and v != _DEEPSPEED_DEFAULTS[k])
    )
    if changed:
        raise NotImplementedError(
            f"expert_parallel: {', '.join(f'expert_parallel.{k}={section[k]!r}' for k in changed)} not supported: "
            "zerotrain keeps the Hugging Face block, router and experts (found by class) and reads only "
            f"{' and '.join(_SUPPORTED)}; remove these keys"
        )
    size = section.get("autoep_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"expert_parallel.autoep_size: expected a positive integer (ranks sharing one "
            f"copy of the experts), got {size!r}"
        )
    return size


def apply_autoep(model: nn.Module, size: int, topology, model_parameters=None, optimizer=None):
    """``expert_parallel(model, size, topology)`` for ``initialize``; returns ``model_parameters``
    with the replaced expert parameters in place of the model's old ones (a list, or param-group
    dicts), and points a client optimizer built before at the new ones too (the old tensors would
    otherwise be stepped, and the experts silently frozen: DeepSpeed #8377)."""
    from zerotrain.experts.hf import _is_hf_experts, expert_parallel

    if not any(_is_hf_experts(m) for m in model.modules()):
        raise ValueError(
            f"expert_parallel.enabled: {type(model).__name__} has no Hugging Face fused experts "
            "module (e.g. MixtralExperts) to spread; AutoEP needs a transformers>=5 MoE model "
            "(Mixtral, Qwen-MoE, DeepSeek), else remove the expert_parallel section"
        )
    before = dict(model.named_parameters())
    if model_parameters is not None:
        model_parameters = list(model_parameters)  # a generator would be read after the replacement
    expert_parallel(model, size, topology=topology)
    after = dict(model.named_parameters())
    new_of = {id(p): after[name] for name, p in before.items() if after.get(name) is not p}

    def remap(params):
        return [new_of.get(id(p), p) for p in params]

    if model_parameters is not None:
        model_parameters = [
            dict(g, params=remap(g["params"])) if isinstance(g, dict) else new_of.get(id(g), g)
            for g in model_parameters
        ]
    if optimizer is not None and hasattr(optimizer, "param_groups") and not callable(optimizer):
        stale = [p for g in optimizer.param_groups for p in g["params"] if id(p) in new_of]
        if any(optimizer.state.get(p) for p in stale):
            raise ValueError(
                "expert_parallel: the optimizer passed to initialize has already stepped the "
                "experts expert_parallel replaces; build it after initialize (pass a callable "
                "or use the config's optimizer section)"
            )
        for group in optimizer.param_groups:
            group["params"] = remap(group["params"])
    return model_parameters
