"""`ConfigError` and the translation of pydantic's ValidationError into readable, dotted-path messages."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from .fields import field_spellings, known_keys


class ConfigError(ValueError):
    """A bad config. The message names each offending dotted key and how to fix it.

    `problems` holds one line per problem (the message joins them).
    """

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


class UnknownConfigKeyWarning(UserWarning):
    """A top-level config key zerotrain does not know was ignored (DeepSpeed ignores them too).

    Set ``"strict": true`` in the config, or ``ZEROTRAIN_STRICT_CONFIG=1``, to make it an error."""


_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean (true/false)",
    "string": "a string",
    "dict": "an object ({...})",
    "model": "an object ({...})",
    "list": "a list ([...])",
}


def from_validation_error(exc: ValidationError, root: type[BaseModel]) -> ConfigError:
    """Turn every pydantic error into one line `<dotted.key>: <problem>` and wrap them in a ConfigError."""
    problems = [_describe(err, root) for err in exc.errors()]
    return config_error(problems)


def config_error(problems: list[str]) -> ConfigError:
    """A ConfigError listing `problems`; a single problem is the whole message."""
    if len(problems) == 1:
        return ConfigError(problems[0], problems)
    return ConfigError("invalid config:\n" + "\n".join(f"  - {p}" for p in problems), problems)


def dotted(loc: Iterable[Any]) -> str:
    """('zero_optimization', 'stage') -> 'zero_optimization.stage'; list indices become [i]."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(err: dict[str, Any], root: type[BaseModel]) -> str:
    loc, kind = tuple(err["loc"]), err["type"]
    key = dotted(loc)
    if kind == "extra_forbidden":
        return _unknown_key(loc, root)
    if kind == "missing":
        return f"'{key}' is required"
    problem = _problem(kind, err)
    return f"{key}: {problem}" if key else problem


def _problem(kind: str, err: dict[str, Any]) -> str:
    value, ctx = err.get("input"), err.get("ctx") or {}
    got = f"got {value!r} ({type(value).__name__})"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", err["msg"]))
    family = kind.split("_")[0]
    if kind.endswith(("_type", "_parsing")) or kind == "int_from_float":
        what = _EXPECTED.get(family, kind)
        if kind == "int_from_float":
            what = "a whole number"
        return f"expected {what}, {got}"
    if kind == "literal_error":
        return f"expected one of {ctx.get('expected')}, {got}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return f"must be {bounds[kind]} {limit}, {got}"
    return f"{err['msg']}, {got}"


def _unknown_key(loc: tuple[Any, ...], root: type[BaseModel]) -> str:
    key, name = dotted(loc), loc[-1]
    model = model_at(root, loc[:-1])
    choices = known_keys(model) if model is not None else []
    match = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.6)
    if match:
        return f"unknown config key '{key}'; did you mean '{match[0]}'?"
    if not choices or len(choices) > 20:
        return f"unknown config key '{key}'; docs/config.md lists the valid keys"
    where = f"under '{dotted(loc[:-1])}'" if len(loc) > 1 else "at the top level"
    return f"unknown config key '{key}'; valid keys {where}: {', '.join(sorted(choices))}"


def model_at(root: type[BaseModel], loc: Iterable[Any]) -> type[BaseModel] | None:
    """The section model that validates the object at `loc` (None if it is not a section)."""
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        field = next((info for name, info in model.model_fields.items() if part in field_spellings(name, info)), None)
        model = _section_type(field.annotation) if field is not None else None
    return model


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_type(arg)
        if found is not None:
            return found
    return None
