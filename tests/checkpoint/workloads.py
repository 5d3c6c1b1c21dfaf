"""Training runs for the checkpoint tests: train, save, go on; or load in fresh processes and go on.

Batches depend only on the global step, so a resumed run sees exactly what the uninterrupted
one saw; rank r takes rows ``[(m*world + r)*micro, ...)`` of a step's global batch.
"""

from __future__ import annotations

import torch

from tests.engine.workloads import SEQ, TINY, make_model

STEPS = 3  # steps before the save, and after it (past the fp16 scale's first changes and the LR warm-up)


def config(stage: int, precision: str = "fp32", micro: int = 2, gas: int = 2, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 3, "total_num_steps": 40, "warmup_max_lr": 3e-3},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
        "steps_per_print": 1000,
    }
    if stage == 3:  # partition the weights; small tensors stay whole (both paths covered)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":  # a small window: the scale changes (and steps skip) within the run
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 1}
    cfg.update(extra)
    return cfg


def batch_for(step: int, micro_index: int, engine) -> torch.Tensor:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, TINY["vocab_size"], (micro * gas * world, SEQ), generator=g)
    lo = (micro_index * world + rank) * micro
    return data[lo : lo + micro].to(engine.device)


def train(engine, steps: int) -> list[float]:
    """``steps`` optimizer steps from the engine's current global step; the global mean loss
    of each."""
    import torch.distributed as dist

    losses = []
    for _ in range(steps):
        step = engine.global_steps
        total = torch.zeros((), device=engine.device)
        for m in range(engine.gradient_accumulation_steps()):
            batch = batch_for(step, m, engine)
            loss = engine(batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (dist.get_world_size() * engine.gradient_accumulation_steps()))
    return losses


def build(cfg: dict, dropout: float = 0.0):
    import zerotrain

    model = make_model(dropout=dropout)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def final_state(engine) -> dict:
    """Whole weights (gathered at stage 3), counters, scale, lr and a random draw."""
    weights = {k: v.clone() for k, v in engine.module_state_dict().items()}
    return {
        "weights": weights,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped": engine.skipped_steps,
        "micro_steps": engine.micro_steps,
        "scale": engine.loss_scale,
        "lr": engine.get_lr(),
        "draw": torch.rand(3),
    }
