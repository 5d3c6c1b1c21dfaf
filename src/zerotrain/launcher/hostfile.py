"""DeepSpeed's hostfile and ``--include``/``--exclude`` grammar.

A hostfile lists one node per line, ``worker-0 slots=4`` or ``user@worker-0 slots=4`` (ssh's
user); ``#`` comments and blank lines are allowed. The result of parsing and filtering is the
*world*: an ordered mapping from node (as ssh/pdsh are given it: ``[user@]host``) to the slot
(device) indices used on it. ``--include``/``--exclude`` name nodes by host, without the user
(``@`` separates nodes there). Unlike DeepSpeed, every mistake is an error that quotes the
offending line or spec, and a hostfile named explicitly must exist.

Host names are letters, digits, ``.``, ``-`` and ``_``, not starting with ``-`` (which ssh would
read as an option); IPv4 addresses are host names too. ``host:port`` and IPv6 literals are
refused (``:`` separates slots in the specs, and torch's rendezvous would need brackets): the
message says what to write instead.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re

from zerotrain.launcher.errors import LaunchError

# DeepSpeed's default hostfile location, read only when it exists and no --hostfile is given.
DEFAULT_HOSTFILE = "/job/hostfile"
# Devices per node; a larger slots= is a typo (and would build a huge slot list).
MAX_SLOTS = 1024
_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)\s*(#.*)?$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")

World = dict[str, list[int]]


def host_of(node: str) -> str:
    """The host of a ``[user@]host`` node."""
    return node.rpartition("@")[2]


def user_of(node: str) -> str | None:
    """The user of a ``user@host`` node, else None."""
    user, at, _ = node.rpartition("@")
    return user if at else None


def node_problem(node: str) -> str | None:
    """Why ``node`` (``[user@]host``) cannot be used, with the fix; None when it can."""
    user, at, host = node.rpartition("@")
    if at and not _NAME.match(user):
        return (
            f"{node!r} is not USER@HOST (a user name is letters, digits, '.', '-', '_'; "
            "or set the user in ~/.ssh/config)"
        )
    if host.startswith("-"):
        return f"host {host!r} starts with '-', which ssh would read as an option; fix the host name"
    if ":" in host or host.startswith("["):
        try:
            ipaddress.ip_address(host.strip("[]").split("%")[0])
        except ValueError:
            return (
                f"{host!r} is not a host name: for HOST:PORT write the host alone and pass "
                "--ssh_port PORT (or set Port in ~/.ssh/config)"
            )
        return (
            f"IPv6 address {host!r} is not supported as a node; give the node's host name "
            "(e.g. from /etc/hosts or a Host entry of ~/.ssh/config)"
        )
    if not _NAME.match(host):
        return f"host {host!r} may hold only letters, digits, '.', '-' and '_'"
    return None


def parse_hostfile_text(text: str, source: str = "hostfile") -> World:
    """``{"worker-0": [0, 1, 2, 3], ...}`` in file order from hostfile text."""
    world: World = {}
    hosts: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            raise LaunchError(
                "--hostfile", f"{source}:{number}: {raw!r} is not 'HOST slots=N' (e.g. 'worker-0 slots=4')"
            )
        host, slot_text = match["host"], match["slots"]
        problem = node_problem(host)
        if problem:
            raise LaunchError("--hostfile", f"{source}:{number}: {raw!r}: {problem}")
        slots = int(slot_text) if len(slot_text) <= 6 else MAX_SLOTS + 1
        if slots < 1:
            raise LaunchError(
                "--hostfile",
                f"{source}:{number}: {raw!r} gives {host} no slots; use slots=1 or more, or remove the line",
            )
        if slots > MAX_SLOTS:
            raise LaunchError(
                "--hostfile",
                f"{source}:{number}: {raw!r}: slots={slot_text} is more than "
                f"{MAX_SLOTS} devices per node; give the node's device count",
            )
        if host_of(host) in hosts:
            raise LaunchError(
                "--hostfile",
                f"{source}:{number}: {raw!r} repeats host {host_of(host)!r}; list each host once with its total slots",
            )
        hosts.add(host_of(host))
        world[host] = list(range(slots))
    if not world:
        raise LaunchError("--hostfile", f"{source} lists no hosts; add lines like 'worker-0 slots=4'")
    return world


def read_hostfile(path: str | None) -> World | None:
    """The hostfile's world; None when no path was given and DeepSpeed's default file is absent.

    A path given explicitly must exist (DeepSpeed silently runs locally instead).
    """
    if path is None:
        if not os.path.isfile(DEFAULT_HOSTFILE):
            return None
        path = DEFAULT_HOSTFILE
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise LaunchError("--hostfile", f"cannot read {path!r} ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise LaunchError(
            "--hostfile",
            f"{path}:{line}: byte {data[err.start]:#04x} is not UTF-8 text; "
            "save the hostfile as plain text ('HOST slots=N' lines)",
        ) from None
    return parse_hostfile_text(text, source=path)


def parse_node_specs(spec: str, flag: str) -> dict[str, list[int] | None]:
    """``"worker-0@worker-1:0,2"`` -> ``{"worker-0": None, "worker-1": [0, 2]}`` (None: all slots)."""
    nodes: dict[str, list[int] | None] = {}
    for node_spec in spec.split("@"):
        host, colon, slot_text = node_spec.partition(":")
        if not host or (colon and not slot_text):
            raise LaunchError(
                flag, f'{node_spec!r} in {spec!r} is not HOST or HOST:SLOT[,SLOT...] (e.g. "worker-0@worker-1:0,2")'
            )
        if host in nodes:
            raise LaunchError(flag, f"host {host!r} appears twice in {spec!r}; join its slots: {host}:0,1")
        slots = None
        if colon:
            try:
                slots = [int(s) for s in slot_text.split(",")]
            except ValueError:
                raise LaunchError(
                    flag,
                    f"slots {slot_text!r} of {host!r} in {spec!r} must be numbers "
                    "separated by commas (e.g. worker-1:0,2)",
                ) from None
        nodes[host] = slots
    return nodes


def _by_node(world: World, specs: dict[str, list[int] | None], flag: str, spec: str) -> dict[str, list[int] | None]:
    """``specs`` keyed by the world's nodes (a spec names a ``user@host`` node by its host)."""
    nodes = {host_of(node): node for node in world}
    nodes.update({node: node for node in world})
    keyed: dict[str, list[int] | None] = {}
    for host, slots in specs.items():
        if host not in nodes:
            raise LaunchError(
                flag,
                f"{spec!r} names host {host!r}, which is not in the hostfile "
                f"(hosts: {', '.join(host_of(n) for n in world)})",
            )
        node = nodes[host]
        unknown = [s for s in slots or [] if s not in world[node]]
        if unknown:
            raise LaunchError(
                flag,
                f"{spec!r} names slot(s) {unknown} of {host!r}, which has slots {world[node][0]}-{world[node][-1]}",
            )
        keyed[node] = slots
    return keyed


def filter_world(world: World, include: str | None = None, exclude: str | None = None) -> World:
    """Keep only ``include``'s hosts/slots, or drop ``exclude``'s; hosts left without slots go."""
    if include and exclude:
        raise LaunchError("--include", "--include and --exclude cannot be combined; use one of them")
    if include:
        specs = _by_node(world, parse_node_specs(include, "--include"), "--include", include)
        # File order, as DeepSpeed keeps it, so node ranks follow the hostfile.
        return {host: sorted(specs[host] or world[host]) for host in world if host in specs}
    if exclude:
        specs = _by_node(world, parse_node_specs(exclude, "--exclude"), "--exclude", exclude)
        kept: World = {}
        for host, slots in world.items():
            if host in specs:
                dropped = specs[host]
                slots = [] if dropped is None else [s for s in slots if s not in dropped]
            if slots:
                kept[host] = slots
        if not kept:
            raise LaunchError("--exclude", f"{exclude!r} leaves no host to run on")
        return kept
    return dict(world)


def limit_world(world: World, num_nodes: int | None, num_gpus: int | None) -> World:
    """The first ``num_nodes`` hosts, each with its first ``num_gpus`` slots (DeepSpeed's rule)."""
    hosts = list(world)
    if num_nodes is not None:
        if num_nodes > len(hosts):
            raise LaunchError(
                "--num_nodes", f"{num_nodes} node(s) asked but the hostfile has {len(hosts)}: {', '.join(hosts)}"
            )
        hosts = hosts[:num_nodes]
    limited: World = {}
    for host in hosts:
        slots = world[host]
        if num_gpus is not None:
            if num_gpus > len(slots):
                raise LaunchError(
                    "--num_gpus",
                    f"{num_gpus} process(es) per node asked but {host} has {len(slots)} slot(s) in the hostfile",
                )
            slots = slots[:num_gpus]
        limited[host] = slots
    return limited


def format_world(world: World) -> str:
    """``"worker-0:0,1@worker-1:0"``: the include spec that selects exactly ``world`` (nodes named
    by host)."""
    return "@".join(f"{host_of(node)}:{','.join(map(str, slots))}" for node, slots in world.items())


def encode_world(world: World) -> str:
    """The world as the nodes' agents get it (``--world``): JSON ``[[node, [slot, ...]], ...]``,
    which holds any node name unambiguously (a ``HOST:SLOTS@...`` spec cannot hold ``user@host``)."""
    return json.dumps([[node, slots] for node, slots in world.items()], separators=(",", ":"))


def decode_world(text: str, flag: str = "--world") -> World:
    """`encode_world`'s JSON, or (written by hand) a ``HOST[:SLOT,...]@...`` spec."""
    if not text.startswith("["):
        specs = parse_node_specs(text, flag)
        for host in specs:
            problem = node_problem(host)
            if problem:
                raise LaunchError(flag, problem)
        return specs  # a node without slots: --nproc (or the default) processes
    try:
        pairs = json.loads(text)
        world = {node: slots for node, slots in pairs}
        ok = len(world) == len(pairs) and all(
            isinstance(node, str)
            and isinstance(slots, list)
            and 0 < len(slots) <= MAX_SLOTS
            and all(type(s) is int and 0 <= s for s in slots)
            for node, slots in world.items()
        )
    except (ValueError, TypeError):
        ok = False
    if not ok or not world:
        raise LaunchError(flag, f"{text[:80]!r} is not a JSON list of [node, [slot, ...]] pairs")
    for node in world:
        problem = node_problem(node)
        if problem:
            raise LaunchError(flag, problem)
    return world
