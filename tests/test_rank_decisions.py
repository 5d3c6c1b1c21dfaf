"""Every rank decision comes from the topology (docs/design.md, "Ranks come from the topology"),
checked on the source with ``ast``.

Outside ``zerotrain.comm`` and ``zerotrain.topology`` no module asks ``torch.distributed`` for a
rank or a world size without a group: ``dist.get_rank()``, ``torch.distributed.get_world_size()``,
``from torch.distributed import get_rank`` then ``get_rank()``, and ``get_rank(None)`` /
``get_rank(group=None)`` (None is the world) all count. Outside ``comm``, ``topology`` and the
launcher no module asks ``zerotrain.comm`` (``zerotrain.comm.distributed``) for the world's rank or
size either: ``comm.get_rank()``, ``comm.get_world_size()`` without a group. A reference to one of
these functions that is not a call (``rank_of = dist.get_rank``) counts too: its calls cannot be
checked. Every import counts, function-level ones included, and relative imports are resolved.
"""

from __future__ import annotations

import ast

from tests.source_tree import ROOT, import_base
from tests.source_tree import modules as _modules

#: Functions that answer for a group, the world when the group is missing or None.
TORCH = {
    "torch.distributed.get_rank",
    "torch.distributed.get_world_size",
    "torch.distributed.distributed_c10d.get_rank",
    "torch.distributed.distributed_c10d.get_world_size",
}
#: zerotrain.comm's process-wide answers (``get_rank()`` has no group; ``get_world_size(group=None)``).
COMM = {
    "zerotrain.comm.get_rank",
    "zerotrain.comm.get_world_size",
    "zerotrain.comm.distributed.get_rank",
    "zerotrain.comm.distributed.get_world_size",
}

#: Packages allowed to ask: comm owns the process group, topology every rank and group.
TORCH_ALLOWED = ("zerotrain.comm", "zerotrain.topology")
#: ... and the launcher (it starts the processes and reads the world it made).
COMM_ALLOWED = TORCH_ALLOWED + ("zerotrain.launcher",)

#: Offenders in files owned by other work in progress (issue 30): module -> why it is still here.
#: The lead empties this list; a module leaving it must not come back.
ALLOWED_FOR_NOW: dict[str, str] = {}


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _bindings(tree: ast.AST, module: str, is_package: bool) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import in the module (any scope)."""
    package = module if is_package else module.rpartition(".")[0]
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:  # ``import torch.distributed`` binds ``torch``
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = import_base(node, package)
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted name an expression like ``dist.get_rank`` or ``torch.distributed.get_rank`` means."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    return ".".join([names[node.id]] + attrs[::-1])


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


#: The default group named outright: the world all the same.
WORLD_GROUPS = {
    "torch.distributed.group.WORLD",
    "torch.distributed.GroupMember.WORLD",
    "torch.distributed.distributed_c10d.group.WORLD",
    "torch.distributed.distributed_c10d.GroupMember.WORLD",
}


def _asks_the_world(call: ast.Call, names: dict[str, str]) -> bool:
    """No group argument, or the group given as None or as torch's default group by name."""
    group = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "group"), None)
    if any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
        return False  # ``**kwargs``/``*args``: the group may be there
    return group is None or _is_none(group) or _dotted(group, names) in WORLD_GROUPS


def world_queries(source: str, module: str = "zerotrain.example", is_package: bool = False) -> list[str]:
    """``line: what`` for every world rank/size question in ``source`` that ``module`` may not ask."""
    tree = ast.parse(source)
    names = _bindings(tree, module, is_package)
    called = set()
    found = []
    forbidden = set()
    if not _in(module, TORCH_ALLOWED):
        forbidden |= TORCH
    if not _in(module, COMM_ALLOWED):
        forbidden |= COMM
    if not forbidden:
        return []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called.add(id(node.func))
            target = _dotted(node.func, names)
            if target in forbidden and _asks_the_world(node, names):
                found.append(f"{node.lineno}: {ast.unparse(node)} ({target}, the world's)")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load) and id(node) not in called:
            target = _dotted(node, names)
            if target in forbidden:
                found.append(f"{node.lineno}: {ast.unparse(node)} passed as a value ({target})")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


MODULES = _modules()


def offenders() -> dict[str, list[str]]:
    """module -> its world questions, for every module under src/zerotrain."""
    out = {}
    for module, path in MODULES.items():
        found = world_queries(path.read_text(), module, path.name == "__init__.py")
        if found:
            out[module] = found
    return out


# --- the checks ---------------------------------------------------------------------------------


def test_no_rank_decision_asks_the_world():
    found = {m: f for m, f in offenders().items() if m not in ALLOWED_FOR_NOW}
    detail = "\n".join(f"{MODULES[m].relative_to(ROOT)}:{line}" for m, lines in found.items() for line in lines)
    assert not found, (
        "ask the topology (engine.topology, or zerotrain.topology.current() without an "
        "engine) instead of the world:\n" + detail
    )


def test_allowed_for_now_lists_only_offenders():
    # An entry whose module no longer asks the world must leave the list (so it cannot come back).
    assert sorted(set(ALLOWED_FOR_NOW) - set(offenders())) == []


def test_the_checker_flags_a_bare_get_rank():
    assert world_queries("import torch.distributed as dist\n\ndef f():\n    return dist.get_rank()\n") == [
        "4: dist.get_rank() (torch.distributed.get_rank, the world's)"
    ]


def test_the_checker_sees_every_spelling():
    src = """
import torch
import torch.distributed
from torch import distributed as d
from torch.distributed import get_world_size as size, get_rank
import zerotrain.comm as comm
from zerotrain.comm.distributed import get_rank as process_rank
from ..comm import get_world_size

def f(group):
    a = torch.distributed.get_rank()
    b = d.get_world_size(None)
    c = size(group=None)
    e = get_rank()
    g = comm.get_rank()
    h = process_rank()
    i = get_world_size()
    pick = d.get_rank
    j = d.get_world_size(group=d.group.WORLD)
    k = torch.distributed.get_rank(torch.distributed.GroupMember.WORLD)
    ok = (d.get_rank(group), size(group=group), get_world_size(group), torch.distributed.get_rank(group=group))
"""
    found = world_queries(src, "zerotrain.engine.example")
    assert [int(line.split(":")[0]) for line in found] == [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], found
    assert "zerotrain.comm.get_world_size" in found[6]  # the relative import resolved


def test_the_checker_allows_comm_topology_and_the_launcher_their_own_questions():
    bare = (
        "import torch.distributed as dist\nfrom zerotrain.comm import get_rank\nx = dist.get_rank()\ny = get_rank()\n"
    )
    assert world_queries(bare, "zerotrain.comm.distributed") == []
    assert world_queries(bare, "zerotrain.topology.topology") == []
    assert [s.split(":")[0] for s in world_queries(bare, "zerotrain.launcher.launch")] == ["3"]  # torch's: no
    assert len(world_queries(bare, "zerotrain.log")) == 2
