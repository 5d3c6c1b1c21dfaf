"""The library's modules as files, for the tests that read the source with ``ast``."""

from __future__ import annotations

from pathlib import Path

from zerotrain._lazy import public_name

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "zerotrain"


def module_name(path: Path) -> str:
    """``src/zerotrain/zero/zero_stage.py`` -> ``zerotrain.zero.zero_stage`` (a package is its ``__init__``).

    A file under ``deepspeed_paths/`` gets the name it is imported by, DeepSpeed's path:
    ``src/zerotrain/deepspeed_paths/runtime/utils.py`` -> ``zerotrain.runtime.utils``."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return public_name(".".join(parts))


def modules() -> dict[str, Path]:
    """Every module under src/zerotrain, by dotted name."""
    return {module_name(p): p for p in sorted(SRC.rglob("*.py")) if "__pycache__" not in p.parts}


def import_base(node, package: str) -> str:
    """The absolute module a ``from ... import`` names (``node``: an ``ast.ImportFrom`` in a module
    of ``package``; relative levels resolved)."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return public_name(base)
