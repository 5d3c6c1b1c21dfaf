"""The ``zerotrain`` command line.

``zerotrain launch [options] script.py [script args]`` starts one process per
device on this machine. As with ``deepspeed``, the subcommand may be left out:
``zerotrain --num_gpus=2 train.py --deepspeed ds_config.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from zerotrain import __version__
from zerotrain.launcher.allocator import ALLOCATORS
from zerotrain.launcher.deepspeed_shim import CHOICES as DEEPSPEED_SHIM_CHOICES

if TYPE_CHECKING:
    from zerotrain.launcher.launch import LaunchOptions

ErrorFn = Callable[[str], NoReturn]

SUBCOMMANDS = ("launch", "estimate", "tune", "consolidate", "convert-deepspeed")
_TOP_LEVEL_FLAGS = ("-h", "--help", "--version")
LAUNCHER_CHOICES = ("pdsh", "ssh", "slurm", "openmpi")
# Top-level module -> the zerotrain extra that installs it (pyproject.toml's optional-dependencies).
OPTIONAL_EXTRAS = {
    "matplotlib": "plot",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "ray": "ray",
    "pyspark": "spark",
    "transformers": "hf",
    "accelerate": "hf",
    "peft": "hf",
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value} (e.g. --nproc 2)")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 1 and 65535, got {value} (e.g. --master_port 29500)")
    return value


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``zerotrain launch`` (DeepSpeed launcher spelling) to ``parser``."""
    add = parser.add_argument
    add(
        "--num_gpus",
        "--nproc",
        "--nproc_per_node",
        dest="nproc",
        type=_positive_int,
        metavar="N",
        help="processes to start on this machine (default: one per visible GPU, or 1 on CPU)",
    )
    add(
        "--master_addr",
        default=None,
        help="address of node 0's rendezvous store (default: 127.0.0.1 on one node; with a hostfile, "
        "the first host's address)",
    )
    add(
        "--master_port",
        type=_port,
        default=29500,
        help="port of the rendezvous store; on one node a busy port is replaced by a free one (default: 29500)",
    )
    add("--no_local_rank", action="store_true", help="do not append --local_rank=N to the script's arguments")
    add("--module", action="store_true", help="run the target as a module, like python -m")
    add("--no_python", action="store_true", help="run the target as a program, not with python")
    add("--rank0_only", action="store_true", help="show only rank 0's output on the console")
    add(
        "--log_dir",
        "--enable_each_rank_log",
        dest="log_dir",
        metavar="DIR",
        help="keep each rank's stdout/stderr under DIR (default: a temporary directory removed on exit)",
    )
    add(
        "--bind_cores_to_rank",
        action="store_true",
        help="pin each rank to its own equal share of the CPU cores (os.sched_setaffinity; no numactl "
        "needed) and default OMP_NUM_THREADS to that share",
    )
    add(
        "--bind_core_list",
        metavar="CORES",
        help="the cores to share out, e.g. 0,2-5 (default: one thread of every core this process may "
        "use); implies --bind_cores_to_rank",
    )
    add(
        "--allocator",
        choices=ALLOCATORS,
        default=None,
        help="the ranks' host memory allocator: tcmalloc (preloaded), system (glibc's malloc), or auto "
        "(default, or $ZEROTRAIN_ALLOCATOR): tcmalloc when the ranks run on the CPU and it is "
        "installed",
    )
    add(
        "--deepspeed_shim",
        choices=DEEPSPEED_SHIM_CHOICES,
        default=None,
        help="whether `import deepspeed` in the ranks is zerotrain when DeepSpeed is not installed: auto "
        "(default, or $ZEROTRAIN_DEEPSPEED_SHIM): when the script imports transformers, accelerate or "
        "deepspeed; on: for any script; off: never",
    )
    multinode = parser.add_argument_group("multi-node options (DeepSpeed's spelling)")
    node = multinode.add_argument
    node("-H", "--hostfile", help="file of 'HOST slots=N' lines (default: /job/hostfile when it exists)")
    node("-i", "--include", help='hosts/slots to use, e.g. "worker-0@worker-1:0,2"')
    node("-e", "--exclude", help='hosts/slots to leave out, e.g. "worker-1:0"')
    node("--num_nodes", type=_positive_int, metavar="K", help="use the first K hosts of the hostfile")
    node(
        "--launcher",
        choices=LAUNCHER_CHOICES,
        help="how to start each node's agent: pdsh (default when installed), ssh, slurm (srun inside "
        "an allocation), openmpi (mpirun)",
    )
    node("--launcher_args", default="", metavar="ARGS", help="extra arguments for ssh/pdsh/srun/mpirun, one string")
    node("--ssh_port", type=_port, metavar="P", help="ssh port of the nodes")
    node(
        "--no_ssh",
        action="store_true",
        help="run only this node's agent (start it on every node yourself, with --node_rank)",
    )
    node(
        "--node_rank",
        metavar="R",
        help="this node's rank with --no_ssh: a number, slurm (from SLURM_*), openmpi (from OMPI_*) or host=NAME",
    )
    node("--force_multi", action="store_true", help="multi-node launch even for a single host")
    node(
        "--max_restarts",
        type=_count,
        default=0,
        metavar="K",
        help="restart all ranks up to K times after a failure (torch elastic agent; default 0)",
    )
    # Internal: what the multi-node launcher passes to each node's agent.
    node("--rdzv_id", help=argparse.SUPPRESS)
    node("--world", help=argparse.SUPPRESS)
    node("--stop_on_stdin_eof", action="store_true", help=argparse.SUPPRESS)
    node("--write_pid_file", action="store_true", help=argparse.SUPPRESS)
    add("user_script", nargs="?", help="training script (a module with --module, a program with --no_python)")
    add("user_args", nargs=argparse.REMAINDER, help="arguments for the training script")


def build_parser() -> argparse.ArgumentParser:
    """The top-level ``zerotrain`` parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="zerotrain",
        description="Memory-efficient distributed training for PyTorch (DeepSpeed-compatible).",
        epilog="Without a subcommand, arguments go to 'launch' (zerotrain --num_gpus=2 train.py ...).",
    )
    parser.add_argument("--version", action="version", version=f"zerotrain {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", title="subcommands")
    launch = subcommands.add_parser(
        "launch",
        allow_abbrev=False,
        help="run a training script on this machine, one process per device",
        description="Run a training script on this machine, one process per device, on torch's elastic agent.",
    )
    add_launch_arguments(launch)
    launch.set_defaults(run=_launch, subparser=launch)
    _add_estimate_subcommand(subcommands)
    from zerotrain.checkpoint.cli import add_consolidate, add_convert_deepspeed  # checkpoint tools

    add_consolidate(subcommands)
    add_convert_deepspeed(subcommands)
    return parser


def _add_estimate_subcommand(subcommands) -> None:
    # Parsing and output live in zerotrain.estimate.cli; this only registers the subcommand.
    from zerotrain.estimate.cli import add_estimate_arguments, run_estimate

    estimate = subcommands.add_parser(
        "estimate",
        allow_abbrev=False,
        help="estimate memory per ZeRO stage and recommend a config",
        description="Estimate per-GPU and per-node memory for every ZeRO stage and recommend a config.",
    )
    add_estimate_arguments(estimate)
    estimate.set_defaults(run=run_estimate, subparser=estimate)
    from zerotrain.estimate.tune import add_tune_arguments, run_tune

    tune = subcommands.add_parser(
        "tune",
        allow_abbrev=False,
        help="find the largest micro-batch per ZeRO stage by short trial runs",
        description="Find, by short trial runs, the largest micro-batch each ZeRO stage fits under a "
        "memory limit, and write the fastest config that fits.",
    )
    add_tune_arguments(tune)
    tune.set_defaults(run=run_tune, subparser=tune)


def _with_subcommand(argv: list[str]) -> list[str]:
    # DeepSpeed habit: `zerotrain --num_gpus=2 train.py` means `zerotrain launch ...`.
    if not argv or argv[0] in SUBCOMMANDS or argv[0] in _TOP_LEVEL_FLAGS:
        return argv
    return ["launch", *argv]


def _check_target(args: argparse.Namespace, error: ErrorFn) -> None:
    script = args.user_script
    if not script:
        error("user_script: missing the training script; usage: zerotrain launch [options] train.py [script args]")
    if args.module and args.no_python:
        error("--module and --no_python cannot be combined; --module runs the target with python -m")
    if args.module:
        return
    if args.no_python:
        # Ranks exec the program like a shell would: a bare name is looked up on PATH only.
        if not shutil.which(script):
            hint = f"; for a file in this directory use ./{script}" if os.path.isfile(script) else ""
            error(f"user_script: {script!r} is not an executable program on PATH or at that path{hint}")
        return
    if not os.path.isfile(script):
        hint = "; for a module name add --module" if "/" not in script and not script.endswith(".py") else ""
        error(f"user_script: file {script!r} not found (paths are relative to {os.getcwd()}){hint}")


def validate_launch_args(args: argparse.Namespace, error: ErrorFn) -> None:
    """Reject unsupported or inconsistent launch flags via ``error(message)``."""
    if args.master_addr is not None and not args.master_addr.strip():
        error("--master_addr: must not be empty (e.g. --master_addr 127.0.0.1)")
    _check_target(args, error)


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """LaunchOptions from parsed ``zerotrain launch`` arguments (this machine only)."""
    from zerotrain.launcher.multinode_cli import local_options

    return local_options(args)


def _launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    validate_launch_args(args, parser.error)
    # The elastic machinery is loaded only for a command line that passed validation.
    from zerotrain.launcher.errors import LaunchError
    from zerotrain.launcher.launch import LaunchOptions, launch_local
    from zerotrain.launcher.multinode_cli import plan_launch
    from zerotrain.launcher.node_runner import NodeRunner

    try:
        plan = plan_launch(args)
        if isinstance(plan, LaunchOptions):
            return launch_local(plan)
        return NodeRunner(plan).run()
    except LaunchError as err:
        parser.error(str(err))


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``zerotrain``; returns the process exit code.

    Usage errors exit with status 2 through argparse.
    """
    argv = _with_subcommand(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args, args.subparser)
    except ModuleNotFoundError as err:
        # A subcommand reached an optional dependency that is not installed: one line naming
        # the extra, not a traceback.
        extra = OPTIONAL_EXTRAS.get((err.name or "").partition(".")[0])
        if extra is None:
            raise
        print(
            f"zerotrain {args.command} needs {err.name.partition('.')[0]}: pip install 'zerotrain[{extra}]'",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
