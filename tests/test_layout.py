"""The dependency rule of docs/design.md ("Dependency rule"), checked on the source with ``ast``.

- The DeepSpeed-named compatibility modules (``COMPAT``: everything under ``deepspeed_paths/``, imported
  as ``zerotrain.runtime``, ``zerotrain.moe``, ...) hold re-exports and aliases only, and no module
  outside them imports from them.
- The package-level import graph has no cycle through ``zero`` or ``offload`` (zero uses offload,
  never the other way), and none at all once the root namespace (``zerotrain/__init__``) is left out.
- The module-level import graph (imports that run when a module is imported, not those inside
  functions) has no cycle at all: a cycle there is an import that can fail half-initialized.
- The README's "Layout" block lists every folder under src/zerotrain.

Every import counts, lazy ones inside functions included (a function-level import is a dependency
all the same, only paid later), and so do the lazy loaders' targets: a string literal naming a
zerotrain module that is a dict value (``lazy_attributes(names={...})``, ``zerotrain.__init__``'s
``_EXPORTS``) or the argument of ``importlib.import_module``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from tests.source_tree import ROOT, SRC, import_base
from tests.source_tree import modules as _modules
from zerotrain._lazy import DEEPSPEED_NAMED, DEEPSPEED_PATHS, public_name

#: Packages (and everything under them) that exist only to give DeepSpeed's import paths
#: (docs/compat.md): the files under ``deepspeed_paths/`` (``deepspeed.runtime.*``, ``deepspeed.utils.*``,
#: ``deepspeed.ops.*``, ``deepspeed.moe.*``, ``deepspeed.pipe``, ``deepspeed.compression.*``,
#: ``deepspeed.profiling.*``, ``deepspeed.checkpointing``), imported under those names, and the installed
#: ``deepspeed`` shim. Packages whose name DeepSpeed shares but that hold zerotrain's own
#: implementation of the concern (accelerator, comm, checkpoint, monitor, launcher, zero) are not
#: compatibility modules.
COMPAT = (DEEPSPEED_PATHS, *(f"zerotrain.{name}" for name in DEEPSPEED_NAMED), "zerotrain.hf.shim")

#: Package-level edges allowed to close a cycle: none through these packages.
ACYCLIC = ("zero", "offload")


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The zerotrain module ``name`` imports (its longest prefix that is a module)."""
    parts = public_name(name).split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def imports_of(module: str) -> set[str]:
    """Every zerotrain module ``module`` imports, at module level or inside functions."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        target = _resolve(name)
        if target is not None and target != module:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = import_base(node, package)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in MODULES else base)
        elif isinstance(node, (ast.Dict, ast.DictComp)):
            for value in node.values if isinstance(node, ast.Dict) else [node.value]:
                if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value in MODULES:
                    add(value.value)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value)
    return found


def _runs_at_import(body):
    """The statements of ``body`` that run when the module is imported: all but function bodies
    and ``if TYPE_CHECKING:`` blocks (class bodies, ``if``/``try``/``with`` blocks included)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _runs_at_import(node.orelse)
            continue
        yield node
        for block in ("body", "orelse", "finalbody"):
            yield from _runs_at_import(getattr(node, block, []) or [])
        for handler in getattr(node, "handlers", []) or []:
            yield from _runs_at_import(handler.body)


def import_time_imports_of(module: str) -> set[str]:
    """The zerotrain modules that importing ``module`` runs first: its module-level imports, each
    with the packages above it (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__``), but not
    ``module``'s own packages (already running) or the root namespace."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        target = _resolve(name)
        if target is None:
            return
        parts = target.split(".")
        for end in range(2, len(parts) + 1):
            step = ".".join(parts[:end])
            if step in MODULES and step != module and not module.startswith(step + "."):
                found.add(step)

    for node in _runs_at_import(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = import_base(node, package)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if _resolve(full) == public_name(full) else base)
    return found


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``a -> b -> ... -> a``) per strongly connected component with more than one module
    (or a module importing itself), found by depth-first search."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(root: str) -> None:  # iterative Tarjan: the graph has a few hundred modules
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    cycles = []
    for component in components:  # a shortest way back to the component's first module
        members, start = set(component), min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier:
            nxt = []
            for node in frontier:
                for child in sorted(graph[node] & members):
                    if child == start:
                        cycles.append(paths[node] + [start])
                        nxt = []
                        frontier = []
                        break
                    if child not in paths:
                        paths[child] = paths[node] + [child]
                        nxt.append(child)
                else:
                    continue
                break
            frontier = nxt if frontier else []
    return cycles


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def compat_imports() -> list[str]:
    """``importer -> compat module`` for every module outside COMPAT that imports from it."""
    return sorted(f"{m} -> {t}" for m in MODULES if not _in(m, COMPAT) for t in imports_of(m) if _in(t, COMPAT))


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def package_graph() -> dict[str, dict[str, list[str]]]:
    """Top-level package -> imported package -> the module edges behind it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for m in MODULES:
        for t in imports_of(m):
            a, b = _top(m), _top(t)
            if a != b:
                graph.setdefault(a, {}).setdefault(b, []).append(f"{m} -> {t}")
    return graph


def cycles_through(graph, packages) -> list[list[str]]:
    """For each package in ``packages``: a shortest import path leading from it back to itself."""
    found = []
    for start in packages:
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in [p for f in frontier for p in graph.get(f, {})]:
            nxt = []
            for node in frontier:
                for b in graph.get(node, {}):
                    if b not in paths:
                        paths[b] = paths[node] + [b]
                        nxt.append(b)
            frontier = nxt
        back = [f for f in frontier if start in graph.get(f, {})]
        if back:
            found.append(paths[back[0]] + [start])
    return found


def compat_definitions() -> list[str]:
    """Code in compatibility modules: anything beyond imports, names bound to other names or
    constants (tables of names included), ``__all__`` and the lazy loader (``__getattr__``/``__dir__``)."""
    out = []
    for m in MODULES:
        if not _in(m, COMPAT):
            continue
        for node in ast.parse(MODULES[m].read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # docstring
            if isinstance(node, (ast.FunctionDef,)) and node.name in ("__getattr__", "__dir__"):
                continue
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and not any(
                isinstance(n, ast.Lambda) for n in ast.walk(node)
            ):
                continue  # aliases, __all__, name tables, lazy_attributes(...)
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") == "become_deepspeed"
            ):
                continue  # the installed shim aliases zerotrain's modules as deepspeed's
            out.append(f"{m}:{node.lineno} {type(node).__name__} {getattr(node, 'name', '')}".rstrip())
    return out


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## Layout\n+```\n(.*?)^```", text, re.S | re.M)
    assert match, "README.md has no '## Layout' code block"
    return match.group(1)


def folders() -> list[str]:
    return sorted(p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists())


# --- the checks ---------------------------------------------------------------------------------


def test_no_module_outside_compat_imports_from_it():
    assert compat_imports() == [], (
        "real code imports from the DeepSpeed-named compatibility modules; "
        "import from the module that implements the name instead"
    )


def test_compat_modules_hold_only_reexports():
    assert compat_definitions() == [], "move the code to its concern's package and re-export it here"


def test_no_import_cycle_through_zero_or_offload():
    graph = package_graph()
    cycles = cycles_through(graph, ACYCLIC)
    detail = [" -> ".join(c) + ": " + "; ".join(graph[a][b][0] for a, b in zip(c, c[1:])) for c in cycles]
    assert not cycles, "\n".join(detail)
    assert "offload" in graph["zero"], "zero uses offload (the direction the rule keeps)"


def test_package_graph_is_acyclic_but_for_the_root_namespace():
    # zerotrain/__init__ names every package (lazily) and a few modules read its __version__:
    # the one node allowed on a cycle.
    graph = {a: {b: e for b, e in out.items() if b != "<root>"} for a, out in package_graph().items() if a != "<root>"}
    cycles = cycles_through(graph, sorted(graph))
    assert not cycles, "\n".join(
        " -> ".join(c) + ": " + "; ".join(graph[a][b][0] for a, b in zip(c, c[1:])) for c in cycles
    )


def test_no_import_cycle_between_modules_at_import_time():
    graph = {m: import_time_imports_of(m) for m in MODULES}
    cycles = module_cycles(graph)
    assert not cycles, (
        "modules that import each other when imported (make one import lazy, or move "
        "the shared piece below both):\n" + "\n".join(" -> ".join(c) for c in cycles)
    )


def test_the_module_cycle_check_finds_a_cycle_and_its_path():
    # The checker itself, on a made-up graph: a -> b -> c -> a beside an acyclic d -> a.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(module_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    # And the scanner: a module-level import counts with its packages, a function-level one does not.
    assert "zerotrain.engine.engine" in import_time_imports_of("zerotrain.engine.pipeline_engine")
    # ``from zerotrain.recompute import settings`` in recompute/recompute.py: the submodule counts, its
    # own package does not (it is already running when the module is).
    assert "zerotrain.recompute.settings" in import_time_imports_of("zerotrain.recompute.recompute")
    assert "zerotrain.recompute" not in import_time_imports_of("zerotrain.recompute.recompute")
    assert "zerotrain.offload" not in import_time_imports_of("zerotrain.zero")  # inside functions only


def test_deepspeed_paths_are_one_module_per_file_under_their_public_names():
    on_disk = {
        p.stem if p.suffix == ".py" else p.name
        for p in (SRC / "deepspeed_paths").iterdir()
        if p.name != "__init__.py" and p.name != "__pycache__"
    }
    assert on_disk == set(DEEPSPEED_NAMED)  # the finder's list is the folder's contents
    # and no real module at the top level has one of these names (the finder would hide it).
    assert not any((SRC / name / "__init__.py").exists() or (SRC / f"{name}.py").exists() for name in DEEPSPEED_NAMED)
    # In a fresh interpreter, each name and its deepspeed_paths name are the same module object.
    script = (
        "import pickle, sys\n"
        "import zerotrain as deepspeed\n"
        "import zerotrain.runtime.zero.stage3, zerotrain.deepspeed_paths.runtime.zero.stage3 as alias\n"
        "assert alias is sys.modules['zerotrain.runtime.zero.stage3'] is deepspeed.runtime.zero.stage3\n"
        "assert alias.__name__ == alias.__spec__.name == 'zerotrain.runtime.zero.stage3'\n"
        "from zerotrain.moe.layer import MoE\n"
        "from zerotrain.deepspeed_paths.moe.layer import MoE as MoE2\n"
        "from zerotrain.experts.layer import MoE as MoE3\n"
        "assert MoE is MoE2 is MoE3 and pickle.loads(pickle.dumps(MoE)) is MoE\n"
        "import zerotrain.checkpointing, zerotrain.recompute\n"
        "assert zerotrain.checkpointing.checkpoint is zerotrain.recompute.checkpoint\n"
        "assert deepspeed.pipe.PipelineModule is __import__('zerotrain.pipeline').pipeline.PipelineModule\n"
        "import zerotrain.deepspeed_paths.utils.groups as groups\n"
        "assert deepspeed.utils.groups is groups and groups.__name__ == 'zerotrain.utils.groups'\n"
        "files = {}\n"
        "for name, module in list(sys.modules.items()):\n"
        "    if name.startswith('zerotrain') and getattr(module, '__file__', None):\n"
        "        assert files.setdefault(module.__file__, module) is module, name\n"
        "try:\n"
        "    import zerotrain.runtime.no_such_module\n"
        "except ModuleNotFoundError as error:\n"
        "    assert error.name == 'zerotrain.runtime.no_such_module', error.name\n"
        "else:\n"
        "    raise AssertionError('imported a module that does not exist')\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(SRC.parent)},
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_readme_layout_lists_every_folder():
    block = layout_block()
    listed = set(re.findall(r"^  ([A-Za-z_]\w*)/", block, re.M))
    assert listed == set(folders()), (
        f"missing: {sorted(set(folders()) - listed)}, not a folder: {sorted(listed - set(folders()))}"
    )


def test_the_checks_see_lazy_and_function_level_imports():
    # The scanner itself: a lazy loader's target and an import inside a function both count.
    assert "zerotrain.zero.leaves" in imports_of("zerotrain.utils")  # lazy_attributes(names={...})
    assert "zerotrain.utils" in MODULES and "zerotrain.deepspeed_paths.utils" not in MODULES  # public names
    assert "zerotrain.offload" in imports_of("zerotrain.zero.build")  # inside build_zero_stage
