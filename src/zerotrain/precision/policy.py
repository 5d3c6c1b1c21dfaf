"""The dtypes of one training run, read once from the config.

- ``param_dtype``: what the model's parameters (and so forward/backward) use;
- ``master_dtype``: what the optimizer updates (fp32 whenever params are 16-bit, unless
  ``bf16.bf16_master_weights_and_grads``: then the bf16 shards themselves, and the optimizer's
  state is bf16 too);
- ``grad_accum_dtype``: what partitioned gradients accumulate in (``data_types.grad_accum_dtype``,
  default: the parameters' dtype);
- ``comm_dtype``: what gradients are reduced in (``communication_data_type``, default: theirs);
- ``autocast_dtype``: what the forward is autocast to (``torch_autocast``; parameters stay fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotrain.precision.autocast import autocast_dtype
from zerotrain.precision.loss_scaler import DynamicLossScaler, LossScaler

_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    if name is None:
        return default
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of fp32, fp16, bf16") from None


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype = torch.float32
    auto_cast: bool = False
    check_overflow: bool = False
    autocast_dtype: torch.dtype | None = None
    # bf16 masters: the optimizer steps the bf16 shards and keeps its state in bf16.
    low_precision_masters: bool = False

    @property
    def master_dtype(self) -> torch.dtype:
        return self.param_dtype if self.low_precision_masters else torch.float32

    @property
    def mixed(self) -> bool:
        """True when the optimizer keeps fp32 master weights apart from 16-bit parameters."""
        return self.param_dtype != torch.float32 and not self.low_precision_masters

    @classmethod
    def from_config(cls, cfg, device: torch.device | None = None) -> PrecisionPolicy:
        if cfg.fp16.enabled:
            param = torch.float16
        elif cfg.bf16.enabled:
            param = torch.bfloat16
        else:
            param = torch.float32
        data_types = cfg.data_types if isinstance(cfg.data_types, dict) else {}
        autocast = autocast_dtype(cfg.torch_autocast, device if device is not None else torch.device("cpu"))
        return cls(
            param_dtype=param,
            grad_accum_dtype=_dtype(data_types.get("grad_accum_dtype"), param),
            comm_dtype=_dtype(cfg.communication_data_type, param),
            auto_cast=bool(cfg.fp16.enabled and cfg.fp16.auto_cast),
            check_overflow=bool(
                cfg.fp16.enabled or (cfg.bf16.enabled and cfg.bf16.check_grad_overflow) or autocast == torch.float16
            ),
            autocast_dtype=autocast,
            low_precision_masters=bool(cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads),
        )


def build_loss_scaler(cfg, precision: PrecisionPolicy | None = None) -> LossScaler:
    """fp16: dynamic (``loss_scale`` 0) or static scaling; fp16 autocast: dynamic scaling with
    ``torch.amp.GradScaler``'s constants (as DeepSpeed uses one there); otherwise a scale of 1."""
    fp16 = cfg.fp16
    if precision is not None and precision.autocast_dtype == torch.float16:
        # GradScaler: start 2**16, halve on every overflow, double after 2000 clean steps.
        return DynamicLossScaler(init_scale=2.0**16, scale_window=2000, min_scale=2.0**-24, hysteresis=1)
    if not fp16.enabled:
        return LossScaler(1.0)
    if fp16.loss_scale > 0:
        return LossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        raise_error_at_min_scale=fp16.raise_error_at_min_scale,
    )
