"""`zero_allow_untested_optimizer`: which optimizers may run on ZeRO's flat shards.

At stages 1-3 (and with fp16/bf16 at stage 0) the optimizer does not see the model's parameters
but flat fp32 shards that cut across them. An elementwise optimizer (Adam, SGD, ...) computes
exactly what it would on the whole parameters; one whose update depends on a parameter's norm
or shape (LAMB and LARS trust ratios, Adafactor's factored moments, Shampoo, Muon) silently
computes per-shard statistics instead. So, like DeepSpeed, zerotrain refuses an optimizer it has
not checked unless the config says `"zero_allow_untested_optimizer": true`.

DeepSpeed's tested list is its own Adam/Adagrad/Lion kernels and torch's Adam, AdamW and Adagrad;
zerotrain's is every elementwise torch.optim class plus its own Lion (and DeepSpeed-named Adam
classes from ``zerotrain.ops`` when present). Classes are matched exactly, as in DeepSpeed: a
subclass may override ``step``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .errors import ConfigError

#: Elementwise optimizers: each element's update depends only on that element's gradient and state
#: (plus per-group scalars such as lr and the step count), so flat shards change nothing.
ELEMENTWISE_OPTIMIZERS = (
    "torch.optim.Adam",
    "torch.optim.AdamW",
    "torch.optim.SGD",
    "torch.optim.Adagrad",
    "torch.optim.Adadelta",
    "torch.optim.Adamax",
    "torch.optim.NAdam",
    "torch.optim.RAdam",
    "torch.optim.RMSprop",
    "torch.optim.Rprop",
    "torch.optim.ASGD",
    "zerotrain.optim.lion.Lion",
    "zerotrain.ops.adam.FusedAdam",
    "zerotrain.ops.adam.DeepSpeedCPUAdam",
)

#: Optimizers whose whole-parameter step ZeRO's ``ZeroStage`` provides for (zero/muon_shards.py).
SHARD_AWARE_OPTIMIZERS = ("zerotrain.optim.muon.MuonWithAuxAdam",)

#: Optimizers known to depend on whole parameters (shape, norm, or a closure over the model):
#: refused on flat shards even with zero_allow_untested_optimizer.
SHAPE_DEPENDENT_OPTIMIZERS = ("Adafactor", "LBFGS", "Muon", "SparseAdam", "Lamb", "FusedLamb", "LARS", "Shampoo")


def elementwise_optimizer_classes() -> tuple[type, ...]:
    """The classes of ELEMENTWISE_OPTIMIZERS (and SHARD_AWARE_OPTIMIZERS, which flat shards do not
    change either) that exist in this installation."""
    found = []
    for dotted in ELEMENTWISE_OPTIMIZERS + SHARD_AWARE_OPTIMIZERS:
        module_name, _, name = dotted.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            continue
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def optimizer_sees_flat_shards(config: Any) -> bool:
    """True when the optimizer steps flat shards: ZeRO stages 1-3, or fp16/bf16 at any stage."""
    return config.zero_optimization.stage >= 1 or config.fp16.enabled or config.bf16.enabled


def check_zero_optimizer(config: Any, optimizer: Any) -> None:
    """Refuse an optimizer whose update would change on flat shards, per the config.

    ``config`` is a ``ZeroTrainConfig``; ``optimizer`` the torch optimizer the stage will drive
    (None passes: there is nothing to step). Raises ConfigError naming the optimizer class and
    ``zero_allow_untested_optimizer``; with that key true, an unknown optimizer only warns.
    """
    if optimizer is None or not optimizer_sees_flat_shards(config):
        return
    cls = type(optimizer)
    if cls in elementwise_optimizer_classes():
        return
    where = _where(config)
    if cls.__name__ in SHAPE_DEPENDENT_OPTIMIZERS:
        raise ConfigError(
            f"{cls.__name__} updates depend on each parameter's shape or norm, but {where} gives the "
            "optimizer flat shards that cut across parameters, so it would compute something else; use "
            "zero_optimization.stage 0 in fp32, or an elementwise optimizer (Adam, AdamW, SGD, Lion, ...)"
        )
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not config.zero_allow_untested_optimizer:
        raise ConfigError(
            f"optimizer {name} is not one zerotrain has checked with {where}: the optimizer steps flat "
            "shards that cut across parameters, which is only right for an elementwise update (Adam, "
            "AdamW, SGD, Adagrad, RMSprop, Lion, ...). If its update of each element depends only on "
            'that element\'s gradient and state, set "zero_allow_untested_optimizer": true in the '
            "config; otherwise use zero_optimization.stage 0 in fp32"
        )
    warnings.warn(
        f"zero_allow_untested_optimizer: {name} runs on flat shards with {where}; its results "
        "are right only if its update is elementwise",
        UserWarning,
        stacklevel=2,
    )


def _where(config: Any) -> str:
    stage = config.zero_optimization.stage
    if stage >= 1:
        return f"zero_optimization.stage={stage}"
    return "fp16" if config.fp16.enabled else "bf16"
