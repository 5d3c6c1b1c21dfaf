"""One node's launch of one process per device on torch's elastic agent.

`launch_local(opts)` is the programmatic equivalent of ``zerotrain launch`` on one machine, and
what every node of a multi-node launch runs (``--no_ssh``: ``opts.nnodes``/``opts.node_rank``).
It turns `LaunchOptions` into a `torch.distributed.launcher.api.LaunchConfig` plus a worker
command and hands both to `elastic_launch`; the agent spawns, tees, monitors and tears down the
ranks. Argument parsing lives in `cli.py` and `multinode_cli.py`; starting the nodes in
`multinode.py` and `node_runner.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from zerotrain.launcher import affinity, allocator, deepspeed_shim, ports
from zerotrain.launcher.errors import LaunchError, failure_exit_code, format_failure_report
from zerotrain.launcher.node_lifetime import node_lifetime

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# Seconds between SIGTERM and SIGKILL for surviving ranks once one rank fails
# (torch's default is 30 s, too slow for an interactive launcher).
DEFAULT_SHUTDOWN_TIMEOUT = 5
_BIND_ATTEMPTS = 3
# Run by path, not with -m, so ranks do not import the zerotrain package (and
# torch) before the user's script has had a chance to set up its environment.
ENTRY_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "local_rank_entry.py")


@dataclasses.dataclass
class LaunchOptions:
    """What to run and how; mirrors the flags of ``zerotrain launch``.

    Attributes:
        script: path of the training script (a module name with ``module``,
            a program with ``no_python``).
        script_args: arguments given to the script (``--local_rank=N`` is
            appended per rank unless ``no_local_rank``).
        nproc: processes on this machine; None means one per visible
            accelerator, or 1 on CPU.
        master_addr, master_port: where rank 0's rendezvous store listens; a
            busy port is replaced by a free one.
        module: run ``script`` as ``python -m script``.
        no_python: execute ``script`` directly as a program.
        no_local_rank: do not append ``--local_rank=N``.
        rank0_only: show only rank 0's output on the console.
        log_dir: keep per-rank stdout/stderr logs here; None means a temporary
            directory removed on exit.
        shutdown_timeout: seconds the other ranks get between SIGTERM and
            SIGKILL once a rank has failed.
        bind_cores_to_rank: pin each local rank to an equal, separate slice of
            the cores (``os.sched_setaffinity`` in the rank before the script).
        bind_core_list: the cores to slice, DeepSpeed syntax (``"0,2-5"``);
            None means one hyper-thread of every core this process may use.
        nnodes, node_rank: this agent is node ``node_rank`` of ``nnodes`` (multi-node: one agent
            per node, node 0 hosting the rendezvous store at master_addr:master_port).
        max_restarts: times the agent restarts every rank after a failure (torch's elastic
            restart, on the c10d rendezvous; each attempt's ranks get a fresh MASTER_PORT).
        run_id: rendezvous id, the same on every node (default: a fresh one).
        devices: accelerator indices this node uses (the hostfile's slots); exported as
            CUDA_VISIBLE_DEVICES (the accelerator's variable) when given.
        node_name: how failure reports name this node (multi-node).
        stop_on_stdin_eof: stop all ranks when standard input closes (the ssh launcher's
            connection to this node ended).
        pid_file: write the agent's pid here while it runs (the pdsh launcher's stop command
            reads it).
        allocator: the ranks' host allocator, ``auto``/``tcmalloc``/``system``; None means
            ``ZEROTRAIN_ALLOCATOR``, else ``auto`` (launcher/allocator.py).
        deepspeed_shim: whether ``import deepspeed`` in the ranks is zerotrain when DeepSpeed is
            not installed, ``auto``/``on``/``off``; None means ``ZEROTRAIN_DEEPSPEED_SHIM``, else
            ``auto`` (launcher/deepspeed_shim.py).
    """

    script: str
    script_args: list[str] = dataclasses.field(default_factory=list)
    nproc: int | None = None
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    rank0_only: bool = False
    log_dir: str | None = None
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    max_restarts: int = 0
    run_id: str | None = None
    devices: list[int] | None = None
    node_name: str | None = None
    stop_on_stdin_eof: bool = False
    pid_file: str | None = None
    allocator: str | None = None
    deepspeed_shim: str | None = None


class _RecordingLogsSpecs(DefaultLogsSpecs):
    """DefaultLogsSpecs that remembers where each rank's logs went."""

    last_dest: LogsDest | None = None

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        self.last_dest = super().reify(envs)
        return self.last_dest


def note(message: str) -> None:
    """Print a launcher message (not a rank's output) to stderr."""
    print(f"zerotrain: {message}", file=sys.stderr, flush=True)


def quiet_agent_bookkeeping() -> None:
    """Hide the agent's kill/exit/signal log lines (the launcher reports these itself).

    Setting LOGLEVEL, torchelastic's own knob, keeps them.
    """
    if "LOGLEVEL" not in os.environ:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
        logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)


def default_nproc() -> int:
    """Number of visible accelerators, or 1 when there is none (CPU)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return accelerator.device_count()
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def _ranks_on_cpu() -> bool:
    """Whether the ranks will compute on the CPU: the accelerator they pick (``get_accelerator``:
    ``ZEROTRAIN_ACCELERATOR``/``DS_ACCELERATOR``, else CUDA when available) is the CPU."""
    from zerotrain.accelerator import get_accelerator

    try:
        return get_accelerator().name == "cpu"
    except ValueError as err:  # a bad ZEROTRAIN_ACCELERATOR: one line, before any rank starts
        raise LaunchError("ZEROTRAIN_ACCELERATOR", str(err)) from None


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_omp_num_threads(nproc: int, environ: dict[str, str] = os.environ, cpus: int | None = None) -> None:
    """Give each rank an even share of ``cpus`` (default: the CPUs this process may use) unless
    the user chose already."""
    if "OMP_NUM_THREADS" in environ:
        return
    cpus = _cpu_count() if cpus is None else cpus
    threads = max(1, cpus // nproc)
    environ["OMP_NUM_THREADS"] = str(threads)
    note(
        f"OMP_NUM_THREADS is not set; using OMP_NUM_THREADS={threads} for each of the "
        f"{nproc} process(es) ({cpus} CPUs). Set it yourself to override."
    )


# torch's switch back from sharing the agent's store with the ranks (pytorch PR #128096) to a
# store per c10d round, hosted by that round's rank 0 on a free port.
UNSHARED_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def restart_safe_environment(opts: LaunchOptions, environ: dict[str, str] = os.environ) -> None:
    """With ``max_restarts``, give the ranks of every attempt a store of their own.

    Otherwise torch's agent hands every attempt's ranks the same store (the static rendezvous's,
    or c10d's shared one), where process groups publish their addresses under keys with no
    attempt in them (``0//cpu//0/<rank>`` for the default group, ``1//...`` for the next). A
    restarted rank that looks up a peer before the restarted peer has rewritten its key gets
    the killed attempt's address: "Gloo connectFullMesh failed ... Connection refused", or a
    hang when that port has been reused (pytorch issues #135712, #167288; PR #135957 dropped
    the per-attempt key prefix).
    """
    if opts.max_restarts <= 0:
        return
    value = environ.get(UNSHARED_STORE_VAR)
    if value not in (None, "1"):
        raise LaunchError(
            "--max_restarts",
            f"{UNSHARED_STORE_VAR}={value} makes restarted ranks share the failed "
            "attempt's store and read its stale addresses; unset it",
        )
    environ[UNSHARED_STORE_VAR] = "1"


def worker_command(opts: LaunchOptions, bind_cores: list[int] | None = None) -> tuple[str, list[str]]:
    """The (entrypoint, args) every rank runs: the per-rank entry shim (which pins itself to its
    slice of ``bind_cores`` when given, and ends with this process: orphan_guard.py)."""
    mode = "exec" if opts.no_python else "module" if opts.module else "script"
    args = ["-u", ENTRY_SCRIPT, f"--mode={mode}", f"--launcher_pid={os.getpid()}", f"--grace={opts.shutdown_timeout:g}"]
    if opts.no_local_rank:
        args.append("--no_local_rank")
    if bind_cores:
        args.append(f"--bind_cores={affinity.format_core_list(bind_cores)}")
    return sys.executable, [*args, "--", opts.script, *opts.script_args]


def build_logs_specs(opts: LaunchOptions, log_dir: str) -> _RecordingLogsSpecs:
    """Tee every rank to files under ``log_dir`` and to the console."""
    console = {0} if opts.rank0_only else None
    return _RecordingLogsSpecs(log_dir=log_dir, tee=Std.ALL, local_ranks_filter=console)


def build_launch_config(
    opts: LaunchOptions, nproc: int, master_port: int, logs_specs: DefaultLogsSpecs
) -> LaunchConfig:
    """LaunchConfig for node ``opts.node_rank`` of ``opts.nnodes``, rendezvous at master_addr:master_port.

    Without restarts the static backend is used (as torchrun does when given a node rank and a
    master port) because it makes the workers' MASTER_ADDR/MASTER_PORT the requested ones, as
    with DeepSpeed. With ``max_restarts`` the c10d backend is used, on one node as on several:
    every agent re-joins on a restart, and with `restart_safe_environment` each attempt's ranks
    get a store of their own on a fresh MASTER_PORT (the static backend keeps one store for all
    attempts, which restarted ranks cannot use; see there).
    """
    restartable = opts.max_restarts > 0
    return LaunchConfig(
        **_shutdown_timeout_argument(opts),
        min_nodes=opts.nnodes,
        max_nodes=opts.nnodes,
        nproc_per_node=nproc,
        logs_specs=logs_specs,
        run_id=opts.run_id or f"zerotrain-{uuid.uuid4().hex[:12]}",
        role="trainer",
        rdzv_backend="c10d" if restartable else "static",
        rdzv_endpoint=f"{opts.master_addr}:{master_port}",
        rdzv_configs={"is_host": opts.node_rank == 0} if restartable else {"rank": opts.node_rank},
        # The ranks' MASTER_ADDR is the rendezvous rank-0 node's address: node 0's is the one
        # given (else torch would use the host's fully qualified name).
        local_addr=opts.master_addr if restartable and opts.node_rank == 0 else None,
        max_restarts=opts.max_restarts,
        log_line_prefix_template="[rank${rank}]: ",
    )


def _shutdown_timeout_argument(opts: LaunchOptions) -> dict:
    """``shutdown_timeout`` for LaunchConfig, which has the field only in newer torch releases
    (torch 2.11 has not; its agent then gives the other ranks a fixed 30 s)."""
    if any(f.name == "shutdown_timeout" for f in dataclasses.fields(LaunchConfig)):
        return {"shutdown_timeout": opts.shutdown_timeout}
    if opts.shutdown_timeout != DEFAULT_SHUTDOWN_TIMEOUT:
        raise LaunchError(
            "shutdown_timeout",
            f"torch {torch.__version__}'s elastic launcher has "
            "no shutdown timeout to set (it waits 30 s); drop the option or upgrade "
            "torch",
        )
    return {}


@contextmanager
def _log_root(log_dir: str | None) -> Iterator[str]:
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        yield log_dir
        return
    tmp = tempfile.mkdtemp(prefix="zerotrain_logs_")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _resolve_port(opts: LaunchOptions) -> int:
    if opts.node_rank > 0:
        return opts.master_port  # node 0 hosts the store; this address is not ours to check
    if ports.is_port_free(opts.master_addr, opts.master_port):
        return opts.master_port
    if opts.nnodes > 1:
        raise LaunchError(
            "--master_port",
            f"port {opts.master_port} is busy on {opts.master_addr} (node 0), "
            "and the other nodes cannot learn a replacement; choose a free port",
        )
    port = ports.free_port(opts.master_addr)
    note(f"master port {opts.master_port} is busy on {opts.master_addr}; using free port {port} instead")
    return port


def launch_local(opts: LaunchOptions) -> int:
    """Run ``opts.script`` on ``opts.nproc`` local processes; return the exit code.

    0 when every rank succeeds; otherwise the failed rank's exit code (128+N
    for signal N, or 1) after the other ranks have been stopped and a report
    naming the failed rank with the tail of its stderr has been printed.
    Raises LaunchError for a configuration problem found before launching.
    """
    nproc = opts.nproc if opts.nproc is not None else default_nproc()
    if nproc <= 0:
        raise LaunchError("--nproc", f"must be a positive number of processes, got {nproc}")
    restart_safe_environment(opts)
    master_port = _resolve_port(opts)
    bind_cores = None
    if opts.bind_cores_to_rank or opts.bind_core_list is not None:
        bind_cores = affinity.cores_to_bind(opts.bind_core_list, nproc)
    if opts.nproc is None:
        note(f"--num_gpus/--nproc not given; launching {nproc} process(es)")
    # With binding each rank runs on its slice, so the thread count is the slice's size.
    set_omp_num_threads(nproc, cpus=None if bind_cores is None else len(bind_cores))
    if opts.devices is not None:
        from zerotrain.accelerator import get_accelerator

        get_accelerator().set_visible_devices_envs(os.environ, opts.devices)
    quiet_agent_bookkeeping()
    with (
        allocator.for_ranks(opts.allocator, _ranks_on_cpu(), note),
        deepspeed_shim.for_ranks(opts.deepspeed_shim, opts.script, opts.module, opts.no_python, note),
        _log_root(opts.log_dir) as log_root,
        node_lifetime(opts),
    ):
        return _run_with_port_retry(opts, nproc, master_port, log_root, bind_cores)


def _run_with_port_retry(
    opts: LaunchOptions, nproc: int, master_port: int, log_root: str, bind_cores: list[int] | None = None
) -> int:
    entrypoint, args = worker_command(opts, bind_cores)
    attempt = 1
    while True:
        logs_specs = build_logs_specs(opts, log_root)
        config = build_launch_config(opts, nproc, master_port, logs_specs)
        try:
            return _run_agent(
                config, entrypoint, args, logs_specs, logs_kept=bool(opts.log_dir), node_name=opts.node_name
            )
        except (DistNetworkError, RendezvousConnectionError) as err:
            # Another process took the port between our check and the store's bind (the c10d
            # rendezvous wraps the store's error).
            if not _port_taken(err) or attempt == _BIND_ATTEMPTS or opts.nnodes > 1:
                raise
        attempt += 1
        lost, master_port = master_port, ports.free_port(opts.master_addr)
        note(f"master port {lost} was taken before the launch; retrying on free port {master_port}")


def _port_taken(err: BaseException | None) -> bool:
    while err is not None:
        if "EADDRINUSE" in str(err):
            return True
        err = err.__cause__
    return False


def _run_agent(
    config: LaunchConfig,
    entrypoint: str,
    args: list[str],
    logs_specs: _RecordingLogsSpecs,
    logs_kept: bool,
    node_name: str | None = None,
) -> int:
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        stderrs = logs_specs.last_dest.stderrs if logs_specs.last_dest else {}
        report = format_failure_report(err, stderrs, config.nproc_per_node, logs_kept, node_name)
        print(report, file=sys.stderr, flush=True)
        return failure_exit_code(err)
    except SignalException as err:
        note(f"received {err.sigval.name}; stopped all ranks")
        return 128 + int(err.sigval)
    except KeyboardInterrupt:
        note("interrupted; stopped all ranks")
        return 130
    return 0
