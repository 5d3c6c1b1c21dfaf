"""Meaningful ranges of the config's numbers, with one-line messages that say what to write.

Bounds beyond DeepSpeed's own (it accepts all of these and then trains silently wrong):

* ``fp16.initial_scale_power`` 0..32: the dynamic scale starts at 2**p. Above 2**32 (Megatron's
  default initial scale, the largest in common use) every extra power only costs a skipped step
  while the scaler halves its way down, and from p=128 the scale is inf in fp32, so every step is
  skipped forever. The bound limits the start only: the scaler still doubles past it when clean
  steps allow. ``fp16.loss_scale`` (static) has the same ceiling, 2**32: a static scale that
  overflows is never lowered.
* Batch sizes at most 2**31 - 1 samples (beyond every published run by orders of magnitude) and
  ``gradient_accumulation_steps`` at most 65536, given or derived: with more, the optimizer steps so
  rarely that a run of any length barely trains (``train_batch_size: 1e18`` meant one step every
  2.5e17 micro-batches).
* Integral floats (``8.0``, ``1e3``) count as integers, as everywhere in the schema (pydantic's
  lax mode); ``8.5`` is refused.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable
from typing import Any

MAX_BATCH = 2**31 - 1
MAX_GRAD_ACCUM = 2**16
MAX_SCALE_POWER = 32
MAX_LOSS_SCALE = 2.0**MAX_SCALE_POWER


def is_number(value: Any) -> bool:
    """A real number (int, float, numpy scalars in a dict config), not bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np_bool_types()))


def np_bool_types() -> tuple[type, ...]:
    numpy = sys.modules.get("numpy")  # only a dict built with numpy can hold numpy.bool_
    return (numpy.bool_,) if numpy is not None else ()


def in_range(
    low: float | None = None, high: float | None = None, *, low_open: bool = False, hint: str = ""
) -> Callable[[Any], Any]:
    """An after-validator: the value must be finite and within [low, high] (low excluded if low_open)."""
    wanted = describe_range(low, high, low_open)
    suffix = f" ({hint})" if hint else ""

    def check(value: Any) -> Any:
        if value is None:
            return value
        bad = isinstance(value, float) and not math.isfinite(value)
        bad = bad or (low is not None and (value <= low if low_open else value < low))
        bad = bad or (high is not None and value > high)
        if bad:
            raise ValueError(f"must be {wanted}{suffix}, got {value!r}")
        return value

    return check


def describe_range(low: float | None, high: float | None, low_open: bool = False) -> str:
    if low is None and high is None:
        return "a finite number"
    if low is not None and high is not None and not low_open:
        return f"from {_num(low)} to {_num(high)}"
    if low is not None and high is not None:
        return f"> {_num(low)} and <= {_num(high)}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_num(low)}"
    return f"<= {_num(high)}"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def check_grad_accum(grad_acc: int, derived_from: str) -> None:
    """Refuse a gradient_accumulation_steps (given or derived) above MAX_GRAD_ACCUM."""
    if grad_acc > MAX_GRAD_ACCUM:
        raise ValueError(
            f"gradient_accumulation_steps {grad_acc}{derived_from} is above {MAX_GRAD_ACCUM}: the optimizer "
            f"would step once every {grad_acc} micro-batches; lower train_batch_size or raise "
            "train_micro_batch_size_per_gpu"
        )


# --- optimizer.params / scheduler.params: free-form dicts, checked where a key has a known meaning ---


def _finite(low: float, low_open: bool = False) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = is_number(value) and math.isfinite(float(value)) and (value > low if low_open else value >= low)
        return None if ok else f"must be a number {'>' if low_open else '>='} {_num(low)}"

    return check


def _betas(value: Any) -> str | None:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(is_number(b) and 0.0 <= b < 1.0 for b in value)
    return None if ok else "must be exactly two numbers in [0, 1), e.g. [0.9, 0.999]"


OPTIMIZER_PARAM_RULES: dict[str, Callable[[Any], str | None]] = {
    "lr": _finite(0.0),
    "betas": _betas,
    "eps": _finite(0.0, low_open=True),
    "weight_decay": _finite(0.0),
    "momentum": _finite(0.0),
}

# Adafactor's eps is a pair (eps1, eps2) with None allowed; torch checks it.
_OWN_EPS = ("adafactor",)


def optimizer_param_problems(opt_type: str, params: dict[str, Any]) -> list[str]:
    """`optimizer.params.<key>: <rule>, got <value>` for each known key whose value is out of range."""
    problems = []
    for key, rule in OPTIMIZER_PARAM_RULES.items():
        if key not in params or (key == "eps" and str(opt_type).lower() in _OWN_EPS):
            continue
        problem = rule(params[key])
        if problem:
            problems.append(f"optimizer.params.{key}: {problem}, got {params[key]!r}")
    return problems


def _is_lr_key(key: str) -> bool:
    # warmup_min_lr, warmup_max_lr, cycle_min_lr, cycle_max_lr, lr_range_test_min_lr, torch's
    # eta_min / base_lr / max_lr, and the ratios that multiply a learning rate.
    return key.endswith("_lr") or key in ("eta_min", "warmup_min_ratio", "cos_min_ratio")


# Periods torch's schedulers divide by: 0 is a ZeroDivisionError at the first step, not at build.
_SCHEDULER_PERIODS = ("step_size", "T_max")


def scheduler_param_problems(params: dict[str, Any]) -> list[str]:
    """A learning rate a scheduler would set must be finite and >= 0 (a negative one trains uphill);
    a period it divides by must be a whole number >= 1."""
    problems = []
    rule = _finite(0.0)
    for key, value in params.items():
        if key in _SCHEDULER_PERIODS:
            whole = is_number(value) and math.isfinite(float(value)) and float(value) == int(value)
            if not (whole and value >= 1):
                problems.append(
                    f"scheduler.params.{key}: must be a whole number of steps >= 1 (the "
                    f"scheduler divides by it), got {value!r}"
                )
            continue
        if not _is_lr_key(str(key)):
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        problem = next((p for p in map(rule, values) if p), None) if values else None
        if problem:
            problems.append(f"scheduler.params.{key}: {problem} (a learning rate), got {value!r}")
    return problems
