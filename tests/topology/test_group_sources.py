"""Every process group and device mesh of the library is created under zerotrain/topology/, and
the process-wide current topology is read only where DeepSpeed's API gives no way to pass one
(docs/design.md, "Topology: who is who"). Checked on the source with ``ast``."""

from __future__ import annotations

import ast

from tests.source_tree import import_base, modules

#: torch's ways of creating process groups and meshes.
CREATORS = {
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "init_device_mesh",
    "DeviceMesh",
    "_unflatten",
    "_flatten",
}

#: Where ``zerotrain.topology.current()`` may be read: the getters (and the package that exports
#: it), and DeepSpeed's entry points without a topology argument (the ``MoE`` constructor,
#: ``MonitorMaster(config)``), as their default.
CURRENT_ALLOWED = {
    "zerotrain.topology",
    "zerotrain.topology.process_wide",
    "zerotrain.experts.layer",
    "zerotrain.monitor.monitor",
}


def _outside_topology():
    for name, path in modules().items():
        if name == "zerotrain.topology" or name.startswith("zerotrain.topology."):
            continue
        yield name, ast.parse(path.read_text(), filename=str(path))


def _called_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        if func.attr == "from_group" and isinstance(func.value, ast.Name) and func.value.id == "DeviceMesh":
            return "DeviceMesh"
        return func.attr
    return None


def test_groups_and_meshes_are_created_only_under_topology():
    found = []
    for name, tree in _outside_topology():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called_name(node) in CREATORS:
                found.append(f"{name}:{node.lineno} {_called_name(node)}()")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed.device_mesh"):
                found.append(f"{name}:{node.lineno} imports torch.distributed.device_mesh")
    assert found == [], "create groups through the topology (zerotrain.topology.groups): " + ", ".join(found)


def test_current_topology_is_read_only_behind_deepspeeds_getters():
    found = []
    for name, path in modules().items():
        if name in CURRENT_ALLOWED:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and import_base(node, package).startswith("zerotrain.topology"):
                if any(alias.name == "current" for alias in node.names):
                    found.append(f"{name}:{node.lineno}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr == "current"
                and isinstance(node.value, ast.Name)
                and node.value.id in ("topology", "process_wide")
            ):
                found.append(f"{name}:{node.lineno}")
    assert found == [], "pass the engine's topology instead of zerotrain.topology.current(): " + ", ".join(found)


def test_the_check_sees_a_creation():
    tree = ast.parse("import torch.distributed as dist\ng = dist.new_group([0])\nm = DeviceMesh.from_group(g, 'cpu')")
    calls = [_called_name(n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert "new_group" in calls and "DeviceMesh" in calls
