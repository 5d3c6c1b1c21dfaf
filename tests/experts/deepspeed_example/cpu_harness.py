"""Runs DeepSpeedExamples' ``training/cifar/cifar10_deepspeed.py`` on CPU and records what it trained.

    <launcher> cpu_harness.py SCRIPT --moe --ep-world-size 2 --num-experts 2 --dtype fp32 -e 1

``SCRIPT`` is DeepSpeedExamples' file itself (not stored in this repository: see
find_script()). With ``EXAMPLE_ENGINE=zerotrain`` (the default) the harness runs it with only
its deepspeed imports changed (tests/deepspeed_examples.py, import_changed); with
``EXAMPLE_ENGINE=deepspeed`` it runs it unchanged (DeepSpeed's torchrun, ``DS_ACCELERATOR=cpu``).
What the CPU needs, around the script:

- ``cpu_shim/`` first on sys.path: its ``torchvision`` gives a synthetic CIFAR-10 of CIFAR's
  shape (no download; cpu_shim/torchvision/datasets.py);
- ``torch.manual_seed(EXAMPLE_SEED)`` before the script (which seeds nothing), so every rank and
  both libraries start from the same weights and draw the same gate noise;
- ``EXAMPLE_RECORD_DIR``: each rank writes ``rank<R>.json`` (the loss of each ``backward``, the
  module's weights fingerprint before the first one, the gradient norm each step clipped by) and
  ``rank<R>.pt`` (its module's state dict after training) there when the script ends;
- ``EXAMPLE_GRADIENT_CLIPPING`` (diagnostics only): another ``gradient_clipping`` than the
  script's 1.0, put into the config the script hands to ``initialize``.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, REPOSITORY)  # for tests/deepspeed_examples.py, in DeepSpeed's environment too
from tests.deepspeed_examples import CIFAR10_MOE, harness_main, write_rank_record  # noqa: E402

sys.path.remove(REPOSITORY)


def find_script() -> str | None:
    """The unchanged script (tests/deepspeed_examples.py, CIFAR10_MOE.find): ``$CIFAR10_DEEPSPEED_SCRIPT``,
    ``$DEEPSPEED_EXAMPLES/training/cifar/...`` or a copy next to this file; None when there is none."""
    return CIFAR10_MOE.find(beside=HERE)


_RECORD = {"losses": [], "norms": [], "initial": None, "engine": None}


def _fingerprint(module) -> float:
    return float(sum(p.detach().double().abs().sum() for p in module.state_dict().values()))


def _watch(engine_cls) -> None:
    backward = engine_cls.backward

    def recorded(self, loss, *args, **kwargs):
        if _RECORD["initial"] is None:
            _RECORD["initial"] = _fingerprint(self.module)
        _RECORD["losses"].append(float(loss.detach()))
        _RECORD["engine"] = self
        return backward(self, loss, *args, **kwargs)

    engine_cls.backward = recorded
    step = engine_cls.step

    def stepped(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        norm = self.get_global_grad_norm()
        if norm is not None:  # DeepSpeed keeps none at stage 0 in fp32: _watch_deepspeed_clipping has it
            _RECORD["norms"].append(float(norm))
        return out

    engine_cls.step = stepped


def _watch_deepspeed_clipping() -> None:
    """DeepSpeed's stage-0 fp32 clipping (runtime.utils.clip_grad_norm_) returns the norm it clipped
    by but the engine drops it: record it."""
    import deepspeed.runtime.engine as ds_engine

    clip = ds_engine.clip_grad_norm_

    def recorded(*args, **kwargs):
        norm = clip(*args, **kwargs)
        _RECORD["norms"].append(float(norm))
        return norm

    ds_engine.clip_grad_norm_ = recorded


def _override_clipping(library, value: float) -> None:
    """``EXAMPLE_GRADIENT_CLIPPING``: a diagnostic run with another ``gradient_clipping`` than the
    script's 1.0 (the config dict the script passes to ``initialize``)."""
    initialize = library.initialize

    def changed(*args, **kwargs):
        kwargs["config"] = {**kwargs["config"], "gradient_clipping": value}
        return initialize(*args, **kwargs)

    library.initialize = changed


def _engine_class(name: str):
    if name == "deepspeed":
        from deepspeed.runtime.engine import DeepSpeedEngine

        return DeepSpeedEngine
    from zerotrain.engine.engine import ZeroTrainEngine

    return ZeroTrainEngine


def _prepare(engine: str, record_dir: str | None) -> None:
    sys.path.insert(0, os.path.join(HERE, "cpu_shim"))
    import torch

    if record_dir:
        _watch(_engine_class(engine))
        if engine == "deepspeed":
            _watch_deepspeed_clipping()
    if os.environ.get("EXAMPLE_GRADIENT_CLIPPING"):
        import importlib

        _override_clipping(importlib.import_module(engine), float(os.environ["EXAMPLE_GRADIENT_CLIPPING"]))
    torch.manual_seed(int(os.environ.get("EXAMPLE_SEED", "1234")))


def _write(record_dir: str) -> None:
    record = {"losses": _RECORD["losses"], "norms": _RECORD["norms"], "initial": _RECORD["initial"]}
    write_rank_record(record_dir, record, _RECORD["engine"])


def main() -> None:
    harness_main(_prepare, _write)


if __name__ == "__main__":
    main()
