"""Stage 3 with rank-dependent control flow: every rank raises, naming the units (issue 29, 13).

A partitioned module run on one rank only (``if rank == 0: h = h + self.extra(h)``) makes the
ranks issue different collectives. Before the identity check, gloo summed or gathered the wrong
buffers silently when the units had equal sizes, and aborted the process (SIGABRT, "Received
data size doesn't match") when they differed. Now every rank raises ``CollectiveMismatch``
naming what each rank was doing, in forward gathers, backward re-gathers, prefetched gathers and
gradient reduce-scatters, in fp32 and bf16; agreed control flow trains as before.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.testing import run_on_ranks

LR = 0.05
WIDTH = 16


class Fork(nn.Module):
    """``inner`` -> (``extra`` on some ranks) -> ``head``.

    mode "forward": ``extra`` runs only where ``use_extra`` (a forward gather on one rank only);
    mode "backward": ``extra`` runs everywhere but its output reaches the loss only where
    ``use_extra`` (its backward re-gather and reduction on one rank only)."""

    def __init__(self, inner_in: int = WIDTH, head_out: int = WIDTH):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(inner_in, WIDTH)
        self.extra = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, head_out)

    def forward(self, x, mode: str = "agree", use_extra: bool = True):
        h = torch.tanh(self.inner(x))
        if mode == "forward" and use_extra:
            h = h + self.extra(h)
        elif mode == "backward":
            y = self.extra(h)
            if use_extra:
                h = h + y
        elif mode == "agree":
            h = h + self.extra(h)
        return self.head(h)  # mode "skip": extra runs nowhere


# In forward, rank 0's gather of ``extra`` meets rank 1's gather of ``head``; in backward rank
# 0's re-gather of ``extra`` meets rank 1's re-gather of ``inner``. Shapes that make those units
# the same size as ``extra`` (1 x 16 x 16 + 16) or not:
SHAPES = {
    ("forward", "equal"): dict(head_out=WIDTH),
    ("forward", "unequal"): dict(head_out=8),
    ("backward", "equal"): dict(inner_in=WIDTH),
    ("backward", "unequal"): dict(inner_in=8),
    # "reduce": backward divergence with ``extra`` (272 elements) kept whole below the
    # persistence threshold: rank 0's first extra collective is its gradient reduce-scatter.
    ("reduce", "unequal"): dict(inner_in=32, head_out=32),
}
OTHER = {"forward": "head", "backward": "inner", "reduce": "inner"}
THRESHOLD = {"reduce": 300}


def _config(precision: str, threshold: int = 0) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _batches(steps: int, inner_in: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(steps, 4, inner_in, generator=g)  # 2 rows per rank


def _run_case(mode: str, shape: dict, precision: str, diverge_at: int) -> str:
    """Train on a fresh group (a failed case leaves its group's exchanges unmatched); rank 0
    takes the rank-dependent path at step ``diverge_at`` (the steps before it record a use
    order without ``extra`` in forward, with it in backward, which later steps prefetch along).
    Returns the error text, or 'trained'."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.comm.distributed import default_timeout

    group = dist.new_group(backend="gloo", timeout=default_timeout())
    rank = dist.get_rank()
    model = Fork(**shape)
    engine, *_ = zerotrain.initialize(
        model=model, config=_config(precision, THRESHOLD.get(mode, 0)), data_parallel_group=group
    )
    mode = "backward" if mode == "reduce" else mode
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    data = _batches(diverge_at + 1, shape.get("inner_in", WIDTH)).to(dtype)
    try:
        for step in range(diverge_at + 1):
            before = "skip" if mode == "forward" else "agree"
            step_mode = mode if step == diverge_at else before
            out = engine(data[step, 2 * rank : 2 * rank + 2], mode=step_mode, use_extra=rank == 0)
            engine.backward(out.float().square().mean())
            engine.step()
    except Exception as error:  # noqa: BLE001 - the test inspects every rank's message
        return f"{type(error).__name__}: {error}"
    return "trained"


CASES = [
    (mode, size, precision, 0)
    for mode in ("forward", "backward")
    for size in ("equal", "unequal")
    for precision in ("fp32", "bf16")
]
# Diverging on the second step, when the recorded order is prefetched ahead of use.
CASES += [("forward", "unequal", "fp32", 1), ("backward", "equal", "fp32", 1)]
CASES += [("reduce", "unequal", precision, 0) for precision in ("fp32", "bf16")]


def _agreed(steps: int) -> dict:
    """The agreed path with the check on: weights to compare with a single-process reference."""
    import torch.distributed as dist

    import zerotrain

    rank = dist.get_rank()
    model = Fork()
    engine, *_ = zerotrain.initialize(model=model, config=_config("fp32"))
    data = _batches(steps, WIDTH)
    for step in range(steps):
        out = engine(data[step, 2 * rank : 2 * rank + 2])
        engine.backward(out.square().mean())
        engine.step()
    state = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.destroy()
    return state


def _all_cases() -> dict:
    import zerotrain

    zerotrain.init_distributed()
    out = {case: _run_case(case[0], SHAPES[case[:2]], case[2], case[3]) for case in CASES}
    out["agreed"] = _agreed(4)
    return out


def test_rank_dependent_control_flow_raises_on_every_rank_naming_the_units():
    results = run_on_ranks(_all_cases, 2, timeout=600, comm_timeout=60)
    for case in CASES:
        mode = case[0]
        for rank, per_rank in enumerate(results):
            message = per_rank[case]
            assert message.startswith("CollectiveMismatch: stage 3: rank"), (case, rank, message)
            # Both ranks say the same: what rank 0 did (the extra module) and what rank 1 did.
            did = "reduced the gradients of" if mode == "reduce" else "gathered"
            assert f"rank 0 {did} unit 'extra' (extra.weight, extra.bias) while rank 1 " in message, (case, message)
            if case[3] == 0:
                assert f"rank 1 gathered unit '{OTHER[mode]}' ({OTHER[mode]}.weight" in message, (case, message)
            else:  # prefetching: rank 1 is at its backward by then
                assert "rank 1 gathered unit '" in message or "rank 1 reduced the gradients of unit '" in message, (
                    case,
                    message,
                )
            assert "same modules in the same order" in message, message
        assert results[0][case] == results[1][case], case

    # The agreed path still trains with the check on: weights equal the single-process run.
    model = Fork()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = _batches(4, WIDTH)
    for step in range(4):
        loss = 0.5 * sum(model(data[step, 2 * r : 2 * r + 2]).square().mean() for r in range(2))
        loss.backward()
        opt.step()
        opt.zero_grad()
    got = results[0]["agreed"]
    for name, want in model.state_dict().items():
        assert torch.allclose(got[name], want, rtol=1e-5, atol=1e-6), name
