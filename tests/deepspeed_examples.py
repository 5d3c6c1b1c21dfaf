"""DeepSpeedExamples' scripts for the example tests (tests/experts and tests/pipeline
``test_deepspeed_example.py``): found outside this repository, checked, and changed only in their
deepspeed imports as they are loaded; and the CPU harnesses' shared main and record writer.

The scripts are DeepSpeedExamples' code (https://github.com/deepspeedai/DeepSpeedExamples) and
are not stored here. A run finds one at its own environment variable (the file itself), at
``$DEEPSPEED_EXAMPLES/<its path in DeepSpeedExamples>`` (a checkout), or, where a harness allows
it, as an untracked copy next to the harness. Without one the run tests skip; CI has none.

This module imports neither torch nor zerotrain at its top (write_rank_record imports torch when
called): the harnesses load it in DeepSpeed's environment too.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import sys
import types
from dataclasses import dataclass

# Every blob id below is the file's at this commit (2025-01-20), and still at 45b4b7156c87 (2026-03-29).
DEEPSPEED_EXAMPLES_COMMIT = "b965b9cd827f096a24e382dcd3b4cd810c9595da"


@dataclass(frozen=True)
class ExampleScript:
    """One DeepSpeedExamples script: its path in that repository, its git blob id (so a run knows it
    has the unchanged file) and the environment variable that may name the file directly."""

    path: str
    blob: str
    env_var: str

    def find(self, beside: str | None = None) -> str | None:
        """``$<env_var>``, then ``$DEEPSPEED_EXAMPLES/<path>``, then ``<beside>/<file name>``: the
        first that is a file, or None."""
        candidates = [os.environ.get(self.env_var)]
        if os.environ.get("DEEPSPEED_EXAMPLES"):
            candidates.append(os.path.join(os.environ["DEEPSPEED_EXAMPLES"], *self.path.split("/")))
        if beside:
            candidates.append(os.path.join(beside, os.path.basename(self.path)))
        return next((path for path in candidates if path and os.path.isfile(path)), None)

    def missing(self) -> str:
        """Why a run test skips, and how to get the script."""
        return (
            f"DeepSpeedExamples' {self.path} not found (not stored here): clone "
            f"https://github.com/deepspeedai/DeepSpeedExamples (commit {DEEPSPEED_EXAMPLES_COMMIT[:12]}) and set "
            f"DEEPSPEED_EXAMPLES to the checkout, or {self.env_var} to the file"
        )


CIFAR10_MOE = ExampleScript(
    "training/cifar/cifar10_deepspeed.py", "e92c439375e1fa4ddb13c573084de8246dfabf55", "CIFAR10_DEEPSPEED_SCRIPT"
)
PIPELINE = ExampleScript(
    "training/pipeline_parallelism/train.py", "b4bc49bf6eb317f4a9298a9b43f176e025bbd99c", "PIPELINE_DEEPSPEED_SCRIPT"
)


def git_blob_id(path: str) -> str:
    """git's id of the file's bytes (``git hash-object``; line ends count, as they do for git)."""
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


_IMPORT = re.compile(r"^import deepspeed$")
_FROM = re.compile(r"^from deepspeed((?:\.\w+)*) import (.+)$")


def import_changed(text: str) -> str:
    """The script with only its deepspeed imports changed: ``import zerotrain as deepspeed``, and
    ``from deepspeed.X import Y`` -> ``from zerotrain.X import Y`` (a from-import names the module,
    not the alias). Every other line is left as it is."""
    lines = []
    for line in text.split("\n"):
        if _IMPORT.match(line):
            line = "import zerotrain as deepspeed"
        else:
            found = _FROM.match(line)
            if found:
                line = f"from zerotrain{found.group(1)} import {found.group(2)}"
        lines.append(line)
    return "\n".join(lines)


def run_as_main(script: str, engine: str = "zerotrain") -> None:
    """Runs the script as ``python script`` would (``__main__``, its folder first on sys.path), its
    deepspeed imports changed for ``engine="zerotrain"``, unchanged for ``"deepspeed"``. The
    caller sets sys.argv."""
    if engine not in ("zerotrain", "deepspeed"):
        raise SystemExit(f"EXAMPLE_ENGINE={engine!r}: use zerotrain or deepspeed")
    script = os.path.abspath(script)
    with open(script) as f:
        text = f.read()
    if engine == "zerotrain":
        text = import_changed(text)
    code = compile(text, script, "exec")
    module = types.ModuleType("__main__")
    module.__file__ = script
    # As runpy does: the script is __main__ while it runs (classes it defines pickle by that name).
    previous = sys.modules["__main__"]
    sys.modules["__main__"] = module
    sys.path.insert(0, os.path.dirname(script))
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"] = previous


def shim_import(shim: str, module: str, *names: str) -> tuple:
    """``from <module> import <names>`` out of a harness's ``cpu_shim`` folder, leaving sys.modules
    as it was: the two harnesses' shims give different ``torchvision`` modules (32x32 and 64x64
    CIFAR-10), and a test process may import both, or torchvision itself."""
    top = module.split(".")[0]

    def ours(name: str) -> bool:
        return name == top or name.startswith(top + ".")

    saved = {name: mod for name, mod in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, shim)
    try:
        imported = importlib.import_module(module)
        return tuple(getattr(imported, name) for name in names)
    finally:
        sys.path.remove(shim)
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


def harness_main(prepare, write) -> None:
    """The main of a CPU harness (tests/*/deepspeed_example/cpu_harness.py): ``sys.argv[1]`` is the
    script, the rest its arguments; ``EXAMPLE_ENGINE`` (zerotrain, the default, or deepspeed) the
    library it runs on. ``prepare(engine, record_dir)`` runs first (``record_dir``:
    ``$EXAMPLE_RECORD_DIR`` or None), then the script (run_as_main), then, with a record
    folder, ``write(record_dir)``."""
    if len(sys.argv) < 2:
        sys.exit("usage: cpu_harness.py SCRIPT [script arguments]")
    script = sys.argv[1]
    engine = os.environ.get("EXAMPLE_ENGINE", "zerotrain")
    if engine not in ("zerotrain", "deepspeed"):
        sys.exit(f"EXAMPLE_ENGINE={engine!r}: use zerotrain or deepspeed")
    record_dir = os.environ.get("EXAMPLE_RECORD_DIR")
    prepare(engine, record_dir)
    sys.argv = sys.argv[1:]
    run_as_main(script, engine)
    if record_dir:
        write(record_dir)


def write_rank_record(record_dir: str, record: dict, engine) -> None:
    """A harness's record of this rank (``$RANK``): ``rank<R>.json`` (``record``) and, when the
    script built an engine, ``rank<R>.pt`` (its module's state dict on the CPU). torch is
    imported here, not at the top: the module stays importable without it."""
    import json

    import torch

    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(record_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if engine is not None:
        state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
        torch.save(state, os.path.join(record_dir, f"rank{rank}.pt"))
