"""check_zero_optimizer: `zero_allow_untested_optimizer` and optimizers that need whole parameters."""

import warnings

import pytest
import torch

from zerotrain.config import ConfigError, check_zero_optimizer, load_config
from zerotrain.optim.lion import Lion

BASE = {"train_batch_size": 8}
PARAMS = [torch.nn.Parameter(torch.zeros(4, 3))]


def _cfg(stage=1, allow=False, **extra):
    return load_config({**BASE, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": allow, **extra})


class TrustRatioSGD(torch.optim.SGD):
    """A LARS-like subclass: its step would compute a norm per shard, not per parameter."""


class MyLamb(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


ELEMENTWISE = [
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Rprop,
    torch.optim.ASGD,
    Lion,
]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_elementwise_optimizers_pass_at_every_zero_stage(stage):
    cfg = _cfg(stage)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cls in ELEMENTWISE:
            check_zero_optimizer(cfg, cls(PARAMS, lr=0.1))


@pytest.mark.parametrize(
    "extra",
    [
        {"zero_optimization": {"stage": 1}},
        {"zero_optimization": {"stage": 3}},
        {"bf16": {"enabled": True}},
        {"fp16": {"enabled": True}},
    ],
)
def test_unknown_optimizer_is_refused_naming_the_key_where_shards_are_flat(extra):
    cfg = load_config({**BASE, **extra})
    for optimizer in (TrustRatioSGD(PARAMS, lr=0.1), MyLamb(PARAMS)):
        with pytest.raises(ConfigError) as info:
            check_zero_optimizer(cfg, optimizer)
        message = str(info.value)
        assert type(optimizer).__qualname__ in message and '"zero_allow_untested_optimizer": true' in message


def test_allow_untested_optimizer_lets_an_unknown_one_run_with_a_warning():
    with pytest.warns(UserWarning, match="zero_allow_untested_optimizer: .*MyLamb"):
        check_zero_optimizer(_cfg(2, allow=True), MyLamb(PARAMS))


def test_stage0_fp32_takes_any_optimizer():
    # Stage 0 in fp32 steps the model's own parameters: nothing is flattened.
    cfg = _cfg(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for optimizer in (MyLamb(PARAMS), torch.optim.LBFGS(PARAMS), torch.optim.Adafactor(PARAMS)):
            check_zero_optimizer(cfg, optimizer)


@pytest.mark.parametrize("allow", [False, True])
def test_shape_dependent_optimizers_are_refused_even_when_allowed(allow):
    for optimizer in (torch.optim.Adafactor(PARAMS), torch.optim.LBFGS(PARAMS)):
        with pytest.raises(ConfigError, match=f"{type(optimizer).__name__} updates depend on each parameter"):
            check_zero_optimizer(_cfg(2, allow=allow), optimizer)


def test_no_optimizer_passes():
    check_zero_optimizer(_cfg(3), None)
