"""Build the optimizer and lr scheduler named in a DeepSpeed-style config.

``build_optimizer`` follows DeepSpeed's ``_configure_basic_optimizer`` and
``build_lr_scheduler`` its ``_scheduler_from_config``; see docs/optim.md for the
differences.
"""

import difflib
import inspect

import torch
from torch.optim import lr_scheduler as torch_schedulers

from .cycle_schedules import LRRangeTest, OneCycle
from .lion import Lion
from .lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from .muon import build_muon

OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "Lion", "Muon")
DEEPSPEED_ONLY_OPTIMIZERS = ("Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "MuAdam", "MuAdamW", "MuSGD")
SCHEDULERS = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}

# Without torch_adam, DeepSpeed builds its own FusedAdam / FusedLion, whose defaults differ from
# torch.optim.AdamW's weight_decay and from our Lion's lr and beta2, so we apply theirs.
FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
FUSED_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "set_grad_none")
FUSED_LION_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}
FUSED_LION_KEYS = ("lr", "betas", "weight_decay", "set_grad_none")
# Optimizers we switch to fused kernels: these never see sparse gradients, which fused rejects.
AUTO_FUSED = (torch.optim.Adam, torch.optim.AdamW)


def build_optimizer(opt_type, opt_params, params, named_parameters=None):
    """Build the optimizer of a config's ``{"type": opt_type, "params": opt_params}`` section.

    Args:
        opt_type: Adam, AdamW, SGD, Adagrad, Lion (any case) or another torch.optim class name.
        opt_params: keyword arguments; Adam/AdamW also take ``torch_adam`` (default False)
            and ``adam_w_mode`` (default True: "Adam" means decoupled weight decay).
        params: iterable of tensors or param-group dicts.
        named_parameters: the model's ``(name, parameter)`` pairs; Muon needs them (it picks each
            parameter's half by name, zerotrain.optim.muon).

    Raises:
        ValueError: unknown type or key, ``max_grad_norm`` in params, or invalid values.
        NotImplementedError: a DeepSpeed-only optimizer such as Lamb or OneBitAdam.
    """
    kwargs = dict(opt_params or {})
    if "max_grad_norm" in kwargs:
        raise ValueError(
            "'max_grad_norm' is not an optimizer parameter; use the top-level 'gradient_clipping' config key instead"
        )
    name = _canonical_optimizer_name(opt_type)
    if name == "Muon":
        if named_parameters is None:
            raise ValueError(
                "optimizer Muon picks Muon or AdamW for each parameter by its name: build it "
                "through zerotrain.initialize (or pass named_parameters=model.named_parameters())"
            )
        return build_muon(_normalize_params(params), list(named_parameters), kwargs)
    cls, kwargs = _optimizer_spec(name, kwargs)
    params = _normalize_params(params)
    _prefer_fused(cls, kwargs, params)
    try:
        return cls(params, **_tuple_betas(kwargs))
    except (TypeError, ValueError) as err:
        raise ValueError(f"optimizer {name}: {err}") from err


def build_lr_scheduler(sched_type, sched_params, optimizer):
    """Build the scheduler of a config's ``{"type": sched_type, "params": sched_params}`` section.

    ``sched_type`` is one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest
    or a ``torch.optim.lr_scheduler`` class name; ``sched_params`` are its keyword arguments.

    Raises:
        ValueError: unknown type, unknown or missing key, or an invalid value.
    """
    cls = _scheduler_class(sched_type)
    kwargs = dict(sched_params or {})
    check_kwargs(cls, kwargs, f"scheduler {cls.__name__}")
    try:
        return cls(optimizer, **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"scheduler {cls.__name__}: {err}") from err


def check_kwargs(cls, kwargs, what, accepted=None):
    """Raise ValueError naming ``what`` and the key if ``kwargs`` does not fit.

    The keys are checked against ``accepted`` if given, else against the constructor of
    ``cls`` after its first two parameters (self and params/optimizer), whose required
    parameters must then be present.
    """
    params = [] if cls is None else list(inspect.signature(cls.__init__).parameters.values())[2:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = list(accepted) if accepted is not None else [p.name for p in params]
    for key in kwargs:
        if key not in names:
            raise ValueError(
                f"unknown parameter {key!r} for {what}; accepted: {', '.join(names)}.{suggest(key, names)}"
            )
    for p in params:
        if p.default is p.empty and p.kind is not p.VAR_POSITIONAL and p.name not in kwargs:
            raise ValueError(f"missing required parameter {p.name!r} for {what}")


def suggest(name, candidates):
    """A " Did you mean 'X'?" hint naming the closest candidate, ignoring case, or ''."""
    by_lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean {by_lower[match[0]]!r}?" if match else ""


def _public_classes(module, base):
    return {
        name: obj
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, base) and obj is not base and not name.startswith("_")
    }


def torch_optimizer_names():
    """Names of the optimizer classes in ``torch.optim``."""
    return sorted(_public_classes(torch.optim, torch.optim.Optimizer))


def torch_scheduler_names():
    """Names of the scheduler classes in ``torch.optim.lr_scheduler``."""
    return sorted(_public_classes(torch_schedulers, torch_schedulers.LRScheduler))


def _canonical_optimizer_name(opt_type):
    """Map a case-insensitive optimizer name to ours or torch.optim's spelling."""
    lowered = str(opt_type).lower()
    for name in DEEPSPEED_ONLY_OPTIMIZERS:
        if name.lower() == lowered:
            raise NotImplementedError(
                f"optimizer {name!r} is DeepSpeed-only and not available in zerotrain; "
                f"supported: {', '.join(OPTIMIZERS)} or any torch.optim optimizer"
            )
    # DeepSpeed's Muon is its own Muon+AdamW hybrid (zerotrain.optim.muon), not torch.optim.Muon.
    shadowed = {n.lower() for n in OPTIMIZERS + DEEPSPEED_ONLY_OPTIMIZERS}
    known = list(OPTIMIZERS) + [n for n in torch_optimizer_names() if n.lower() not in shadowed]
    for name in known:
        if name.lower() == lowered:
            return name
    raise ValueError(f"unknown optimizer type {opt_type!r}; supported: {', '.join(known)}.{suggest(opt_type, known)}")


def _scheduler_class(sched_type):
    known = {**SCHEDULERS, **{n: getattr(torch_schedulers, n) for n in torch_scheduler_names()}}
    if sched_type in known:
        return known[sched_type]
    for name, cls in known.items():
        if name.lower() == str(sched_type).lower():
            return cls
    raise ValueError(
        f"unknown lr scheduler type {sched_type!r}; supported: {', '.join(known)}.{suggest(sched_type, known)}"
    )


def _optimizer_spec(name, kwargs):
    """The class to build and its checked keyword arguments."""
    if name in ("Adam", "AdamW"):
        return _adam_spec(name, kwargs)
    if name == "Lion":
        what = f"optimizer {name} (DeepSpeed FusedLion parameters)"
        return Lion, _fused_kwargs(what, kwargs, FUSED_LION_DEFAULTS, FUSED_LION_KEYS)
    cls = getattr(torch.optim, name)
    check_kwargs(cls, kwargs, f"optimizer {name}")
    return cls, kwargs


def _adam_spec(name, kwargs):
    """DeepSpeed's Adam/AdamW matrix of ``torch_adam`` and ``adam_w_mode``."""
    torch_adam = kwargs.pop("torch_adam", False)
    adam_w_mode = kwargs.pop("adam_w_mode", True)
    cls = torch.optim.AdamW if name == "AdamW" or adam_w_mode else torch.optim.Adam
    if torch_adam:
        check_kwargs(cls, kwargs, f"optimizer {name} (torch_adam: torch.optim.{cls.__name__})")
        return cls, kwargs
    what = (
        f"optimizer {name} (DeepSpeed FusedAdam parameters; set torch_adam: true to pass "
        f"torch.optim.{cls.__name__} arguments)"
    )
    return cls, _fused_kwargs(what, kwargs, FUSED_ADAM_DEFAULTS, FUSED_ADAM_KEYS)


def _fused_kwargs(what, kwargs, defaults, keys):
    """Check ``kwargs`` against a DeepSpeed kernel's ``keys``; return them over its defaults."""
    check_kwargs(None, kwargs, what, keys)
    if kwargs.pop("bias_correction", True) is not True:
        raise ValueError(
            f"{what}: bias_correction=False is not supported (torch's Adam always applies bias correction)"
        )
    # zero_grad() already sets grads to None by default, and the engine owns zero_grad anyway.
    kwargs.pop("set_grad_none", None)
    return {**defaults, **kwargs}


def _tuple_betas(kwargs):
    if isinstance(kwargs.get("betas"), list):
        return {**kwargs, "betas": tuple(kwargs["betas"])}
    return kwargs


def _normalize_params(params):
    """A list of tensors / (name, tensor) pairs / group dicts, with group params as lists."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or param-group dicts, not a tensor")
    items = list(params)
    return [_normalize_group(item) if isinstance(item, dict) else item for item in items]


def _normalize_group(group):
    group = dict(group)
    group_params = group["params"]
    group["params"] = [group_params] if isinstance(group_params, torch.Tensor) else list(group_params)
    return _tuple_betas(group)


def _tensors(params):
    for item in params:
        if isinstance(item, dict):
            yield from (_tensor_of(p) for p in item["params"])
        else:
            yield _tensor_of(item)


def _tensor_of(item):
    return item[1] if isinstance(item, tuple) else item


def _fused_devices():
    from torch.utils import _foreach_utils

    return set(_foreach_utils._get_fused_kernels_supported_devices())


def _prefer_fused(cls, kwargs, params):
    """Ask for fused kernels when every param can use them and the user chose no kernel."""
    if cls not in AUTO_FUSED or kwargs.keys() & {"fused", "foreach"} or kwargs.get("differentiable"):
        return
    devices = _fused_devices()
    tensors = list(_tensors(params))
    if tensors and all(t.device.type in devices and torch.is_floating_point(t) for t in tensors):
        kwargs["fused"] = True
    # Otherwise torch picks foreach kernels itself where the device has them.
