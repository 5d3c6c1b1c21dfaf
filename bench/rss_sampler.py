"""Peak resident memory per labelled phase, sampled in a background thread.

    sampler = RssSampler(0.001)
    sampler.phase("forward 1"); ...; sampler.phase("backward 1"); ...
    peaks = sampler.stop()          # {"forward 1": MiB, "backward 1": MiB, ...}

Reads /proc/self/statm (Linux). Torch ops release the GIL, so the thread samples while they run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

_PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_MIB


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = _Mallinfo2
    return fn


_MALLINFO2 = _mallinfo2()


def mallinfo_mib() -> dict[str, float] | None:
    """glibc's own view of the heap: bytes in use, free but kept (retained), and mmapped."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return {"heap_in_use": m.uordblks / 2**20, "heap_free_retained": m.fordblks / 2**20, "mmapped": m.hblkhd / 2**20}


def malloc_in_use_mib() -> float:
    """Bytes glibc's malloc has handed out and not got back (heap in use + mmapped blocks):
    what is live, as opposed to what RSS also counts (freed heap kept, code pages)."""
    m = mallinfo_mib()
    return float("nan") if m is None else m["heap_in_use"] + m["mmapped"]


class RssSampler:
    """Samples RSS every ``period`` seconds; keeps the peak per phase label."""

    def __init__(self, period: float, track_malloc: bool = False):
        self.period, self.label, self.peaks = period, "start", {}
        # with track_malloc: per phase, malloc's in-use MiB at the moment of the RSS peak
        self.track_malloc, self.in_use_at_peak = track_malloc, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def _sample(self) -> None:
        rss, label = rss_mib(), self.label
        if rss > self.peaks.get(label, 0.0):
            self.peaks[label] = rss
            if self.track_malloc:
                self.in_use_at_peak[label] = malloc_in_use_mib()

    def phase(self, label: str) -> None:
        self._sample()  # the moment a phase starts counts for the phase ending
        self.label = label

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.peaks
