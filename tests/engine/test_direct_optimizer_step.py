"""``optimizer.step()`` on the optimizer ``initialize`` returns, called by the client instead of
``engine.step()`` (Lightning Fabric's DeepSpeed precision plugin does this): it is
``engine.step()``, so training is bit-identical to the engine's own loop at stages 0-3 (SGD and
AdamW, with accumulation and an LR schedule), and ``destroy()`` gives the optimizer its own
``step`` back. Without that, stages 1-3 would silently not train (the optimizer's parameters are
the engine's shards, whose gradients only ``engine.step()`` sets).
"""

from __future__ import annotations

import torch

from zerotrain.testing import run_on_ranks

STEPS, MICRO, GAS = 3, 2, 2
OPTIMIZERS = {
    "sgd": {"type": "SGD", "params": {"lr": 0.1}},
    "adamw": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
}


def _train(stage: int, optimizer: dict, direct: bool) -> dict:
    import torch.distributed as dist

    import zerotrain
    from tests.engine.workloads import global_batches, make_model

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": optimizer,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
        "zero_optimization": {"stage": stage},
    }
    engine, opt, _, _ = zerotrain.initialize(model=model, config=config)
    data = global_batches(STEPS, MICRO * GAS * world)
    for step in range(STEPS):
        for micro in range(GAS):
            lo = (micro * world + rank) * MICRO
            batch = data[step, lo : lo + MICRO]
            engine.backward(engine(batch, labels=batch).loss)
            if direct:  # Fabric: the optimizer's step (and zero_grad after a window), never the engine's
                opt.step()
                if micro == GAS - 1:
                    opt.zero_grad()
            else:
                engine.step()
    state = engine.module_state_dict()
    steps = engine.global_steps
    engine.destroy()
    return {
        "state": {k: v.clone() for k, v in state.items()},
        "global_steps": steps,
        "step_restored": "step" not in vars(opt),
    }


def _all():
    import zerotrain

    zerotrain.init_distributed()
    return {
        (stage, name, direct): _train(stage, optimizer, direct)
        for stage in (0, 1, 2, 3)
        for name, optimizer in OPTIMIZERS.items()
        for direct in (False, True)
    }


def test_direct_optimizer_step_is_the_engines_step():
    runs = run_on_ranks(_all, world_size=2, timeout=240)[0]  # rank 0 holds the stage-3 state dict
    compared = 0
    for (stage, name, direct), got in runs.items():
        assert got["step_restored"] and got["global_steps"] == STEPS
        if not direct:
            continue
        want = runs[(stage, name, False)]["state"]
        assert got["state"].keys() == want.keys() and want
        for key, value in want.items():
            assert torch.equal(got["state"][key], value), (stage, name, key)
            compared += 1
    assert compared > 8 * 10
