"""Asynchronous file I/O for swapping tensors: threads over ``os.preadv`` / ``os.pwritev``.

Both calls release the GIL, so a few threads keep the disk busy while the main thread computes;
no compiled extension is needed. Files are opened with ``O_DIRECT`` where the file system allows
it (buffers, sizes and offsets are then 4096-byte aligned, and the page cache is bypassed); where
it does not (tmpfs, some network file systems) I/O is buffered.

Every swap file is written whole in one operation as ``data (padded to 4096) + trailer block``.
The trailer records a magic number, the write's generation and the data length; a read checks
the file's size and trailer, so a truncated, deleted, replaced or half-written file is reported
with its path instead of being read as good state.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

ALIGN = 4096
_MAGIC = b"ZTSWAP01"
_TRAILER = struct.Struct("<8sQQ")  # magic, generation, data bytes


class SwapFileError(RuntimeError):
    """A swap file is missing, truncated or does not hold the last write."""


def round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_bytes(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host tensor of ``round_up(nbytes)`` bytes whose address is 4096-aligned (what
    O_DIRECT needs), page-locked when ``pin`` and the accelerator supports it."""
    from zerotrain.accelerator import get_accelerator

    size = round_up(nbytes)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    if pin:
        raw = get_accelerator().pin_memory(raw)
    skip = (-raw.data_ptr()) % ALIGN
    return raw.narrow(0, skip, size)


def direct_io_supported(folder: str) -> bool:
    """Whether ``folder``'s file system accepts an aligned O_DIRECT write."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(folder, f".zerotrain-odirect-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [memoryview(aligned_bytes(ALIGN).numpy())], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


class DiskActivity:
    """Wall time during which at least one swap-file read or write was under way, across the
    ``AsyncFileIO`` objects that share it: the I/O time a step spent, to compare with the bytes it
    moved over the disk's bandwidth (overlapping operations count once). Each ZeRO stage object
    owns one and hands it to its swappers' ``AsyncFileIO``, so one engine's ``io_busy_s`` counts
    its own swap files only, not another engine's in the same process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._busy = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy += time.perf_counter() - self._since

    @property
    def busy_s(self) -> float:
        with self._lock:
            running = time.perf_counter() - self._since if self._active else 0.0
            return self._busy + running


class AsyncFileIO:
    """Reads and writes whole swap files on ``threads`` background threads.

    ``block_size``: bytes per system call (a large file is written in several); ``queue_depth``:
    how many file operations may be queued at once (submitting more waits); ``activity``: the
    ``DiskActivity`` its operations are timed in (shared by the swappers of one stage; None: its
    own)."""

    def __init__(
        self,
        threads: int = 1,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        direct: bool = True,
        activity: DiskActivity | None = None,
    ):
        self.activity = activity if activity is not None else DiskActivity()
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.block_size = max(ALIGN, round_up(block_size))
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="zerotrain-swap")
        self._slots = threading.BoundedSemaphore(max(1, queue_depth))
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0

    def write(self, path: str, buffer: torch.Tensor, nbytes: int, generation: int) -> Future:
        """Write ``nbytes`` of ``buffer`` (an ``aligned_bytes`` tensor with room for the data
        padded to 4096 plus one trailer block) to ``path``, replacing it."""
        data = round_up(nbytes)
        trailer = buffer.narrow(0, data, ALIGN)
        trailer.zero_()
        trailer.narrow(0, 0, _TRAILER.size).copy_(
            torch.frombuffer(bytearray(_TRAILER.pack(_MAGIC, generation, nbytes)), dtype=torch.uint8)
        )
        if data > nbytes:  # padding is written too: keep it deterministic
            buffer.narrow(0, nbytes, data - nbytes).zero_()
        return self._submit(self._write, path, buffer.narrow(0, 0, data + ALIGN))

    def read(self, path: str, buffer: torch.Tensor, nbytes: int, generation: int) -> Future:
        """Read what ``write`` wrote under ``generation`` into ``buffer``; the future raises
        ``SwapFileError`` naming ``path`` if the file is not exactly that write."""
        return self._submit(self._read, path, buffer.narrow(0, 0, round_up(nbytes) + ALIGN), nbytes, generation)

    def _submit(self, fn, *args) -> Future:
        self._slots.acquire()
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def _open(self, path: str, flags: int) -> int:
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                self.direct = False  # this file system refuses O_DIRECT: buffered from now on
        return os.open(path, flags, 0o600)

    def _write(self, path: str, view: torch.Tensor) -> None:
        try:
            fd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError as error:
            raise SwapFileError(f"cannot write swap file {path}: {error}") from None
        try:
            mem = memoryview(view.numpy())
            offset = 0
            with self.activity:
                while offset < len(mem):
                    end = min(len(mem), offset + self.block_size)
                    written = os.pwritev(fd, [mem[offset:end]], offset)
                    if written <= 0:
                        raise OSError(errno.EIO, "short write")
                    offset += written
        except OSError as error:
            hint = (
                " (the disk is full: free space or point nvme_path at a larger drive)"
                if error.errno == errno.ENOSPC
                else ""
            )
            raise SwapFileError(f"writing swap file {path} failed: {error}{hint}") from None
        finally:
            os.close(fd)
        with self._lock:
            self.bytes_written += len(mem)

    def _read(self, path: str, view: torch.Tensor, nbytes: int, generation: int) -> None:
        try:
            fd = self._open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise SwapFileError(
                f"swap file {path} is gone (deleted while training?): the "
                "optimizer state it held is lost; restart from a checkpoint"
            ) from None
        except OSError as error:
            raise SwapFileError(f"cannot read swap file {path}: {error}") from None
        try:
            size = os.fstat(fd).st_size
            if size != view.numel():
                raise SwapFileError(
                    f"swap file {path} has {size} bytes, {view.numel()} were written: it was "
                    "truncated or replaced while training; restart from a checkpoint"
                )
            mem = memoryview(view.numpy())
            offset = 0
            with self.activity:
                while offset < len(mem):
                    end = min(len(mem), offset + self.block_size)
                    got = os.preadv(fd, [mem[offset:end]], offset)
                    if got <= 0:
                        raise SwapFileError(
                            f"swap file {path} ended after {offset} bytes of "
                            f"{len(mem)}: it was truncated while training"
                        )
                    offset += got
        except OSError as error:
            raise SwapFileError(f"reading swap file {path} failed: {error}") from None
        finally:
            os.close(fd)
        magic, written_generation, written_bytes = _TRAILER.unpack(
            bytes(mem[round_up(nbytes) : round_up(nbytes) + _TRAILER.size])
        )
        if magic != _MAGIC or written_generation != generation or written_bytes != nbytes:
            raise SwapFileError(
                f"swap file {path} does not hold the last completed write (generation "
                f"{written_generation} of {generation}, {written_bytes} bytes of {nbytes}): it was "
                "overwritten or only partly written; restart from a checkpoint"
            )
        with self._lock:
            self.bytes_read += len(mem)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def wait(futures, clock: list[float] | None = None) -> None:
    """Wait for ``futures`` (re-raising the first error); adds the seconds waited to
    ``clock[0]``."""
    start = time.perf_counter()
    try:
        for future in futures:
            future.result()
    finally:
        if clock is not None:
            clock[0] += time.perf_counter() - start
