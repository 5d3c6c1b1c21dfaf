"""Submodules and re-exported names that load on first attribute access (PEP 562).

``import deepspeed`` imports most of its tree, so scripts reach ``deepspeed.runtime.utils`` or
``deepspeed.ops.adam`` by attribute without importing them. zerotrain keeps ``import zerotrain``
free of torch, and instead gives each package a module ``__getattr__`` that imports the named
submodule (or the module holding a re-exported name) the first time it is asked for. Afterwards
the import system has set the attribute, so later accesses cost nothing.

DeepSpeed's paths (``zerotrain.runtime``, ``zerotrain.moe``, ...) are re-export modules kept
together in ``deepspeed_paths/`` so the top level shows only zerotrain's own packages;
:class:`DeepSpeedPathFinder` loads each file there once, under its public name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_attributes(
    package: str,
    submodules: Iterable[str] = (),
    names: Mapping[str, str] | None = None,
    fallback: Callable[[str], Any] | None = None,
):
    """``(__getattr__, __dir__)`` for ``package``'s ``__init__``.

    ``submodules``: short names of ``package``'s submodules; ``names``: re-exported name -> the
    module that defines it. ``fallback(name)``, if given, handles other names (it raises
    AttributeError for unknown ones); otherwise unknown names raise AttributeError naming the
    module, as Python does.
    """
    submodules = frozenset(submodules)
    names = dict(names or {})

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        module = importlib.import_module(package)
        return sorted(set(vars(module)) | submodules | set(names))

    return __getattr__, __dir__


#: The package whose folder holds DeepSpeed's import paths, and the top-level names found there
#: (``zerotrain.<name>``; the names of packages zerotrain implements itself, such as ``comm``,
#: ``zero``, ``accelerator`` or ``checkpoint``, are real packages at the top level instead).
DEEPSPEED_PATHS = "zerotrain.deepspeed_paths"
DEEPSPEED_NAMED = ("checkpointing", "compression", "moe", "ops", "pipe", "profiling", "runtime", "utils")
_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_paths")


def public_name(module_name: str) -> str:
    """``zerotrain.deepspeed_paths.runtime.zero`` -> ``zerotrain.runtime.zero`` (others unchanged)."""
    if module_name.startswith(DEEPSPEED_PATHS + "."):
        return "zerotrain." + module_name[len(DEEPSPEED_PATHS) + 1 :]
    return module_name


class _SameModule(importlib.abc.Loader):
    """Loads ``zerotrain.deepspeed_paths.X`` as the module ``zerotrain.X`` already is (one object per file)."""

    def __init__(self, public: str):
        self.public = public
        self.spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.public)
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system set the alias's spec on it; keep the file's


class DeepSpeedPathFinder(importlib.abc.MetaPathFinder):
    """``zerotrain.<name>`` for each name in DEEPSPEED_NAMED: the file under ``deepspeed_paths/``
    (its submodules then follow its ``__path__``, as for any package), and
    ``zerotrain.deepspeed_paths.<...>``: the same module objects."""

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if len(parts) == 2 and parts[0] == "zerotrain" and parts[1] in DEEPSPEED_NAMED:
            return importlib.machinery.PathFinder.find_spec(fullname, [_FOLDER])
        if fullname.startswith(DEEPSPEED_PATHS + "."):
            public = public_name(fullname)
            found = importlib.util.find_spec(public)
            if found is None:
                return None
            return importlib.machinery.ModuleSpec(
                fullname, _SameModule(public), is_package=found.submodule_search_locations is not None
            )
        return None


_FINDER = DeepSpeedPathFinder()


def install_deepspeed_paths() -> None:
    """Put :class:`DeepSpeedPathFinder` first on ``sys.meta_path`` (zerotrain/__init__ does; idempotent)."""
    if not any(isinstance(finder, DeepSpeedPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
