"""Offload of optimizer state (stages 1-3) and parameters (stage 3) to host memory or NVMe.

``build_placement(config)`` turns ``zero_optimization.offload_optimizer`` / ``offload_param``
and the ``aio`` section into the ``Placement`` ``ZeroStage``'s units are built with (see
docs/offload.md):

- ``offload_optimizer.device: "cpu"``: fp32 masters, and so the optimizer state the optimizer
  allocates beside them, live in host memory (page-locked with ``pin_memory`` where the
  accelerator supports it); the optimizer step runs there.
- ``offload_optimizer.device: "nvme"``: masters and state live in swap files under
  ``nvme_path`` and are stepped chunk by chunk (``zerotrain.offload.swapper``).
- ``offload_param.device: "cpu"`` (stage 3): the partitioned shards live in host memory and are
  copied to the device when gathered.
- ``offload_param.device: "nvme"`` (stage 3, with ``offload_optimizer.device: "nvme"``): the
  partitioned shards live in swap files, at most ``max_in_cpu`` elements of them in host memory
  (``zerotrain.offload.params``), read ahead of use along the recorded module order.
"""

from __future__ import annotations

import logging
import os

import torch

from zerotrain.offload.aio import SwapFileError
from zerotrain.offload.nvme import (
    MAX_CHUNK_NUMEL,
    NvmeOptimizerOffload,
    NvmeParamOffload,
    NvmeParamSettings,
    NvmeSettings,
    OffloadError,
)
from zerotrain.offload.placement import Placement

__all__ = [
    "build_placement",
    "describe_stats",
    "Placement",
    "NvmeSettings",
    "NvmeOptimizerOffload",
    "NvmeParamSettings",
    "NvmeParamOffload",
    "OffloadError",
    "SwapFileError",
    "HOST",
]

logger = logging.getLogger("zerotrain")

#: Host memory is torch's "cpu" device whatever the accelerator is.
HOST = torch.device("cpu")


def describe_stats(stats: dict) -> str:
    """One line of a stage's ``statistics().offload`` (optimizer, parameter and gradient swap files
    together) for the step log and ``memory_status``; empty without NVMe offload."""
    if not stats:
        return ""
    parts = [stats] + [stats[k] for k in ("params", "grads") if k in stats]
    read = sum(p["bytes_read"] for p in parts)
    written = sum(p["bytes_written"] for p in parts)
    wait_s = sum(p["io_wait_s"] for p in parts)
    disk = sum(p.get("swap_file_bytes", 0) for p in parts)
    return (
        f"offload read={read / 2**30:.3f}GB written={written / 2**30:.3f}GB "
        f"io_wait={wait_s:.2f}s io_busy={stats.get('io_busy_s', 0.0):.2f}s "
        f"swap_on_disk={disk / 2**30:.3f}GB"
    )


def chunk_numel(zero_config) -> int:
    """Elements per swapped chunk: ``sub_group_size`` rounded up to a multiple of 1024, at most
    ``MAX_CHUNK_NUMEL``. (Whole multiples of the CPU's vector width give every element of a chunk
    the same arithmetic as in one whole-shard update, so results are bit-identical.)"""
    asked = -(-int(zero_config.sub_group_size) // 1024) * 1024
    if asked > MAX_CHUNK_NUMEL:
        if "sub_group_size" in zero_config.model_fields_set:
            logger.info(
                "offload: sub_group_size %d is capped at %d elements per swapped chunk, so "
                "the update keeps at most buffer_count chunks in memory",
                asked,
                MAX_CHUNK_NUMEL,
            )
        return MAX_CHUNK_NUMEL
    return max(1, asked)


def build_placement(config):
    """The ``Placement`` for ``config``'s offload settings (no offload: the default one)."""
    from zerotrain.config.zero import AioConfig

    zero = config.zero_optimization
    optimizer_device = zero.offload_optimizer_device
    param_device = zero.offload_param_device
    try:  # validated even when unused, so a mistake there is heard about
        aio = AioConfig.model_validate(getattr(config, "aio", None) or {})
    except Exception as error:  # noqa: BLE001 - pydantic's message names the field
        raise ValueError(f"invalid 'aio' section: {error}") from None
    if optimizer_device == "none" and param_device == "none":
        return Placement()
    nvme = None
    pin = False
    if optimizer_device != "none":
        section = zero.offload_optimizer
        pin = section.pin_memory
        if optimizer_device == "nvme":
            nvme = NvmeSettings(
                path=str(section.nvme_path),
                buffer_count=int(section.buffer_count),
                pin_memory=section.pin_memory,
                chunk_numel=chunk_numel(zero),
                block_size=int(aio.block_size),
                queue_depth=int(aio.queue_depth),
                threads=int(aio.intra_op_parallelism),
            )
    param_nvme = None
    if param_device == "nvme":
        section = zero.offload_param
        param_nvme = NvmeParamSettings(
            path=str(section.nvme_path),
            buffer_count=int(section.buffer_count),
            buffer_numel=int(section.buffer_size),
            max_in_cpu=int(section.max_in_cpu),
            pin_memory=section.pin_memory,
            block_size=int(aio.block_size),
            queue_depth=int(aio.queue_depth),
            threads=int(aio.intra_op_parallelism),
        )
    return Placement(
        master_device=HOST if optimizer_device != "none" else None,
        pin_memory=pin,
        param_device=HOST if param_device in ("cpu", "nvme") else None,
        param_nvme=param_nvme,
        param_pin_memory=bool(zero.offload_param and zero.offload_param.pin_memory),
        nvme=nvme,
        local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
    )
