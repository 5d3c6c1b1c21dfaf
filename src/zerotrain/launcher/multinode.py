"""Multi-node launch: the command that starts torch's elastic agent on every node.

Every node runs ``python -u -m zerotrain.launcher.cli launch --no_ssh ...`` (one elastic agent
per node, node 0 hosting the static rendezvous store at master_addr:master_port); what differs
between launchers is only how that command reaches the nodes and how a node learns its rank:

- ``ssh``: one ``ssh HOST 'cd DIR && export ...; exec python ... --node_rank R ...'`` per node;
- ``pdsh``: one ``pdsh -w HOSTS '...  --node_rank host=%h ...'`` (the rank is the host's
  position in ``--world``);
- ``slurm``: ``srun --nodes K --ntasks-per-node 1 ... --node_rank slurm`` inside an allocation
  (SLURMD_NODENAME's position in ``--world``, or SLURM_NODEID without a hostfile);
- ``openmpi``: ``mpirun -np K --map-by ppr:1:node ... --node_rank openmpi`` (OMPI_COMM_WORLD_RANK).

Remote command strings are built with ``shlex.quote`` for a POSIX shell on the node, so every
argument arrives unchanged (pdsh's own ``%`` substitutions are escaped as ``%%``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import shlex
import socket
import subprocess
import sys
import uuid

from zerotrain.launcher.errors import LaunchError
from zerotrain.launcher.hostfile import World, encode_world, host_of

LAUNCHERS = ("pdsh", "ssh", "slurm", "openmpi")
_HOST_PLACEHOLDER = f"ZEROTRAIN_HOST_{uuid.uuid4().hex}"


@dataclasses.dataclass
class MultiNodePlan:
    """Everything needed to build each node's command.

    Attributes:
        world: host -> slots, in node-rank order; None for ``slurm`` without a hostfile (the
            allocation's nodes, ``nproc`` from the agent flags).
        hosts: the node names in node-rank order.
        agent_flags: flags every node's agent gets besides the rendezvous ones (--nproc,
            --no_local_rank, --module, --max_restarts, ...).
        target: the script (module, program) and its arguments.
        exports: environment exported to every node (remote_env.exported_env).
    """

    launcher: str
    hosts: list[str]
    world: World | None
    master_addr: str
    master_port: int
    target: list[str]
    agent_flags: list[str] = dataclasses.field(default_factory=list)
    exports: dict[str, str] = dataclasses.field(default_factory=dict)
    cwd: str = "."
    python: str = sys.executable
    launcher_args: list[str] = dataclasses.field(default_factory=list)
    ssh_port: int | None = None
    run_id: str = dataclasses.field(default_factory=lambda: f"zerotrain-{uuid.uuid4().hex[:12]}")


def agent_argv(plan: MultiNodePlan, node_rank: str, extra: list[str] = ()) -> list[str]:
    """The per-node agent's command line; ``node_rank`` is a number or how to find it."""
    argv = [
        plan.python,
        "-u",
        "-m",
        "zerotrain.launcher.cli",
        "launch",
        "--no_ssh",
        "--num_nodes",
        str(len(plan.hosts)),
        "--node_rank",
        node_rank,
        "--master_addr",
        plan.master_addr,
        "--master_port",
        str(plan.master_port),
        "--rdzv_id",
        plan.run_id,
    ]
    if plan.world is not None:
        argv += ["--world", encode_world(plan.world)]
    return [*argv, *extra, *plan.agent_flags, *plan.target]


def remote_shell_command(plan: MultiNodePlan, argv: list[str]) -> str:
    """``cd DIR && export K=V ... && exec ARGV``, every word quoted for a POSIX shell."""
    exports = " ".join(f"{key}={shlex.quote(value)}" for key, value in plan.exports.items())
    export_part = f"export {exports} && " if exports else ""
    return f"cd {shlex.quote(plan.cwd)} && {export_part}exec {shlex.join(argv)}"


def ssh_command(plan: MultiNodePlan, host: str, remote: str) -> list[str]:
    """``ssh [launcher args] [-p P] -o BatchMode=yes -- HOST REMOTE`` (user options first: ssh keeps
    the first value it reads for an option; ``--``: the host is never read as an option)."""
    port = ["-p", str(plan.ssh_port)] if plan.ssh_port else []
    return ["ssh", *plan.launcher_args, *port, "-o", "BatchMode=yes", "--", host, remote]


def node_commands(plan: MultiNodePlan) -> list[list[str]]:
    """One local command per node (ssh), or one command for all nodes (pdsh, slurm, openmpi)."""
    if plan.launcher == "ssh":
        return [
            ssh_command(plan, host, remote_shell_command(plan, agent_argv(plan, str(rank), ["--stop_on_stdin_eof"])))
            for rank, host in enumerate(plan.hosts)
        ]
    if plan.launcher == "pdsh":
        # pdsh holds each ssh's standard input open while it runs: a killed pdsh ends the agents.
        flags = ["--write_pid_file", "--stop_on_stdin_eof"]
        remote = remote_shell_command(plan, agent_argv(plan, f"host={_HOST_PLACEHOLDER}", flags))
        remote = remote.replace("%", "%%").replace(_HOST_PLACEHOLDER, "%h")
        return [["pdsh", "-S", "-f", "1024", *plan.launcher_args, "-w", ",".join(plan.hosts), remote]]
    if plan.launcher == "slurm":
        nodes = str(len(plan.hosts))
        nodelist = ["--nodelist", ",".join(plan.hosts)] if plan.world is not None else []
        return [
            [
                "srun",
                "--nodes",
                nodes,
                "--ntasks",
                nodes,
                "--ntasks-per-node",
                "1",
                *nodelist,
                "--kill-on-bad-exit=1",
                *plan.launcher_args,
                *agent_argv(plan, "slurm"),
            ]
        ]
    if plan.launcher == "openmpi":
        exports = [arg for key in plan.exports for arg in ("-x", key)]
        rsh = ["--mca", "plm_rsh_args", f"-p {plan.ssh_port}"] if plan.ssh_port else []
        return [
            [
                "mpirun",
                "-np",
                str(len(plan.hosts)),
                "--host",
                ",".join(f"{h}:1" for h in plan.hosts),
                # One agent per node, free to use every core (mpirun binds to one by default).
                "--map-by",
                "ppr:1:node",
                "--bind-to",
                "none",
                "--wdir",
                plan.cwd,
                *rsh,
                *exports,
                *plan.launcher_args,
                *agent_argv(plan, "openmpi"),
            ]
        ]
    raise LaunchError("--launcher", f"unknown launcher {plan.launcher!r}; choose one of {', '.join(LAUNCHERS)}")


def pdsh_stop_command(plan: MultiNodePlan) -> list[str]:
    """Stop every node's agent of this run (each wrote its pid file; see node_lifetime)."""
    files = f"${{TMPDIR:-/tmp}}/zerotrain-{plan.run_id}-node*.pid"
    remote = f'for f in {files}; do [ -e "$f" ] && kill -TERM "$(cat "$f")"; done; true'
    return ["pdsh", "-S", "-f", "1024", *plan.launcher_args, "-w", ",".join(plan.hosts), remote]


def launcher_env(plan: MultiNodePlan, environ: dict[str, str]) -> dict[str, str]:
    """The environment of the local launcher process: srun and mpirun pass the exports on
    themselves; pdsh needs to be told to use ssh (and the port)."""
    env = dict(environ)
    if plan.launcher in ("slurm", "openmpi"):
        env.update(plan.exports)
    if plan.launcher == "pdsh":
        env.setdefault("PDSH_RCMD_TYPE", "ssh")
        if plan.ssh_port:
            env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {plan.ssh_port}".strip()
    return env


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _resolve(host: str) -> str | None:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError, UnicodeError):
        return None


def _all_loopback(hosts: list[str]) -> bool:
    # Every "node" is this machine (a one-machine test): a loopback address reaches them all.
    addresses = [_resolve(host_of(h)) for h in hosts]
    return all(a is not None and ipaddress.ip_address(a).is_loopback for a in addresses)


def ask_host_address(plan: MultiNodePlan, host: str, timeout: float = 20) -> str | None:
    """The first IP address ``hostname -I`` prints on ``host`` (over ssh), or None."""
    command = ssh_command(plan, host, "hostname -I")
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = result.stdout.split() if result.returncode == 0 else []
    return next((w for w in words if _is_ip(w)), None)


def resolve_master_addr(plan: MultiNodePlan) -> str:
    """The address of node 0 (the first host): an IP as written, else what the name resolves to
    here. A name that resolves to a loopback address (Debian maps its own name to 127.0.1.1)
    while other hosts do not, or that does not resolve, is asked for ``hostname -I`` over ssh
    (ssh/pdsh); with slurm/openmpi such a loopback name is passed as the name. Never an empty
    string: an address that cannot be found is an error naming --master_addr."""
    node = plan.hosts[0]
    host = host_of(node)
    if _is_ip(host):
        return host
    address = _resolve(host)
    if address is not None and (not ipaddress.ip_address(address).is_loopback or _all_loopback(plan.hosts)):
        return address
    if plan.launcher in ("ssh", "pdsh"):
        asked = ask_host_address(plan, node)
        if asked:
            return asked
    elif address is not None:
        return host  # srun/mpirun tasks resolve the name on the nodes themselves
    why = (
        f"it resolves to the loopback address {address} here, which other nodes cannot reach"
        if address
        else "it does not resolve on this machine"
    )
    raise LaunchError(
        "--master_addr",
        f"cannot find an address of the first host {host!r}: {why}"
        + (" and 'hostname -I' over ssh printed none" if plan.launcher in ("ssh", "pdsh") else "")
        + "; pass --master_addr ADDRESS (node 0's address the others can reach)",
    )
