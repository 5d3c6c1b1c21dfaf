"""What ``initialize`` applies to the model and the process before building the engine.

- the config's ``activation_checkpointing`` section configures ``zerotrain.checkpointing``
  (unless the script called ``configure`` itself; docs/activation_checkpointing.md);
- a quantized (QLoRA) base model at ZeRO stage 3 is refused with a message (docs/lora.md).
"""

from __future__ import annotations

from torch import nn


def before_engine(model: nn.Module, cfg) -> None:
    """Apply the checks and settings above for ``model`` under the loaded config ``cfg``."""
    from zerotrain.lora import check_quantized_base
    from zerotrain.recompute.settings import configure_from_engine_config

    check_quantized_base(model, cfg.zero_optimization.stage)
    configure_from_engine_config(cfg)
