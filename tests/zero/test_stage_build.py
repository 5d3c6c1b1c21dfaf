"""``zero.build`` gives each part of a ``ZeroStage`` its dependencies when it is constructed.

Nothing is wired into a built part afterwards (``coordinator.param_swapper = ...``,
``reduction.before_reduce = ...``): checked with ``ast`` over zero/ and offload/, where an
assignment to a collaborator attribute of anything but ``self`` fails, and over zero/build.py,
which assigns attributes only of the units it builds, a parameter's ``data`` and the user's
optimizer's ``add_param_group``. No process is spawned: the parts' behaviour is what the rest of
tests/zero/ checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "zerotrain"
PACKAGES = ("zero", "offload")
# The attributes through which one part reaches another.
COLLABORATORS = {
    "param_swapper",
    "grad_swapper",
    "before_reduce",
    "identities",
    "agreement",
    "checks",
    "coordinator",
    "reduction",
    "offload",
    "param_offload",
    "swapper",
    "outside",
    "swap_statistics",
    "masters",
    "units",
}
# Back-references an owner sets on the units it takes and clears when it gives them back: a
# ParamSwapper on the units whose shards it holds, stage 3's coordinator on the units it gathers.
ALLOWED = {("offload/params.py", "unit.param_swapper"), ("zero/stage3.py", "u.coordinator")}
# What the builder itself may assign: the unit under construction, a parameter's data (the
# cast of parameters outside the optimizer) and the patch on the user's optimizer.
BUILDER_TARGETS = {"unit.master", "unit.shard", "p.data", "optimizer.add_param_group"}


def _assigned(tree: ast.AST):
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    yield node.lineno, sub


def wiring(root: Path = SRC) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for line, attr in _assigned(ast.parse(path.read_text())):
                owner = attr.value
                if isinstance(owner, ast.Name) and owner.id == "self":
                    continue
                text = ast.unparse(attr)
                if attr.attr in COLLABORATORS and (rel, text) not in ALLOWED:
                    found.append(f"{rel}:{line}: {text}")
                elif rel == "zero/build.py" and text not in BUILDER_TARGETS:
                    found.append(f"{rel}:{line}: {text}")
    return found


def test_no_part_is_wired_after_construction():
    found = wiring()
    assert not found, "parts wired by assignment after construction:\n" + "\n".join(found)


def test_the_check_finds_wiring(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "zero" / "build.py").write_text(
        "def build(coordinator, swapper, unit, stage):\n"
        "    coordinator.param_swapper = swapper\n"
        "    unit.master = None\n"
        "    stage.extra = 1\n"
    )
    (tmp_path / "zero" / "other.py").write_text(
        "class Part:\n"
        "    def __init__(self, reduction):\n"
        "        self.reduction = reduction\n"  # a part keeping what it was given: fine
        "        reduction.before_reduce = self.ensure\n"
    )
    (tmp_path / "offload" / "params.py").write_text("def add(self, unit):\n    unit.param_swapper = self\n")
    assert wiring(tmp_path) == [
        "zero/build.py:2: coordinator.param_swapper",
        "zero/build.py:4: stage.extra",
        "zero/other.py:4: reduction.before_reduce",
    ]
