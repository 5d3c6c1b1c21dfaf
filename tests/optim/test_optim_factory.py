"""build_optimizer: DeepSpeed's optimizer names, defaults and errors."""

import pytest
import torch

from zerotrain.optim import Lion, build_optimizer, factory


def params(count=2):
    return [torch.nn.Parameter(torch.randn(3)) for _ in range(count)]


# (type, extra params) -> (class, weight_decay default): DeepSpeed 0.19's Adam matrix.
ADAM_MATRIX = [
    ("Adam", {}, torch.optim.AdamW, 0.0),
    ("Adam", {"adam_w_mode": True}, torch.optim.AdamW, 0.0),
    ("Adam", {"adam_w_mode": False}, torch.optim.Adam, 0.0),
    ("Adam", {"torch_adam": True}, torch.optim.AdamW, 0.01),
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, 0.0),
    ("AdamW", {}, torch.optim.AdamW, 0.0),
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW, 0.0),
    ("AdamW", {"torch_adam": True}, torch.optim.AdamW, 0.01),
    ("adamw", {"torch_adam": True, "adam_w_mode": False}, torch.optim.AdamW, 0.01),
]


@pytest.mark.parametrize("opt_type, extra, cls, weight_decay", ADAM_MATRIX)
def test_adam_mode_matrix(opt_type, extra, cls, weight_decay):
    optimizer = build_optimizer(opt_type, extra, params())
    assert type(optimizer) is cls
    defaults = optimizer.defaults
    assert (defaults["lr"], defaults["betas"], defaults["eps"]) == (1e-3, (0.9, 0.999), 1e-8)
    assert defaults["weight_decay"] == weight_decay
    assert "torch_adam" not in defaults and "adam_w_mode" not in defaults


def test_adam_hyperparameters_and_json_list_betas():
    config = {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    optimizer = build_optimizer("Adam", config, params())
    assert {k: optimizer.defaults[k] for k in config} == {**config, "betas": (0.8, 0.95)}
    assert config["betas"] == [0.8, 0.95]  # caller's dict untouched
    loss = sum((p**2).sum() for group in optimizer.param_groups for p in group["params"])
    loss.backward()
    optimizer.step()


def test_fused_adam_keys_only_without_torch_adam():
    built = build_optimizer("Adam", {"bias_correction": True, "set_grad_none": True, "amsgrad": True}, params())
    assert built.defaults["amsgrad"] is True
    with pytest.raises(ValueError, match="bias_correction"):
        build_optimizer("Adam", {"bias_correction": False}, params())
    with pytest.raises(ValueError, match="'maximize'.*Adam.*torch_adam"):
        build_optimizer("Adam", {"maximize": True}, params())
    assert build_optimizer("Adam", {"torch_adam": True, "maximize": True}, params()).defaults["maximize"]


def test_fused_kernels_when_every_param_supports_them(monkeypatch):
    assert build_optimizer("AdamW", {}, params()).defaults["fused"] is True
    explicit = build_optimizer("Adam", {"torch_adam": True, "foreach": True}, params())
    assert explicit.defaults["fused"] is None and explicit.defaults["foreach"] is True
    monkeypatch.setattr(factory, "_fused_devices", lambda: {"cuda"})
    assert build_optimizer("AdamW", {}, params()).defaults["fused"] is None


def test_no_fused_for_optimizers_that_take_sparse_gradients():
    sgd = build_optimizer("SGD", {"lr": 0.1}, params())
    assert sgd.defaults["fused"] is None


@pytest.mark.parametrize(
    "opt_type, cls, expected",
    [
        ("SGD", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        ("sgd", torch.optim.SGD, {"lr": 0.1}),
        ("Adagrad", torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-10}),
        ("ADAGRAD", torch.optim.Adagrad, {}),
        ("RMSprop", torch.optim.RMSprop, {"alpha": 0.9}),
        ("rmsprop", torch.optim.RMSprop, {}),
    ],
)
def test_torch_optimizers(opt_type, cls, expected):
    optimizer = build_optimizer(opt_type, dict(expected), params())
    assert type(optimizer) is cls
    assert {k: optimizer.defaults[k] for k in expected} == expected
    if cls is torch.optim.Adagrad and not expected:
        assert optimizer.defaults["lr"] == 0.01  # torch's default, as DeepSpeed passes straight through


def test_lion_uses_deepspeed_fused_lion_defaults():
    optimizer = build_optimizer("Lion", {}, params())
    assert type(optimizer) is Lion
    assert {k: optimizer.defaults[k] for k in ("lr", "betas", "weight_decay")} == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "weight_decay": 0.0,
    }
    tuned = build_optimizer("lion", {"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}, params())
    assert tuned.defaults["betas"] == (0.95, 0.98) and tuned.defaults["weight_decay"] == 0.1
    with pytest.raises(ValueError, match="'eps'.*Lion"):
        build_optimizer("Lion", {"eps": 1e-8}, params())


def test_param_groups_and_generators():
    groups = [{"params": iter(params()), "lr": 0.1, "betas": [0.5, 0.6]}, {"params": params(1)[0]}]
    optimizer = build_optimizer("Adam", {"lr": 0.01}, groups)
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.01]
    assert optimizer.param_groups[0]["betas"] == (0.5, 0.6)
    assert len(optimizer.param_groups[0]["params"]) == 2
    assert len(build_optimizer("SGD", {}, (p for p in params(3))).param_groups[0]["params"]) == 3


def test_unknown_type_suggests_and_lists():
    with pytest.raises(ValueError) as info:
        build_optimizer("Adamm", {}, params())
    message = str(info.value)
    assert "'Adamm'" in message and "Did you mean 'Adam'" in message
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "Lion", "RMSprop"):
        assert name in message


@pytest.mark.parametrize(
    "name", ["Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "MuAdam", "MuAdamW", "MuSGD", "onebitadam"]
)
def test_deepspeed_only_optimizers_not_implemented(name):
    with pytest.raises(NotImplementedError, match=f"(?i){name}"):
        build_optimizer(name, {}, params())


@pytest.mark.parametrize(
    "opt_type, bad", [("Adam", "momentum"), ("SGD", "betas"), ("Adagrad", "momentum"), ("Adam", "torch_adamw")]
)
def test_unknown_key_names_key_and_optimizer(opt_type, bad):
    with pytest.raises(ValueError, match=f"'{bad}'.*{opt_type}"):
        build_optimizer(opt_type, {bad: 1}, params())


def test_unknown_key_suggestion():
    with pytest.raises(ValueError, match="Did you mean 'weight_decay'"):
        build_optimizer("SGD", {"weight_decy": 0.1}, params())


@pytest.mark.parametrize("opt_type", ["Adam", "SGD", "Lion"])
def test_max_grad_norm_points_to_gradient_clipping(opt_type):
    with pytest.raises(ValueError, match="gradient_clipping"):
        build_optimizer(opt_type, {"max_grad_norm": 1.0}, params())


def test_invalid_values_raise_value_error_naming_optimizer():
    with pytest.raises(ValueError, match="SGD"):
        build_optimizer("SGD", {"lr": -1.0}, params())
    with pytest.raises(ValueError, match="Adam"):
        build_optimizer("Adam", {"betas": [0.9, 1.5]}, params())
