"""Rank-side workload for the prediction-vs-measurement test: the GPT example trained at ZeRO
stages 0-3 in one process group, with the estimator's prediction for each stage."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

# The GPT of examples/train_gpt.py, widened so model states are a visible part of RSS
# (7.2M parameters: 29 MB in fp32), with examples/ds_config.json's optimizer and buckets.
GPT_SHAPE = dict(vocab_size=256, n_positions=128, n_embd=384, n_layer=4, n_head=6)
SEQ, MICRO, STEPS = 128, 4, 2  # step 2 runs forward with the optimizer state allocated
EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "ds_config.json"


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    return _status("VmHWM")


def example_config(stage: int) -> dict:
    cfg = json.loads(EXAMPLE_CONFIG.read_text())
    cfg.pop("scheduler", None)
    cfg["train_micro_batch_size_per_gpu"] = MICRO
    cfg["zero_optimization"] = {**cfg["zero_optimization"], "stage": stage}
    return cfg


def predict(stage: int, world: int):
    """The estimator's Row for ``stage`` (model built on the meta device)."""
    from zerotrain.config import load_config
    from zerotrain.estimate import Hardware, Settings, Workload, estimate, from_module
    from zerotrain.models import GPT, GPTConfig
    from zerotrain.zero import bucket_numel

    cfg = example_config(stage)
    zero = load_config(cfg, world_size=world).zero_optimization
    with torch.device("meta"):
        meta = GPT(GPTConfig(**GPT_SHAPE))
    settings = Settings(world_size=world, precision="fp32", optimizer="adamw", bucket_numel=bucket_numel(zero, 4))
    est = estimate(
        from_module(meta),
        Hardware(gpus_per_node=world, gpu_reserve=0, process_bytes=0),
        Workload(micro_batch=MICRO, seq_len=SEQ),
        settings,
    )
    return est.row(stage)


def train_all_stages(written_config: dict | None = None) -> dict:
    """On each rank: for stages 0-3, predict, then build, train ``STEPS`` steps and measure;
    then train 2 steps with ``written_config`` (from ``--write-config``) when given."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.memory_release import release_freed_memory
    from zerotrain.models import GPT, GPTConfig

    zerotrain.init_distributed()
    world = dist.get_world_size()
    # Warm-up: the first step touches library code and thread pools for the first time (~50 MiB
    # of resident pages on this machine); that is runtime baseline, not this stage's memory.
    train_written_config({**example_config(0), "train_micro_batch_size_per_gpu": 1}, steps=1)
    out = []
    for stage in range(4):
        row = predict(stage, world)
        gc.collect()
        release_freed_memory()
        base = _reset_peak()
        torch.manual_seed(0)
        model = GPT(GPTConfig(**GPT_SHAPE))
        engine, *_ = zerotrain.initialize(
            model=model, model_parameters=model.parameters(), config=example_config(stage)
        )
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(STEPS):
            ids = torch.randint(0, GPT_SHAPE["vocab_size"], (MICRO, SEQ), generator=g)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            del loss
        out.append(
            {
                "stage": stage,
                "base": base,
                "peak": _status("VmHWM"),
                "measured": engine.memory_breakdown(),
                "gpu": dict(row.gpu),
            }
        )
        del engine, model
        gc.collect()
        release_freed_memory()
    written = train_written_config(written_config) if written_config is not None else None
    return {"stages": out, "written_losses": written}


def build_gpt():
    """``zerotrain estimate --model tests.estimate.measure:build_gpt``."""
    from zerotrain.models import GPT, GPTConfig

    return GPT(GPTConfig(**GPT_SHAPE))


def train_written_config(config: dict, steps: int = 2) -> list[float]:
    """Train ``steps`` steps of the GPT with a config ``zerotrain estimate --write-config`` wrote."""
    import torch.distributed as dist

    import zerotrain

    torch.manual_seed(0)
    model = build_gpt()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(dist.get_rank())
    micro, losses = engine.train_micro_batch_size_per_gpu(), []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        ids = torch.randint(0, GPT_SHAPE["vocab_size"], (micro, SEQ), generator=g)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
