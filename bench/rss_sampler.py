"""Peak resident memory per labelled phase, sampled in a background thread.

    sampler = RssSampler(0.001)
    sampler.phase("forward 1"); ...; sampler.phase("backward 1"); ...
    peaks = sampler.stop()          # {"forward 1": MiB, "backward 1": MiB, ...}

Reads /proc/self/statm (Linux). Torch ops release the GIL, so the thread samples while they run.
"""

from __future__ import annotations

import os
import threading

_PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_MIB


class RssSampler:
    """Samples RSS every ``period`` seconds; keeps the peak per phase label."""

    def __init__(self, period: float):
        self.period, self.label, self.peaks = period, "start", {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            rss = rss_mib()
            if rss > self.peaks.get(self.label, 0.0):
                self.peaks[self.label] = rss

    def phase(self, label: str) -> None:
        rss = rss_mib()  # the moment a phase starts counts for the phase ending
        if rss > self.peaks.get(self.label, 0.0):
            self.peaks[self.label] = rss
        self.label = label

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.peaks
