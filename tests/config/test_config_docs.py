"""docs/config.md's key table covers every key the schema accepts, and each row's status is true.

A row reads `| key | default | status | checked with |`. The "checked with" value is applied at
the key (merged into the config after "with"): for a "raises" row `check_supported` must raise
naming the key; for a "done" or "no effect" row the config must load and pass, with the value
really parsed into the key.
"""

import copy
import json
import re
import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel

from zerotrain.config import ConfigError, ZeroTrainConfig, check_supported, load_config
from zerotrain.config.fields import field_spellings

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
BASE = {"train_batch_size": 8}
STATUSES = ("done", "raises if ", "no effect: ")


def _leaf_keys(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        annotation = info.annotation
        section = next(
            (
                arg
                for arg in (annotation, *getattr(annotation, "__args__", ()))
                if isinstance(arg, type) and issubclass(arg, BaseModel)
            ),
            None,
        )
        if section is not None:
            yield from _leaf_keys(section, f"{prefix}{name}.")
        else:
            yield prefix + name, [prefix + spelling for spelling in field_spellings(name, info)]


def _rows():
    """(key, status, value, extra) for every row of the 'Every key' table."""
    text = DOC.read_text().split("## Every key", 1)[1]
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        assert len(cells) == 4, f"a row needs 4 cells (key, default, status, checked with): {line}"
        key = re.match(r"`([^`]+)`", cells[0]).group(1)
        probe = re.fullmatch(r"`(.+?)`(?: with `(.+)`)?", cells[3])
        assert probe, f"'checked with' of {key} must be `JSON` or `JSON` with `JSON`: {cells[3]!r}"
        value = json.loads(probe.group(1))
        extra = json.loads(probe.group(2)) if probe.group(2) else {}
        rows.append((key, cells[2], value, extra))
    return rows


ROWS = _rows()


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _config(key: str, value, extra: dict) -> dict:
    nested = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    return _merge(_merge(BASE, extra), nested)


def _parsed(cfg, key: str):
    node = cfg
    for part in key.split("."):
        if node is None:
            return None
        node = node.get(part) if isinstance(node, dict) else getattr(node, part)
    return node


def test_every_key_is_documented():
    table = DOC.read_text()
    missing = [
        key
        for key, spellings in _leaf_keys(ZeroTrainConfig)
        if not all(f"`{s}`" in table or f"/ `{s.rsplit('.', 1)[-1]}`" in table for s in spellings)
    ]
    assert not missing, f"add these keys to docs/config.md: {missing}"


def test_one_row_per_schema_key():
    schema = {key for key, _ in _leaf_keys(ZeroTrainConfig)}
    documented = [key for key, *_ in ROWS]
    assert len(documented) == len(set(documented)), "a key has two rows"
    assert set(documented) == schema, (
        f"rows without a schema key: {sorted(set(documented) - schema)}; "
        f"schema keys without a row: {sorted(schema - set(documented))}"
    )


@pytest.mark.parametrize("key, status, value, extra", ROWS, ids=[row[0] for row in ROWS])
def test_row_status_is_true(key, status, value, extra):
    assert status.startswith(STATUSES), f"{key}: status must start with one of {STATUSES}, got {status!r}"
    config = _config(key, value, extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated spellings, untested-optimizer notes
        if status.startswith("raises if "):
            with pytest.raises((NotImplementedError, ConfigError)) as info:
                check_supported(load_config(config))
            named = re.search(re.escape(key) + r"(?!\w)", str(info.value))
            assert named, f"the error for {key}={value!r} does not name the key:\n{info.value}"
            return
        cfg = load_config(config)
        check_supported(cfg)
    # The value reached the parsed config: it differs from what the config without it gives.
    without = load_config(_merge(BASE, extra))
    assert _parsed(cfg, key) != _parsed(without, key), (
        f"{key}: checked value {value!r} gives the default, so the row checks nothing"
    )
