"""Submodules and re-exported names that load on first attribute access (PEP 562).

``import deepspeed`` imports most of its tree, so scripts reach ``deepspeed.runtime.utils`` or
``deepspeed.ops.adam`` by attribute without importing them. zerotrain keeps ``import zerotrain``
free of torch, and instead gives each package a module ``__getattr__`` that imports the named
submodule (or the module holding a re-exported name) the first time it is asked for. Afterwards
the import system has set the attribute, so later accesses cost nothing.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Mapping, Optional


def lazy_attributes(package: str, submodules: Iterable[str] = (),
                    names: Optional[Mapping[str, str]] = None,
                    fallback: Optional[Callable[[str], Any]] = None):
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
