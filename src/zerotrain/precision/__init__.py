"""Mixed precision: dtype policy and fp16 loss scaling."""

from zerotrain.precision.loss_scaler import DynamicLossScaler, LossScaler
from zerotrain.precision.policy import PrecisionPolicy, build_loss_scaler

__all__ = ["DynamicLossScaler", "LossScaler", "PrecisionPolicy", "build_loss_scaler"]
