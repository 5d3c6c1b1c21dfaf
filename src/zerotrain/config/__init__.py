"""zerotrain configuration: a DeepSpeed-compatible JSON config, validated with pydantic.

Typical use::

    cfg = load_config("ds_config.json", world_size=dp_size)   # ConfigError on any problem
    check_supported(cfg)                                       # NotImplementedError for pending features
    check_zero_optimizer(cfg, optimizer)                       # ConfigError for a non-elementwise optimizer
"""

from .args import add_config_arguments
from .auto import fill_auto, fill_from_training_args
from .batch import resolve_batch_sizes
from .errors import ConfigError, UnknownConfigKeyWarning
from .load import load_config, read_config
from .optimizer_check import check_zero_optimizer
from .schema import (
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    FP16Config,
    MLflowConfig,
    OptimizerConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
    ZeroTrainConfig,
)
from .support import PENDING, check_supported, unsupported
from .zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "CometConfig",
    "CSVMonitorConfig",
    "FlopsProfilerConfig",
    "FP16Config",
    "MLflowConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "PENDING",
    "SchedulerConfig",
    "TensorBoardConfig",
    "UnknownConfigKeyWarning",
    "WandbConfig",
    "ZeroConfig",
    "ZeroTrainConfig",
    "add_config_arguments",
    "check_supported",
    "check_zero_optimizer",
    "fill_auto",
    "fill_from_training_args",
    "load_config",
    "read_config",
    "resolve_batch_sizes",
    "unsupported",
]
