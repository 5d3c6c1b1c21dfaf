"""``loss.backward()`` and ``engine.scale(loss).backward()`` instead of ``engine.backward(loss)``
(engine/plain_backward.py): the same weights, bit for bit, at every ZeRO stage, with gradient
accumulation, in fp32, bf16 and fp16; and the fp32 runs match a single-process reference.

The loss is taken three ways: the model's own ``loss`` (computed inside the model from its
``logits``, both returned: the case where DeepSpeed 0.19's ZeRO 1/2 divide by the accumulation
steps twice), a loss the client computes from ``logits``, and a sum of both (every path from
the loss to the parameters must be scaled exactly once). SGD shows any factor on the gradient
in the weights; AdamW is checked beside it."""

from __future__ import annotations

import torch

from tests.engine.workloads import LR, global_batches, make_model, reference_run
from zerotrain.testing import run_on_ranks

STEPS = 3
MICRO = 2
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}


def _client_loss(out, batch):
    """Next-token cross-entropy the client computes from the logits."""
    logits = out.logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def _train(config: dict, how: str, steps: int = STEPS) -> dict:
    """``steps`` optimizer steps on this rank's rows; ``how`` says how each backward is run."""
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = config["gradient_accumulation_steps"]
    model = make_model()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    data = global_batches(steps, MICRO * gas * world)
    backward, loss_kind = how.split(":")
    for step in range(steps):
        for m in range(gas):
            lo = (m * world + rank) * MICRO
            batch = data[step, lo : lo + MICRO]
            if loss_kind == "client":
                loss = _client_loss(engine(batch), batch)
            else:
                out = engine(batch, labels=batch)
                loss = out.loss if loss_kind == "model" else out.loss + 0.5 * _client_loss(out, batch)
            if backward == "engine":
                engine.backward(loss)
            elif backward == "scale":
                engine.scale(loss).backward()
            else:
                loss.backward()
            engine.step()
    # Whole weights (rank 0 only at stage 3) and what the optimizer steps on this rank (its
    # shards, or the fp32 masters in 16-bit training).
    weights = {k: v.float().clone() for k, v in engine.module_state_dict().items()}
    for i, p in enumerate(p for g in engine.optimizer.param_groups for p in g["params"]):
        weights[f"stepped.{i}"] = p.detach().clone()
    engine.destroy()
    return weights


def _config(stage: int, gas: int, optimizer: dict, precision: str | None = None, **fp16) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": optimizer,
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:  # partition every parameter of the tiny model (none is below the threshold)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, **fp16}
    return cfg


def _compare(runs: dict, key: str, a: str, b: str, failures: list) -> None:
    """Weights of run ``a`` and ``b`` of ``key`` must be equal bit for bit."""
    for name, want in runs[a].items():
        if not torch.equal(runs[b][name], want):
            diff = (runs[b][name] - want).abs().max().item()
            failures.append(f"{key}: {b} != {a} at {name} (max diff {diff:g})")


def _all_cases() -> dict:
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    rank = dist.get_rank()
    failures, fp32_weights = [], {}
    # Every stage, fp32 and bf16, accumulation 1 and 2, SGD; AdamW at accumulation 2.
    for stage in (0, 1, 2, 3):
        for precision in (None, "bf16"):
            for gas, optimizer in ((1, SGD), (2, SGD), (2, ADAMW)):
                key = f"stage={stage} {precision or 'fp32'} gas={gas} {optimizer['type']}"
                cfg = _config(stage, gas, optimizer, precision)
                # The client's losses where the accumulation factor matters for SGD.
                losses = ("model", "client", "both") if (gas, optimizer) == (2, SGD) else ("model",)
                runs = {
                    f"{backward}:{loss}": _train(cfg, f"{backward}:{loss}")
                    for backward in ("engine", "plain")
                    for loss in losses
                }
                for loss in losses:
                    _compare(runs, key, f"engine:{loss}", f"plain:{loss}", failures)
                if precision is None:
                    fp32_weights[key] = {k: v for k, v in runs["plain:model"].items() if not k.startswith("stepped.")}
    # fp16: scale() with a static and a dynamic loss scale; a bare backward under static scaling.
    scales = {}
    for stage in (0, 1, 2, 3):
        for fp16 in ({"loss_scale": 64}, {"loss_scale": 0, "initial_scale_power": 8}):
            key = f"stage={stage} fp16 {fp16}"
            cfg = _config(stage, 2, SGD, "fp16", **fp16)
            # Static: a bare backward is scaled at the outputs. Dynamic: it raises (below).
            hows = (
                ("engine:model", "scale:model", "plain:model")
                if fp16["loss_scale"]
                else ("engine:model", "scale:model", "engine:client", "scale:client")
            )
            runs = {how: _train(cfg, how) for how in hows}
            for how in hows:
                if not how.startswith("engine"):
                    _compare(runs, key, "engine:" + how.split(":")[1], how, failures)
    # What scale() returns, and the refusal of a bare backward under dynamic scaling.
    batch = global_batches(1, 2 * MICRO)[0, rank * MICRO : (rank + 1) * MICRO]
    for name, precision, fp16 in (
        ("fp32", None, {}),
        ("bf16", "bf16", {}),
        ("static", "fp16", {"loss_scale": 64}),
        ("dynamic", "fp16", {"loss_scale": 0, "initial_scale_power": 8}),
    ):
        engine, *_ = zerotrain.initialize(model=make_model(), config=_config(1, 2, SGD, precision, **fp16))
        loss = engine(batch, labels=batch).loss
        scales[name] = (engine.scale(loss) / loss.float()).item()
        if name == "dynamic":
            try:
                loss.backward()
                scales["bare"] = "accepted"
            except RuntimeError as error:
                scales["bare"] = str(error)
            engine.zero_grad()
        engine.destroy()
    return {"failures": failures, "fp32": fp32_weights, "scales": scales}


def test_plain_backward_and_scale_equal_engine_backward():
    results = run_on_ranks(_all_cases, world_size=2, timeout=900)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: " + "\n".join(r["failures"])
        assert r["scales"]["fp32"] == 1.0 and r["scales"]["bf16"] == 1.0
        assert r["scales"]["static"] == 64.0 and r["scales"]["dynamic"] == 256.0
        message = r["scales"]["bare"]
        assert "engine.scale(loss).backward()" in message and "\n" not in message, message
    # The fp32 runs against single-process training on the whole global batch.
    for key, weights in results[0]["fp32"].items():
        gas = int(key.split("gas=")[1].split()[0])
        optimizer = SGD if key.endswith("SGD") else ADAMW
        _, want = reference_run(STEPS, MICRO * gas * 2, optimizer)
        for name, value in want.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key} {name}: {m}")
