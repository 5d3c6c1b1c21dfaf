"""Byte sizes: parsing ``24GiB`` / ``80GB`` / ``7e9`` from the command line, and printing them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,  # bare letters: binary, as in `free -g`
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}

GiB = 2**30


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """``"24GiB"`` -> 25769803776; ``"80GB"`` -> 80e9; a bare number is bytes.

    Raises ValueError naming ``what`` and the accepted spellings."""
    if isinstance(text, (int, float)):
        return int(text)
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{what}: cannot read {text!r} as a size; write e.g. 24GiB, 80GB, 512MiB "
            "(GiB = 2**30 bytes, GB = 10**9 bytes)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def parse_count(text: str | int | float, what: str = "count") -> int:
    """``"7e9"``, ``"7B"``, ``"560M"`` or ``"7000000000"`` -> a whole number of parameters."""
    if isinstance(text, (int, float)):
        return int(text)
    match = _SIZE.match(str(text))
    suffix = match.group(2).lower() if match else None
    if match is None or suffix not in _COUNT_SUFFIX:
        raise ValueError(f"{what}: cannot read {text!r} as a number of parameters; write e.g. 7e9, 7B, 560M")
    value = int(float(match.group(1)) * _COUNT_SUFFIX[suffix])
    if value <= 0:
        raise ValueError(f"{what}: must be positive, got {text!r}")
    return value
