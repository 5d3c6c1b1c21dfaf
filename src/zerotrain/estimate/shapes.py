"""What the estimator needs to know about a model: parameter counts and, when known, its
transformer shape (layers, hidden size, heads, vocabulary) for the activation formulas.

Three sources: a Hugging Face ``config.json`` (counted analytically, no download, no
``transformers`` needed), a bare parameter count (``--params 7e9``), or a live ``nn.Module``
(possibly built on the meta device), whose parameters are counted exactly.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

# Architectures whose positions are rotary/ALiBi (no learned position table) and whose MLP is
# gated (three matrices) and bias-free.
_GATED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "cohere")
_NO_POSITION_TABLE = _GATED + ("bloom", "gpt_neox", "falcon", "mpt", "gptj", "phi")


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts of one model (elements, not bytes).

    ``largest_layer_params``: the most parameters any one module owns directly (stage 3 gathers
    a module's parameters together; DeepSpeed's estimators call it the largest layer).
    ``largest_param``: the largest single tensor (one gradient bucket of its own at stages 0-2).
    ``layers``/``hidden``/``heads``/``vocab`` are None when unknown (a bare parameter count):
    activation memory then needs a measured forward or is left out, saying so."""

    params: int
    largest_layer_params: int
    largest_param: int
    name: str = "model"
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    frozen_params: int = 0
    module: nn.Module | None = field(default=None, compare=False, repr=False)
    source: str = "params"  # params | hf-config | module

    @property
    def has_transformer_shape(self) -> bool:
        return None not in (self.layers, self.hidden, self.heads)

    def with_layout(self, **changes) -> ModelShape:
        return replace(self, **changes)


def from_params(params: int, largest_layer_params: int | None = None, **shape: Any) -> ModelShape:
    """A hypothetical model of ``params`` trainable parameters. Without ``largest_layer_params``
    the largest layer is taken as the largest of a transformer's shape when given (the
    embedding), else 1/32 of the model (as for a 32-layer transformer), and said so."""
    if params <= 0:
        raise ValueError(f"params must be positive, got {params}")
    hidden, vocab = shape.get("hidden"), shape.get("vocab")
    if largest_layer_params is None:
        if hidden and vocab:
            largest_layer_params = max(vocab * hidden, 4 * hidden * hidden)
        else:
            largest_layer_params = max(1, params // 32)
    return ModelShape(
        params=params,
        largest_layer_params=largest_layer_params,
        largest_param=largest_layer_params,
        name=f"{params / 1e9:g}B-parameter model",
        source="params",
        **shape,
    )


def _first(cfg: dict, *names: str, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def read_hf_config(path_or_dict: str | os.PathLike | dict) -> dict:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--hf-config: file {path!r} not found (give the model's config.json)") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--hf-config: {path!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--hf-config: {path!r} must hold a JSON object (a Hugging Face config)")
    return data


def from_hf_config(config: str | os.PathLike | dict) -> ModelShape:
    """Count a Hugging Face decoder's parameters from its config, analytically.

    Per layer: attention ``4h²`` (fewer with grouped KV heads), MLP ``2·h·ffn`` (``3·h·ffn`` for
    gated LLaMA-style MLPs), norms and biases; plus the token embedding, a learned position table
    where the architecture has one, and an output head unless tied. GPT-2-style layers give the
    seeds' ``12h² + 13h`` per layer."""
    cfg = read_hf_config(config)
    model_type = str(cfg.get("model_type", "")).lower()
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    vocab = _first(cfg, "vocab_size")
    missing = [
        n
        for n, v in (
            ("num_hidden_layers", layers),
            ("hidden_size", hidden),
            ("num_attention_heads", heads),
            ("vocab_size", vocab),
        )
        if v is None
    ]
    if missing:
        raise ValueError(
            f"--hf-config: the config has no {', '.join(missing)} (a decoder "
            "transformer's config.json names them); give --params instead"
        )
    layers, hidden, heads, vocab = int(layers), int(hidden), int(heads), int(vocab)
    gated = model_type in _GATED
    ffn = int(
        _first(cfg, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", default=4 * hidden) or 4 * hidden
    )
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads) or heads)
    head_dim = int(_first(cfg, "head_dim", default=hidden // heads) or hidden // heads)
    bias = bool(_first(cfg, "attention_bias", "bias", "enable_bias", default=not gated))
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q_out + 2 * kv_out) + q_out * hidden
    mlp = (3 if gated else 2) * hidden * ffn
    norms = (1 if gated else 2) * 2 * hidden  # RMSNorm: weight only; LayerNorm: weight + bias
    biases = (q_out + 2 * kv_out + hidden + ffn + hidden) if bias else 0
    per_layer = attention + mlp + norms + biases
    embedding = vocab * hidden
    positions = 0
    if model_type not in _NO_POSITION_TABLE:
        positions = int(_first(cfg, "max_position_embeddings", "n_positions", default=0) or 0) * hidden
        if model_type == "opt":
            positions += 2 * hidden  # OPT's learned positions carry an offset of 2
    final_norm = hidden * (1 if gated else 2)
    extra = 2 * hidden if model_type == "bloom" else 0  # BLOOM's word_embeddings_layernorm
    tied = bool(cfg.get("tie_word_embeddings", True))
    head = 0 if tied else vocab * hidden
    params = layers * per_layer + embedding + positions + final_norm + extra + head
    return ModelShape(
        params=params,
        largest_layer_params=max(embedding, mlp // (3 if gated else 2)),
        largest_param=embedding,
        name=cfg.get("_name_or_path") or model_type or "hf-model",
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        source="hf-config",
    )


def from_module(module: nn.Module, name: str | None = None) -> ModelShape:
    """Exact counts from a model (real or on the meta device); tied parameters count once."""
    seen: dict[int, nn.Parameter] = {}
    for p in module.parameters():
        seen.setdefault(id(p), p)
    trainable = [p for p in seen.values() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters to estimate")
    largest_layer = max(
        sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad) for m in module.modules()
    )
    config = getattr(module, "config", None)
    shape: dict[str, Any] = {}
    if config is not None:  # HF-style or zerotrain GPTConfig: read the shape for the formulas
        fields = config if isinstance(config, dict) else vars(config)

        def get(*names):
            return _first(fields, *names)

        shape = dict(
            layers=get("num_hidden_layers", "n_layer", "num_layers"),
            hidden=get("hidden_size", "n_embd", "d_model"),
            heads=get("num_attention_heads", "n_head"),
            vocab=get("vocab_size"),
        )
        shape = {k: int(v) for k, v in shape.items() if isinstance(v, int)}
    return ModelShape(
        params=sum(p.numel() for p in trainable),
        largest_layer_params=largest_layer,
        largest_param=max(p.numel() for p in trainable),
        frozen_params=sum(p.numel() for p in seen.values() if not p.requires_grad),
        name=name or type(module).__name__,
        module=module,
        source="module",
        **shape,
    )


def load_builder(spec: str) -> Callable[[], nn.Module]:
    """``"my_pkg.models:build"`` -> the callable ``build`` (called with no arguments)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model: expected 'package.module:function', got {spec!r}")
    try:
        target = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model: cannot import {module_name!r} ({err}); is it on PYTHONPATH?") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--model: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--model: {spec!r} is not callable; it must build and return an nn.Module")
    return target


def build_on_meta(builder: Callable[[], nn.Module]) -> nn.Module:
    """Call ``builder()`` with the meta device as default: no memory, no weights initialised."""
    with torch.device("meta"):
        model = builder()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model: the builder returned {type(model).__name__}, not an nn.Module")
    return model
