"""The usual fine-tuning rules of thumb, and the estimator's refinement of each.

The rules' table (bytes or bits per parameter, activations excluded): full fine-tuning in bf16
12 bytes (2 weights + 2 gradients + 8 optimizer), LoRA ~17.6 bits, QLoRA ~5.6 bits, and
"2 x params (B) = GB" for loading 16-bit weights. The refinements say what the rule leaves out:
mixed-precision Adam keeps fp32 master weights (+4 bytes: 16 bytes/param, the ZeRO paper's
count), and adapters trained with Adam cost 16 bytes per *adapter* parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

# The LoRA rule: adapters of ~0.4 bits per 16-bit base parameter, i.e. 2.5% of the parameters.
ADAPTER_FRACTION = 0.4 / 16
# QLoRA's NF4 block constants with double quantisation: 0.127 bits per parameter (Dettmers et
# al. 2023), which the rule's 4 bits leave out.
QLORA_CONSTANTS_BITS = 0.127


@dataclass(frozen=True)
class ThumbRow:
    method: str
    rule_bits_per_param: float
    refined_bits_per_param: float
    note: str

    def rule_bytes(self, params: int) -> float:
        return self.rule_bits_per_param * params / 8

    def refined_bytes(self, params: int) -> float:
        return self.refined_bits_per_param * params / 8


def fine_tuning_rows(adapter_fraction: float = ADAPTER_FRACTION) -> list[ThumbRow]:
    """The rules' rows with the estimator's count beside them (bits per base parameter)."""
    adapter_adam = 16 * 8 * adapter_fraction  # 2 weights + 2 grads + 4 master + 8 Adam, in bits
    return [
        ThumbRow("load 16-bit weights (2 x params(B) = GB)", 16, 16, "weights only"),
        ThumbRow(
            "full fine-tuning, bf16 + Adam",
            12 * 8,
            16 * 8,
            "the rule's 12 B leaves out the 4-byte fp32 master weights mixed precision keeps",
        ),
        ThumbRow(
            "LoRA (16-bit base)",
            17.6,
            16 + adapter_adam,
            f"frozen base 16 bits + adapters ({adapter_fraction:.1%} of params) at 16 B each",
        ),
        ThumbRow(
            "QLoRA (4-bit base)",
            5.6,
            4 + QLORA_CONSTANTS_BITS + adapter_adam,
            "adds NF4 block constants; QLoRA does not combine with ZeRO-3",
        ),
    ]
