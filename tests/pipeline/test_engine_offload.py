"""Optimizer offload with pipelining (ZeRO 1/2 per stage, beyond DeepSpeed, which refuses it):
P=2 x D=1, 4 micro-batches, every stage's weights after each step equal to the same run without
offload (fp32 SGD and AdamW exactly; bf16 AdamW within 1e-6 relative of the masters' rounding,
i.e. bitwise on the 16-bit weights), for ``offload_optimizer`` on ``cpu`` and on ``nvme`` (a swap
folder in a temporary directory)."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from zerotrain.testing import run_on_ranks

D_IN, HIDDEN, LAYERS, MICRO, M, STEPS = 6, 8, 4, 2, 4, 3


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(D_IN if i == 0 else HIDDEN, HIDDEN) for i in range(LAYERS)]


def _batches() -> list:
    g = torch.Generator().manual_seed(11)
    return [
        [(torch.randn(MICRO, D_IN, generator=g), torch.randn(MICRO, HIDDEN, generator=g)) for _ in range(M)]
        for _ in range(STEPS)
    ]


def _optimizer(params, name: str):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _to_bf16(batch):
    x, y = batch
    return x.to(torch.bfloat16), y.to(torch.bfloat16)


def _run(stage: int, optimizer: str, precision: str, offload: str | None, swap_dir: str) -> dict:
    import zerotrain
    from zerotrain.pipeline import PipelineModule

    model = PipelineModule(_layers(), num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    zero = {"stage": stage}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": M,
        "train_batch_size": MICRO * M,
        "gradient_clipping": 0.05,
        "zero_optimization": zero,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = zerotrain.initialize(model=model, optimizer=lambda p: _optimizer(p, optimizer), config=config)
    assert (engine.zero_offload_optimizer() is not None) == (offload is not None)
    if precision == "bf16":
        engine.set_batch_fn(_to_bf16)
    history, losses = [], []
    for batch in _batches():
        losses.append(float(engine.train_batch(iter(batch))))
        history.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    stats = engine.zero_stage_object.statistics(
        engine.module, engine.optimizer
    ).offload  # NVMe's swap I/O (empty otherwise)
    engine.destroy()
    return {"history": history, "losses": losses, "swapped": stats.get("swap_file_bytes", 0)}


def _train(combos: list, swap_dir: str) -> dict:
    import os

    import zerotrain

    zerotrain.init_distributed()
    out = {}
    for stage, optimizer, precision, offload in combos:
        folder = os.path.join(swap_dir, f"{stage}-{optimizer}-{precision}")
        os.makedirs(folder, exist_ok=True)
        out[(stage, optimizer, precision, offload)] = _run(stage, optimizer, precision, offload, folder)
    return out


COMBOS = [
    (stage, opt, precision, offload)
    for stage, (opt, precision), offload in itertools.product(
        (1, 2), (("sgd", "fp32"), ("adamw", "fp32"), ("adamw", "bf16")), (None, "cpu", "nvme")
    )
]


def test_optimizer_offload_matches_no_offload(tmp_path):
    results = run_on_ranks(_train, world_size=2, args=(COMBOS, str(tmp_path)), timeout=900)
    failures = []
    for stage, opt, precision, offload in COMBOS:
        if offload is None:
            continue
        what = f"stage {stage} {opt} {precision} offload {offload}"
        for rank, res in enumerate(results):
            got, want = res[(stage, opt, precision, offload)], res[(stage, opt, precision, None)]
            assert (got["swapped"] > 0) == (offload == "nvme"), (what, got["swapped"])
            if got["losses"] != want["losses"]:
                failures.append(f"{what} rank {rank}: losses {got['losses']} != {want['losses']}")
            for step, (a, b) in enumerate(zip(got["history"], want["history"])):
                for name in b:
                    if not torch.equal(a[name], b[name]):
                        err = float((a[name].float() - b[name].float()).norm() / b[name].float().norm())
                        failures.append(f"{what} rank {rank} step {step}: {name} differs (relative {err:.2e})")
    assert not failures, "\n".join(failures)
