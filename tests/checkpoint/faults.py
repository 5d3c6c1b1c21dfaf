"""Filesystem fault injection for the checkpoint crash tests.

``FileSystemCalls`` wraps every filesystem call that changes state or may fail while a
checkpoint is saved -- ``open`` (builtins, io and os), the first write to each file opened for binary
writing, ``fsync``, ``mkdir``, ``rename``/``replace``, ``unlink``/``remove``, ``rmdir``,
``chmod``, ``shutil.rmtree`` and ``shutil.copyfile`` (``rmtree``'s own unlinks and rmdirs are
counted too) -- numbers them, and before call number ``at`` runs ``action(call)``: ``os._exit``
for a crash (SIGKILL-like: nothing is cleaned up, no ``finally`` runs), or raising
``OSError(ENOSPC)`` for a full disk.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import threading
from pathlib import Path

# Calls that can fail with ENOSPC (creating or growing something); deletions cannot.
CAN_RUN_OUT_OF_SPACE = {"open-w", "os.open-w", "write", "fsync", "mkdir", "replace", "rename", "copyfile"}


def _short(arg) -> str:
    return Path(os.fsdecode(arg)).name if isinstance(arg, (str, bytes, os.PathLike)) else str(arg)


class FileSystemCalls:
    """Count (and fault) filesystem calls between ``install()`` and ``uninstall()``."""

    def __init__(self, at: int | None = None, action=None, kinds=None):
        self.at, self.action, self.kinds = at, action, kinds
        self.calls: list[tuple] = []
        self._lock = threading.Lock()
        self._saved: list[tuple] = []

    def hit(self, kind: str, *args) -> None:
        if self.kinds is not None and kind not in self.kinds:
            return
        with self._lock:
            call = (kind, *map(_short, args))
            self.calls.append(call)
            if len(self.calls) == self.at:
                self.action(call, self.calls[:-1])

    def install(self) -> FileSystemCalls:
        hit = self.hit
        real_open, real_os_open = builtins.open, os.open

        class Writer(io.BufferedWriter):
            """Counts its first write: a crash before any later write to the same file leaves
            the same kind of state (a file with a prefix of its content) in the same place."""

            started = False

            def write(self, data):
                if not self.started:
                    self.started = True
                    hit("write", self.raw.name)
                return super().write(data)

        def counting_open(file, mode="r", *args, **kwargs):
            if isinstance(file, int):
                return real_open(file, mode, *args, **kwargs)
            writing = any(c in mode for c in "wax+")
            hit("open-w" if writing else "open-r", file)
            if mode in ("wb", "xb", "ab") and not args and not kwargs:
                return Writer(io.FileIO(file, mode.replace("b", "")))
            return real_open(file, mode, *args, **kwargs)

        def counting_os_open(path, flags, *args, **kwargs):
            hit("os.open-w" if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) else "os.open-r", path)
            return real_os_open(path, flags, *args, **kwargs)

        def wrap(module, name, kind=None, show=1):
            real = getattr(module, name)

            def wrapper(*args, **kwargs):
                hit(kind or name, *args[:show])
                return real(*args, **kwargs)

            self._saved.append((module, name, real))
            setattr(module, name, wrapper)

        for module, name, real, new in (
            (builtins, "open", real_open, counting_open),
            (io, "open", io.open, counting_open),
            (os, "open", real_os_open, counting_os_open),
        ):
            self._saved.append((module, name, real))
            setattr(module, name, new)
        wrap(os, "fsync")
        wrap(os, "mkdir")
        wrap(os, "rename", show=2)
        wrap(os, "replace", show=2)
        wrap(os, "unlink")
        wrap(os, "remove", "unlink")
        wrap(os, "rmdir")
        wrap(os, "chmod")
        wrap(shutil, "rmtree")
        wrap(shutil, "copyfile", show=2)
        return self

    def uninstall(self) -> None:
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)
        self._saved.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()


def no_space(call, _calls) -> None:
    raise OSError(errno.ENOSPC, f"No space left on device (injected before {call[0]} {call[1:]})")
