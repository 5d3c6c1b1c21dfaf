"""Give memory the allocator keeps after large frees back to the operating system.

glibc's malloc keeps freed heap memory for reuse; when full-size temporaries (a module's whole
parameters during ``zero.Init``, gathered units) alternate with long-lived shards, the freed gaps
pile up and the resident size grows past what is held. ``malloc_trim(0)`` returns free pages,
including those in the middle of the heap. Elsewhere (other C libraries, non-Linux) this is a
no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Return the allocator's free pages to the OS (cheap; safe to call often)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
