"""Seed 003's accelerate flow as a user runs it, started by the real ``accelerate launch``.

``from_pretrained`` (partitioned while loading under ``zero3_init_flag``, "auto" values unfilled
at that point), ``from_config`` the same way, a torch ``AdamW`` over decay / no-decay groups
(run_clm_no_trainer's), transformers' ``get_scheduler("linear")``, ``prepare``, then
``accelerator.backward`` / ``optimizer.step`` / ``scheduler.step`` / ``optimizer.zero_grad``.
With ``offload_optimizer`` accelerate swaps the AdamW for ``DeepSpeedCPUAdam(optimizer.param_groups)``
and keeps stepping its scheduler over the AdamW's groups.

Writes one JSON file (rank 0): per-step losses, the learning rate each step used (read from the
engine's optimizer), the final weights (gathered, as float lists) and what ``from_config`` built.
:func:`plain_reference` is the same training in plain PyTorch, one fp32 process.

Usage: ``accelerate launch --config_file cfg.yaml accelerate_flows.py REPO_ROOT MODEL_DIR OUT.json``
"""

from __future__ import annotations

import json
import sys

import torch

STEPS, MICRO, LR, WARMUP = 4, 2, 3e-3, 1
NO_DECAY = ("bias", "ln_")


def grouped(model) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not any(k in n for k in NO_DECAY)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(k in n for k in NO_DECAY)], "weight_decay": 0.0},
    ]


def run(model_dir: str, out: str) -> None:
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForCausalLM, get_scheduler

    from tests.hf.hf_workloads import TokenDataset

    accelerator = Accelerator()
    # Item 3 of issue 29: both build inside zero.Init with the config's "auto" values unfilled.
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    from_config_local = sum(p.numel() for p in built.parameters())
    del built
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    world = accelerator.num_processes
    loader = torch.utils.data.DataLoader(TokenDataset(MICRO * STEPS * world), batch_size=MICRO)
    optimizer = torch.optim.AdamW(grouped(model), lr=LR)
    # run_clm_no_trainer's counts: accelerate steps a prepared scheduler once per process.
    scheduler = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=WARMUP * world, num_training_steps=STEPS * world
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    engine = accelerator.deepspeed_engine_wrapped.engine
    losses, lrs = [], []
    for batch in loader:
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        lrs.append(engine.get_lr())  # what this step uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(outputs.loss.detach().float(), "mean").item())
    weights = engine.module_state_dict()  # gathered on rank 0 at stage 3
    if accelerator.is_main_process:
        result = {
            "losses": losses,
            "lrs": lrs,
            "world": world,
            "stage": engine.zero_optimization_stage(),
            "optimizer": type(engine.optimizer).__name__,
            "config": engine.config.raw,
            "param_dtype": str(next(engine.module.parameters()).dtype),
            "from_config_local_numel": from_config_local,
            "weights": {k: v.float().flatten().tolist() for k, v in weights.items()},
        }
        with open(out, "w", encoding="utf-8") as handle:
            json.dump(result, handle)
    accelerator.wait_for_everyone()


def plain_reference(model_dir: str, world: int = 2) -> dict:
    """One fp32 process, each step on the ranks' joint batch: AdamW over the same groups, gradient
    clipping 1.0, the script's linear schedule stepped ``world`` times per optimizer step (accelerate
    steps a prepared scheduler once per process). Returns losses, per-step lrs and the final weights."""
    from transformers import AutoModelForCausalLM, get_scheduler

    from tests.hf.hf_workloads import TokenDataset

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = TokenDataset(MICRO * STEPS * world).ids
    optimizer = torch.optim.AdamW(grouped(model), lr=LR)
    scheduler = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=WARMUP * world, num_training_steps=STEPS * world
    )
    losses, lrs = [], []
    for step in range(STEPS):
        batch = data[step * MICRO * world : (step + 1) * MICRO * world]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lrs.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        for _ in range(world):
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "lrs": lrs, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # the repository root, for tests.hf
    run(sys.argv[2], sys.argv[3])
