"""Hugging Face integration: transformers' Trainer and accelerate run on zerotrain.

transformers and accelerate drive DeepSpeed through its public API; zerotrain implements that
API. :func:`use_zerotrain_as_deepspeed` (or ``python -m zerotrain.hf <command>``) makes their
``import deepspeed`` resolve to zerotrain, so the Trainer's ``TrainingArguments(deepspeed=...)``
and accelerate's DeepSpeed plugin run zerotrain's engine with their own, unmodified code.
``HfZeroConfig`` stands in for transformers' ``HfDeepSpeedConfig`` (ZeRO-3 partitioned
``from_pretrained``) without the switch. See docs/hf.md.

Needs the ``hf`` extra (``pip install 'zerotrain[hf]'``: transformers and accelerate).
"""

from __future__ import annotations

import importlib.util

_MISSING = [name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(f"zerotrain.hf needs {' and '.join(_MISSING)}: pip install 'zerotrain[hf]'")

from zerotrain.hf.switch import DEEPSPEED_VERSION, SHIM_DIR, is_active, use_zerotrain_as_deepspeed  # noqa: E402

__all__ = ["use_zerotrain_as_deepspeed", "is_active", "SHIM_DIR", "DEEPSPEED_VERSION", "HfZeroConfig"]


def __getattr__(name: str):
    # Imported on use: it imports accelerate, which must come after use_zerotrain_as_deepspeed().
    if name == "HfZeroConfig":
        from zerotrain.hf.pretrained import HfZeroConfig

        return HfZeroConfig
    raise AttributeError(f"module 'zerotrain.hf' has no attribute {name!r}")
