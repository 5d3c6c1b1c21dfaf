"""Filling `"auto"` config values, the Hugging Face Trainer / accelerate convention.

DeepSpeed itself never resolves "auto"; transformers' HfTrainerDeepSpeedConfig does, from the
TrainingArguments. `fill_from_training_args` applies the same mapping; `fill_auto` fills any keys.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from typing import Any

from .batch import GAS, MB, TB
from .errors import ConfigError
from .load import ConfigSource, read_config
from .zero import STAGE3_ALIASES

AUTO = "auto"
_TOP_ALIASES = {"bf16": "bfloat16", "bfloat16": "bf16"}
_ZERO_ALIASES = {**STAGE3_ALIASES, **{v: k for k, v in STAGE3_ALIASES.items()}}


def fill_auto(config: ConfigSource, values: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of `config` with each "auto" at a dotted key of `values` replaced by its value.

    Keys that are absent or not "auto" are left alone. Both spellings of aliased keys match
    (`zero_optimization.stage3_prefetch_bucket_size` / `prefetch_bucket_size`, `bf16` / `bfloat16`).
    """
    data = read_config(config)
    for key, value in values.items():
        spot = _locate(data, key)
        if spot is not None and spot[0][spot[1]] == AUTO:
            spot[0][spot[1]] = copy.deepcopy(value)
    return data


def fill_from_training_args(
    config: ConfigSource,
    *,
    world_size: int,
    per_device_train_batch_size: int | None = None,
    gradient_accumulation_steps: int | None = None,
    learning_rate: float | None = None,
    adam_beta1: float | None = None,
    adam_beta2: float | None = None,
    adam_epsilon: float | None = None,
    weight_decay: float | None = None,
    max_grad_norm: float | None = None,
    warmup_steps: int | None = None,
    num_training_steps: int | None = None,
    hidden_size: int | None = None,
    fp16: bool | None = None,
    bf16: bool | None = None,
) -> dict[str, Any]:
    """Fill "auto" values from Trainer-style arguments, exactly as transformers' DeepSpeed integration does.

    Arguments left as None fill nothing. A config value that is not "auto" and disagrees with a
    given argument is a mismatch; all mismatches raise one ConfigError. Returns a new dict.
    train_batch_size is world_size * micro batch * accumulation steps (each taken from the argument,
    else from the config); hidden_size H gives reduce_bucket_size H*H,
    stage3_prefetch_bucket_size int(0.9*H*H) and stage3_param_persistence_threshold 10*H.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    data = read_config(config)
    micro = _int_or_none(per_device_train_batch_size, data.get(MB))
    accum = _int_or_none(gradient_accumulation_steps, data.get(GAS))
    total = None if micro is None or accum is None else world_size * micro * accum
    square = None if hidden_size is None else hidden_size * hidden_size
    plan = [  # (config key, value, argument it came from or None for fill-only)
        (MB, per_device_train_batch_size, "per_device_train_batch_size"),
        (GAS, gradient_accumulation_steps, "gradient_accumulation_steps"),
        (TB, total, f"world_size*micro_batch*accumulation_steps ({world_size}*{micro}*{accum})"),
        ("gradient_clipping", max_grad_norm, "max_grad_norm"),
        ("optimizer.params.lr", learning_rate, "learning_rate"),
        ("optimizer.params.betas", _pair(adam_beta1, adam_beta2), "adam_beta1+adam_beta2"),
        ("optimizer.params.eps", adam_epsilon, "adam_epsilon"),
        ("optimizer.params.weight_decay", weight_decay, "weight_decay"),
        ("scheduler.params.warmup_min_lr", 0, None),
        ("scheduler.params.warmup_max_lr", learning_rate, "learning_rate"),
        # DeepSpeed >= 0.19.6 rejects warmup_num_steps <= 0; transformers clamps to 1 the same way.
        ("scheduler.params.warmup_num_steps", None if warmup_steps is None else max(1, warmup_steps), "warmup_steps"),
        ("scheduler.params.total_num_steps", num_training_steps, "num_training_steps"),
        ("fp16.enabled", fp16, "fp16"),
        ("bf16.enabled", bf16, "bf16"),
        ("zero_optimization.reduce_bucket_size", square, None),
        ("zero_optimization.stage3_prefetch_bucket_size", None if square is None else int(0.9 * square), None),
        ("zero_optimization.stage3_param_persistence_threshold", None if square is None else 10 * hidden_size, None),
    ]
    lines = (_fill_one(data, key, value, source) for key, value, source in plan if value is not None)
    mismatches = [line for line in lines if line]
    if mismatches:
        raise ConfigError(
            "config values disagree with the training arguments:\n"
            + "\n".join(mismatches)
            + '\nSet these config values to "auto" to take them from the arguments, '
            "or make both agree.",
            mismatches,
        )
    return data


def _fill_one(data: dict[str, Any], key: str, value: Any, source: str | None) -> str | None:
    """Fill `key` if it is "auto"; return a mismatch line if it disagrees with a matched argument."""
    spot = _locate(data, key)
    if spot is None:
        return None
    parent, name = spot
    current = parent[name]
    if current == AUTO:
        parent[name] = copy.deepcopy(value)
        return None
    if source is None or current is None or _same(current, value):
        return None
    return f"- ds {key}={_show(current)} vs {source}={_show(value)}"


def _locate(data: dict[str, Any], dotted: str) -> tuple[dict[str, Any], str] | None:
    """(parent dict, key as spelled in the config) for a dotted key, trying alias spellings; None if absent."""
    node: Any = data
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, dict):
            return None
        aliases = _TOP_ALIASES if depth == 0 else _ZERO_ALIASES if parts[0] == "zero_optimization" else {}
        spelled = part if part in node else aliases.get(part)
        if spelled not in node:
            return None
        if depth == len(parts) - 1:
            return node, spelled
        node = node[spelled]
    return None


def _int_or_none(argument: int | None, configured: Any) -> int | None:
    if argument is not None:
        return argument
    if isinstance(configured, (int, float)) and not isinstance(configured, bool):
        return int(configured)
    return None


def _pair(first: float | None, second: float | None) -> list[float] | None:
    return None if first is None or second is None else [first, second]


def _same(configured: Any, wanted: Any) -> bool:
    if isinstance(wanted, bool):
        return _as_bool(configured) == wanted
    if isinstance(wanted, (list, tuple)):
        return (
            isinstance(configured, (list, tuple))
            and len(configured) == len(wanted)
            and all(_same(c, w) for c, w in zip(configured, wanted))
        )
    if isinstance(wanted, (int, float)) and isinstance(configured, (int, float)) and not isinstance(configured, bool):
        return math.isclose(configured, wanted, rel_tol=1e-9, abs_tol=0.0)
    return configured == wanted


def _as_bool(value: Any) -> Any:
    # Configs in the wild write "enabled": "true"; compare such strings as the booleans they mean.
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def resolve_unfilled_auto(config: dict[str, Any], model: Any = None) -> tuple[dict[str, Any], list[str]]:
    """Give every "auto" nobody filled the value a user would want for `model`, as `initialize` does.

    Frameworks hand `initialize` configs with "auto" left in (TRL's reference model gets the
    accelerate plugin's config before transformers fills the model-dependent values). Returns a
    new dict and one line per resolved key, for the caller to log:
    - the bucket sizes come from the model's hidden size H as transformers fills them (H*H,
      int(0.9*H*H), 10*H);
    - a top-level dotted key (`"zero_optimization.reduce_bucket_size": 4096`, which TRL writes meaning
      the nested key) is dropped, and fills that nested "auto" where the model gives no value;
      without either the bucket sizes take their defaults;
    - `fp16.enabled` / `bf16.enabled` follow the model's parameters' dtype;
    - any other "auto" is dropped, so the field takes its default (DeepSpeed's behaviour); batch sizes
      are then derived by the batch rule, which still raises when they cannot be.
    """
    data = read_config(config)
    lines: list[str] = []
    dotted: dict[str, Any] = {}  # canonical nested key -> the top-level dotted key's value
    for key in [k for k in data if "." in k and k.split(".", 1)[0] in data]:
        dotted[_canonical(key)] = data.pop(key)
        lines.append(f"top-level key '{key}' read as the nested key it names")
    from .load import auto_keys  # load imports this module

    derived = _derived_values(model)
    for key in auto_keys(data):
        parent, name = _locate_leaf(data, key)
        canonical = _canonical(key)
        # The model's own value first: TRL writes 0.9*H*H unrounded, transformers int(0.9*H*H).
        if derived.get(canonical) is not None:
            parent[name] = derived[canonical]
            lines.append(f"{key}={_show(parent[name])} (from the model)")
        elif canonical in dotted:
            parent[name] = _whole_if_integral(dotted[canonical])
            lines.append(f"{key}={_show(parent[name])} (from the top-level key)")
        else:
            del parent[name]
            lines.append(f"{key}: its default (nothing filled the 'auto')")
    return data, lines


def _whole_if_integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _derived_values(model: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    hidden = _hidden_size(model)
    if hidden is not None:
        values.update(
            {
                "zero_optimization.reduce_bucket_size": hidden * hidden,
                "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
            }
        )
    dtype = _parameter_dtype(model)
    if dtype is not None:
        import torch

        values["fp16.enabled"] = dtype == torch.float16
        values["bf16.enabled"] = dtype == torch.bfloat16
    return values


def _hidden_size(model: Any) -> int | None:
    """transformers' choice: the largest of `config.hidden_sizes`, else `config.hidden_size`."""
    model_config = getattr(model, "config", None)
    sizes = getattr(model_config, "hidden_sizes", None)
    size = max(sizes) if sizes else getattr(model_config, "hidden_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _parameter_dtype(model: Any) -> Any:
    parameters = getattr(model, "parameters", None)
    if parameters is None:
        return None
    for parameter in parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return None


def _canonical(dotted: str) -> str:
    """One spelling per key: `bfloat16` -> `bf16`, stage-3 aliases -> their `stage3_` names."""
    parts = dotted.split(".")
    if parts[0] == "bfloat16":
        parts[0] = "bf16"
    if parts[0] == "zero_optimization" and len(parts) == 2:
        parts[1] = STAGE3_ALIASES.get(parts[1], parts[1])
    return ".".join(parts)


def _locate_leaf(data: dict[str, Any], dotted: str) -> tuple[Any, Any]:
    """(container, key or index) of a key path as `auto_keys` spells it (`a.b[2]` for list items)."""
    node: Any = data
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        name, _, index = part.partition("[")
        if depth == len(parts) - 1 and not index:
            return node, name
        node = node[name]
        if index:
            position = int(index.rstrip("]"))
            if depth == len(parts) - 1:
                return node, position
            node = node[position]
    raise KeyError(dotted)
