"""The NVMe swap folder of one rank: checks at initialize, the swapper, removal at exit."""

from __future__ import annotations

import collections
import copy
import logging
import os
import shutil
import socket
import uuid
import weakref
from dataclasses import dataclass

import torch

from zerotrain.offload.aio import ALIGN, AsyncFileIO, DiskActivity, direct_io_supported, round_up
from zerotrain.offload.swapper import OptimizerSwapper

logger = logging.getLogger("zerotrain")

GiB = 2**30
#: Largest chunk (elements) when ``sub_group_size`` asks for more: DeepSpeed's default 1e9 pulls a
#: whole model's state into memory for the update, which is what offload is meant to avoid.
MAX_CHUNK_NUMEL = 2**24


class OffloadError(ValueError):
    """An offload setting cannot work on this machine (path, permissions, space)."""


@dataclass(frozen=True)
class NvmeSettings:
    """``offload_optimizer`` with ``device: "nvme"`` and the ``aio`` section, as the swapper uses
    them."""

    path: str
    buffer_count: int = 4
    pin_memory: bool = False
    chunk_numel: int = MAX_CHUNK_NUMEL
    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1


def check_folder(path: str, what: str = "offload_optimizer.nvme_path") -> None:
    """Fail with the fix when ``path`` is not an existing, writable directory."""
    if not os.path.exists(path):
        raise OffloadError(
            f"zero_optimization.{what} {path!r} does not exist: create it "
            "(a directory on the NVMe drive) or point nvme_path at one"
        )
    if not os.path.isdir(path):
        raise OffloadError(f"zero_optimization.{what} {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadError(
            f"zero_optimization.{what} {path!r} is not writable by this process "
            "(user id %d): fix its permissions or choose another directory" % os.getuid()
        )


def _probe_state(optimizer, group: dict) -> dict[str, torch.dtype] | None:
    """The elementwise state tensors the optimizer creates for a parameter of ``group``: one
    step of a fresh optimizer of the same class on an 8-element tensor (None if that fails)."""
    try:
        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = torch.zeros(8)
        probe = copy.copy(optimizer)  # same class and settings, its own groups and state
        probe.param_groups = [{**group, "params": [p]}]
        probe.state = collections.defaultdict(dict)
        probe.step()
        return {k: v.dtype for k, v in probe.state[p].items() if torch.is_tensor(v) and v.dim() == 1 and v.numel() == 8}
    except Exception:  # noqa: BLE001 - an unusual constructor: estimate instead
        return None


def _make_run_folder(path: str, rank: int, kind: str = "swap") -> str:
    name = f"zerotrain-{kind}-{socket.gethostname()}-{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}"
    folder = os.path.join(os.path.abspath(path), name)
    try:
        os.mkdir(folder, 0o700)
    except OSError as error:
        raise OffloadError(f"cannot create the swap folder {folder}: {error}") from None
    return folder


class NvmeOptimizerOffload:
    """This rank's swap folder ``<nvme_path>/zerotrain-swap-<host>-<pid>-rank<r>-<id>`` and the
    swapper over it. The folder is removed by ``close()``, at interpreter exit, or when this
    object is garbage collected, whichever comes first."""

    def __init__(
        self,
        settings: NvmeSettings,
        optimizer,
        rank: int,
        planned: list[tuple[int, int]],
        swap_master: bool,
        local_ranks: int = 1,
        activity: DiskActivity | None = None,
    ):
        """``planned``: ``(param group, shard elements)`` of every trained unit to come, for the
        disk-space check made before anything is written; ``activity``: the stage's
        ``DiskActivity`` the swap I/O is timed in (None: its own)."""
        if settings.buffer_count < 1:
            raise OffloadError(
                "zero_optimization.offload_optimizer.buffer_count must be at least 1 "
                f"(got {settings.buffer_count}): each buffer holds one chunk in memory"
            )
        check_folder(settings.path)
        self.folder = _make_run_folder(settings.path, rank)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)
        try:
            self.need_bytes = self._required_bytes(optimizer, planned, settings.chunk_numel, swap_master)
            self._check_space(settings.path, local_ranks)
            direct = direct_io_supported(self.folder)
            if not direct:
                logger.warning(
                    "offload: %s does not accept O_DIRECT; swap files use buffered I/O (through the page cache)",
                    settings.path,
                )
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and not any(
                g.get("fused") for g in optimizer.param_groups
            ):
                # bench/adam_kernels.py: fused is ~6x the per-tensor loop torch uses on the CPU
                logger.info(
                    "offload: %s steps the swapped chunks with torch's per-tensor kernel; "
                    "build it with fused=True (or use the config's optimizer section, "
                    "which does) for the fused CPU kernel",
                    type(optimizer).__name__,
                )
            self.io = AsyncFileIO(settings.threads, settings.block_size, settings.queue_depth, direct, activity)
            self.swapper = OptimizerSwapper(
                self.folder, settings.chunk_numel, settings.buffer_count, self.io, settings.pin_memory
            )
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _required_bytes(optimizer, planned, chunk: int, swap_master: bool) -> int:
        """Disk bytes the swap files will take once every chunk has stepped."""
        per_group: dict[int, list[torch.dtype]] = {}
        for g, group in enumerate(optimizer.param_groups):
            found = _probe_state(optimizer, group)
            if found is None:
                logger.warning(
                    "offload: could not probe %s's state; assuming Adam's (two fp32 "
                    "tensors per element) for the disk-space check",
                    type(optimizer).__name__,
                )
                found = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
            per_group[g] = list(found.values()) + ([torch.float32] if swap_master else [])
        total = 0
        for group, numel in planned:
            for start in range(0, numel, chunk):
                n = min(chunk, numel - start)
                total += sum(round_up(n * d.itemsize) + ALIGN for d in per_group[group])
        return total

    def _check_space(self, path: str, local_ranks: int) -> None:
        free = shutil.disk_usage(self.folder).free
        need = self.need_bytes * local_ranks
        if need > free:
            ranks = f" x {local_ranks} ranks on this node" if local_ranks > 1 else ""
            raise OffloadError(
                f"zero_optimization.offload_optimizer.nvme_path {path!r} has {free / GiB:.2f} GiB "
                f"free, but the swapped optimizer state needs {self.need_bytes / GiB:.2f} GiB per "
                f"rank{ranks} ({need} bytes): free space or choose a larger drive"
            )

    def close(self) -> None:
        io = getattr(self, "io", None)
        if io is not None:
            io.close()
        self._finalizer()  # removes the folder (once)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


@dataclass(frozen=True)
class NvmeParamSettings:
    """``offload_param`` with ``device: "nvme"`` (stage 3) and the ``aio`` section."""

    path: str
    buffer_count: int = 5
    buffer_numel: int = int(1e8)
    max_in_cpu: int = int(1e9)
    pin_memory: bool = False
    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1


class NvmeParamOffload:
    """This rank's parameter swap folder ``<nvme_path>/zerotrain-params-<host>-<pid>-rank<r>-<id>``
    and the ``ParamSwapper`` over it; removed like the optimizer's (``close()``, exit, GC)."""

    def __init__(
        self,
        settings: NvmeParamSettings,
        rank: int,
        need_bytes: int,
        local_ranks: int = 1,
        also_on_disk: tuple[str, int] | None = None,
        activity: DiskActivity | None = None,
    ):
        """``need_bytes``: the shards' swap files; ``also_on_disk``: ``(path, bytes)`` of the
        optimizer's swap files, counted too when they share the drive; ``activity``: the
        stage's ``DiskActivity`` (None: its own), shared with the gradient swapper."""
        from zerotrain.offload.params import ParamSwapper

        if settings.buffer_count < 1:
            raise OffloadError(
                f"zero_optimization.offload_param.buffer_count must be at least 1 (got {settings.buffer_count})"
            )
        check_folder(settings.path, "offload_param.nvme_path")
        self.settings = settings
        self.folder = _make_run_folder(settings.path, rank, "params")
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)
        try:
            self.need_bytes = need_bytes
            need = need_bytes
            if also_on_disk is not None and os.stat(also_on_disk[0]).st_dev == os.stat(self.folder).st_dev:
                need += also_on_disk[1]
            free = shutil.disk_usage(self.folder).free
            if need * local_ranks > free:
                raise OffloadError(
                    f"zero_optimization.offload_param.nvme_path {settings.path!r} has "
                    f"{free / GiB:.2f} GiB free, but the swapped parameters need "
                    f"{need_bytes / GiB:.2f} GiB per rank (with the optimizer's swap files on the "
                    f"same drive {need / GiB:.2f} GiB, x {local_ranks} ranks on this node): free "
                    "space or choose a larger drive"
                )
            direct = direct_io_supported(self.folder)
            self.io = AsyncFileIO(settings.threads, settings.block_size, settings.queue_depth, direct, activity)
            self.swapper = ParamSwapper(
                self.folder,
                self.io,
                settings.max_in_cpu,
                settings.buffer_count,
                settings.buffer_numel,
                settings.pin_memory,
            )
        except BaseException:
            self.close()
            raise

    def grad_swapper(self, grads: dict, wait_reduction):
        """A ``GradSwapper`` over the trained units' shard gradients ``grads`` (unit -> tensor),
        in this folder, with the same buffer settings."""
        from zerotrain.offload.params import GradSwapper

        s = self.settings
        return GradSwapper(
            self.folder,
            self.io,
            s.max_in_cpu,
            s.buffer_count,
            s.buffer_numel,
            s.pin_memory,
            grads=grads,
            wait_reduction=wait_reduction,
        )

    def close(self) -> None:
        io = getattr(self, "io", None)
        if io is not None:
            io.close()
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
