"""``io_busy_s`` on the real clock: overlapping swap I/O counted once, idle gaps not at all.

    python bench/disk_activity.py

Two threads each hold ``DiskActivity`` for 0.3 s at the same time, then the process idles
0.2 s, then one more 0.1 s hold: the busy time should be about 0.4 s (0.3 + 0.1), not 0.7 s
(the holds summed) or 0.6 s (the idle gap counted). Sleeps overshoot on a loaded machine, so
this is a measurement to read, not a test (tests/offload/test_offload.py checks the counting
on a scripted clock).
"""

from __future__ import annotations

import json
import threading
import time

from zerotrain.offload.aio import DiskActivity


def measure(hold_s: float = 0.3, idle_s: float = 0.2, last_s: float = 0.1) -> dict:
    clock = DiskActivity()

    def hold(seconds: float) -> None:
        with clock:
            time.sleep(seconds)

    start = time.perf_counter()
    threads = [threading.Thread(target=hold, args=(hold_s,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(idle_s)  # idle: not counted
    hold(last_s)
    return {
        "busy_s": round(clock.busy_s, 4),
        "expected_s": hold_s + last_s,
        "wall_s": round(time.perf_counter() - start, 4),
        "summed_holds_s": 2 * hold_s + last_s,
    }


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
