"""Seed 003's accelerate training script shape, run unchanged under zerotrain.

``prepare(model, optimizer, dataloader, scheduler)``, ``accelerator.backward(loss)``,
``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``. With an ``optimizer`` /
``scheduler`` section in the DeepSpeed config the script builds ``DummyOptim`` /
``DummyScheduler`` (seed 003's diff). Run by ``accelerate launch`` (tests/hf/test_accelerate.py)
and imported by the in-process tests; prints one JSON line of losses on rank 0.
"""

from __future__ import annotations

import json
import sys

import torch

STEPS = 4
MICRO = 2
LR = 3e-3


def train(accelerator=None) -> list[float]:
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler
    from transformers import get_scheduler

    from tests.hf.hf_workloads import TokenDataset, make_model

    accelerator = accelerator or Accelerator()
    model = make_model()
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    loader = torch.utils.data.DataLoader(TokenDataset(MICRO * STEPS * accelerator.num_processes), batch_size=MICRO)
    if "optimizer" in config:
        optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=0.01)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    if "scheduler" in config:
        scheduler = DummyScheduler(optimizer, total_num_steps=STEPS, warmup_num_steps=1)
    else:
        scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=STEPS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    for batch in loader:
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def plain_reference(schedule: str, world: int = 2) -> list[float]:
    """The same training in plain PyTorch, one process, each step on the ranks' joint batch:
    AdamW, gradient clipping 1.0 (accelerate's default), and the script's schedule (`linear`:
    transformers' linear warmup/decay over STEPS, stepped `world` times per optimizer step as
    accelerate steps a prepared scheduler once per process; `WarmupDecayLR`: the config's, with
    the values accelerate fills from DummyScheduler: warmup 1, total ceil(STEPS / world))."""
    import math

    from transformers import get_scheduler

    from tests.hf.hf_workloads import TokenDataset, make_model
    from zerotrain.runtime.lr_schedules import WarmupDecayLR

    model = make_model()
    data = TokenDataset(MICRO * STEPS * world).ids
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    if schedule == "linear":
        scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=STEPS)
    else:
        scheduler = WarmupDecayLR(
            optimizer, total_num_steps=math.ceil(STEPS / world), warmup_min_lr=0, warmup_max_lr=LR, warmup_num_steps=1
        )
    losses = []
    for step in range(STEPS):
        batch = data[step * MICRO * world : (step + 1) * MICRO * world]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        for _ in range(world if schedule == "linear" else 1):
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def config_file_form(path: str) -> dict:
    """On each rank: seed 003's `deepspeed_config_file` form through `Accelerator(deepspeed_plugin=...)`."""
    import zerotrain.hf

    zerotrain.hf.use_zerotrain_as_deepspeed()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=path, zero3_init_flag=True))
    losses = train(accelerator)
    engine = accelerator.deepspeed_engine_wrapped.engine
    return {
        "losses": losses,
        "raw": engine.config.raw,
        "stage": engine.zero_optimization_stage(),
        "optimizer": type(engine.optimizer).__name__,
        "lr_scheduler": type(engine.lr_scheduler).__name__,
    }


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # the repository root, for tests.hf
    from accelerate import Accelerator

    acc = Accelerator()
    result = {
        "losses": train(acc),
        "engine": type(acc.deepspeed_engine_wrapped.engine).__module__,
        "stage": acc.deepspeed_engine_wrapped.engine.zero_optimization_stage(),
        "world": acc.num_processes,
    }
    if acc.is_main_process:
        print("RESULT " + json.dumps(result), flush=True)
