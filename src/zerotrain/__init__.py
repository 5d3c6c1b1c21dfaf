"""zerotrain: memory-efficient distributed training for PyTorch with a DeepSpeed-compatible API.

A DeepSpeed script runs after ``import zerotrain as deepspeed``::

    engine, optimizer, dataloader, lr_scheduler = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for batch in dataloader:
        loss = engine(batch["input_ids"], labels=batch["labels"]).loss
        engine.backward(loss)
        engine.step()

Public names are imported on first use, so ``import zerotrain.config`` or the ``zerotrain`` CLI
do not pay for importing the engine (and torch) up front.
"""

from __future__ import annotations

import importlib

from zerotrain._lazy import install_deepspeed_paths

# zerotrain.runtime, zerotrain.moe, ... (DeepSpeed's paths) live in deepspeed_paths/.
install_deepspeed_paths()

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "zerotrain.engine.initialize",
    "ZeroTrainEngine": "zerotrain.engine.engine",
    "init_distributed": "zerotrain.comm.distributed",
    "add_config_arguments": "zerotrain.config",
    "memory_status": "zerotrain.monitor.memory",
    "see_memory_usage": "zerotrain.monitor.memory",
    "MonitorMaster": "zerotrain.monitor",
    "get_accelerator": "zerotrain.accelerator",
    "logger": "zerotrain.log",
    "log_dist": "zerotrain.log",
    "PipelineModule": "zerotrain.pipeline",
    "DummyOptim": "zerotrain.optim.placeholders",
    "DummyScheduler": "zerotrain.optim.placeholders",
}
# DeepSpeed's names for the same things, for code written against deepspeed.*
_ALIASES = {"DeepSpeedEngine": "ZeroTrainEngine"}
# Subpackages reachable as attributes, as ``import deepspeed`` makes its own (``zerotrain.runtime.utils``
# works too: each package loads its DeepSpeed-named submodules on first access, zerotrain._lazy).
_SUBMODULES = {
    "comm",
    "config",
    "engine",
    "optim",
    "zero",
    "models",
    "testing",
    "launcher",
    "monitor",
    "runtime",
    "accelerator",
    "ops",
    "moe",
    "pipe",
    "utils",
    "compression",
    "checkpointing",
    "checkpoint",
    "profiling",
}

__all__ = sorted(set(_EXPORTS) | set(_ALIASES) | {"__version__"})


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES | set(_EXPORTS) | set(_ALIASES))


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"zerotrain.{name}")
    target = _ALIASES.get(name, name)
    if target in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[target]), target)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zerotrain' has no attribute {name!r}")
