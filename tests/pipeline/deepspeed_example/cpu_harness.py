"""Runs DeepSpeedExamples' ``training/pipeline_parallelism/train.py`` on CPU and records what it trained.

    <launcher> cpu_harness.py SCRIPT --deepspeed_config CONFIG -p 2 --steps 4 --backend gloo

``SCRIPT`` is DeepSpeedExamples' file itself, not stored in this repository (tests/deepspeed_examples.py,
PIPELINE: ``$PIPELINE_DEEPSPEED_SCRIPT`` or ``$DEEPSPEED_EXAMPLES/training/pipeline_parallelism/train.py``).
With ``EXAMPLE_ENGINE=zerotrain`` (the default; zerotrain's launcher) the harness runs it with only its
deepspeed imports changed (import_changed); with ``EXAMPLE_ENGINE=deepspeed`` (DeepSpeed's torchrun) it
runs it unchanged. CONFIG: tests/pipeline/test_deepspeed_example.py's CONFIG, written to a file. What
the CPU needs, around the script (reference/pipeline.md 1.8):

- ``torch.cuda.set_device`` (called unconditionally by the script) does nothing without CUDA;
- ``cpu_shim/`` first on sys.path: its ``torchvision`` gives torchvision's AlexNet and a synthetic
  CIFAR-10 (no download; see cpu_shim/torchvision/__init__.py);
- ``EXAMPLE_RECORD_DIR``: each rank writes ``rank<R>.json`` (the losses ``train_batch`` returned,
  a fingerprint of the CPU random generator's state after each, its stage) and ``rank<R>.pt``
  (its stage's state dict) there when the script ends, watching ``EXAMPLE_ENGINE``'s
  ``PipelineEngine``.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, REPOSITORY)  # for tests/deepspeed_examples.py, in DeepSpeed's environment too
from tests.deepspeed_examples import harness_main, write_rank_record  # noqa: E402

sys.path.remove(REPOSITORY)
sys.path.insert(0, os.path.join(HERE, "cpu_shim"))

import torch  # noqa: E402

if not torch.cuda.is_available():
    torch.cuda.set_device = lambda device: None

_RECORD = {"losses": [], "rng": [], "engine": None}


def _watch(engine_cls) -> None:
    train_batch = engine_cls.train_batch

    def recorded(self, *args, **kwargs):
        loss = train_batch(self, *args, **kwargs)
        _RECORD["losses"].append(float(loss))
        # Where the CPU generator stands after the step (dropout masks come from it).
        _RECORD["rng"].append(int(torch.get_rng_state().to(torch.int64).sum()))
        _RECORD["engine"] = self
        return loss

    engine_cls.train_batch = recorded


def _engine_class(name: str):
    if name == "deepspeed":
        from deepspeed.runtime.pipe.engine import PipelineEngine
    else:
        from zerotrain.engine.pipeline_engine import PipelineEngine
    return PipelineEngine


def _prepare(engine: str, record_dir: str | None) -> None:
    if record_dir:
        _watch(_engine_class(engine))


def _write(record_dir: str) -> None:
    engine = _RECORD["engine"]
    stage = engine.stage_id if engine is not None else None
    write_rank_record(record_dir, {"losses": _RECORD["losses"], "rng": _RECORD["rng"], "stage": stage}, engine)


def main() -> None:
    harness_main(_prepare, _write)


if __name__ == "__main__":
    main()
