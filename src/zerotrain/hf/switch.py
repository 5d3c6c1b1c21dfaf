"""The switch: run transformers' and accelerate's DeepSpeed code paths on zerotrain.

Either in the script, before transformers or accelerate is imported::

    import zerotrain.hf
    zerotrain.hf.use_zerotrain_as_deepspeed()

or with no change to the script, for the process and everything it starts::

    python -m zerotrain.hf accelerate launch --config_file cfg.yaml train.py
    python -m zerotrain.hf zerotrain launch --nproc 2 train.py --deepspeed ds_config.json

Both put the shim folder (a ``deepspeed`` package that becomes an alias of ``zerotrain``, and its
package metadata) first on the module search path and in ``PYTHONPATH``, so child processes
(launcher workers, dataloader workers) see the same ``deepspeed``.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

SHIM_DIR = str(Path(__file__).resolve().parent / "shim")
# The DeepSpeed release whose names, config and defaults zerotrain follows (docs/compat.md);
# transformers and accelerate compare against it for their version gates.
DEEPSPEED_VERSION = "0.19.6+zerotrain"

# Modules that decide at import time whether DeepSpeed is installed: imported before the switch,
# they keep their "not installed" answer for the life of the process.
_DECIDE_AT_IMPORT = ("transformers.integrations.deepspeed", "accelerate.accelerator", "accelerate.utils.deepspeed")


def use_zerotrain_as_deepspeed() -> None:
    """Make ``import deepspeed`` resolve to zerotrain in this process and its children.

    Call it before importing transformers' Trainer/TrainingArguments/models or accelerate.
    Raises ``RuntimeError`` naming the module if one of them was imported first, or if the real
    DeepSpeed is already imported. Idempotent.
    """
    current = sys.modules.get("deepspeed")
    from zerotrain.hf.deepspeed_alias import DeepSpeedAliasModule

    if isinstance(current, DeepSpeedAliasModule):
        return
    if current is not None:
        raise RuntimeError(
            f"the real DeepSpeed is already imported ({getattr(current, '__file__', current)}); "
            "call use_zerotrain_as_deepspeed() before anything imports deepspeed"
        )
    early = [name for name in _DECIDE_AT_IMPORT if name in sys.modules]
    if early:
        raise RuntimeError(
            f"use_zerotrain_as_deepspeed() was called after {', '.join(early)} was imported; those modules "
            "decided then that DeepSpeed is not installed. Call it first in the script (before importing "
            "transformers or accelerate), start the script with `python -m zerotrain.hf python train.py`, or run "
            "`python -m zerotrain.hf install` once to make `import deepspeed` zerotrain in this environment."
        )
    put_shim_first()


def put_shim_first() -> None:
    """The shim first on ``sys.path`` and on ``PYTHONPATH`` (for child processes), then
    ``import deepspeed``: zerotrain from now on, whatever imports it."""
    if SHIM_DIR not in sys.path:
        sys.path.insert(0, SHIM_DIR)
    os.environ["PYTHONPATH"] = _with_shim(os.environ.get("PYTHONPATH", ""))
    importlib.invalidate_caches()
    importlib.import_module("deepspeed")


def is_active() -> bool:
    """Whether ``deepspeed`` in this process is zerotrain's alias."""
    from zerotrain.hf.deepspeed_alias import DeepSpeedAliasModule

    return isinstance(sys.modules.get("deepspeed"), DeepSpeedAliasModule)


def _with_shim(pythonpath: str) -> str:
    parts = [p for p in pythonpath.split(os.pathsep) if p and p != SHIM_DIR]
    return os.pathsep.join([SHIM_DIR, *parts])


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the shim first in ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = _with_shim(env.get("PYTHONPATH", ""))
    return env
