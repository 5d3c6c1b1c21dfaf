"""What ``zero.Init`` reads from a DeepSpeed config: the partitions' dtype, the ``offload_param``
section and the memory-release policy, with unfilled ``"auto"`` values left to their defaults."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zerotrain.memory_release import set_memory_release

if TYPE_CHECKING:
    from zerotrain.config import OffloadParamConfig


def dtype_from_config(config_dict_or_path, group=None) -> tuple[torch.dtype, OffloadParamConfig | None]:
    """DeepSpeed's reading of a ds_config in zero.Init: the partitions' dtype, and the
    ``offload_param`` section when its device is not "none". Also applies the config's
    ``memory_release`` (zerotrain only), before Init tunes the allocator. Batch sizes are
    checked against the data-parallel ``group``'s size (None: the world)."""
    from zerotrain.config import load_config
    from zerotrain.config.load import read_config

    if dist.is_initialized():
        world = dist.get_world_size(group)
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    data = _without_auto(read_config(config_dict_or_path))
    if "train_batch_size" not in data and "train_micro_batch_size_per_gpu" not in data:
        data["train_micro_batch_size_per_gpu"] = 1  # all "auto": Init reads no batch size
    cfg = load_config(data, world_size=world)
    set_memory_release(cfg.memory_release)
    zero = cfg.zero_optimization
    offload = zero.offload_param if zero.offload_param_device != "none" else None
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if getattr(zero, key):
            raise NotImplementedError(
                f"zero.Init: the config's zero_optimization.{key} (ZeRO++) is not implemented; set it to false"
            )
    if zero.zero_hpz_partition_size > 1:
        raise NotImplementedError(
            "zero.Init: the config's zero_optimization."
            "zero_hpz_partition_size > 1 (hpZ) is not implemented; set it to 1"
        )
    if cfg.bf16.enabled:
        return torch.bfloat16, offload
    if cfg.fp16.enabled:
        return torch.float16, offload
    return torch.float32, offload


def _without_auto(data):
    """``data`` without its unfilled ``"auto"`` values (keys holding "auto", or a list with one),
    so their defaults apply, as DeepSpeed's ``zero.Init`` reads a config: transformers creates
    ``zero.Init`` from a config whose model-dependent "auto" values (``reduce_bucket_size``, ...)
    are filled only later, at ``initialize``; accelerate likewise before ``prepare``."""
    if isinstance(data, dict):
        return {key: _without_auto(value) for key, value in data.items() if not _is_auto(value)}
    return data


def _is_auto(value) -> bool:
    if isinstance(value, list):
        return any(_is_auto(item) for item in value)
    return isinstance(value, str) and value == "auto"
