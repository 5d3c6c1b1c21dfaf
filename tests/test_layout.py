"""The dependency rule of docs/design.md ("Dependency rule"), checked on the source with ``ast``.

- The DeepSpeed-named compatibility modules (``COMPAT``) hold re-exports and aliases only, and no
  module outside them imports from them.
- The package-level import graph has no cycle through ``zero`` or ``offload`` (zero uses offload,
  never the other way), and none at all once the root namespace (``zerotrain/__init__``) is left out.
- The README's "Layout" block lists every folder under src/zerotrain.

Every import counts, lazy ones inside functions included (a function-level import is a dependency
all the same, only paid later), and so do the lazy loaders' targets: a string literal naming a
zerotrain module that is a dict value (``lazy_attributes(names={...})``, ``zerotrain.__init__``'s
``_EXPORTS``) or the argument of ``importlib.import_module``.
"""

from __future__ import annotations

import ast
import re

from tests.source_tree import ROOT, SRC, import_base, modules as _modules

#: Packages (and everything under them) that exist only to give DeepSpeed's import paths
#: (docs/compat.md): ``deepspeed.runtime.*``, ``deepspeed.utils.*``, ``deepspeed.ops.*``,
#: ``deepspeed.moe.*``, ``deepspeed.pipe``, ``deepspeed.compression.*``, ``deepspeed.profiling.*`` and the installed
#: ``deepspeed`` shim. Packages whose name DeepSpeed shares but that hold zerotrain's own
#: implementation of the concern (accelerator, comm, checkpoint, checkpointing, monitor, launcher,
#: zero) are not compatibility modules.
COMPAT = ("zerotrain.runtime", "zerotrain.utils", "zerotrain.ops", "zerotrain.moe", "zerotrain.pipe",
          "zerotrain.compression", "zerotrain.profiling", "zerotrain.hf.shim")

#: Package-level edges allowed to close a cycle: none through these packages.
ACYCLIC = ("zero", "offload")


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The zerotrain module ``name`` imports (its longest prefix that is a module)."""
    parts = name.split(".")
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
            for value in (node.values if isinstance(node, ast.Dict) else [node.value]):
                if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value in MODULES:
                    add(value.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value)
    return found


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def compat_imports() -> list[str]:
    """``importer -> compat module`` for every module outside COMPAT that imports from it."""
    return sorted(f"{m} -> {t}" for m in MODULES if not _in(m, COMPAT)
                  for t in imports_of(m) if _in(t, COMPAT))


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
                    isinstance(n, ast.Lambda) for n in ast.walk(node)):
                continue  # aliases, __all__, name tables, lazy_attributes(...)
            if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", "") == "become_deepspeed"):
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
    assert compat_imports() == [], ("real code imports from the DeepSpeed-named compatibility modules; "
                                    "import from the module that implements the name instead")


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
    graph = {a: {b: e for b, e in out.items() if b != "<root>"} for a, out in package_graph().items()
             if a != "<root>"}
    cycles = cycles_through(graph, sorted(graph))
    assert not cycles, "\n".join(" -> ".join(c) + ": " + "; ".join(graph[a][b][0] for a, b in zip(c, c[1:]))
                                  for c in cycles)


def test_readme_layout_lists_every_folder():
    block = layout_block()
    listed = set(re.findall(r"^  ([A-Za-z_]\w*)/", block, re.M))
    assert listed == set(folders()), (f"missing: {sorted(set(folders()) - listed)}, "
                                      f"not a folder: {sorted(listed - set(folders()))}")


def test_the_checks_see_lazy_and_function_level_imports():
    # The scanner itself: a lazy loader's target and an import inside a function both count.
    assert "zerotrain.zero.leaves" in imports_of("zerotrain.utils")  # lazy_attributes(names={...})
    assert "zerotrain.offload" in imports_of("zerotrain.zero.build")  # inside build_zero_stage
