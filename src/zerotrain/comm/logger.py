"""The comms logger: DeepSpeed's ``comms_logger`` for every collective zerotrain issues.

It is a hook (``zerotrain.comm.hooks``): enabled (``"comms_logger": {"enabled": true}`` or
``zerotrain.comm.configure(enabled=True)``), it is added to the process-wide hooks every group's
``Collectives`` object runs its collectives through (``zerotrain.comm.group``); disabled, it is
removed, so a disabled logger does no work per call at all. An engine whose config enabled it
releases it at ``destroy()`` (``release``): the logger is disabled once no engine or script that
enabled it holds it; what it recorded stays for ``log_summary()``.

What is timed:

- **latency** of an op: from issue to completion. For a synchronous op that is the call. For an
  async op (``async_op=True``, how ZeRO overlaps gradient reduction with backward) it is issue to
  the moment the backend finished it: on gloo the completion callback of the op's future, on CUDA
  the return of ``wait()`` after synchronising the device (the device is also synchronised before
  issue on CUDA, like DeepSpeed, so queued compute is not counted). Latencies of overlapped ops
  overlap each other and the computation, so their sum is *not* time lost to communication.
- **waiting**: the time the calling thread was blocked in a collective (the synchronous call, the
  issue of an async op, and ``wait()``). That is the time communication added to the step; the
  summary reports it as a share of the wall time since the logger was enabled.

Per op name and message size it keeps ``[count, [latency ms], [algbw Gbps], [busbw Gbps]]``
(DeepSpeed's ``comms_dict`` layout). The message size is the whole buffer: the tensor of an
all-reduce or broadcast, the gathered output of an all-gather, the input of a reduce-scatter.
Bandwidths follow nccl-tests (doc/PERFORMANCE.md): algbw = size / time; busbw = algbw x
2(n-1)/n for all-reduce, x (n-1)/n for all-gather and reduce-scatter, x 1 for broadcast.
(DeepSpeed reports 2 x size / time as an all-reduce's ``tput``; busbw is the same.)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from types import FrameType

import torch.distributed as dist

from zerotrain.comm.group import add_process_hook, remove_process_hook
from zerotrain.comm.hang import convert_size, record_progress
from zerotrain.comm.hooks import Call, CollectiveHook
from zerotrain.log import log_rank0

__all__ = [
    "CommsLogger",
    "comms_logger",
    "configure",
    "release",
    "log_summary",
    "calc_bw_log",
    "convert_size",
    "trim_mean",
    "start_profiling_comms",
    "stop_profiling_comms",
    "start_profiling_op",
    "stop_profiling_op",
]

# zerotrain function -> the name it is logged under (DeepSpeed's, so prof_ops lists carry over).
LOG_NAMES = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather_into": "all_gather_into_tensor",
    "reduce_scatter_into": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier",
}
# The ops the logger records: tensor collectives. Object exchanges and group creation
# (``zerotrain.comm.objects``) go through the same hooks but are not logged.
LOGGED_OPS = frozenset(LOG_NAMES.values())
_ALIASES = {
    "all_gather_into": "all_gather_into_tensor",
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter_into": "reduce_scatter_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_to_all": "all_to_all_single",
}
_BY_SCRIPT = "script"  # the holder of a logger enabled by keyword or by a config section


def calc_bw_log(comm_op: str, size: int, duration_ms: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbps of ``comm_op`` moving ``size`` bytes in ``duration_ms`` ms."""
    if duration_ms <= 0 or size == 0:
        return 0.0, 0.0
    n = world_size
    algbw = size / duration_ms
    if comm_op == "all_reduce":
        busbw = algbw * 2 * (n - 1) / n
    elif comm_op in (
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_gather",
        "reduce_scatter",
        "all_to_all_single",
    ):
        busbw = algbw * (n - 1) / n
    else:  # broadcast, barrier, point-to-point
        busbw = algbw
    # bytes/ms -> Gbps
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def trim_mean(data, trim_percent: float) -> float:
    """Mean without the lowest and highest ``trim_percent`` of values (DeepSpeed's)."""
    data = sorted(data)
    n = len(data)
    if n == 0:
        return 0.0
    k = int(round(n * trim_percent))
    kept = data[k : n - k] or data
    return sum(kept) / len(kept)


class _TimedWork:
    """An async collective's handle that records the op when it is waited for."""

    __slots__ = (
        "_inner",
        "_logger",
        "_name",
        "_record",
        "_nbytes",
        "_group",
        "_t0",
        "_seq",
        "_done_at",
        "_recorded",
        "__weakref__",
    )

    def __init__(self, inner, logger: CommsLogger, name, record, nbytes, group, t0, seq):
        self._inner, self._logger, self._name, self._record = inner, logger, name, record
        self._nbytes, self._group, self._t0, self._seq = nbytes, group, t0, seq
        self._done_at: float | None = None
        self._recorded = False
        if logger._sync is None:  # gloo: the future completes when the backend has finished
            try:
                inner.get_future().add_done_callback(self._on_done)
            except Exception:
                pass

    def _on_done(self, _future) -> None:
        self._done_at = time.perf_counter()

    def wait(self, *args, **kwargs):
        logger = self._logger
        w0 = time.perf_counter()
        out = self._inner.wait(*args, **kwargs)
        if logger._sync is not None:
            logger._sync()
        w1 = time.perf_counter()
        if not self._recorded:
            self._recorded = True
            logger.wait_ms += (w1 - w0) * 1e3
            end = self._done_at if self._done_at is not None else w1
            logger.append(self._name, self._record, (end - self._t0) * 1e3, self._nbytes, self._group)
            if logger.debug:
                record_progress(self._group, self._seq, self._name, self._nbytes)
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)


class CommsLogger(CollectiveHook):
    """Records collectives while enabled; ``comms_dict[op][size] = [count, lats, algbws, busbws]``."""

    def __init__(self):
        self.comms_dict: dict[str, dict[int, list]] = {}
        self.enabled = False
        self.verbose = False
        self.debug = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self.wait_ms = 0.0
        self._enabled_since: float | None = None
        self._enabled_s = 0.0
        self._sync = None
        self._world_sizes: dict = {}  # group -> size, refreshed whenever the logger is enabled
        self._holders: list = []  # what enabled it: whole configs (engines), or _BY_SCRIPT

    # -- configuration --------------------------------------------------------------------
    def configure(
        self,
        comms_config=None,
        *,
        enabled=None,
        prof_all=None,
        prof_ops=None,
        verbose=None,
        debug=None,
        holder=_BY_SCRIPT,
    ) -> None:
        """Apply a ``comms_logger`` section (object or dict), then any keyword overrides.
        Enabling adds ``holder`` to what holds the logger enabled (see ``release``); disabling
        drops every holder."""
        if comms_config is not None:
            get = (
                comms_config.get
                if isinstance(comms_config, Mapping)
                else (lambda key, default=None: getattr(comms_config, key, default))
            )
            enabled = get("enabled", False) if enabled is None else enabled
            prof_all = get("prof_all", True) if prof_all is None else prof_all
            prof_ops = get("prof_ops", []) if prof_ops is None else prof_ops
            verbose = get("verbose", False) if verbose is None else verbose
            debug = get("debug", False) if debug is None else debug
        if verbose is not None:
            self.verbose = bool(verbose)
        if debug is not None:
            self.debug = bool(debug)
        if prof_all is not None:
            self.prof_all = bool(prof_all)
        if prof_ops is not None:
            self.prof_ops = sorted({_ALIASES.get(op, op) for op in prof_ops})
        if enabled is not None:
            self.enable(holder) if enabled else self.disable()

    def release(self, holder) -> None:
        """``holder`` (an engine's config) no longer needs the logger: disable it if nothing
        else holds it enabled. Nothing happens when ``holder`` did not enable it."""
        if not any(h is holder for h in self._holders):
            return
        self._holders = [h for h in self._holders if h is not holder]
        if not self._holders:
            self.disable()

    def enable(self, holder=_BY_SCRIPT) -> None:
        from zerotrain.accelerator import get_accelerator

        accelerator = get_accelerator()
        self._sync = accelerator.synchronize if accelerator.name != "cpu" else None
        self._world_sizes = {}
        if not self.enabled:
            self.enabled = True
            self._enabled_since = time.perf_counter()
        if not any(h is holder for h in self._holders):
            self._holders.append(holder)
        add_process_hook(self)

    def disable(self) -> None:
        if self._enabled_since is not None:
            self._enabled_s += time.perf_counter() - self._enabled_since
            self._enabled_since = None
        self.enabled = False
        self._holders = []
        remove_process_hook(self)

    def reset(self) -> None:
        """Forget every record and restart the wall-time clock."""
        self.comms_dict = {}
        self.wait_ms = 0.0
        self._enabled_s = 0.0
        self._world_sizes = {}
        if self.enabled:
            self._enabled_since = time.perf_counter()

    # DeepSpeed's profiling switches
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | {_ALIASES.get(op, op) for op in op_name_list})

    def stop_profiling_op(self, op_name_list) -> None:
        drop = {_ALIASES.get(op, op) for op in op_name_list}
        self.prof_ops = [op for op in self.prof_ops if op not in drop]

    @property
    def enabled_seconds(self) -> float:
        running = time.perf_counter() - self._enabled_since if self._enabled_since is not None else 0.0
        return self._enabled_s + running

    # -- recording ------------------------------------------------------------------------
    def run(self, call: Call, issue):
        """The hook: issue the collective timed and record it (tensor collectives in the
        profiled set only)."""
        name = call.op
        if name not in LOGGED_OPS or (not self.prof_all and name not in self.prof_ops):
            return issue()
        record = name
        if self.debug:
            record = f"{name} | [Caller Func: {_caller()}]"
        sync = self._sync
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        result = issue()
        if call.async_op:
            self.wait_ms += (time.perf_counter() - t0) * 1e3
            return _TimedWork(result, self, name, record, call.nbytes, call.group, t0, call.seq)
        if sync is not None:
            sync()
        latency = (time.perf_counter() - t0) * 1e3
        self.wait_ms += latency
        self.append(name, record, latency, call.nbytes, call.group)
        if self.debug:
            record_progress(call.group, call.seq, name, call.nbytes)
        return result

    def append(self, raw_name: str, record_name: str, latency_ms: float, msg_size: int, group=None) -> None:
        world = self._world_sizes.get(group)
        if world is None:
            world = self._world_sizes[group] = dist.get_world_size(group) if dist.is_initialized() else 1
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency_ms, world)
        sizes = self.comms_dict.setdefault(record_name, {})
        entry = sizes.get(msg_size)
        if entry is None:
            sizes[msg_size] = [1, [latency_ms], [algbw], [busbw]]
        else:
            entry[0] += 1
            entry[1].append(latency_ms)
            entry[2].append(algbw)
            entry[3].append(busbw)
        if self.verbose:
            rank = dist.get_rank() if dist.is_initialized() else 0
            log_rank0(
                f"rank={rank} | comm op: {record_name} | time (ms): {latency_ms:.2f} | msg size: "
                f"{convert_size(msg_size)} | algbw (Gbps): {algbw:.2f}  | busbw (Gbps): {busbw:.2f} "
            )

    # -- summary --------------------------------------------------------------------------
    def summary(self) -> dict:
        """This rank's records: per op and size, count, total and (10%-trimmed) average
        latency, algbw and busbw; and the time spent waiting in collectives."""
        ops = {}
        for record_name, sizes in self.comms_dict.items():
            ops[record_name] = {
                size: {
                    "count": vals[0],
                    "total_latency_ms": sum(vals[1]),
                    "avg_latency_ms": trim_mean(vals[1], 0.1),
                    "algbw_gbps": trim_mean(vals[2], 0.1),
                    "busbw_gbps": trim_mean(vals[3], 0.1),
                    "latencies_ms": list(vals[1]),
                }
                for size, vals in sorted(sizes.items())
            }
        wall_ms = self.enabled_seconds * 1e3
        return {
            "ops": ops,
            "wait_ms": self.wait_ms,
            "wall_ms": wall_ms,
            "wait_share": self.wait_ms / wall_ms if wall_ms > 0 else 0.0,
        }

    def log_all(self, print_log: bool = True, show_straggler: bool = False) -> dict:
        data = self.summary()
        lines = [
            f"{'Comm. Op': <20}{'Message Size': <20}{'Count': <20}{'Total Latency(ms)': <20}"
            f"{'Avg Latency(ms)': <20}{'tput_avg (Gbps)': <20}{'busbw_avg (Gbps)': <20}"
        ]
        for record_name, sizes in data["ops"].items():
            lines.append(record_name)
            for size, row in sizes.items():
                lines.append(
                    f"{' ': <20}{convert_size(size): <20}{row['count']: <20}"
                    f"{row['total_latency_ms']: <20.2f}{row['avg_latency_ms']: <20.2f}"
                    f"{row['algbw_gbps']: <20.2f}{row['busbw_gbps']: <20.2f}"
                )
        if show_straggler:
            data["straggler"] = self._straggler(lines)
        lines.append(
            f"Waiting in collectives: {data['wait_ms']:.2f} ms of {data['wall_ms']:.2f} ms "
            f"wall time since the comms logger was enabled ({100 * data['wait_share']:.1f}%)"
        )
        data["table"] = "\n".join(lines)
        if print_log:
            print(data["table"], flush=True)
        return data

    def _straggler(self, lines: list[str]) -> dict:
        """DeepSpeed's straggler table: per op, the minimum latency over ranks is the op's own
        time; the rest of this rank's latency is waiting for the slowest rank (collective)."""
        import torch

        lines += [
            "_______________________________",
            "Breakdown with straggler effect",
            "-------------------------------",
            f"{'Comm. Op': <20}{'Message Size': <20}{'Count': <20}{'Total comm lat(ms)': <20}"
            f"{'Total straggler(ms)': <20}{'Avg comm lat(ms)': <20}{'Avg straggler(ms)': <20}",
        ]
        out: dict = {}
        device = None
        if dist.is_initialized() and dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        for record_name in sorted(self.comms_dict):
            lines.append(record_name)
            for size, vals in sorted(self.comms_dict[record_name].items()):
                lats = torch.tensor(vals[1], dtype=torch.float64, device=device)
                mins = lats.clone()
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.all_reduce(mins, op=dist.ReduceOp.MIN)  # not logged: the raw op
                straggler = (lats - mins).tolist()
                row = {
                    "count": vals[0],
                    "total_comm_lat_ms": float(mins.sum()),
                    "total_straggler_ms": sum(straggler),
                    "avg_comm_lat_ms": trim_mean(mins.tolist(), 0.1),
                    "avg_straggler_ms": trim_mean(straggler, 0.1),
                }
                out.setdefault(record_name, {})[size] = row
                lines.append(
                    f"{' ': <20}{convert_size(size): <20}{row['count']: <20}"
                    f"{row['total_comm_lat_ms']: <20.2f}{row['total_straggler_ms']: <20.2f}"
                    f"{row['avg_comm_lat_ms']: <20.2f}{row['avg_straggler_ms']: <20.2f}"
                )
        return out


comms_logger = CommsLogger()


def _caller() -> str:
    """The function that called ``zerotrain.comm`` (DeepSpeed's debug record names): the first
    frame outside this package."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("zerotrain.comm"):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "?"


# -- DeepSpeed's module-level API (deepspeed.comm.configure / log_summary / ...) ------------
def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None) -> None:
    """Configure the comms logger from a config (``ZeroTrainConfig``, its ``comms_logger``
    section, or a dict of either) and/or keyword overrides. A whole ``ZeroTrainConfig`` that
    enables it holds it until ``release(config)`` (the engine's ``destroy()``); enabled any
    other way, it stays on until ``configure(enabled=False)``."""
    section, holder = deepspeed_config, _BY_SCRIPT
    if section is not None:
        if isinstance(section, Mapping):
            section = section.get("comms_logger", section)
        elif hasattr(section, "comms_logger"):
            section, holder = section.comms_logger, section
    comms_logger.configure(
        section, enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug, holder=holder
    )


def release(config) -> None:
    """An engine built from ``config`` is destroyed: remove the logger's hook if that config
    enabled it and nothing else holds it (records are kept for ``log_summary``)."""
    comms_logger.release(config)


def log_summary(show_straggler: bool = False) -> dict:
    """Print the comms table on rank 0 (every rank must call it with ``show_straggler=True``,
    which runs one all-reduce per row) and return this rank's data (``summary()`` + ``table``)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return comms_logger.log_all(print_log=rank == 0, show_straggler=show_straggler)


def start_profiling_comms() -> None:
    comms_logger.start_profiling_comms()


def stop_profiling_comms() -> None:
    comms_logger.stop_profiling_comms()


def start_profiling_op(op_name_list) -> None:
    comms_logger.start_profiling_op(op_name_list)


def stop_profiling_op(op_name_list) -> None:
    comms_logger.stop_profiling_op(op_name_list)
