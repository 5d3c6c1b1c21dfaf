"""Unknown top-level keys warn and are dropped (DeepSpeed ignores them); strict mode makes them errors.

Nested sections stay strict either way, as DeepSpeed's are."""

import warnings

import pytest

from zerotrain.config import ConfigError, UnknownConfigKeyWarning, check_supported, load_config

BASE = {"train_batch_size": 8}


def test_unknown_top_level_key_warns_naming_it_and_the_nearest_key_and_is_dropped():
    config = {**BASE, "cuda_visible_devices": "0,1", "zero_optimisation": {"stage": 2}}
    with pytest.warns(UnknownConfigKeyWarning) as record:
        cfg = load_config(config)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert "unknown top-level config key 'cuda_visible_devices' ignored" in messages[0]
    assert "no known key is close" in messages[0]
    assert "'zero_optimisation' ignored; did you mean 'zero_optimization'?" in messages[1]
    assert all('"strict": true' in m and "ZEROTRAIN_STRICT_CONFIG=1" in m for m in messages)
    # The run goes on: the misspelled section is not applied, the rest is.
    assert cfg.zero_optimization.stage == 0 and cfg.train_batch_size == 8
    check_supported(cfg)
    assert cfg.raw == config  # the config as given is kept (for checkpoints)


def test_unknown_top_level_auto_value_is_not_reported_as_unfilled():
    with pytest.warns(UnknownConfigKeyWarning, match="my_custom_key"):
        load_config({**BASE, "my_custom_key": "auto"})


@pytest.mark.parametrize("strict", [True, "true", 1])
def test_strict_in_config_makes_unknown_top_level_keys_errors(strict):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeyWarning)
        with pytest.raises(
            ConfigError, match="unknown config key 'zero_optimisation'; did you mean 'zero_optimization'"
        ):
            load_config({**BASE, "zero_optimisation": {"stage": 2}, "strict": strict})


def test_strict_env_var_makes_unknown_top_level_keys_errors(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_STRICT_CONFIG", "1")
    with pytest.raises(ConfigError, match="unknown config key 'cuda_visible_devices'"):
        load_config({**BASE, "cuda_visible_devices": "0"})
    monkeypatch.setenv("ZEROTRAIN_STRICT_CONFIG", "0")
    with pytest.warns(UnknownConfigKeyWarning):
        load_config({**BASE, "cuda_visible_devices": "0"})


def test_strict_false_and_known_keys_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeyWarning)
        assert load_config({**BASE, "strict": False, "zero_optimization": {"stage": 1}}).strict is False


@pytest.mark.parametrize(
    "section",
    [{"zero_optimization": {"stgae": 1}}, {"fp16": {"enabeld": True}}, {"checkpoint": {"tag_valdation": "Warn"}}],
)
def test_nested_sections_stay_strict(section):
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config({**BASE, **section})
