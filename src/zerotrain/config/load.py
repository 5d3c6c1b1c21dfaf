"""Turning a dict / JSON path / argparse namespace into a validated `ZeroTrainConfig`."""

from __future__ import annotations

import argparse
import base64
import binascii
import copy
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from .errors import ConfigError, config_error, from_validation_error
from .schema import FOREIGN_SECTIONS, ZeroTrainConfig, unknown_top_level_keys

ConfigSource = dict | str | os.PathLike
_ARG_NAMES = ("deepspeed_config", "zerotrain_config", "deepscale_config")


def load_config(
    config: ConfigSource | None, args: argparse.Namespace | None = None, world_size: int = 1
) -> ZeroTrainConfig:
    """Validate a config and resolve its batch sizes for `world_size` data-parallel ranks.

    `config` is a dict, a path to a JSON file, or None to use `args.deepspeed_config` /
    `args.zerotrain_config` (see `add_config_arguments`). The caller's dict is never modified.
    Raises ConfigError for any problem, including "auto" values nobody filled in
    (use `fill_auto` or `fill_from_training_args` first).
    """
    if isinstance(config, ZeroTrainConfig):
        config = config.raw
    data = read_config(_pick_source(config, args))
    _reject_auto(data)
    try:
        return ZeroTrainConfig.model_validate(data, context={"world_size": world_size})
    except ValidationError as exc:
        raise from_validation_error(exc, ZeroTrainConfig) from None


def read_config(source: ConfigSource) -> dict[str, Any]:
    """A deep copy of a dict config, or the parsed JSON object of a path (or base64-encoded JSON)."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(source).__name__}")
    path = os.fspath(source)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            return _parse_json(handle.read(), f"config file {path}")
    decoded = _maybe_base64(path)
    if decoded is None:
        raise ConfigError(f"config file not found: {path}")
    return _parse_json(decoded, "base64-encoded config")


def _parse_json(text: str, origin: str) -> dict[str, Any]:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{origin} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} must hold a JSON object ({{...}}), got {type(data).__name__}")
    return data


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"duplicate key '{key}' in config JSON; keep only one")
        seen[key] = value
    return seen


def _maybe_base64(text: str) -> str | None:
    # DeepSpeed's launcher may hand the config over as urlsafe-base64 JSON instead of a file.
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def _pick_source(config: ConfigSource | None, args: argparse.Namespace | None) -> ConfigSource:
    from_args = _config_from_args(args)
    if config is None and from_args is None:
        raise ConfigError(
            "no config given: pass load_config(config=<dict or path to ds_config.json>), or add "
            "--deepspeed_config / --zerotrain_config via add_config_arguments(parser) and pass args"
        )
    if config is not None and from_args is not None and not _same_config(config, from_args):
        raise ConfigError(
            f"two different configs given: config={_short(config)} and "
            f"args.deepspeed_config={_short(from_args)}; pass only one"
        )
    return config if config is not None else from_args


def _config_from_args(args: argparse.Namespace | None) -> ConfigSource | None:
    if args is None:
        return None
    given = {name: getattr(args, name) for name in _ARG_NAMES if getattr(args, name, None) is not None}
    if "deepscale_config" in given:
        warnings.warn(
            "--deepscale_config is deprecated; use --deepspeed_config or --zerotrain_config",
            DeprecationWarning,
            stacklevel=3,
        )
    values = list(given.values())
    if any(not _same_config(values[0], other) for other in values[1:]):
        shown = ", ".join(f"args.{name}={_short(value)}" for name, value in given.items())
        raise ConfigError(f"conflicting config arguments: {shown}; pass only one")
    return values[0] if values else None


def _same_config(a: ConfigSource, b: ConfigSource) -> bool:
    if isinstance(a, (str, os.PathLike)) and isinstance(b, (str, os.PathLike)):
        if os.path.realpath(a) == os.path.realpath(b):
            return True
    return read_config(a) == read_config(b)


def _short(source: ConfigSource) -> str:
    return repr(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "<dict>"


def iter_leaves(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield (key path, value) for every non-container value of a nested dict (list items as [i])."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from iter_leaves(value, path + (str(key),))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from iter_leaves(value, path[:-1] + (f"{path[-1]}[{index}]",) if path else (f"[{index}]",))
    else:
        yield path, node


# Keys whose own value "auto" is a setting, not a placeholder (DeepSpeed's default).
_AUTO_ALLOWED = {("pipeline", "stages")}


def auto_keys(data: dict[str, Any]) -> list[str]:
    """Dotted keys whose value is still "auto" (sections zerotrain does not implement and unknown
    top-level keys, which validation drops or rejects, are skipped)."""
    skipped = set(FOREIGN_SECTIONS) | set(unknown_top_level_keys(data))
    return [
        ".".join(path)
        for path, value in iter_leaves(data)
        if value == "auto" and path and path[0] not in skipped and path not in _AUTO_ALLOWED
    ]


def _reject_auto(data: dict[str, Any]) -> None:
    keys = auto_keys(data)
    if keys:
        raise config_error(
            [
                f"{key} is 'auto' but no value was filled in; call fill_auto(config, {{'{key}': ...}}) "
                "or fill_from_training_args(config, ...) before load_config"
                for key in keys
            ]
        )
