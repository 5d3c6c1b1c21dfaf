"""Activation memory: what forward keeps for backward, per rank.

From a transformer's shape, Korthikanti et al.'s per-layer count ("Reducing activation
recomputation in large transformer models", 2022): ``s·b·h·(34 + 5·a·s/h)`` bytes per layer in
16-bit (dropout masks take one byte per element), and its 32-bit form for n layers
``n·b·l·h·(67 + 9·m·l/h)``; both are used as written. Attention that never materialises the
``a·s²`` score matrix (flash / SDPA kernels) keeps only the ``34 s·b·h`` part; the formula's
``a·s²`` term is the conservative (eager attention) count.

With activation checkpointing each layer keeps only its input (``s·b·h`` elements) and one layer
is recomputed at a time, so the peak is ``n·s·b·h·e`` plus one layer's full activations.

From a model, ``measure_saved_bytes`` runs one forward (on the meta device when the model is
there: no memory, no compute) with a saved-tensors hook and adds up the distinct storages
autograd keeps for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.estimate.shapes import ModelShape

# (coefficient of s·b·h, coefficient of a·s²·b) in bytes per layer, by activation element size.
KORTHIKANTI = {2: (34, 5), 4: (67, 9)}


@dataclass(frozen=True)
class ActivationBytes:
    """Per-rank activation bytes at one micro-batch. ``layers``: the transformer blocks;
    ``logits``: the output head's logits and the loss's saved log-softmax (fp32), which the
    per-layer formula leaves out; ``method`` says where the numbers come from."""

    layers: int
    logits: int
    method: str
    checkpointed: bool = False
    known: bool = True

    @property
    def total(self) -> int:
        return self.layers + self.logits


UNKNOWN = ActivationBytes(
    0, 0, "unknown: no model shape (give --hf-config, --model, or --layers/--hidden/--heads/--vocab)", known=False
)


def korthikanti_layer_bytes(
    seq: int, batch: int, hidden: int, heads: int, element_size: int, flash_attention: bool = False
) -> int:
    """Bytes one transformer layer keeps for backward (the whole model's ``M_activation`` / n)."""
    if element_size not in KORTHIKANTI:
        raise ValueError(f"activation element size {element_size}: the formula covers 2 (fp16/bf16) and 4 (fp32)")
    linear, quadratic = KORTHIKANTI[element_size]
    sbh = seq * batch * hidden
    score = 0 if flash_attention else quadratic * heads * seq * seq * batch
    return linear * sbh + score


def formula_activations(
    shape: ModelShape,
    micro_batch: int,
    seq_len: int,
    element_size: int,
    checkpointing: bool = False,
    flash_attention: bool = False,
) -> ActivationBytes:
    """Activations of ``shape`` (needs layers, hidden, heads; vocab for the logits)."""
    if not shape.has_transformer_shape:
        return UNKNOWN
    n, h, a = shape.layers, shape.hidden, shape.heads
    per_layer = korthikanti_layer_bytes(seq_len, micro_batch, h, a, element_size, flash_attention)
    if checkpointing:
        layers = n * seq_len * micro_batch * h * element_size + per_layer
    else:
        layers = n * per_layer
    # Logits in the compute dtype plus the fp32 log-softmax cross-entropy saves.
    logits = micro_batch * seq_len * shape.vocab * (element_size + 4) if shape.vocab else 0
    what = "Korthikanti per-layer formula" + (" with checkpointing" if checkpointing else "")
    return ActivationBytes(layers, logits, what, checkpointing)


def measure_saved_bytes(model: nn.Module, example_args: tuple, example_kwargs: dict | None = None) -> tuple[int, int]:
    """(bytes autograd saves for backward, bytes of the output tensors) for one forward of
    ``model(*example_args, **example_kwargs)``; on the meta device this allocates nothing.

    Parameters (and views of them) are not counted: they are model state, not activations."""
    param_storages = set()
    for p in model.parameters():
        if p.device.type != "meta":
            param_storages.add(p.untyped_storage().data_ptr())
    param_ids = {id(p) for p in model.parameters()}
    saved: dict[object, int] = {}

    def pack(t: torch.Tensor):
        if id(t) in param_ids or (t._base is not None and id(t._base) in param_ids):
            return t
        key = _storage_key(t)
        if key is not None and key not in param_storages:
            saved[key] = max(saved.get(key, 0), _storage_nbytes(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*example_args, **(example_kwargs or {}))
    outputs = {}
    for t in _tensors(out):
        key = _storage_key(t)
        if key is not None:
            outputs[key] = _storage_nbytes(t)
    only_outputs = sum(v for k, v in outputs.items() if k not in saved)
    return sum(saved.values()), only_outputs


def measured_activations(
    model: nn.Module, micro_batch: int, seq_len: int, vocab: int | None, element_size: int, checkpointing: bool = False
) -> ActivationBytes:
    """Run one forward of a causal LM on ``micro_batch × seq_len`` token ids (``labels`` too
    when the forward accepts them) and count what it keeps for backward."""
    device = next(model.parameters()).device
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
    dtype = torch.float32 if element_size == 4 else torch.bfloat16
    if device.type == "meta" and element_size != 4:
        model = model.to(dtype)
    try:
        try:
            saved, outputs = measure_saved_bytes(model, (ids,), {"labels": ids})
        except TypeError:
            saved, outputs = measure_saved_bytes(model, (ids,))
    except Exception as err:  # a user's model may need other inputs: say what was tried
        raise ValueError(
            f"could not run a forward of {type(model).__name__} on input_ids of shape "
            f"[{micro_batch}, {seq_len}] to measure activations ({type(err).__name__}: "
            f"{err}); give --hf-config (or --layers/--hidden/--heads/--vocab) for "
            "the formula instead"
        ) from None
    kind = "meta" if device.type == "meta" else device.type
    return ActivationBytes(saved, outputs, f"measured: one forward on {kind} (saved-tensor hooks)", checkpointing)


def _storage_key(t: torch.Tensor):
    if t.device.type == "meta":
        return ("meta", id(t._base) if t._base is not None else id(t))
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _storage_nbytes(t: torch.Tensor) -> int:
    if t.device.type == "meta":
        base = t._base if t._base is not None else t
        return base.numel() * base.element_size()
    return t.untyped_storage().nbytes()


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from _tensors(v)
    elif hasattr(out, "__dict__"):
        for v in vars(out).values():
            yield from _tensors(v)
