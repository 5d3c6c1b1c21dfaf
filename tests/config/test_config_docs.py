"""docs/config.md's key table covers every key the schema accepts."""

from pathlib import Path

from pydantic import BaseModel

from zerotrain.config import ZeroTrainConfig
from zerotrain.config.fields import field_spellings

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _leaf_keys(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        annotation = info.annotation
        section = next((arg for arg in (annotation, *getattr(annotation, "__args__", ()))
                        if isinstance(arg, type) and issubclass(arg, BaseModel)), None)
        if section is not None:
            yield from _leaf_keys(section, f"{prefix}{name}.")
        else:
            yield prefix + name, [prefix + spelling for spelling in field_spellings(name, info)]


def test_every_key_is_documented():
    table = DOC.read_text()
    missing = [key for key, spellings in _leaf_keys(ZeroTrainConfig)
               if not all(f"`{s}`" in table or f"/ `{s.rsplit('.', 1)[-1]}`" in table for s in spellings)]
    assert not missing, f"add these keys to docs/config.md: {missing}"
