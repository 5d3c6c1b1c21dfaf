"""Give memory the allocator keeps after large frees back to the operating system.

glibc's malloc keeps freed heap memory for reuse; when full-size temporaries (a module's whole
parameters during ``zero.Init``, gathered units) alternate with long-lived shards, the freed gaps
pile up and the resident size grows past what is held. ``malloc_trim(0)`` returns free pages,
including those in the middle of the heap. Elsewhere (other C libraries, non-Linux) this is a
no-op, and so it is under tcmalloc, which ``zerotrain launch`` preloads into CPU ranks when it is
installed (launcher/allocator.py): tcmalloc reuses freed blocks by size class, so its heap
neither fragments like glibc's nor needs handing back, and glibc's calls reach glibc's own,
unused heap.
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


# The config's ``memory_release`` (zerotrain only), held by each engine's stage object
# (:class:`ReleasePolicy`), so two engines in one process follow their own configs:
# "eager" fixes glibc's mmap threshold and hands freed memory back to the OS several times a step
# (lowest peak RSS; every page handed back is zero-filled again by the kernel when reused: 20-35%
# of a CPU step's time on the GPT-2 benchmarks, docs/benchmarks.md); "per_step" leaves the
# threshold to glibc and hands memory back once a step, before backward allocates gradients
# beside the saved activations (DDP's step time, a peak between the two); "off" leaves glibc alone
# during training. One-time releases (after building the stage, zero.Init) happen under each.
MEMORY_RELEASE_POLICIES = ("eager", "per_step", "off")
# zero.Init's policy: Init runs before (or without) an engine, so it reads this process-wide
# setting (its config's ``memory_release``, else ZEROTRAIN_MEMORY_RELEASE, else "eager"). Engines
# never write it and never read it.
_init_policy = {"name": os.environ.get("ZEROTRAIN_MEMORY_RELEASE", "eager")}


def default_memory_release(stage: int) -> str:
    """Stage 3 is chosen for memory: "eager". Stages 0-2 are chosen for speed: "per_step"."""
    return "eager" if stage == 3 else "per_step"


def resolve_memory_release(policy: str | None, stage: int = 3) -> str:
    """The config's policy, else ``ZEROTRAIN_MEMORY_RELEASE``, else the default for ``stage``
    (:func:`default_memory_release`); a one-line error naming both sources for anything else."""
    name = policy or os.environ.get("ZEROTRAIN_MEMORY_RELEASE") or default_memory_release(stage)
    if name not in MEMORY_RELEASE_POLICIES:
        raise ValueError(
            f"memory_release must be one of {', '.join(MEMORY_RELEASE_POLICIES)}, "
            f"got {name!r} (config key memory_release or ZEROTRAIN_MEMORY_RELEASE)"
        )
    return name


class ReleasePolicy:
    """One engine's ``memory_release`` policy: built by ``build_zero_stage`` from that engine's
    config and passed down to its reductions and parameter coordinator."""

    def __init__(self, name: str | None = None, stage: int = 3):
        self.name = resolve_memory_release(name, stage)

    @property
    def eager(self) -> bool:
        return self.name == "eager"

    def configure_allocator(self) -> bool:
        """:func:`configure_allocator` under this policy."""
        return configure_allocator(self.name)

    def before_backward(self) -> None:
        """The release at the start of backward (what forward and the loss freed goes back
        before backward allocates gradients and gathers beside the saved activations): under
        "eager" and "per_step"."""
        if self.name != "off":
            release_freed_memory()

    def between_phases(self) -> None:
        """A per-step release elsewhere (after the optimizer step), under "eager"."""
        if self.eager:
            release_freed_memory()

    def trim_every(self, numel: int) -> TrimEvery:
        return TrimEvery(numel, self)

    def __repr__(self) -> str:
        return f"ReleasePolicy({self.name!r})"


def set_memory_release(policy: str | None, stage: int = 3) -> None:
    """Select zero.Init's policy (process-wide: see ``_init_policy``): the config's, else
    ``ZEROTRAIN_MEMORY_RELEASE``, else the default for ``stage``."""
    _init_policy["name"] = resolve_memory_release(policy, stage)


def memory_release() -> str:
    """zero.Init's policy (a ZeRO stage object's own is its ``memory_release``)."""
    return _init_policy["name"]


def configure_allocator(policy: str | None = None) -> bool:
    """Under the "eager" policy (``policy``; None: zero.Init's), fix glibc's mmap threshold at
    4 MiB (once per process; ``ZEROTRAIN_MALLOC_TUNING=0`` leaves the allocator alone).
    Allocations of 4 MiB or more are then always mmapped and go back to the OS when freed, so
    peak RSS tracks the bytes actually live; smaller ones stay on the fast heap. The threshold
    is glibc's, one per process, and glibc cannot undo it: a process that built an "eager"
    engine (or ran zero.Init without a config saying "off") keeps it, and an "off" engine beside
    it allocates under it too (it still never trims). Returns whether the setting is in force."""
    name = memory_release() if policy is None else policy
    if os.environ.get("ZEROTRAIN_MALLOC_TUNING", "1") == "0" or name != "eager":
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
    through a :class:`ReleasePolicy` and its :class:`TrimEvery`, which follow it)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


class TrimEvery:
    """Release freed memory once per ``numel`` gradient elements reduced in backward.

    Backward frees activations (mostly below glibc's mmap threshold, so they stay in its heap)
    while the next units' full-size gradients are allocated (mmapped): without handing the freed
    heap back, RSS is the sum of both. Trimming once per bucket costs a few ms per step (plus
    re-faulting the pages in the next forward)."""

    def __init__(self, numel: int, policy: ReleasePolicy):
        self.numel = max(1, numel)
        self.policy = policy
        self._since = 0

    def reduced(self, numel: int) -> None:
        if not self.policy.eager:
            return
        self._since += numel
        if self._since >= self.numel:
            self._since = 0
            release_freed_memory()
