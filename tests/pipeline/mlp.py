"""The pipeline tests' small MLP workload: seeded Linear layers, every replica's micro-batches, and
the single-process reference run they are compared with."""

from __future__ import annotations

import torch
from torch import nn

D_IN, HIDDEN, MICRO, M, STEPS = 6, 8, 2, 4, 3
LR = {"sgd": 0.1, "adamw": 0.01, "sgd_noclip": 0.1}


def layers(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(D_IN if i == 0 else HIDDEN, HIDDEN) for i in range(n)]


def batches(dp: int, steps: int = STEPS) -> list:
    """``[step][data rank][micro-batch] -> (inputs, labels)``."""
    g = torch.Generator().manual_seed(7)
    return [
        [
            [(torch.randn(MICRO, D_IN, generator=g), torch.randn(MICRO, HIDDEN, generator=g)) for _ in range(M)]
            for _ in range(dp)
        ]
        for _ in range(steps)
    ]


def optimizer(params, name: str):
    if name.startswith("sgd"):
        return torch.optim.SGD(params, lr=LR[name], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR[name], weight_decay=0.1)


def reference(model_layers: list[nn.Module], dp: int, optimizer_name: str, clip: float) -> dict:
    """One process over every replica's micro-batches, the loss averaged over them; ``clip`` 0:
    no clipping (the norm is still reported)."""
    model = nn.Sequential(*model_layers)
    opt = optimizer(model.parameters(), optimizer_name)
    losses, norms = [], []
    for step in batches(dp):
        total = 0.0
        for rank in step:
            for x, y in rank:
                loss = nn.functional.mse_loss(model(x), y)
                (loss / (M * dp)).backward()
                total += float(loss.detach())
        losses.append(total / (M * dp))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or 1e9)))
        opt.step()
        opt.zero_grad()
    return {
        "losses": losses,
        "norms": norms,
        "model": model,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def config(dp: int, stage: int, schedule: str, clip: float, m: int = M, **pipeline) -> dict:
    """The engine config of the virtual-stage tests: ``m`` micro-batches of ``MICRO`` per replica,
    ZeRO ``stage``, clipping at ``clip``, ``pipeline`` keys beside the schedule."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": m,
        "train_batch_size": MICRO * m * dp,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "pipeline": {"schedule": schedule, **pipeline},
    }


def compare_weights(what: str, weights: dict, ref_weights: dict, rtol: float = 1e-6) -> list[str]:
    """Mismatches of one rank's weights against the reference's (relative norm of the difference)."""
    failures = []
    for name, value in weights.items():
        want = ref_weights[name]
        err = float((value - want).norm() / want.norm())
        if not err <= rtol:
            failures.append(f"{what}: {name} relative error {err:.2e}")
    return failures


def compare(what: str, weights: dict, losses: list, ref: dict, rtol: float = 1e-6) -> list[str]:
    """Mismatches of one rank's weights (relative norm of the difference) and returned losses
    against ``reference(...)``'s."""
    failures = compare_weights(what, weights, ref["weights"], rtol)
    for step, (a, b) in enumerate(zip(losses, ref["losses"])):
        if not abs(a - b) <= rtol * abs(b):
            failures.append(f"{what}: step {step} loss {a} != reference {b}")
    return failures


def train_and_eval(engine, dp: int) -> dict:
    """``STEPS`` ``train_batch`` calls on this replica's micro-batches, then one ``eval_batch`` on
    the next step's: the returned losses and the eval loss."""
    rank = engine.topology.data_rank
    losses = [float(engine.train_batch(iter(step[rank]))) for step in batches(dp)]
    return {"losses": losses, "eval": float(engine.eval_batch(iter(batches(dp, steps=STEPS + 1)[STEPS][rank])))}


def check_replicas(what: str, got: list, ref: dict, dp: int) -> list[str]:
    """One combination on every rank (``got[rank]``: ``weights``, ``losses``, ``eval``,
    ``skipped``) against ``reference(...)``: no skipped step, each rank's weights and losses the
    reference's, the same losses on every rank, every layer on some rank, and the eval loss the
    reference model's on the next step's batches."""
    failures = []
    whole = {}
    for rank, mine in enumerate(got):
        assert mine["skipped"] == 0
        whole.update(mine["weights"])
        failures += compare(f"{what} rank {rank}", mine["weights"], mine["losses"], ref)
        if mine["losses"] != got[0]["losses"] or mine["eval"] != got[0]["eval"]:
            failures.append(f"{what} rank {rank}: the returned loss differs between ranks")
    assert sorted(whole) == sorted(ref["weights"]), "the ranks together hold every layer"
    with torch.no_grad():
        want = float(
            torch.stack(
                [
                    nn.functional.mse_loss(ref["model"](x), y)
                    for rank in batches(dp, steps=STEPS + 1)[STEPS]
                    for x, y in rank
                ]
            ).mean()
        )
    if not abs(got[0]["eval"] - want) <= 1e-6 * want:
        failures.append(f"{what}: eval loss {got[0]['eval']} != reference {want}")
    return failures
