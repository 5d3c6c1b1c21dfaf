"""Tiny deterministic training workloads shared by the engine and ZeRO tests.

``engine_trajectory`` runs on every rank under ``run_on_ranks``; ``reference_trajectory`` is
plain single-process PyTorch on the whole global batch. Both see the same model init and the
same global batches, rank r taking rows ``[r*micro, (r+1)*micro)`` of each micro-batch slot.
"""

from __future__ import annotations

import torch

from zerotrain.models import GPT, GPTConfig

TINY = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
SEQ = 16
# Small enough that training is not chaotic: rounding differences then stay at fp32 ulp level
# instead of being amplified by Adam over 20 steps.
LR = 1e-3


def make_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def global_batches(steps: int, global_batch: int, seed: int = 1, vocab: int = TINY["vocab_size"]) -> torch.Tensor:
    """``[steps, global_batch, SEQ]`` random token ids below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, global_batch, SEQ), generator=g)


def adamw_config(micro: int, gas: int = 1, clip: float = 0.0, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
    }
    cfg.update(extra)
    return cfg


def engine_trajectory(config: dict, steps: int, model_kwargs: dict | None = None) -> dict:
    """Train with zerotrain on this rank; returns per-step mean losses (over the global batch,
    averaged across ranks) and the final parameters."""

    import zerotrain

    model = make_model(**(model_kwargs or {}))
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = train_steps(engine, steps)
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grad_norm": engine.get_global_grad_norm(),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "memory": engine.memory_breakdown(),
    }


def train_steps(engine, steps: int) -> list[float]:
    """Train ``steps`` optimizer steps on this rank's rows of the shared global batches; returns
    each step's loss averaged over the global batch (all ranks, all micro-batches)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    data = global_batches(steps, micro * gas * world).to(engine.device)
    losses = []
    for step in range(steps):
        step_loss = torch.zeros((), device=engine.device)
        for m in range(gas):
            lo = (m * world + rank) * micro
            batch = data[step, lo : lo + micro]
            loss = engine(batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / gas
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
    return losses


def recorded_steps(engine, steps: int, micro: int) -> tuple[list[float], list[float], list[int]]:
    """Train ``steps`` steps of one micro-batch each on this rank's rows; each step's loss (this
    rank's), learning rate and the engine's global samples after it: what monitors log."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = global_batches(steps, micro * world)
    losses, lrs, samples = [], [], []
    for step in range(steps):
        batch = data[step, rank * micro : (rank + 1) * micro]
        loss = engine(batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
        samples.append(engine.global_samples)
    return losses, lrs, samples


def reference_trajectory(steps: int, global_batch: int, clip: float = 0.0, model_kwargs: dict | None = None) -> dict:
    """Single-process fp32 training on the full global batch each step."""
    model = make_model(**(model_kwargs or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    data = global_batches(steps, global_batch)
    losses, norms = [], []
    for step in range(steps):
        loss = model(data[step], labels=data[step]).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def reference_run(steps: int, global_batch: int, optimizer: dict, **model_kwargs) -> tuple[list, dict]:
    """Single-process fp32 training on the full global batch with ``optimizer`` (a config's
    ``{"type": ..., "params": ...}``, by its torch.optim name): each step's loss and the final
    state dict (a tied weight under each of its names, as ``engine.module_state_dict()``)."""
    model = make_model(**model_kwargs)
    opt = getattr(torch.optim, optimizer["type"])(model.parameters(), **optimizer["params"])
    data = global_batches(steps, global_batch, vocab=model_kwargs.get("vocab_size", TINY["vocab_size"]))
    losses = []
    for step in range(steps):
        loss = model(data[step], labels=data[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.state_dict().items()}


def assert_close_trajectory(got: list[float], want: list[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: {a} vs reference {b} (rtol {rtol})"
