"""NVMe offload of a ``ZeroStage``: building its optimizer and parameter swappers after checking
path and free space for the planned units, and reading their numbers for ``offload_stats``."""

from __future__ import annotations

import torch

from zerotrain.offload.aio import DiskActivity
from zerotrain.offload.placement import Placement
from zerotrain.precision import PrecisionPolicy
from zerotrain.zero.init import is_partitioned
from zerotrain.zero.partition import shard_alignment


def _shard_worlds(plan, shard_world: int, specs) -> list[int]:
    """Each planned unit's shard count: ``shard_world``, or its own group's size where
    ``specs`` gives one (experts, sharded over their expert-data group)."""
    specs = specs if specs is not None else [None] * len(plan)
    return [shard_world if spec is None or shard_world == 1 else spec.size for spec in specs]


def optimizer_offload(placement: Placement, plan, optimizer, shard_world: int, rank: int,
                  precision: PrecisionPolicy, activity: DiskActivity, specs=None):
    """The swap folder and swapper, after checking path and free space for the planned units
    (``specs``: each unit's ``UnitReduction`` or None, as ``split_by_reduction`` gives them)."""
    from zerotrain.offload import NvmeOptimizerOffload

    align = shard_alignment(precision.param_dtype)
    planned = []
    for (g, params), world in zip(plan, _shard_worlds(plan, shard_world, specs)):
        if g is not None:
            numel = sum(p._zerotrain_layout.numel if is_partitioned(p) else p.numel() for p in params)
            planned.append((g, -(-numel // (world * align)) * align))
    first = next((p for _, params in plan for p in params), None)
    on_host = first is None or first.device.type == "cpu"
    return NvmeOptimizerOffload(placement.nvme, optimizer, rank, planned,
                                swap_master=precision.mixed or not on_host,
                                local_ranks=placement.local_ranks, activity=activity)


def param_offload(placement: Placement, plan, shard_world: int, rank: int,
                        precision: PrecisionPolicy, optimizer_offload, activity: DiskActivity,
                        specs=None):
    """The parameter swap folder, after checking path and free space for every unit's shard."""
    from zerotrain.offload import NvmeParamOffload
    from zerotrain.offload.aio import ALIGN, round_up

    align = shard_alignment(precision.param_dtype)
    itemsize = torch.empty((), dtype=precision.param_dtype).element_size()
    need = 0
    for (_, params), world in zip(plan, _shard_worlds(plan, shard_world, specs)):
        numel = sum(p._zerotrain_layout.numel if is_partitioned(p) else p.numel() for p in params)
        need += round_up(-(-numel // (world * align)) * align * itemsize) + ALIGN
    also = ((optimizer_offload.folder, optimizer_offload.need_bytes)
            if optimizer_offload is not None else None)
    return NvmeParamOffload(placement.param_nvme, rank, need, placement.local_ranks, also,
                            activity=activity)


def offload_stats(stage) -> dict:
    """NVMe optimizer offload, last step: ``bytes_read``, ``bytes_written``, ``io_wait_s``
    (the step's time blocked on swap I/O), ``step_s``, ``io_wait_share``, ``io_busy_s`` (wall
    time with any swap read or write under way, parameters' and gradients' included, from
    the previous step's end to this one's); and the swap footprint: ``swap_file_bytes`` on
    disk, ``swap_buffer_bytes`` in memory. Empty without NVMe offload."""
    if stage.offload is None:
        return {}
    swapper = stage.offload.swapper
    stats = dict(swapper.stats)
    stats["io_wait_share"] = stats["io_wait_s"] / stats["step_s"] if stats["step_s"] else 0.0
    stats["swap_file_bytes"] = swapper.file_nbytes()
    stats["swap_buffer_bytes"] = swapper.buffer_nbytes
    stats["direct_io"] = stage.offload.io.direct
    stats["io_busy_s"] = stage._io_busy_s
    if stage.param_offload is not None:
        params = stage.param_offload.swapper
        if stage.grad_swapper is not None:
            grads = stage.grad_swapper
            stats["grads"] = {**getattr(stage, "_grad_io", grads.stats),
                              "swap_file_bytes": grads.file_nbytes(),
                              "resident_bytes": grads.resident_nbytes}
        stats["params"] = {**getattr(stage, "_param_io", params.stats),
                           "swap_file_bytes": params.file_nbytes(),
                           "swap_buffer_bytes": params.buffer_nbytes,
                           "resident_bytes": params.resident_nbytes,
                           "peak_resident_numel": params.peak_resident_numel}
    return stats
