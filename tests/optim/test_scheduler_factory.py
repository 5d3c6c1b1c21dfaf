"""build_lr_scheduler: DeepSpeed schedule names, torch schedulers and errors."""

import pytest
import torch

from zerotrain.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_lr_scheduler


def make_optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


@pytest.mark.parametrize(
    "name, cls, params",
    [
        ("WarmupLR", WarmupLR, {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}),
        ("WarmupDecayLR", WarmupDecayLR, {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear"}),
        ("WarmupCosineLR", WarmupCosineLR, {"total_num_steps": 20, "warmup_min_ratio": 0.1}),
        ("OneCycle", OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}),
        ("LRRangeTest", LRRangeTest, {"lr_range_test_min_lr": 1e-4}),
        ("warmuplr", WarmupLR, {}),
    ],
)
def test_builds_deepspeed_schedules(name, cls, params):
    optimizer = make_optimizer()
    scheduler = build_lr_scheduler(name, params, optimizer)
    assert type(scheduler) is cls and scheduler.optimizer is optimizer
    scheduler.step()
    assert scheduler.state_dict() == {"last_batch_iteration": 0}


def test_builds_torch_schedulers_with_their_kwargs():
    optimizer = make_optimizer()
    scheduler = build_lr_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.05])
    assert isinstance(
        build_lr_scheduler("CosineAnnealingLR", {"T_max": 10}, make_optimizer()),
        torch.optim.lr_scheduler.CosineAnnealingLR,
    )
    assert build_lr_scheduler("WarmupLR", None, make_optimizer()).max_lrs == [0.1]


def test_unknown_scheduler_suggests():
    with pytest.raises(ValueError, match="'WarmupLRR'.*Did you mean 'WarmupLR'"):
        build_lr_scheduler("WarmupLRR", {}, make_optimizer())
    with pytest.raises(ValueError, match="Did you mean 'StepLR'"):
        build_lr_scheduler("StepRL", {}, make_optimizer())


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("WarmupLR", {"warmup_max": 0.1}, "'warmup_max'.*WarmupLR.*Did you mean 'warmup_max_lr'"),
        ("WarmupDecayLR", {"warmup_num_steps": 5}, "'total_num_steps'.*WarmupDecayLR"),
        ("OneCycle", {"cycle_min_lr": 0.01}, "'cycle_max_lr'.*OneCycle"),
        ("StepLR", {"step_size": 2, "gama": 0.5}, "'gama'.*StepLR"),
        ("StepLR", {}, "'step_size'.*StepLR"),
        ("WarmupLR", {"warmup_type": "exp"}, "WarmupLR.*warmup_type"),
        ("WarmupLR", {"warmup_num_steps": 1.5}, "WarmupLR.*warmup_num_steps"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "LRRangeTest.*lr_range_test_step_size"),
    ],
)
def test_bad_params_name_scheduler_and_key(name, params, match):
    with pytest.raises(ValueError, match=match):
        build_lr_scheduler(name, params, make_optimizer())
