"""CPU core binding for ``--bind_cores_to_rank`` / ``--bind_core_list``.

DeepSpeed wraps each rank in ``numactl -C <cores>``; zerotrain needs no numactl: each rank's
entry shim calls ``os.sched_setaffinity`` on its share of the list before the script starts.
The list is split in equal consecutive slices, one per local rank (leftover cores unused).
"""

from __future__ import annotations

import os

from zerotrain.launcher.errors import LaunchError


def parse_core_list(text: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``: DeepSpeed's syntax (ascending, no overlaps, no spaces)."""
    cores: list[int] = []
    for item in text.split(","):
        first, dash, last = item.partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise LaunchError(
                "--bind_core_list",
                f"{item!r} in {text!r} is not a core number or a range like 2-5 (e.g. --bind_core_list 0,2-4,6)",
            ) from None
        if lo < 0 or hi < lo:
            raise LaunchError("--bind_core_list", f"bad range {item!r}: write low-high with low <= high")
        if cores and lo <= cores[-1]:
            raise LaunchError(
                "--bind_core_list",
                f"{item!r} overlaps or precedes an earlier entry; list cores in ascending order without repeats",
            )
        cores.extend(range(lo, hi + 1))
    return cores


def _allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _first_thread_of_each_core(cpus: list[int]) -> list[int]:
    """One logical CPU per physical core (the lowest-numbered hyper-thread), when the kernel
    reports thread siblings; otherwise every CPU."""
    keep = []
    for cpu in cpus:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                siblings = parse_core_list(f.read().strip())
        except (OSError, LaunchError):
            return cpus
        if cpu == min(s for s in siblings if s in cpus or s == cpu):
            keep.append(cpu)
    return keep


def cores_to_bind(core_list: str | None, nproc: int) -> list[int]:
    """The cores to share among ``nproc`` local ranks: ``core_list`` if given (each must be a CPU
    this process may run on), else one hyper-thread of every physical core it may run on."""
    allowed = _allowed_cpus()
    if core_list is None:
        cores, flag = _first_thread_of_each_core(allowed), "--bind_cores_to_rank"
    else:
        cores, flag = parse_core_list(core_list), "--bind_core_list"
        outside = [c for c in cores if c not in allowed]
        if outside:
            raise LaunchError(
                flag, f"core(s) {outside} are not available to this process (allowed: {format_core_list(allowed)})"
            )
    if len(cores) < nproc:
        raise LaunchError(
            flag,
            f"{len(cores)} core(s) cannot give each of the {nproc} rank(s) one; "
            f"list more cores or start fewer processes",
        )
    return cores


def cores_per_rank(cores: list[int], nproc: int) -> int:
    return len(cores) // nproc


def format_core_list(cores: list[int]) -> str:
    """``[0, 2, 3, 4]`` -> ``"0,2-4"``."""
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)
