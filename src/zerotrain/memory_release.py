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
import os

# glibc's mallopt parameter, and the size from which allocations get their own mmap (returned to
# the OS on free). glibc's default starts at 128 KiB but raises itself up to 32 MiB after the
# first such free, after which model-sized temporaries (gloo's gather/scatter copies, autograd's
# per-step gradients and activations) come from the heap and stay resident once freed.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 4 * 2**20


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


# The config's ``memory_release`` (zerotrain only), process-wide like the allocator it tunes:
# "eager" fixes glibc's mmap threshold and hands freed memory back to the OS several times a step
# (lowest peak RSS; every page handed back is zero-filled again by the kernel when reused: 20-35%
# of a CPU step's time on the GPT-2 benchmarks, docs/benchmarks.md); "per_step" leaves the
# threshold to glibc and hands memory back once a step, before backward allocates gradients
# beside the saved activations (DDP's step time, a peak between the two); "off" leaves glibc alone
# during training. One-time releases (after building the stage, zero.Init) happen under each.
MEMORY_RELEASE_POLICIES = ("eager", "per_step", "off")
_policy = {"name": os.environ.get("ZEROTRAIN_MEMORY_RELEASE", "eager")}


def default_memory_release(stage: int) -> str:
    """Stage 3 is chosen for memory: "eager". Stages 0-2 are chosen for speed: "per_step"."""
    return "eager" if stage == 3 else "per_step"


def set_memory_release(policy: str | None, stage: int = 3) -> None:
    """Select the policy: the config's, else ``ZEROTRAIN_MEMORY_RELEASE``, else the default for
    ``stage`` (:func:`default_memory_release`)."""
    name = policy or os.environ.get("ZEROTRAIN_MEMORY_RELEASE") or default_memory_release(stage)
    if name not in MEMORY_RELEASE_POLICIES:
        raise ValueError(f"memory_release must be one of {', '.join(MEMORY_RELEASE_POLICIES)}, "
                         f"got {name!r} (config key memory_release or ZEROTRAIN_MEMORY_RELEASE)")
    _policy["name"] = name


def memory_release() -> str:
    return _policy["name"]


def configure_allocator() -> bool:
    """Under the "eager" policy, fix glibc's mmap threshold at 4 MiB (once per process;
    ``ZEROTRAIN_MALLOC_TUNING=0`` leaves the allocator alone). Allocations of 4 MiB or more are
    then always mmapped and go back to the OS when freed, so peak RSS tracks the bytes actually
    live; smaller ones stay on the fast heap. glibc cannot undo this, so a process that built an
    "eager" engine (or ran zero.Init without a config saying "off") keeps it. Returns whether the
    setting is in force."""
    if os.environ.get("ZEROTRAIN_MALLOC_TUNING", "1") == "0" or memory_release() != "eager":
        return False
    return _fix_mmap_threshold()


@functools.lru_cache(maxsize=1)
def _fix_mmap_threshold() -> bool:
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release_freed_memory() -> None:
    """Return the allocator's free pages to the OS now (for one-time releases; per-step ones go
    through :func:`release_before_backward`, :func:`release_between_phases` and
    :class:`TrimEvery`, which follow the policy)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


def release_before_backward() -> None:
    """The release at the start of backward (what forward and the loss freed goes back before
    backward allocates gradients and gathers beside the saved activations): under "eager" and
    "per_step"."""
    if memory_release() != "off":
        release_freed_memory()


def release_between_phases() -> None:
    """A per-step release elsewhere (after the optimizer step), under the "eager" policy."""
    if memory_release() == "eager":
        release_freed_memory()


class TrimEvery:
    """Release freed memory once per ``numel`` gradient elements reduced in backward.

    Backward frees activations (mostly below glibc's mmap threshold, so they stay in its heap)
    while the next units' full-size gradients are allocated (mmapped): without handing the freed
    heap back, RSS is the sum of both. Trimming once per bucket costs a few ms per step (plus
    re-faulting the pages in the next forward)."""

    def __init__(self, numel: int):
        self.numel = max(1, numel)
        self._since = 0

    def reduced(self, numel: int) -> None:
        if memory_release() != "eager":
            return
        self._since += numel
        if self._since >= self.numel:
            self._since = 0
            release_freed_memory()
