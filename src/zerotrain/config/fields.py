"""Shared building blocks for the config section models: the base class and value types."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field

from .ranges import MAX_BATCH, MAX_GRAD_ACCUM, in_range


class Section(BaseModel):
    """Base of every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


def _reject_bool(value: Any) -> Any:
    # pydantic happily turns True into 1; in a config that is almost always a mistake.
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r} (bool)")
    return value


def lower(value: Any) -> Any:
    """Before-validator for case-insensitive choices."""
    return value.lower() if isinstance(value, str) else value


def _whole(value: Any) -> Any:
    # An integral float (8.0, 1e3: what JSON writers and YAML emit) is that integer, as pydantic's
    # lax mode has it, however large (pydantic refuses 1e30 with a parser message instead), so
    # range checks report the number.
    value = _reject_bool(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_whole)]
Float = Annotated[float, BeforeValidator(_reject_bool)]
NonNegInt = Annotated[int, Field(ge=0), BeforeValidator(_whole)]
PosInt = Annotated[int, Field(gt=0), BeforeValidator(_whole)]
LowerStr = Annotated[str, BeforeValidator(lower)]
#: a float that must also be finite (no inf / NaN)
FiniteFloat = Annotated[float, BeforeValidator(_reject_bool), AfterValidator(in_range())]
#: a batch size in samples: 1..2**31-1 (ranges.py says why)
BatchSize = Annotated[
    int, Field(gt=0), BeforeValidator(_whole), AfterValidator(in_range(1, MAX_BATCH, hint="a batch size in samples"))
]
#: gradient accumulation steps: 1..65536
GradAccum = Annotated[
    int,
    Field(gt=0),
    BeforeValidator(_whole),
    AfterValidator(in_range(1, MAX_GRAD_ACCUM, hint="micro-batches per optimizer step")),
]


def steps_or_never(value: Any) -> Any:
    """`steps_per_print`-style values: accelerate passes float('inf') to mean "never"."""
    if isinstance(value, float) and math.isinf(value) and value > 0:
        return None
    return value


def aliased(default: Any, name: str, alias: str, **kwargs: Any) -> Any:
    """A field that accepts both `name` and `alias` as its JSON key (errors report the spelling used)."""
    return Field(default, validation_alias=AliasChoices(name, alias), **kwargs)


def reject_both_spellings(data: Any, pairs: dict[str, str]) -> None:
    """Raise if a mapping holds both spellings of one key (pydantic would call the second one unknown)."""
    if not isinstance(data, dict):
        return
    for name, alias in pairs.items():
        if name in data and alias in data:
            raise ValueError(f"both '{alias}' and '{name}' are given; they are the same setting, keep one")


def field_spellings(name: str, info: Any) -> list[str]:
    """The JSON keys accepted for one field: its name, or its alias choices."""
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    return [alias] if isinstance(alias, str) else [name]


def known_keys(model: type[BaseModel]) -> list[str]:
    """All JSON keys a section model accepts: field names plus their alias spellings."""
    return [key for name, info in model.model_fields.items() for key in field_spellings(name, info)]
