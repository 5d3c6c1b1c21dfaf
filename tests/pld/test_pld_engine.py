"""Progressive layer dropping in the engine: DeepSpeed's theta sequence, the forward kwargs only
while training, theta 1.0 changing nothing, theta kept across a checkpoint, and at ZeRO stage 3
on 2 ranks the same blocks dropped everywhere and never gathered, weights equal to a
single-process loop that drops the same blocks."""

from __future__ import annotations

import torch

from tests.pld.models import PLDNet, batches
from zerotrain.testing import run_on_ranks

# DeepSpeed's ProgressiveLayerDrop(theta=0.5, gamma=0.1).update_state(s) for s = 0..19:
# (1 - 0.5) * np.exp(-0.1 * s) + 0.5, as deepspeed/runtime/progressive_layer_drop.py computed it.
THETA = [
    1.0,
    0.9524187090179798,
    0.9093653765389909,
    0.8704091103408589,
    0.8351600230178197,
    0.8032653298563167,
    0.7744058180470133,
    0.7482926518957047,
    0.7246644820586108,
    0.7032848298702996,
    0.6839397205857212,
    0.6664355418490397,
    0.650597105956101,
    0.6362658965170063,
    0.6232984819708032,
    0.611565080074215,
    0.6009482589973277,
    0.5913417620263673,
    0.5826494441107932,
    0.5747843096113175,
]
PLD = {"enabled": True, "theta": 0.5, "gamma": 0.1}


def _config(gas: int = 2, optimizer: str = "SGD", pld=None, **extra) -> dict:
    params = {"lr": 0.05} if optimizer == "SGD" else {"lr": 1e-2, "weight_decay": 0.1}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": optimizer, "params": params},
    }
    if pld is not None:
        cfg["progressive_layer_drop"] = pld
    cfg.update(extra)
    return cfg


def _train(engine, model, data, steps: int, gas: int, start: int = 0):
    """``steps`` optimizer steps from step ``start``; per step: the thetas the forward saw, the
    engine's theta after the step, and the blocks kept in each micro-step."""
    out = []
    for step in range(start, start + steps):
        seen, kept = [], []
        for micro in range(gas):
            x, y = data[step * gas + micro]
            engine.backward(engine(x, y))
            seen.append(model.seen[-1].get("pld_theta"))
            kept.append(list(model.blocks.last_kept))
            engine.step()
        out.append({"seen": seen, "theta": engine.get_pld_theta(), "kept": kept})
    return out


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _schedule_and_switches():
    import zerotrain

    data = batches(40, 2)
    model = PLDNet()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=_config(pld=PLD))
    run = _train(engine, model, data, 20, gas=2)
    engine.eval()
    engine(*data[0])
    eval_kwargs = model.seen[-1]
    engine.train()
    engine(*data[0])
    train_kwargs = model.seen[-1]
    accessors = (engine.pld_enabled(), engine.pld_params(), engine.pld_theta(), engine.pld_gamma())

    off_model = PLDNet()
    off, *_ = zerotrain.initialize(model=off_model, model_parameters=off_model.parameters(), config=_config())
    off(*data[0])
    off_state = (off.get_pld_theta(), off_model.seen[-1], off.pld_enabled(), off.pld_params())

    # theta 1.0: the same training as without PLD, bit for bit (SGD and AdamW)
    same = {}
    for optimizer in ("SGD", "AdamW"):
        finals = []
        for pld in (None, {"enabled": True, "theta": 1.0, "gamma": 0.1}):
            m = PLDNet()
            e, *_ = zerotrain.initialize(
                model=m, model_parameters=m.parameters(), config=_config(optimizer=optimizer, pld=pld)
            )
            _train(e, m, data, 5, gas=2)
            finals.append(_weights(m))
        same[optimizer] = all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0])
    # A pipeline engine calls its stages itself, with no pld_theta: refused, naming the section.
    from zerotrain.pipe import PipelineModule

    pipe = PipelineModule(layers=[torch.nn.Linear(8, 8)], num_stages=1, loss_fn=torch.nn.MSELoss())
    try:
        zerotrain.initialize(model=pipe, model_parameters=pipe.parameters(), config=_config(gas=1, pld=PLD))
        refused = None
    except ValueError as error:
        refused = str(error)
    return {
        "run": run,
        "eval": eval_kwargs,
        "train": train_kwargs,
        "accessors": accessors,
        "off": off_state,
        "same": same,
        "pipeline": refused,
    }


def test_theta_sequence_forward_kwargs_and_theta_one():
    (r,) = run_on_ranks(_schedule_and_switches, 1, timeout=300)
    run = r["run"]
    # After step s the engine holds theta(s) exactly (update_state(global_steps) before the
    # step counts it); step s's two micro-steps saw theta(s - 1), step 0's saw 1.0.
    assert [step["theta"] for step in run] == THETA
    assert [step["seen"] for step in run] == [[t, t] for t in [1.0] + THETA[:-1]]
    assert any(not all(k) for step in run for k in step["kept"])  # layers were dropped
    assert r["eval"] == {}  # DeepSpeed passes nothing in eval mode
    assert r["train"] == {"progressive_layer_drop": True, "pld_theta": THETA[-1]}
    assert r["accessors"] == (True, {"theta": 0.5, "gamma": 0.1}, 0.5, 0.1)
    assert r["off"] == (None, {}, False, False)
    assert r["same"] == {"SGD": True, "AdamW": True}
    assert r["pipeline"] and "progressive_layer_drop" in r["pipeline"] and "\n" not in r["pipeline"]


def _resume(folder: str):
    import zerotrain

    data = batches(12, 2)
    cfg = _config(optimizer="AdamW", pld=PLD)
    model = PLDNet()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    whole = _train(engine, model, data, 6, gas=2)

    first = PLDNet()
    engine, *_ = zerotrain.initialize(model=first, model_parameters=first.parameters(), config=cfg)
    head = _train(engine, first, data, 3, gas=2)
    engine.save_checkpoint(folder, tag="t3")

    second = PLDNet(seed=5)  # other initial weights: everything must come from the checkpoint
    resumed, *_ = zerotrain.initialize(model=second, model_parameters=second.parameters(), config=cfg)
    resumed.load_checkpoint(folder, tag="t3")
    loaded_theta = resumed.get_pld_theta()
    tail = _train(resumed, second, data, 3, gas=2, start=3)
    final = _weights(model)
    equal = all(torch.equal(final[n], p) for n, p in _weights(second).items())
    return {"whole": whole, "head": head, "tail": tail, "loaded_theta": loaded_theta, "equal": equal}


def test_resume_keeps_theta_and_drop_decisions(tmp_path):
    (r,) = run_on_ranks(_resume, 1, args=(str(tmp_path / "ckpt"),), timeout=300)
    whole = r["whole"]
    assert r["head"] == whole[:3]
    assert r["loaded_theta"] == THETA[2]  # DeepSpeed: 1.0 until the next step
    assert r["tail"] == whole[3:]  # thetas seen, thetas after each step, blocks kept
    assert r["equal"]


def _stage3_rank(steps: int):
    import zerotrain

    model = PLDNet(depth=6)
    data = batches(steps, 4)
    pld = {"enabled": True, "theta": 0.2, "gamma": 0.5}
    cfg = _config(gas=1, pld=pld, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = engine.topology.data_rank
    counts = {}

    def counting(unit, block):
        original = unit.start_gather

        def start_gather(*args, **kwargs):
            counts[block] = counts.get(block, 0) + 1
            return original(*args, **kwargs)

        return start_gather

    for unit in engine.zero_stage_object.parameter_coordinator.units:
        blocks = {int(name.split(".")[1]) for name in unit.names if name.startswith("blocks.")}
        if blocks:
            (block,) = blocks
            unit.start_gather = counting(unit, block)
    per_step = []
    for x, y in data:
        counts.clear()
        engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        engine.step()
        per_step.append({"kept": list(model.blocks.last_kept), "gathers": dict(counts)})
    return {"steps": per_step, "weights": engine.module_state_dict()}


def _reference(steps: int):
    """One process, the whole batch, the same schedule and the same draws (step source = step)."""
    from zerotrain.pld import ProgressiveLayerDrop

    model = PLDNet(depth=6)
    step = [0]
    model.blocks.bind(lambda: step[0], index=0)
    schedule = ProgressiveLayerDrop(theta=0.2, gamma=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    kept = []
    for x, y in batches(steps, 4):
        model(x, y, **schedule.get_state()).backward()
        kept.append(list(model.blocks.last_kept))
        schedule.update_state(step[0])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step[0] += 1
    return kept, model.state_dict()


def test_stage3_two_ranks_drop_the_same_blocks_and_never_gather_them():
    steps = 8
    ranks = run_on_ranks(_stage3_rank, 2, args=(steps,), timeout=300)
    kept, reference = _reference(steps)
    assert [s["kept"] for s in ranks[0]["steps"]] == [s["kept"] for s in ranks[1]["steps"]] == kept
    assert sum(not k for step in kept for k in step) >= 6  # blocks really were dropped
    for r in ranks:
        for step in r["steps"]:
            for block, keep in enumerate(step["kept"]):
                gathered = step["gathers"].get(block, 0)
                assert gathered > 0 if keep else gathered == 0, (block, step)
    weights = ranks[0]["weights"]
    assert weights.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=name)
