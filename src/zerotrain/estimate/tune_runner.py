"""One trial of ``zerotrain tune``, run on every rank as ``python -m zerotrain.estimate.tune_runner
SCRIPT [args]`` under ``zerotrain launch``.

Before running the user's script it makes ``zerotrain.initialize`` use the trial's config
(``ZEROTRAIN_TUNE_CONFIG``) whatever the script passes, and wraps ``ZeroTrainEngine.step``: after
one warm-up optimizer step it times ``ZEROTRAIN_TUNE_STEPS`` more, writes this rank's peak memory
and throughput to ``$ZEROTRAIN_TUNE_OUT/rank<r>.json`` and ends the process (exit status 0).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path


def peak_memory_bytes() -> int:
    """This rank's peak: the accelerator's reserved memory, or the process's VmHWM on CPU."""
    import torch

    from zerotrain.accelerator import get_accelerator

    if get_accelerator().name == "cuda":
        return int(torch.cuda.max_memory_reserved())
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _TrialDone(SystemExit):
    pass


def install(config_path: str, steps: int, out_dir: str) -> None:
    import importlib

    import zerotrain
    import zerotrain.engine
    from zerotrain.engine.engine import ZeroTrainEngine

    # The package re-exports the function under the submodule's name: fetch the module itself.
    init_module = importlib.import_module("zerotrain.engine.initialize")

    original_initialize = init_module.initialize

    def initialize(*args, **kwargs):
        kwargs.pop("config_params", None)
        kwargs["config"] = config_path
        parsed = kwargs.get("args", args[0] if args else None)
        for name in ("deepspeed_config", "zerotrain_config", "deepscale_config"):
            if parsed is not None and getattr(parsed, name, None) is not None:
                setattr(parsed, name, config_path)
        return original_initialize(*args, **kwargs)

    init_module.initialize = initialize
    zerotrain.engine.initialize = initialize
    zerotrain.initialize = initialize
    original_step = ZeroTrainEngine.step
    state = {"micro": 0, "start": None, "done_steps": 0}

    def step(self, *args, **kwargs):
        result = original_step(self, *args, **kwargs)
        state["micro"] += 1
        if state["micro"] % self.gradient_accumulation_steps() != 0:
            return result
        if state["start"] is None:  # the first optimizer step is warm-up (allocations, kernels)
            state["start"], state["micro"] = time.perf_counter(), 0
            return result
        state["done_steps"] += 1
        if state["done_steps"] >= steps:
            elapsed = time.perf_counter() - state["start"]
            samples = state["micro"] * self.train_micro_batch_size_per_gpu() * self.dp_world_size
            record = {
                "peak_bytes": peak_memory_bytes(),
                "samples_per_s": samples / elapsed,
                "steps": state["done_steps"],
                "rank": self.global_rank,
            }
            Path(out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))
            raise _TrialDone(0)
        return result

    ZeroTrainEngine.step = step


def main() -> None:
    config = os.environ["ZEROTRAIN_TUNE_CONFIG"]
    steps = int(os.environ.get("ZEROTRAIN_TUNE_STEPS", "3"))
    out = os.environ["ZEROTRAIN_TUNE_OUT"]
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m zerotrain.estimate.tune_runner SCRIPT [args]")
    install(config, steps, out)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except _TrialDone:
        pass
    raise SystemExit(0)


if __name__ == "__main__":
    main()
