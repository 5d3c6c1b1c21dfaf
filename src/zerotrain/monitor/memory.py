"""Memory reports: DeepSpeed's ``memory_status`` and ``see_memory_usage`` (also importable from
``zerotrain.runtime.utils``, DeepSpeed's path, and as ``zerotrain.memory_status``), and the weak
list of live engines they read when no engine is named (DeepSpeed's functions take none).

On CUDA they report torch's allocator (allocated, cached, their peaks), like DeepSpeed. On CPU,
where torch keeps no such counters, they report what the process holds: RSS (psutil), peak RSS
since the process started (``resource.getrusage``; it cannot be reset), and the bytes the live
engines hold by category (``engine.memory_breakdown()``: parameters, gradients, optimizer state,
communication buffers), counted from the tensors themselves: the engine passed as ``engine=``, else
every live engine of the process, summed (RSS is the process's, so is what it is compared with).
"""

from __future__ import annotations

import gc
import logging
import weakref

import psutil
import torch

from zerotrain.accelerator import get_accelerator
from zerotrain.accelerator.cpu import peak_rss_bytes
from zerotrain.topology.process_rank import process_rank

logger = logging.getLogger("zerotrain")

GB = 1024**3
_engines: list[weakref.ref] = []
_last = {"alloc": 0, "cache": 0}


def register_engine(engine) -> None:
    """Remember ``engine`` (weakly) so memory reports can show what it holds."""
    _engines[:] = [ref for ref in _engines if ref() is not None]
    _engines.append(weakref.ref(engine))


def unregister_engine(engine) -> None:
    """Forget ``engine`` (``engine.destroy()``: it holds no training state any more)."""
    _engines[:] = [ref for ref in _engines if ref() is not None and ref() is not engine]


def live_engines() -> list:
    """The engines not destroyed and still alive, oldest first."""
    return [e for e in (ref() for ref in _engines) if e is not None]


def _held(engines: list) -> tuple[dict, list[dict]]:
    """What ``engines`` hold by category, summed, and each one's breakdown."""
    each = [e.memory_breakdown() for e in engines]
    total: dict[str, int] = {}
    for held in each:
        for key, value in held.items():
            total[key] = total.get(key, 0) + value
    return total, each


def memory_status(msg: str, print_rank: int = -1, reset_max: bool = False, engine=None) -> dict | None:
    """Print this rank's memory (every rank, or only ``print_rank``) and return the numbers.

    CUDA: ``RANK=r MEMSTATS msg device=cuda:r current alloc=..GB (delta=..GB max=..GB) current
    cache=..GB (delta=..GB max=..GB)``. CPU: ``... device=cpu current rss=..GB (delta=..GB
    max=..GB) engine=..GB (parameters=..GB gradients=..GB ...)``. ``delta`` is the change since the
    previous call; ``reset_max`` resets CUDA peaks first (the CPU peak cannot be reset). The
    engine part is ``engine``'s, or with none named the sum over every live engine (then
    ``stats["engines"]`` lists each one's, and the line ends ``engines=N`` when N > 1).
    """
    rank = max(process_rank(), 0)  # the process's global rank, as DeepSpeed prints and compares it
    if print_rank != -1 and rank != print_rank:
        return None
    accelerator = get_accelerator()
    accelerator.synchronize()
    if accelerator.name == "cuda":
        if reset_max:
            torch.cuda.reset_peak_memory_stats()
        device = torch.cuda.current_device()
        stats = {
            "device": f"cuda:{device}",
            "allocated": torch.cuda.memory_allocated(device),
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "cached": torch.cuda.memory_reserved(device),
            "max_cached": torch.cuda.max_memory_reserved(device),
        }
        current, peak, other = stats["allocated"], stats["max_allocated"], stats["cached"]
        d_alloc, d_cache = current - _last["alloc"], other - _last["cache"]
        _last.update(alloc=current, cache=other)
        line = (
            f"RANK={rank} MEMSTATS {msg} device={stats['device']} current alloc={current / GB:0.4f}GB "
            f"(delta={d_alloc / GB:0.4f}GB max={peak / GB:0.4f}GB) current cache={other / GB:0.4f}GB "
            f"(delta={d_cache / GB:0.4f}GB max={stats['max_cached'] / GB:0.4f}GB)"
        )
    else:
        rss = psutil.Process().memory_info().rss
        # the kernel folds current RSS into the peak lazily, so the peak can trail it by a few pages
        stats = {"device": "cpu", "rss": rss, "max_rss": max(peak_rss_bytes(), rss)}
        delta = rss - _last["alloc"]
        _last["alloc"] = rss
        line = (
            f"RANK={rank} MEMSTATS {msg} device=cpu current rss={rss / GB:0.4f}GB "
            f"(delta={delta / GB:0.4f}GB max={stats['max_rss'] / GB:0.4f}GB)"
        )
    engines = [engine] if engine is not None else live_engines()
    if engines:
        held, stats["engines"] = _held(engines)
        stats["engine"] = held
        line += (
            f" engine={sum(held.values()) / GB:0.4f}GB ("
            + " ".join(f"{k}={v / GB:0.4f}GB" for k, v in held.items())
            + ")"
        )
        if len(engines) > 1:
            line += f" engines={len(engines)}"
        offload = " ".join(filter(None, (_offload_line(e) for e in engines)))
        if offload:
            line += " " + offload
    print(line, flush=True)
    stats["line"] = line
    return stats


def _offload_line(engine) -> str:
    """NVMe offload's last-step I/O and swap footprint (empty without it)."""
    from zerotrain.offload import describe_stats

    return describe_stats(engine.zero_stage_object.statistics(engine.module, engine.optimizer).offload)


def see_memory_usage(message: str, force: bool = False, engine=None) -> None:
    """Log memory on rank 0 when ``force`` (DeepSpeed's; a no-op otherwise): device memory
    (``MA``/``Max_MA``/``CA``/``Max_CA``) on CUDA or RSS/peak RSS and the bytes ``engine`` (else
    every live engine, summed) holds on CPU, then the machine's virtual memory. Resets the CUDA
    peaks for the next call."""
    # Once: on the named engine's first data rank, else on the process's global rank 0 (DeepSpeed's).
    first = engine.topology.is_first("data") if engine is not None else max(process_rank(), 0) == 0
    if not force or not first:
        return
    gc.collect()
    logger.info(message)
    if get_accelerator().name == "cuda":
        logger.info(
            f"MA {round(torch.cuda.memory_allocated() / GB, 2)} GB "
            f"Max_MA {round(torch.cuda.max_memory_allocated() / GB, 2)} GB "
            f"CA {round(torch.cuda.memory_reserved() / GB, 2)} GB "
            f"Max_CA {round(torch.cuda.max_memory_reserved() / GB, 2)} GB "
        )
        torch.cuda.reset_peak_memory_stats()
    else:
        rss = psutil.Process().memory_info().rss
        line = f"RSS {round(rss / GB, 2)} GB Max_RSS {round(peak_rss_bytes() / GB, 2)} GB"
        engines = [engine] if engine is not None else live_engines()
        if engines:
            held, _ = _held(engines)
            line += " | engine " + " ".join(f"{k} {round(v / GB, 4)} GB" for k, v in held.items())
            if len(engines) > 1:
                line += f" ({len(engines)} engines)"
            offload = " ".join(filter(None, (_offload_line(e) for e in engines)))
            if offload:
                line += " | " + offload
        logger.info(line)
    vm = psutil.virtual_memory()
    logger.info(f"CPU Virtual Memory:  used = {round((vm.total - vm.available) / GB, 2)} GB, percent = {vm.percent}%")
