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

from zerotrain.offload.aio import ALIGN, AsyncFileIO, direct_io_supported, round_up
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
        raise OffloadError(f"zero_optimization.{what} {path!r} does not exist: create it "
                           "(a directory on the NVMe drive) or point nvme_path at one")
    if not os.path.isdir(path):
        raise OffloadError(f"zero_optimization.{what} {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadError(f"zero_optimization.{what} {path!r} is not writable by this process "
                           "(user id %d): fix its permissions or choose another directory" % os.getuid())


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
        return {k: v.dtype for k, v in probe.state[p].items()
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == 8}
    except Exception:  # noqa: BLE001 - an unusual constructor: estimate instead
        return None


class NvmeOptimizerOffload:
    """This rank's swap folder ``<nvme_path>/zerotrain-swap-<host>-<pid>-rank<r>-<id>`` and the
    swapper over it. The folder is removed by ``close()``, at interpreter exit, or when this
    object is garbage collected, whichever comes first."""

    def __init__(self, settings: NvmeSettings, optimizer, rank: int, planned: list[tuple[int, int]],
                 swap_master: bool, local_ranks: int = 1):
        """``planned``: ``(param group, shard elements)`` of every trained unit to come, for the
        disk-space check made before anything is written."""
        if settings.buffer_count < 1:
            raise OffloadError("zero_optimization.offload_optimizer.buffer_count must be at least 1 "
                               f"(got {settings.buffer_count}): each buffer holds one chunk in memory")
        check_folder(settings.path)
        name = f"zerotrain-swap-{socket.gethostname()}-{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}"
        self.folder = os.path.join(os.path.abspath(settings.path), name)
        try:
            os.mkdir(self.folder, 0o700)
        except OSError as error:
            raise OffloadError(f"cannot create the swap folder {self.folder}: {error}") from None
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)
        try:
            self.need_bytes = self._required_bytes(optimizer, planned, settings.chunk_numel,
                                                   swap_master)
            self._check_space(settings.path, local_ranks)
            direct = direct_io_supported(self.folder)
            if not direct:
                logger.warning("offload: %s does not accept O_DIRECT; swap files use buffered I/O "
                               "(through the page cache)", settings.path)
            self.io = AsyncFileIO(settings.threads, settings.block_size, settings.queue_depth, direct)
            self.swapper = OptimizerSwapper(self.folder, settings.chunk_numel,
                                            settings.buffer_count, self.io, settings.pin_memory)
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
                logger.warning("offload: could not probe %s's state; assuming Adam's (two fp32 "
                               "tensors per element) for the disk-space check", type(optimizer).__name__)
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
                f"rank{ranks} ({need} bytes): free space or choose a larger drive")

    def close(self) -> None:
        io = getattr(self, "io", None)
        if io is not None:
            io.close()
        self._finalizer()  # removes the folder (once)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
