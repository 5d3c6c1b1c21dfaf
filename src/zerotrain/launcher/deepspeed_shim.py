"""``--deepspeed_shim``: ``import deepspeed`` in the ranks resolves to zerotrain when DeepSpeed is absent.

transformers' Trainer and accelerate reach DeepSpeed through ``import deepspeed``; without it they
stop with "DeepSpeed is not available => pip3 install deepspeed". zerotrain.hf's shim folder (a
``deepspeed`` package that becomes an alias of zerotrain, and its package metadata: docs/hf.md)
answers that import. The launcher puts it first on the ranks' ``PYTHONPATH``, as
``python -m zerotrain.hf`` does, so a DeepSpeed command line (``deepspeed --num_gpus=2 train.py
--deepspeed ds_config.json``) runs with zerotrain's launcher name alone.

- ``auto`` (the default; ``ZEROTRAIN_DEEPSPEED_SHIM`` sets another): when the script (or
  ``--module`` target) imports ``transformers``, ``accelerate`` or ``deepspeed`` anywhere in its
  source (read with ``ast``, not run), no ``deepspeed`` is importable and transformers and
  accelerate are installed (the shim is part of the ``hf`` extra);
- ``on``: for any target, under the same conditions (a script that reaches transformers only
  through modules of its own);
- ``off``: never.

A real DeepSpeed that is importable is always left alone, as is zerotrain's own ``deepspeed``
written by ``python -m zerotrain.hf install`` (it is already zerotrain).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from zerotrain.launcher.errors import flag_or_env

CHOICES = ("auto", "on", "off")
ENV_VAR = "ZEROTRAIN_DEEPSPEED_SHIM"
# Imports that reach DeepSpeed through ``import deepspeed`` (transformers' Trainer, accelerate).
NEEDS_DEEPSPEED = ("transformers", "accelerate", "deepspeed")
# What ``python -m zerotrain.hf install`` writes first in its files (zerotrain.hf.install.MARKER).
_INSTALLED_MARKER = "written by `python -m zerotrain.hf install`"
INSTALL_HINT = (
    "`python -m zerotrain.hf install` makes zerotrain the `deepspeed` of this environment "
    "(or start the command with `python -m zerotrain.hf`)"
)


def shim_dir() -> str:
    """zerotrain.hf's shim folder, found without importing zerotrain.hf (which needs the extra)."""
    spec = importlib.util.find_spec("zerotrain.hf")
    return str(Path(spec.origin).resolve().parent / "shim")


def resolve(choice: str | None, environ=os.environ) -> str:
    """The flag's value, else ``ZEROTRAIN_DEEPSPEED_SHIM``, else ``auto``; one line for anything else."""
    return flag_or_env(choice, "--deepspeed_shim", ENV_VAR, CHOICES, "value", environ)


def imported_packages(source: str) -> set[str]:
    """Top-level names of every absolute import in ``source`` (in functions too); empty when the
    source does not parse (the rank reports that itself)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def target_source(script: str, module: bool) -> str | None:
    """The text of the script, or of a ``--module`` target (located without importing its
    packages); None when it cannot be found or read."""
    path: str | None = script
    if module:
        path = _module_file(script)
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _module_file(name: str) -> str | None:
    search, spec = None, None
    for part in name.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = spec.submodule_search_locations
    if spec.submodule_search_locations:  # a package runs its __main__
        main = Path(next(iter(spec.submodule_search_locations))) / "__main__.py"
        return str(main) if main.is_file() else None
    return spec.origin if spec.origin and spec.origin.endswith(".py") else None


def installed_deepspeed(shim: str) -> str | None:
    """Where an importable ``deepspeed`` other than the shim folder's lives, or None."""
    spec = importlib.machinery.PathFinder.find_spec(
        "deepspeed", [p for p in _search_path() if os.path.abspath(p) != shim]
    )
    if spec is None:
        return None
    return spec.origin or next(iter(spec.submodule_search_locations or []), "deepspeed")


def _search_path() -> list[str]:
    return [p or os.getcwd() for p in sys.path]


def _is_zerotrains(origin: str) -> bool:
    try:
        return _INSTALLED_MARKER in Path(origin).read_text(encoding="utf-8", errors="replace")[:400]
    except OSError:
        return False


def configure(choice: str | None, script: str, module: bool, no_python: bool, environ=os.environ) -> str | None:
    """Put the shim first in ``environ['PYTHONPATH']`` when it applies; return a line for the
    launcher to print, or None when there is nothing to say."""
    mode = resolve(choice, environ)
    if mode == "off":
        return None
    shim = shim_dir()
    pythonpath = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if pythonpath[:1] == [shim]:
        return None  # `python -m zerotrain.hf ...` already did it
    name = os.path.basename(script)
    if mode == "auto":
        source = None if no_python else target_source(script, module)
        wanted = sorted(imported_packages(source or "") & set(NEEDS_DEEPSPEED))
        if not wanted:
            return None
        why = f"{name} imports {' and '.join(wanted)}"
    else:
        why = f"--deepspeed_shim on ({name})"
    origin = installed_deepspeed(shim)
    if origin is not None:
        if _is_zerotrains(origin):
            return None
        return f"{why}; its ranks use the DeepSpeed installed at {origin} (zerotrain leaves it alone)"
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return (
            f"{why}, but DeepSpeed is not installed and zerotrain's stand-in needs {' and '.join(missing)}: "
            "pip install 'zerotrain[hf]' (or write `import zerotrain as deepspeed` in the script)"
        )
    environ["PYTHONPATH"] = os.pathsep.join([shim, *(p for p in pythonpath if p != shim)])
    return (
        f"{why} and DeepSpeed is not installed: `import deepspeed` in its ranks is zerotrain "
        f"(zerotrain.hf's shim first on PYTHONPATH; --deepspeed_shim off or {ENV_VAR}=off turns this off)"
    )


@contextlib.contextmanager
def for_ranks(
    choice: str | None, script: str, module: bool, no_python: bool, say: Callable[[str], None]
) -> Iterator[None]:
    """Within the block, this process's environment (which the elastic agent hands its ranks)
    carries the shim when it applies; afterwards ``PYTHONPATH`` is what it was."""
    saved = os.environ.get("PYTHONPATH")
    said = configure(choice, script, module, no_python)
    if said:
        say(said)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


# What a rank prints when `import deepspeed` found nothing (transformers/accelerate's check, Python's).
_MISSING_SIGNS = ("DeepSpeed is not available", "No module named 'deepspeed'")


def failure_hint(stderr_tail: list[str]) -> str | None:
    """A line for the failure report when the rank failed for want of ``deepspeed``."""
    if not any(sign in line for line in stderr_tail for sign in _MISSING_SIGNS):
        return None
    if any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate")):
        return (
            "zerotrain: the rank found no `deepspeed`; zerotrain stands in for it with the hf extra "
            "(pip install 'zerotrain[hf]'), or write `import zerotrain as deepspeed` in the script"
        )
    return (
        f"zerotrain: the rank found no `deepspeed`; zerotrain stands in for it: {INSTALL_HINT}, or let "
        f"the launcher do it for this run with --deepspeed_shim on (or {ENV_VAR}=on)"
    )
