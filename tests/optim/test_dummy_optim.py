"""zerotrain.DummyOptim / DummyScheduler with zerotrain.initialize (no accelerate).

The filling rules are table-tested on `resolve_placeholders` (no processes needed: initialize
fills and checks the config before it starts communicating). One 2-rank group then trains at
stages 0, 2 and 3 with the placeholders and compares with plain PyTorch: AdamW over the same
param groups and a LambdaLR written out from DeepSpeed's WarmupDecayLR formula (linear warmup),
and clipping 1.0, fp32, rel 1e-5 on the losses (the same tolerance argument as tests/engine: only the order of
fp32 sums differs; a wrong lr, weight decay or group moves a loss by > 1e-3).
"""

from __future__ import annotations

import pytest
import torch

import zerotrain
from tests.engine.workloads import assert_close_trajectory, global_batches, make_model
from zerotrain.config import ConfigError
from zerotrain.optim.placeholders import resolve_placeholders
from zerotrain.testing import run_on_ranks

LR, WD, WARMUP, TOTAL, STEPS, MICRO, WORLD = 1e-3, 0.05, 2, 6, 6, 2, 2


def sections(**optimizer_params):
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", **optimizer_params}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
                "warmup_type": "linear",
            },
        },
    }


def param_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def test_auto_values_are_filled_from_the_placeholders():
    opt = zerotrain.DummyOptim([torch.zeros(2)], lr=LR, weight_decay=WD, betas=(0.9, 0.95))
    sched = zerotrain.DummyScheduler(opt, total_num_steps=TOTAL, warmup_num_steps=WARMUP)
    config, optimizer, scheduler, params = resolve_placeholders(sections(betas="auto"), opt, sched, None)
    assert (optimizer, scheduler, params) == (None, None, opt.params)
    assert config["optimizer"]["params"] == {"lr": LR, "weight_decay": WD, "betas": (0.9, 0.95)}
    assert config["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": LR,
        "warmup_num_steps": WARMUP,
        "total_num_steps": TOTAL,
        "warmup_type": "linear",
    }


@pytest.mark.parametrize(
    "case, optimizer_params, scheduler_params, want",
    [
        # defaults fill "auto" (accelerate's: lr 1e-3, weight decay 0, warmup at least 1)
        ("defaults", {}, {}, ({"lr": 0.001, "weight_decay": 0.0}, {"warmup_num_steps": 1, "warmup_max_lr": 0.001})),
        # a given value the section lacks is added (a given lr is also the schedule's peak); a default is not
        ("absent", {"lr": LR}, {"total_num_steps": 9}, ({"lr": LR}, {"total_num_steps": 9, "warmup_max_lr": LR})),
        # warmup_num_steps=0 becomes 1 (DeepSpeed >= 0.19.6 rejects 0)
        (
            "warmup0",
            {},
            {"warmup_num_steps": 0},
            ({"lr": 0.001, "weight_decay": 0.0}, {"warmup_num_steps": 1, "warmup_max_lr": 0.001}),
        ),
    ],
)
def test_fill_rules(case, optimizer_params, scheduler_params, want):
    config = {
        "optimizer": {"type": "AdamW", "params": {}} if case == "absent" else sections()["optimizer"],
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {} if case == "absent" else {"warmup_num_steps": "auto", "warmup_max_lr": "auto"},
        },
    }
    opt = zerotrain.DummyOptim([torch.zeros(2)], **optimizer_params)
    sched = zerotrain.DummyScheduler(opt, **scheduler_params)
    filled, *_ = resolve_placeholders(config, opt, sched, None)
    assert filled["optimizer"]["params"] == want[0]
    assert filled["scheduler"]["params"] == want[1]


def test_schedule_without_end_ignores_total_num_steps_but_rejects_unknown_keywords():
    opt = zerotrain.DummyOptim([torch.zeros(2)], lr=LR)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "scheduler": {"type": "WarmupLR", "params": {}}}
    filled, *_ = resolve_placeholders(config, opt, zerotrain.DummyScheduler(opt, total_num_steps=9), None)
    assert "total_num_steps" not in filled["scheduler"]["params"]
    with pytest.raises(ConfigError, match="scheduler WarmupLR has no parameter 'cycle_min_lr'"):
        resolve_placeholders(config, opt, zerotrain.DummyScheduler(opt, cycle_min_lr=0.1), None)


def test_contradicting_values_are_one_error_naming_both_sides():
    opt = zerotrain.DummyOptim([torch.zeros(2)], lr=LR, weight_decay=WD)
    sched = zerotrain.DummyScheduler(opt, total_num_steps=TOTAL, warmup_num_steps=WARMUP)
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": WD}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"total_num_steps": 100, "warmup_num_steps": WARMUP, "warmup_max_lr": 1e-4},
        },
    }
    with pytest.raises(ConfigError) as caught:
        resolve_placeholders(config, opt, sched, None)
    message = str(caught.value)
    assert f"optimizer.params.lr=0.0001 vs DummyOptim(lr={LR})" in message
    assert "scheduler.params.total_num_steps=100 vs DummyScheduler(total_num_steps=6)" in message
    assert f"scheduler.params.warmup_max_lr=0.0001 vs DummyOptim(lr={LR})" in message
    assert len(caught.value.problems) == 3  # weight_decay and warmup_num_steps agree


def test_an_explicit_default_still_counts_as_given():
    opt = zerotrain.DummyOptim([torch.zeros(2)], lr=0.001)
    with pytest.raises(ConfigError, match="optimizer.params.lr=0.01 vs DummyOptim"):
        resolve_placeholders({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}, opt, None, None)
    # not given: the config's value stands
    filled, *_ = resolve_placeholders(
        {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}, zerotrain.DummyOptim([torch.zeros(2)]), None, None
    )
    assert filled["optimizer"]["params"]["lr"] == 0.01


@pytest.mark.parametrize(
    "config, scheduler_kwargs, model_parameters, fragment",
    [
        ({}, None, None, "needs an 'optimizer' section"),
        (sections(), {"lr_scheduler_callable": lambda o: None}, None, "remove one"),
        ({"optimizer": sections()["optimizer"]}, {}, None, "needs a 'scheduler' section"),
        (sections(), None, [torch.zeros(1)], "pass the parameters once"),
    ],
)
def test_missing_sections_and_double_answers_are_errors(config, scheduler_kwargs, model_parameters, fragment):
    opt = zerotrain.DummyOptim([torch.zeros(2)], lr=LR)
    sched = None if scheduler_kwargs is None else zerotrain.DummyScheduler(opt, **scheduler_kwargs)
    with pytest.raises(ConfigError, match=fragment):
        zerotrain.initialize(
            model=torch.nn.Linear(2, 2),
            optimizer=opt,
            lr_scheduler=sched,
            model_parameters=model_parameters,
            config=config,
        )


def test_callable_builds_the_scheduler_when_the_config_has_none():
    opt = zerotrain.DummyOptim([torch.zeros(2)], lr=LR)
    build = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1)  # noqa: E731
    config, _, scheduler, _ = resolve_placeholders(
        {"optimizer": sections()["optimizer"]}, opt, zerotrain.DummyScheduler(opt, lr_scheduler_callable=build), None
    )
    assert scheduler is build and "scheduler" not in config


def placeholder_runs() -> dict:
    """On each rank: stages 0, 2, 3 built from DummyOptim/DummyScheduler and a config's sections."""
    import torch.distributed as dist

    zerotrain.init_distributed()
    rank = dist.get_rank()
    data = global_batches(STEPS, MICRO * WORLD)
    out = {}
    for stage in (0, 2, 3):
        model = make_model()
        optimizer = zerotrain.DummyOptim(param_groups(model), lr=LR, weight_decay=WD)
        scheduler = zerotrain.DummyScheduler(optimizer, total_num_steps=TOTAL, warmup_num_steps=WARMUP)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage},
            **sections(),
        }
        engine, real_optimizer, _, real_scheduler = zerotrain.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        losses, lrs = [], []
        for step in range(STEPS):
            lrs.append([group["lr"] for group in real_optimizer.param_groups])
            batch = data[step, rank * MICRO : (rank + 1) * MICRO]
            loss = engine(batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / WORLD)
        out[stage] = {
            "scheduler": type(real_scheduler).__name__,
            "lrs": lrs,
            "losses": losses,
            "weight_decay": [group["weight_decay"] for group in real_optimizer.param_groups],
            "params": {n: p.detach().clone() for n, p in engine.module_state_dict().items()},
        }
    return out


def warmup_decay(step: int) -> float:
    """DeepSpeed's WarmupDecayLR factor (linear warmup) for the optimizer step `step`: the
    schedule is at iteration -1 (lr warmup_min_lr = 0) for the first step, then it = step - 1."""
    it = step - 1
    if it < 0:
        return 0.0
    warmup = max(2, WARMUP)
    return it / warmup if it < warmup else max(0.0, (TOTAL - it) / max(1, TOTAL - warmup))


def plain_pytorch() -> dict:
    model = make_model()
    optimizer = torch.optim.AdamW(
        [{**group, "weight_decay": group.get("weight_decay", WD)} for group in param_groups(model)], lr=LR
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)
    data = global_batches(STEPS, MICRO * WORLD)
    losses, lrs = [], []
    for step in range(STEPS):
        lrs.append([group["lr"] for group in optimizer.param_groups])
        loss = model(data[step], labels=data[step]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "lrs": lrs, "params": {n: p.detach().clone() for n, p in model.state_dict().items()}}


def test_initialize_with_placeholders_trains_like_plain_pytorch():
    ranks = run_on_ranks(placeholder_runs, world_size=WORLD, timeout=180)
    want = plain_pytorch()
    assert any(lr > 0 for lr in want["lrs"][-1])  # the schedule moved the weights
    for stage, got in ranks[0].items():
        assert got["scheduler"] == "WarmupDecayLR"
        assert got["weight_decay"] == [WD, 0.0]
        for step, (lrs, wanted) in enumerate(zip(got["lrs"], want["lrs"])):
            assert lrs == pytest.approx(wanted, rel=1e-12), (stage, step)
        assert_close_trajectory(got["losses"], want["losses"], rtol=1e-5)
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-6, msg=f"stage {stage} {name}")
