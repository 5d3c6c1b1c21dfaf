"""LoRA / QLoRA support checks (peft models need nothing else from zerotrain).

A peft LoRA model trains as any model: its frozen base parameters (``requires_grad=False``) are
partitioned at stage 3 and never stepped, and only the adapter parameters reach the optimizer
(docs/lora.md). What cannot work is a *quantized* base (QLoRA: bitsandbytes ``Linear4bit`` /
``Linear8bitLt``, or other packed-integer linear layers) at stage 3, which partitions every
parameter into flat floating-point buffers. :func:`check_quantized_base` finds such layers by
class and parameter type — without importing bitsandbytes — and ``initialize`` calls it.
"""

from __future__ import annotations

from torch import nn

# bitsandbytes' quantized layer and parameter classes (peft's LoRA wrappers of them keep the
# names); any class defined in a quantization package counts too.
QUANTIZED_LAYER_CLASSES = frozenset(
    {"Linear4bit", "Linear8bitLt", "LinearFP4", "LinearNF4", "Params4bit", "Int8Params"}
)
_QUANTIZED_PACKAGES = ("bitsandbytes", "hqq", "auto_gptq", "gptqmodel", "awq", "optimum.quanto")


def find_quantized_layers(model: nn.Module) -> list[str]:
    """Descriptions (``name: class``) of the quantized layers and parameters in ``model``, plus
    the Hugging Face model's own quantization flags; empty for a plain model."""
    found = []
    for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit"):
        if getattr(model, flag, False) is True:
            found.append(f"model.{flag} is True")
    for name, module in model.named_modules():
        if _is_quantized_type(type(module)):
            found.append(f"{name or '<model>'}: {type(module).__module__}.{type(module).__qualname__}")
    for name, param in model.named_parameters():
        if _is_quantized_type(type(param)) or not (param.is_floating_point() or param.is_complex()):
            found.append(f"{name}: {type(param).__qualname__} of dtype {param.dtype}")
    return found


def check_quantized_base(model: nn.Module, stage: int) -> None:
    """Raise ``NotImplementedError`` naming the layers when ``model`` has a quantized base and
    ``stage`` is 3 (QLoRA and ZeRO-3 are incompatible, as for DeepSpeed)."""
    if stage != 3:
        return
    found = find_quantized_layers(model)
    if not found:
        return
    shown = "\n".join(f"  - {line}" for line in found[:8]) + (
        f"\n  ... ({len(found) - 8} more)" if len(found) > 8 else ""
    )
    raise NotImplementedError(
        "QLoRA (a 4-bit/8-bit quantized base model) is incompatible with ZeRO stage 3: stage 3 "
        "partitions every parameter into flat floating-point shards and gathers them back, which "
        "packed quantized weights and their quantization state cannot go through (DeepSpeed "
        f"ZeRO-3 does not support QLoRA either). Found:\n{shown}\n"
        "Use zero_optimization.stage 0-2 for a quantized base, or LoRA on a bf16/fp16 base at stage 3."
    )


def _is_quantized_type(cls: type) -> bool:
    for klass in cls.__mro__:
        if klass.__name__ in QUANTIZED_LAYER_CLASSES:
            return True
        module = klass.__module__ or ""
        if any(module == package or module.startswith(package + ".") for package in _QUANTIZED_PACKAGES):
            return True
    return False
