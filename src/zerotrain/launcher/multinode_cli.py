"""From ``zerotrain launch`` arguments to what runs: a local launch, one node's agent
(``--no_ssh``), or a multi-node plan (hostfile with several hosts, ``--force_multi``,
``--launcher slurm|openmpi``)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import subprocess

from zerotrain.launcher import hostfile
from zerotrain.launcher.errors import LaunchError
from zerotrain.launcher.launch import DEFAULT_MASTER_ADDR, LaunchOptions, default_nproc, note
from zerotrain.launcher.multinode import LAUNCHERS, MultiNodePlan, resolve_master_addr
from zerotrain.launcher.node_lifetime import pid_file_path
from zerotrain.launcher.remote_env import exported_env

_TOOLS = {
    "ssh": ("ssh", "openssh-client"),
    "pdsh": ("pdsh", "pdsh"),
    "slurm": ("srun", "Slurm"),
    "openmpi": ("mpirun", "openmpi-bin"),
}


def local_options(args: argparse.Namespace, **overrides) -> LaunchOptions:
    """LaunchOptions from parsed ``zerotrain launch`` arguments (this machine only)."""
    fields = dict(
        script=args.user_script,
        script_args=list(args.user_args),
        nproc=args.nproc,
        master_addr=args.master_addr or DEFAULT_MASTER_ADDR,
        master_port=args.master_port,
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        rank0_only=args.rank0_only,
        log_dir=args.log_dir,
        bind_cores_to_rank=args.bind_cores_to_rank or args.bind_core_list is not None,
        bind_core_list=args.bind_core_list,
        max_restarts=args.max_restarts,
        allocator=args.allocator,
        deepspeed_shim=args.deepspeed_shim,
    )
    fields.update(overrides)
    return LaunchOptions(**fields)


def _devices(slots: list[int]) -> list[int] | None:
    # Only a non-default choice of devices is exported (CUDA_VISIBLE_DEVICES=0,2), as a user's own
    # CUDA_VISIBLE_DEVICES must otherwise stay untouched.
    return None if slots == list(range(len(slots))) else slots


def _world_from_args(args: argparse.Namespace) -> hostfile.World | None:
    world = hostfile.read_hostfile(args.hostfile)
    if world is not None and args.hostfile is None:
        note(f"using DeepSpeed's default hostfile {hostfile.DEFAULT_HOSTFILE}")
    if world is None:
        return None
    world = hostfile.filter_world(world, args.include, args.exclude)
    return hostfile.limit_world(world, args.num_nodes, args.nproc)


def resolve_node_rank(
    spec: str | None, world: hostfile.World | None, nnodes: int, environ: dict[str, str] | None = None
) -> int:
    """``--node_rank``: a number; ``host=NAME`` (NAME's position in the world); ``slurm``
    (SLURMD_NODENAME's position in the world, else SLURM_NODEID); ``openmpi`` (OMPI_COMM_WORLD_RANK)."""
    env = os.environ if environ is None else environ
    forms = "a number 0..N-1, slurm, openmpi or host=NAME"
    if spec is None:
        raise LaunchError("--node_rank", f"required with --no_ssh: {forms} (e.g. --node_rank 0 on the first node)")
    if spec.startswith("host="):
        name = spec[len("host=") :]
        nodes = list(world or [])
        # pdsh's %h is the host of a user@host node.
        matches = [i for i, node in enumerate(nodes) if name in (node, hostfile.host_of(node))]
        if not matches:
            raise LaunchError("--node_rank", f"host {name!r} is not one of the nodes ({', '.join(nodes)})")
        rank = matches[0]
    elif spec == "slurm":
        node = env.get("SLURMD_NODENAME")
        if world is not None:
            hosts = [hostfile.host_of(h) for h in world]
            names = {h: i for i, h in enumerate(hosts)} | {h.split(".")[0]: i for i, h in enumerate(hosts)}
            if node not in names:
                raise LaunchError(
                    "--node_rank",
                    f"SLURMD_NODENAME={node!r} is not one of the hostfile's hosts "
                    f"({', '.join(world)}); name the nodes as Slurm does",
                )
            rank = names[node]
        else:
            rank = _int_env(env, "SLURM_NODEID", "srun")
            _check_size(env, "SLURM_STEP_NUM_NODES", nnodes, "srun --nodes")
    elif spec == "openmpi":
        rank = _int_env(env, "OMPI_COMM_WORLD_RANK", "mpirun")
        _check_size(env, "OMPI_COMM_WORLD_SIZE", nnodes, "mpirun -np with --map-by ppr:1:node")
    else:
        try:
            rank = int(spec)
        except ValueError:
            raise LaunchError("--node_rank", f"{spec!r} is not {forms}") from None
    if not 0 <= rank < nnodes:
        raise LaunchError("--node_rank", f"{rank} is outside 0..{nnodes - 1} for {nnodes} node(s)")
    return rank


def _int_env(env, name: str, tool: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise LaunchError("--node_rank", f"{name} is not set: run this under {tool}, or give --node_rank N") from None


def _check_size(env, name: str, nnodes: int, how: str) -> None:
    if name in env and env[name] != str(nnodes):
        raise LaunchError(
            "--node_rank", f"{name}={env[name]} but {nnodes} node(s) expected: start one task per node ({how})"
        )


def node_agent_options(args: argparse.Namespace) -> LaunchOptions:
    """One node's agent of a multi-node launch (``--no_ssh``: started by hand, ssh, pdsh, srun, mpirun)."""
    if args.world:
        world = hostfile.decode_world(args.world)
    else:
        world = _world_from_args(args)
    nnodes = args.num_nodes or (len(world) if world else None)
    if nnodes is None:
        raise LaunchError("--num_nodes", "with --no_ssh give --num_nodes K (or a --hostfile listing the nodes)")
    rank = resolve_node_rank(args.node_rank, world, nnodes)
    host = list(world)[rank] if world else socket.gethostname()
    slots = world[host] if world and world[host] else None
    master_addr = args.master_addr
    if master_addr is None:
        if not world:
            raise LaunchError("--master_addr", "with --no_ssh give node 0's address (e.g. --master_addr 10.0.0.1)")
        master_addr = hostfile.host_of(list(world)[0])
    return local_options(
        args,
        nproc=args.nproc if args.nproc is not None or slots is None else len(slots),
        master_addr=master_addr,
        nnodes=nnodes,
        node_rank=rank,
        run_id=args.rdzv_id,
        devices=_devices(slots) if slots else None,
        node_name=f"node {rank} ({host})",
        stop_on_stdin_eof=args.stop_on_stdin_eof,
        pid_file=pid_file_path(args.rdzv_id or "manual", rank) if args.write_pid_file else None,
    )


def _slurm_hosts() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError(
            "--launcher",
            "slurm: not inside a Slurm allocation (SLURM_JOB_NODELIST is not set); "
            "run under sbatch/salloc, or pass --hostfile",
        )
    result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    hosts = result.stdout.split()
    if result.returncode != 0 or not hosts:
        raise LaunchError("--launcher", f"slurm: 'scontrol show hostnames {nodelist}' failed: {result.stderr.strip()}")
    return hosts


def plan_launch(args: argparse.Namespace) -> LaunchOptions | MultiNodePlan:
    """What ``zerotrain launch`` runs for these arguments."""
    if (args.include or args.exclude) and (args.num_nodes or args.nproc):
        raise LaunchError(
            "--include" if args.include else "--exclude",
            "cannot be combined with --num_nodes/--num_gpus; the spec already picks nodes and slots",
        )
    if args.no_ssh:
        return node_agent_options(args)
    world = _world_from_args(args)
    launcher = args.launcher
    if world is None:
        if launcher == "slurm":
            hosts = _slurm_hosts()[: args.num_nodes]
            return _plan(args, "slurm", hosts, None)
        if launcher or args.num_nodes not in (None, 1) or args.force_multi:
            flag = "--launcher" if launcher else "--num_nodes" if args.num_nodes else "--force_multi"
            raise LaunchError(flag, "multi-node launch needs --hostfile FILE listing the nodes ('HOST slots=N' lines)")
        if args.include or args.exclude:
            local = {"localhost": list(range(default_nproc()))}
            slots = hostfile.filter_world(local, args.include, args.exclude)["localhost"]
            return local_options(args, nproc=len(slots), devices=_devices(slots))
        return local_options(args)
    if len(world) == 1 and not args.force_multi and launcher not in ("slurm", "openmpi"):
        slots = next(iter(world.values()))
        return local_options(args, nproc=len(slots), devices=_devices(slots))
    if launcher is None:
        launcher = "pdsh" if shutil.which("pdsh") else "ssh"
        note(f"--launcher not given; using {launcher}" + ("" if launcher == "pdsh" else " (pdsh is not installed)"))
    return _plan(args, launcher, list(world), world)


def _plan(args: argparse.Namespace, launcher: str, hosts: list[str], world: hostfile.World | None) -> MultiNodePlan:
    if launcher not in LAUNCHERS:
        raise LaunchError("--launcher", f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")
    users = [h for h in hosts if hostfile.user_of(h) is not None]
    if users and launcher in ("slurm", "openmpi"):
        raise LaunchError(
            "--hostfile",
            f"{users[0]!r}: a user@host node needs --launcher ssh or pdsh "
            f"({launcher} starts the nodes' tasks itself); write the host alone",
        )
    tool, package = _TOOLS[launcher]
    if shutil.which(tool) is None:
        raise LaunchError("--launcher", f"{launcher} needs '{tool}' on PATH ({package} is not installed here)")
    flags: list[str] = []
    for name in ("no_local_rank", "module", "no_python", "bind_cores_to_rank", "rank0_only"):
        if getattr(args, name):
            flags.append(f"--{name}")
    for name in ("log_dir", "bind_core_list", "allocator", "deepspeed_shim"):
        if getattr(args, name) is not None:
            flags += [f"--{name}", getattr(args, name)]
    if args.max_restarts:
        flags += ["--max_restarts", str(args.max_restarts)]
    if world is None and args.nproc is not None:
        flags += ["--nproc", str(args.nproc)]
    plan = MultiNodePlan(
        launcher=launcher,
        hosts=hosts,
        world=world,
        master_addr=args.master_addr or "",
        master_port=args.master_port,
        target=[args.user_script, *args.user_args],
        agent_flags=flags,
        exports=exported_env(),
        cwd=os.getcwd(),
        launcher_args=shlex.split(args.launcher_args or ""),
        ssh_port=args.ssh_port,
    )
    if not plan.master_addr:
        plan.master_addr = resolve_master_addr(plan)
    return plan
