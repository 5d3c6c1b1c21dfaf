"""Make ``import deepspeed`` (and ``deepspeed.*``) resolve to zerotrain in this process.

transformers' Trainer and accelerate reach DeepSpeed only through DeepSpeed's public names
(``deepspeed.initialize``, ``deepspeed.zero.Init``, ``deepspeed.comm``, the engine's methods), and
decide whether DeepSpeed is installed by finding the module *and* its package metadata. The shim
folder (``shim/``: a ``deepspeed`` package of two lines and a ``deepspeed-<version>.dist-info``)
answers both when it is on ``sys.path``; its ``__init__`` calls :func:`become_deepspeed`, which
replaces that package by an alias of ``zerotrain``:

- ``deepspeed.X.Y`` is ``zerotrain.X.Y`` (the same objects: ``deepspeed.DeepSpeedEngine`` *is*
  ``zerotrain.ZeroTrainEngine``), read through an alias module so that
- names DeepSpeed has, transformers/accelerate use, and zerotrain's own modules lack come from
  :mod:`zerotrain.hf.deepspeed_extras` (listed there, each with why it is enough);
- anything else raises ``AttributeError``/``ModuleNotFoundError`` naming the DeepSpeed name and
  saying zerotrain does not provide it (docs/compat.md lists what is provided).

Nothing in zerotrain's own modules is modified.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

ALIAS = "deepspeed"
TARGET = "zerotrain"


def _target_name(alias_name: str) -> str:
    return TARGET + alias_name[len(ALIAS) :]


class DeepSpeedAliasModule(types.ModuleType):
    """``deepspeed.<path>``: attributes of ``zerotrain.<path>``, then the extras for that path."""

    def __init__(self, name: str, target: types.ModuleType | None):
        super().__init__(name, getattr(target, "__doc__", None))
        self.__dict__["_zerotrain_target"] = target
        self.__path__ = []  # a package: submodules come from DeepSpeedAliasFinder
        self.__package__ = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        from zerotrain.hf import deepspeed_extras

        target = self.__dict__["_zerotrain_target"]
        sub = f"{self.__name__}.{attr}"
        replaced = deepspeed_extras.override(self.__name__, attr)
        if replaced is not deepspeed_extras.MISSING:
            return replaced
        if target is not None and hasattr(target, attr):
            value = getattr(target, attr)
            if isinstance(value, types.ModuleType) and value.__name__ == _target_name(sub):
                return importlib.import_module(sub)  # the alias, so extras apply below it too
            return value
        extra = deepspeed_extras.lookup(self.__name__, attr)
        if extra is not deepspeed_extras.MISSING:
            return extra
        if _submodule_exists(sub):
            return importlib.import_module(sub)
        raise AttributeError(
            f"'{sub}' is not provided by zerotrain (running as DeepSpeed through zerotrain.hf); "
            "docs/compat.md lists the DeepSpeed names zerotrain provides"
        )

    def __dir__(self):
        target = self.__dict__["_zerotrain_target"]
        return sorted(set(super().__dir__()) | set(dir(target) if target is not None else ()))


def _submodule_exists(alias_name: str) -> bool:
    from zerotrain.hf import deepspeed_extras

    if deepspeed_extras.is_extra_module(alias_name):
        return True
    try:
        return importlib.util.find_spec(_target_name(alias_name)) is not None
    except ModuleNotFoundError:
        return False


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``deepspeed.*`` submodules: alias modules over ``zerotrain.*`` (or extras only)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(ALIAS + ".") or not _submodule_exists(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        target_name = _target_name(spec.name)
        try:
            target = importlib.import_module(target_name)
        except ModuleNotFoundError as error:
            if error.name != target_name:
                raise  # a real import error inside zerotrain's module
            target = None  # a DeepSpeed module that only the extras fill
        return DeepSpeedAliasModule(spec.name, target)

    def exec_module(self, module):
        pass


_FINDER = DeepSpeedAliasFinder()


def become_deepspeed(shim_name: str = ALIAS) -> types.ModuleType:
    """Install the alias: ``sys.modules['deepspeed']`` becomes zerotrain's alias module.

    Called by the shim package's ``__init__``; idempotent.
    """
    if not any(finder is _FINDER for finder in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
    current = sys.modules.get(ALIAS)
    if isinstance(current, DeepSpeedAliasModule):
        return current
    root = DeepSpeedAliasModule(ALIAS, importlib.import_module(TARGET))
    root.__version__ = _shim_version()
    # find_spec("deepspeed") answers from the imported module's spec: keep the shim's.
    for attr in ("__file__", "__spec__", "__loader__"):
        setattr(root, attr, getattr(current, attr, None))
    if root.__spec__ is None:  # installed without the shim (HfZeroConfig): find_spec must not fail
        root.__spec__ = importlib.machinery.ModuleSpec(ALIAS, _FINDER, is_package=True)
    sys.modules[shim_name] = root
    return root


def _shim_version() -> str:
    from importlib import metadata

    try:
        return metadata.version(ALIAS)
    except metadata.PackageNotFoundError:  # alias installed without the shim's metadata
        from zerotrain.hf.switch import DEEPSPEED_VERSION

        return DEEPSPEED_VERSION
