"""Hugging Face causal LMs as a ``PipelineModule``, without rewriting them.

``from_hf_causal_lm(model_or_config, num_stages=2)`` turns a transformers GPT-2
(``GPT2LMHeadModel``) or Llama (``LlamaForCausalLM``) into pipeline layers that run the model's
own modules:

    [token embedding] (+ [position embedding + dropout] for GPT-2), [block] x n_layer,
    [final norm], [LM head]

- The LM head is the token embedding again (a ``TiedLayerSpec`` with ``forward_fn``, as
  Megatron's ``GPTModelPipe``) when the model ties them (``lm_head.weight is wte.weight``,
  ``tie_word_embeddings``): one value on the first and last stage, gradients summed.
- Blocks are called as the HF model calls them: the causal mask from transformers'
  ``create_causal_mask`` for the model's attention implementation, ``position_ids = arange(seq)``,
  no cache; Llama's rotary embedding (computed once at model level in HF) is computed on each
  stage from the model's own rotary module and handed to every block. What crosses stages is the
  hidden state alone.
- ``loss_fn``: transformers' ``ForCausalLMLoss`` (the HF model's own shifted cross-entropy,
  mean over the micro-batch's tokens). A batch is ``(input_ids, labels)``, e.g.
  ``(ids, ids)``; the engine averages the micro-batches' losses, which equals the HF model's
  loss on the whole batch when each micro-batch has the same number of counted labels (no
  ``-100``).
- A built model: its modules (and parameters) are used in place; every rank builds the same
  model (same seed) and keeps only its stage's layers. A config: the model is built on the meta
  device and each stage materializes and initializes (HF's ``_init_weights``) only its own
  layers.
- ``hf_state_dict(pipe)``: this rank's parameters under the HF model's names.

No attention mask input (no padding) and no dropout equivalence with the HF model's random
stream: compare with dropout 0.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from zerotrain.pipeline.module import PipelineModule
from zerotrain.pipeline.specs import LayerSpec, TiedLayerSpec

__all__ = ["from_hf_causal_lm", "hf_state_dict", "CausalLMLoss", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("gpt2", "llama")
_TIED_KEY = "embed"


def _materialize(inner: nn.Module, init_fn) -> nn.Module:
    """A meta-device module becomes a fresh CPU copy initialized by ``init_fn`` (HF's
    ``_init_weights``); a real module is returned as is."""
    if init_fn is None or not any(t.is_meta for t in list(inner.parameters()) + list(inner.buffers())):
        return inner
    inner = copy.deepcopy(inner).to_empty(device="cpu")
    for module in inner.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    with torch.no_grad():
        inner.apply(init_fn)
    return inner


class HFPipeLayer(nn.Module):
    """One pipeline layer holding one HF module (``inner``) whose parameters are named
    ``hf_prefix + name`` in the HF model."""

    def __init__(self, inner: nn.Module, hf_prefix: str, init_fn=None):
        super().__init__()
        self.inner = _materialize(inner, init_fn)
        self.hf_prefix = hf_prefix


class TokenEmbeddingPipe(HFPipeLayer):
    """``input_ids -> embeddings`` (``wte`` / ``embed_tokens``); the tied LM head too."""

    def forward(self, input_ids):
        return self.inner(input_ids)


def tied_lm_head(module: TokenEmbeddingPipe, hidden):
    """The LM head as the token embedding's transpose (``forward_fn`` of the tied spec)."""
    return nn.functional.linear(hidden, module.inner.weight)


def _positions(hidden) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class GPT2PositionsPipe(HFPipeLayer):
    """GPT-2: ``embeddings + wpe(arange(seq))``, then the embedding dropout."""

    def __init__(self, inner, hf_prefix, dropout: float, init_fn=None):
        super().__init__(inner, hf_prefix, init_fn)
        self.drop = nn.Dropout(dropout)

    def forward(self, hidden):
        return self.drop(hidden + self.inner(_positions(hidden)).to(hidden.device))


class DecoderBlockPipe(HFPipeLayer):
    """One transformer block (``GPT2Block`` / ``LlamaDecoderLayer``) called as the HF model calls
    it; ``rotary``: Llama's rotary embedding module (buffers only), computed here per block."""

    def __init__(self, inner, hf_prefix, config, model_type: str, rotary=None, init_fn=None):
        super().__init__(inner, hf_prefix, init_fn)
        self.config = config
        self.model_type = model_type
        self.rotary = rotary

    def forward(self, hidden):
        from transformers.masking_utils import create_causal_mask

        position_ids = _positions(hidden)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids
        )
        if self.model_type == "gpt2":
            return self.inner(hidden, None, mask, None, use_cache=False, position_ids=position_ids)
        return self.inner(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            cache=None,
            use_cache=False,
            position_embeddings=self.rotary(hidden, position_ids=position_ids),
        )


class FinalNormPipe(HFPipeLayer):
    """The final norm (``ln_f`` / ``norm``)."""

    def forward(self, hidden):
        return self.inner(hidden)


class LMHeadPipe(HFPipeLayer):
    """An untied LM head (``lm_head``)."""

    def forward(self, hidden):
        return self.inner(hidden)


class CausalLMLoss:
    """The HF causal LM's own loss: transformers' ``ForCausalLMLoss`` (labels shifted left by
    one, ``-100`` ignored, fp32 logits, mean over counted tokens)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, logits, labels):
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, vocab_size=self.vocab_size)

    def __repr__(self) -> str:
        return f"CausalLMLoss(vocab_size={self.vocab_size})"


def _as_model(model_or_config):
    """``(model, init_fn)``: a built model (init_fn None) or one built on meta from a config."""
    try:
        from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
    except ImportError as error:  # pragma: no cover - transformers is in the hf/dev extras
        raise ImportError("from_hf_causal_lm needs transformers: pip install 'zerotrain[hf]'") from error
    if not isinstance(model_or_config, (PreTrainedModel, PretrainedConfig)):
        raise TypeError(
            f"from_hf_causal_lm: model_or_config must be a transformers PreTrainedModel or "
            f"PretrainedConfig, got {type(model_or_config).__name__}"
        )
    config = model_or_config.config if isinstance(model_or_config, PreTrainedModel) else model_or_config
    if config.model_type not in _BUILDERS:
        raise ValueError(
            f"from_hf_causal_lm: model_type {config.model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if isinstance(model_or_config, PreTrainedModel):
        return model_or_config, None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_or_config)
    return model, model._init_weights


def _gpt2_layers(model, init_fn) -> tuple[list, bool]:
    body, config = model.transformer, model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError(
            "from_hf_causal_lm: GPT-2 with add_cross_attention=True is not supported; "
            "set config.add_cross_attention=False"
        )
    tied = model.lm_head.weight is body.wte.weight
    first = [
        _embedding_spec(body.wte, "transformer.wte.", tied, init_fn),
        LayerSpec(GPT2PositionsPipe, body.wpe, "transformer.wpe.", config.embd_pdrop, init_fn=init_fn),
    ]
    blocks = [
        LayerSpec(DecoderBlockPipe, block, f"transformer.h.{i}.", config, "gpt2", init_fn=init_fn)
        for i, block in enumerate(body.h)
    ]
    last = [
        LayerSpec(FinalNormPipe, body.ln_f, "transformer.ln_f.", init_fn=init_fn),
        _head_spec(model.lm_head, body.wte, "transformer.wte.", tied, init_fn),
    ]
    return first + blocks + last, tied


def _llama_layers(model, init_fn) -> tuple[list, bool]:
    body, config = model.model, model.config
    tied = model.lm_head.weight is body.embed_tokens.weight
    rotary = body.rotary_emb
    if init_fn is not None:  # the meta model's rotary buffers are empty: one real copy, same config
        rotary = type(rotary)(config=config)
    first = [_embedding_spec(body.embed_tokens, "model.embed_tokens.", tied, init_fn)]
    blocks = [
        LayerSpec(DecoderBlockPipe, layer, f"model.layers.{i}.", config, "llama", rotary=rotary, init_fn=init_fn)
        for i, layer in enumerate(body.layers[: config.num_hidden_layers])
    ]
    last = [
        LayerSpec(FinalNormPipe, body.norm, "model.norm.", init_fn=init_fn),
        _head_spec(model.lm_head, body.embed_tokens, "model.embed_tokens.", tied, init_fn),
    ]
    return first + blocks + last, tied


def _embedding_spec(embedding, prefix, tied, init_fn):
    if tied:
        return TiedLayerSpec(
            _TIED_KEY, TokenEmbeddingPipe, embedding, prefix, init_fn=init_fn, tied_weight_attr="inner.weight"
        )
    return LayerSpec(TokenEmbeddingPipe, embedding, prefix, init_fn=init_fn)


def _head_spec(head, embedding, embedding_prefix, tied, init_fn):
    if tied:
        return TiedLayerSpec(
            _TIED_KEY,
            TokenEmbeddingPipe,
            embedding,
            embedding_prefix,
            init_fn=init_fn,
            forward_fn=tied_lm_head,
            tied_weight_attr="inner.weight",
        )
    return LayerSpec(LMHeadPipe, head, "lm_head.", init_fn=init_fn)


_BUILDERS = {"gpt2": _gpt2_layers, "llama": _llama_layers}


def from_hf_causal_lm(
    model_or_config,
    num_stages=None,
    topology=None,
    partition_method: str = "type:DecoderBlockPipe",
    loss_fn=None,
    **pipeline_kwargs,
) -> PipelineModule:
    """A ``PipelineModule`` running a transformers GPT-2 or Llama causal LM.

    ``model_or_config``: a ``GPT2LMHeadModel``/``LlamaForCausalLM`` (its modules are used in place;
    build it with the same seed on every rank) or its config (each stage builds and initializes
    only its own layers). ``partition_method`` defaults to balancing the transformer blocks
    (Megatron's ``"type:transformer"``); ``loss_fn`` defaults to the HF model's own shifted
    cross-entropy (``CausalLMLoss``); other keyword arguments go to ``PipelineModule``
    (``seed_layers``, ``activation_checkpoint_interval``, ...). Batches are
    ``(input_ids, labels)``."""
    model, init_fn = _as_model(model_or_config)
    layers, _ = _BUILDERS[model.config.model_type](model, init_fn)
    pipe = PipelineModule(
        layers,
        num_stages=num_stages,
        topology=topology,
        loss_fn=loss_fn if loss_fn is not None else CausalLMLoss(model.config.vocab_size),
        partition_method=partition_method,
        **pipeline_kwargs,
    )
    pipe.hf_config = model.config
    return pipe


def hf_state_dict(pipe: PipelineModule) -> dict[str, torch.Tensor]:
    """This rank's parameters under the HF model's names (``transformer.h.3.attn.c_attn.weight``).
    A tied embedding appears under the embedding's name on both the first and the last stage;
    merge the ranks' dicts to get the whole model (with ``lm_head.weight`` equal to it when tied)."""
    out = {}
    for module in pipe.modules():
        if isinstance(module, HFPipeLayer):
            for name, param in module.inner.named_parameters():
                out[module.hf_prefix + name] = param
    return out
