"""Passing a config: dict, path, base64, argparse flags (add_config_arguments)."""

import argparse
import base64
import json

import pytest

from zerotrain.config import ConfigError, add_config_arguments, load_config

CONFIG = {"train_batch_size": 8, "gradient_clipping": 0.5}


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def _parse(argv):
    return add_config_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_defaults():
    args = _parse([])
    assert (args.deepspeed, args.zerotrain, args.deepspeed_config, args.deepscale, args.deepscale_config) == (
        False,
        False,
        None,
        False,
        None,
    )


@pytest.mark.parametrize("flag", ["--deepspeed_config", "--zerotrain_config"])
def test_config_flags_share_one_dest(flag):
    args = _parse(["--deepspeed", flag, "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    assert not hasattr(args, "zerotrain_config")


def test_zerotrain_and_deprecated_flags():
    args = _parse(["--zerotrain", "--deepscale", "--deepscale_config", "old.json"])
    assert args.zerotrain and args.deepscale and args.deepscale_config == "old.json"


def test_returns_the_parser_with_a_group():
    parser = argparse.ArgumentParser()
    assert add_config_arguments(parser) is parser
    assert any(group.title == "zerotrain" for group in parser._action_groups)


def test_load_from_path_and_pathlike(config_path):
    assert load_config(str(config_path)).gradient_clipping == 0.5
    assert load_config(config_path, world_size=2).train_micro_batch_size_per_gpu == 4


def test_load_from_args(config_path):
    cfg = load_config(None, args=_parse(["--deepspeed_config", str(config_path)]), world_size=4)
    assert cfg.train_micro_batch_size_per_gpu == 2


def test_load_from_plain_namespace_zerotrain_config(config_path):
    cfg = load_config(None, args=argparse.Namespace(zerotrain_config=str(config_path)))
    assert cfg.gradient_clipping == 0.5


def test_deprecated_deepscale_config(config_path):
    with pytest.warns(DeprecationWarning, match="deepscale_config"):
        cfg = load_config(None, args=_parse(["--deepscale_config", str(config_path)]))
    assert cfg.train_batch_size == 8


def test_same_config_twice_is_fine(config_path):
    args = _parse(["--deepspeed_config", str(config_path)])
    assert load_config(str(config_path), args=args).train_batch_size == 8
    assert load_config(dict(CONFIG), args=args).train_batch_size == 8


def test_different_configs_conflict(config_path):
    args = _parse(["--deepspeed_config", str(config_path)])
    with pytest.raises(ConfigError, match="two different configs given"):
        load_config({"train_batch_size": 16}, args=args)


def test_conflicting_namespace_attributes(config_path, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"train_batch_size": 4}))
    args = argparse.Namespace(deepspeed_config=str(config_path), zerotrain_config=str(other))
    with pytest.raises(ConfigError, match="conflicting config arguments"):
        load_config(None, args=args)


@pytest.mark.parametrize("args", [None, argparse.Namespace(), argparse.Namespace(deepspeed_config=None)])
def test_no_config_at_all(args):
    with pytest.raises(ConfigError, match="no config given: pass load_config"):
        load_config(None, args=args)


def test_base64_config():
    encoded = base64.urlsafe_b64encode(json.dumps(CONFIG).encode()).decode()
    assert load_config(encoded).gradient_clipping == 0.5
