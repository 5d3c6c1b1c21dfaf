"""Per-layer MoE statistics in the step log and the monitors (zerotrain.experts.stats): on 2 gloo
ranks with ep_size 2, two MoE layers (top-2 with capacity drops, top-1 dropless), gradient
accumulation 2, the figures the engine reports equal the ones recomputed from DeepSpeed's dense
gate output (dispatch mask) of every forward on every rank: routes per expert summed over the
ranks, the share of routes the dispatch mask lost, the mean l_aux; monitors every step, the log
line over the ``steps_per_print`` window; evaluation forwards not counted."""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.testing import run_on_ranks

STEPS, GAS, TOKENS = 4, 2, 24


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        from zerotrain.moe.layer import MoE

        self.inp = nn.Linear(8, 16)
        self.moe_a = MoE(16, nn.Linear(16, 16), num_experts=4, ep_size=2, k=2, capacity_factor=0.5, min_capacity=0)
        self.moe_b = MoE(16, nn.Linear(16, 16), num_experts=2, ep_size=2, k=1, drop_tokens=False, use_rts=False)

    def forward(self, x):
        h = self.moe_a(self.inp(x))[0]
        return self.moe_b(h)[0].square().mean()


def _expected(layer, x):
    """One forward's figures from the gate's dense output: DeepSpeed's dispatch mask."""
    from zerotrain.experts.gating import top1gating, top2gating

    logits = x.float() @ layer.deepspeed_moe.gate.wg.weight.float().t()
    if layer.deepspeed_moe.gate.k == 2:
        l_aux, _, dispatch, counts = top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False)
    else:
        l_aux, _, dispatch, counts = top1gating(logits, 1.0, 0, drop_tokens=False, use_rts=False)
    return counts.double(), float(counts.sum() - dispatch.sum()), float(l_aux)


def _rank(out_dir):
    import os

    import zerotrain
    from zerotrain.experts import stats as stats_module

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = _Model()
    # deterministic gates (no sampling): the reference can recompute them
    model.moe_a.deepspeed_moe.gate.top2_2nd_expert_sampling = False
    config = {
        "train_micro_batch_size_per_gpu": TOKENS,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": f"{out_dir}/rank{rank}", "job_name": "stats"},
    }
    engine, _, _, _ = zerotrain.initialize(model=model, config=config, model_parameters=model.parameters())
    events, lines = [], []
    write_events = engine.monitor.write_events
    engine.monitor.write_events = lambda ev: (events.extend(ev), write_events(ev))
    stats_module.log_rank0 = lambda msg, *a, **k: lines.append(msg)
    g = torch.Generator().manual_seed(10 + rank)
    seen = {}
    for n in ("moe_a", "moe_b"):
        getattr(model, n).register_forward_pre_hook(lambda m, args, n=n: seen.__setitem__(n, args[0].detach()))
    mine = []  # this rank's expected figures per step: {layer: [counts, dropped, l_aux sum, forwards]}
    for _ in range(STEPS):
        step = {}
        for _ in range(GAS):
            x = torch.randn(TOKENS, 8, generator=g)
            engine.backward(engine(x))
            # the gate inputs this forward saw (the weights change only at the step)
            figures = {f"{n}.deepspeed_moe": _expected(getattr(model, n), seen[n]) for n in ("moe_a", "moe_b")}
            for name, (counts, dropped, l_aux) in figures.items():
                old = step.get(name, [0, 0.0, 0.0, 0])
                step[name] = [old[0] + counts, old[1] + dropped, old[2] + l_aux, old[3] + 1]
            engine.step()
        mine.append(step)
    engine.eval()
    with torch.no_grad():
        engine(torch.randn(TOKENS, 8, generator=g))  # not counted
    engine.train()
    # initialize handed the layers the engine's topology: their group is its ep_size_2 group
    ep_group = engine.topology.expert_groups(2).expert_group
    given = [(m._topology is engine.topology, m.deepspeed_moe.ep_group is ep_group) for m in (model.moe_a, model.moe_b)]
    del ep_group
    engine.destroy()
    hooks = sum(len(m._forward_hooks) for m in model.modules())  # forward (post) hooks: the statistics' only
    return {"mine": mine, "events": events, "lines": lines, "hooks": hooks, "given": given}


def _figures(per_rank_steps, name):
    counts = sum(step[name][0] for step in per_rank_steps)
    dropped = sum(step[name][1] for step in per_rank_steps)
    l_aux = sum(step[name][2] for step in per_rank_steps) / sum(step[name][3] for step in per_rank_steps)
    return [int(c) for c in counts.tolist()], dropped / float(counts.sum()), l_aux


def test_step_log_and_monitors_report_expert_counts_drops_and_l_aux(tmp_path):
    out = run_on_ranks(_rank, world_size=2, args=(str(tmp_path),), timeout=240)
    assert all(o["hooks"] == 0 for o in out)  # destroy() removed the statistics hooks
    assert all(o["given"] == [(True, True), (True, True)] for o in out)
    events = {}
    for tag, value, step in out[0]["events"]:
        events.setdefault(tag, []).append((step, value))
    some_drops = False
    for name in ("moe_a.deepspeed_moe", "moe_b.deepspeed_moe"):
        tag = f"Train/Samples/moe/{name}"
        for s in range(STEPS):  # monitors: each step's figures over both ranks
            counts, drop_rate, l_aux = _figures([out[0]["mine"][s], out[1]["mine"][s]], name)
            samples = (s + 1) * TOKENS * GAS * 2
            assert events[f"{tag}/l_aux"][s] == (samples, pytest_approx(l_aux))
            assert events[f"{tag}/drop_rate"][s] == (samples, pytest_approx(drop_rate))
            assert [events[f"{tag}/expert_{e}_count"][s][1] for e in range(len(counts))] == counts
            some_drops |= drop_rate > 0
            if name.startswith("moe_b"):
                assert drop_rate == 0  # dropless
    assert some_drops  # the top-2 layer's capacity really dropped routes
    # the log line every 2 steps: the figures of the 2 steps since the last line
    assert len(out[0]["lines"]) == STEPS // 2
    for w, line in enumerate(out[0]["lines"]):
        steps = [out[r]["mine"][s] for r in (0, 1) for s in (2 * w, 2 * w + 1)]
        want = []
        for name in ("moe_a.deepspeed_moe", "moe_b.deepspeed_moe"):
            counts, drop_rate, l_aux = _figures(steps, name)
            want.append(f"{name}: counts={counts}, dropped={100 * drop_rate:.2f}%, l_aux={l_aux:.4f}")
        assert line == "moe | " + " | ".join(want)


def pytest_approx(value):
    import pytest

    return pytest.approx(value, rel=1e-9, abs=1e-12)
