"""NVMe offload of a ``ZeroStage``: building its optimizer and parameter swappers after checking
path and free space for the planned units, and their numbers (``SwapStatistics``)."""

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


def optimizer_offload(
    placement: Placement,
    plan,
    optimizer,
    shard_world: int,
    rank: int,
    precision: PrecisionPolicy,
    activity: DiskActivity,
    specs=None,
):
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
    assert placement.nvme is not None  # called only where the placement swaps to NVMe
    return NvmeOptimizerOffload(
        placement.nvme,
        optimizer,
        rank,
        planned,
        swap_master=precision.mixed or not on_host,
        local_ranks=placement.local_ranks,
        activity=activity,
    )


def param_offload(
    placement: Placement,
    plan,
    shard_world: int,
    rank: int,
    precision: PrecisionPolicy,
    optimizer_offload,
    activity: DiskActivity,
    specs=None,
):
    """The parameter swap folder, after checking path and free space for every unit's shard."""
    from zerotrain.offload import NvmeParamOffload
    from zerotrain.offload.aio import ALIGN, round_up

    align = shard_alignment(precision.param_dtype)
    itemsize = torch.empty((), dtype=precision.param_dtype).element_size()
    need = 0
    for (_, params), world in zip(plan, _shard_worlds(plan, shard_world, specs)):
        numel = sum(p._zerotrain_layout.numel if is_partitioned(p) else p.numel() for p in params)
        need += round_up(-(-numel // (world * align)) * align * itemsize) + ALIGN
    also = (optimizer_offload.folder, optimizer_offload.need_bytes) if optimizer_offload is not None else None
    assert placement.param_nvme is not None  # called only where the placement swaps to NVMe
    return NvmeParamOffload(placement.param_nvme, rank, need, placement.local_ranks, also, activity=activity)


class SwapStatistics:
    """NVMe offload's numbers for ``StageStatistics.offload``, over the swap parts it is given:
    the optimizer's ``NvmeOptimizerOffload``, the parameters' ``NvmeParamOffload`` and the
    reduction's ``GradSwapper`` (None where absent), and the stage's ``DiskActivity``."""

    def __init__(self, optimizer_offload, param_offload, grad_swapper, activity: DiskActivity):
        self._optimizer = optimizer_offload
        self._params = param_offload.swapper if param_offload is not None else None
        self._grads = grad_swapper
        self._activity = activity
        self._busy_since, self._busy_s = 0.0, 0.0
        self._param_io: dict | None = None  # the last step's reads and writes of shards
        self._grad_io: dict | None = None

    def step_done(self) -> None:
        """Take the step's I/O of the parameter and gradient swappers and the disk's busy time
        since the previous step's end."""
        if self._params is not None:
            self._param_io = self._params.take_stats()
        if self._grads is not None:
            self._grad_io = self._grads.take_stats()
        self._busy_s = self._activity.busy_s - self._busy_since
        self._busy_since = self._activity.busy_s

    def as_dict(self) -> dict:
        """NVMe optimizer offload, last step: ``bytes_read``, ``bytes_written``, ``io_wait_s``
        (the step's time blocked on swap I/O), ``step_s``, ``io_wait_share``, ``io_busy_s``
        (wall time with any swap read or write under way, parameters' and gradients' included,
        from the previous step's end to this one's); and the swap footprint:
        ``swap_file_bytes`` on disk, ``swap_buffer_bytes`` in memory. Empty without NVMe
        optimizer offload."""
        if self._optimizer is None:
            return {}
        swapper = self._optimizer.swapper
        stats = dict(swapper.stats)
        stats["io_wait_share"] = stats["io_wait_s"] / stats["step_s"] if stats["step_s"] else 0.0
        stats["swap_file_bytes"] = swapper.file_nbytes()
        stats["swap_buffer_bytes"] = swapper.buffer_nbytes
        stats["direct_io"] = self._optimizer.io.direct
        stats["io_busy_s"] = self._busy_s
        if self._params is not None:
            params, grads = self._params, self._grads
            if grads is not None:
                stats["grads"] = {
                    **(self._grad_io if self._grad_io is not None else grads.stats),
                    "swap_file_bytes": grads.file_nbytes(),
                    "resident_bytes": grads.resident_nbytes,
                }
            stats["params"] = {
                **(self._param_io if self._param_io is not None else params.stats),
                "swap_file_bytes": params.file_nbytes(),
                "swap_buffer_bytes": params.buffer_nbytes,
                "resident_bytes": params.resident_nbytes,
                "peak_resident_numel": params.peak_resident_numel,
            }
        return stats
