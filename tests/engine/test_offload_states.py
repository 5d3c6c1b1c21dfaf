"""``engine.offload_states()`` / ``reload_states()`` / ``empty_partition_cache()``
(zero/offload_states.py): a round trip in the middle of training leaves it bit-identical to an
uninterrupted run (weights, and what each rank's optimizer steps), at stages 0-3, SGD and AdamW,
fp32 and bf16; while offloaded the named states' storages hold no memory (memory_breakdown() and
the storages themselves show it), a forward still runs when only optimizer state is away, and
training calls that need offloaded state refuse. ``empty_partition_cache()`` at stage 3 releases
the unit kept gathered from forward into backward and the buffer pool, and training goes on
exactly."""

from __future__ import annotations

import torch

from tests.engine.workloads import LR, global_batches, make_model
from zerotrain.testing import run_on_ranks

MICRO, GAS = 2, 2
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}


def _config(stage: int, optimizer: dict, precision: str | None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "optimizer": optimizer,
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:  # partition every parameter of the tiny model (none is below the threshold)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if precision:
        cfg[precision] = {"enabled": True}
    return cfg


def _micro_batches(steps: int):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = global_batches(steps, MICRO * GAS * world)
    for step in range(steps):
        for m in range(GAS):
            lo = (m * world + rank) * MICRO
            yield data[step, lo : lo + MICRO]


def _state(engine) -> dict:
    """Whole weights (rank 0 at stage 3) and this rank's stepped tensors and optimizer state."""
    out = {k: v.float().clone() for k, v in engine.module_state_dict().items()}
    stepped = [p for g in engine.optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(stepped):
        out[f"stepped.{i}"] = p.detach().clone()
        for key, value in engine.optimizer.state.get(p, {}).items():
            if torch.is_tensor(value):
                out[f"stepped.{i}.{key}"] = value.clone()
    return out


def _train(config: dict, steps: int, interrupt=None) -> dict:
    """``steps`` optimizer steps; ``interrupt(engine, micro_index, phase)`` runs at each micro
    step before its forward ("before") and between its forward and backward ("between")."""
    import zerotrain

    engine, *_ = zerotrain.initialize(model=make_model(), config=config)
    for i, batch in enumerate(_micro_batches(steps)):
        if interrupt:
            interrupt(engine, i, "before")
        loss = engine(batch, labels=batch).loss
        if interrupt:
            interrupt(engine, i, "between")
        engine.backward(loss)
        engine.step()
    state = _state(engine)
    engine.destroy()
    return state


def _differences(want: dict, got: dict) -> list[str]:
    if want.keys() != got.keys():
        return [f"keys differ: {sorted(want.keys() ^ got.keys())[:4]}"]
    return [
        f"{k} (max diff {(got[k] - want[k]).abs().max().item():g})" for k in want if not torch.equal(got[k], want[k])
    ]


def _outcome(call) -> str:
    try:
        call()
        return "accepted"
    except RuntimeError as error:
        return str(error)


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


def _round_trips() -> dict:
    import zerotrain
    from zerotrain.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    zerotrain.init_distributed()
    failures, seen = [], {}
    cases = [(0, SGD, None), (0, ADAMW, "bf16")] + [
        (stage, optimizer, precision)
        for stage in (1, 2, 3)
        for optimizer, precision in ((SGD, None), (ADAMW, None), (SGD, "bf16"), (ADAMW, "bf16"))
    ]
    for stage, optimizer, precision in cases:
        key = f"stage={stage} {optimizer['type']} {precision or 'fp32'}"
        cfg = _config(stage, optimizer, precision)
        want = _train(cfg, 4)

        # Optimizer state (and separate fp32 masters) only, as between generation and
        # training: forward still runs.
        include = [OffloadStateTypeEnum.optim_states]
        if precision and stage < 3:
            include.append(OffloadStateTypeEnum.hp_params)

        def offload(engine, i, phase, key=key, include=include):
            batch = global_batches(1, MICRO)[0].to(engine.device)
            if (i, phase) == (3, "before"):  # mid-window: the window's first gradients are held
                before = engine.memory_breakdown()
                tensors = engine.zero_stage_object.state_tensors(engine.module, engine.optimizer)
                engine.offload_states()  # everything
                after = engine.memory_breakdown()
                seen[key] = {
                    "before": before,
                    "after": after,
                    "left": {k: _storage_bytes(v) for k, v in tensors.items()},
                }
                seen[key]["forward"] = _outcome(lambda: engine(batch))
                engine.reload_states()
            elif (i, phase) == (4, "before"):  # a window boundary: between optimizer steps
                # through the optimizer, as OpenRLHF calls them (DeepSpeed's ZeRO optimizer has them)
                engine.optimizer.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=True)
                with torch.no_grad():
                    engine(batch)
                seen[key]["step"] = _outcome(engine.step)
                engine.optimizer.reload_states(non_blocking=True)

        got = _train(cfg, 4, offload)
        failures += [f"{key}: {d}" for d in _differences(want, got)]

    # empty_partition_cache at stage 3: after a forward (the output layer's unit is kept for
    # backward) and after a step (the pool); then training goes on exactly.
    cache = {}
    for optimizer, precision in ((SGD, None), (ADAMW, "bf16")):
        key = f"{optimizer['type']} {precision or 'fp32'}"
        cfg = _config(3, optimizer, precision)
        want = _train(cfg, 4)

        def empty_cache(engine, i, phase, key=key):
            if i < 2:
                return
            held = engine.memory_breakdown()
            engine.empty_partition_cache()
            cache.setdefault(key, []).append(
                (
                    phase,
                    held["gathered_parameters"] + held["gather_pool"],
                    engine.memory_breakdown()["gathered_parameters"] + engine.memory_breakdown()["gather_pool"],
                )
            )

        got = _train(cfg, 4, empty_cache)
        failures += [f"empty_partition_cache {key}: {d}" for d in _differences(want, got)]

    engine, *_ = zerotrain.initialize(model=make_model(), config=_config(1, SGD, None))
    try:
        engine.offload_states(device=OffloadDeviceEnum.nvme)
        nvme = "accepted"
    except ValueError as error:
        nvme = str(error)
    engine.destroy()
    return {"failures": failures, "seen": seen, "cache": cache, "nvme": nvme}


def test_offload_round_trip_is_exact_and_frees_the_states():
    results = run_on_ranks(_round_trips, world_size=2, timeout=600)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: " + "\n".join(r["failures"])
        for key, seen in r["seen"].items():
            before, after = seen["before"], seen["after"]
            # Every named state's storage holds nothing while offloaded ...
            assert all(v == 0 for v in seen["left"].values()), (key, seen["left"])
            # ... and memory_breakdown counts it gone, held in host buffers instead.
            held = ("optimizer_state", "parameters", "master_parameters")
            assert before["optimizer_state"] > 0, key
            assert before["parameters"] + before.get("master_parameters", 0) > 0, key
            assert all(after.get(name, 0) == 0 for name in held), (key, after)
            assert after["offloaded_states"] >= sum(before.get(name, 0) for name in held), key
            assert "reload_states()" in seen["forward"], (key, seen["forward"])
            assert "optim_states" in seen["step"] and "reload_states()" in seen["step"], seen["step"]
        for key, records in r["cache"].items():
            # After a grad-enabled forward the kept unit is released; memory back to nothing held.
            assert all(after == 0 for _, _, after in records), (key, records)
            assert any(phase == "between" and held > 0 for phase, held, _ in records), (key, records)
        assert "nvme" in r["nvme"] and "\n" not in r["nvme"], r["nvme"]
