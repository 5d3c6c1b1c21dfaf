"""The batch triple: train_batch_size = micro_batch_per_gpu * gradient_accumulation_steps * world_size."""

import pytest

from zerotrain.config import ConfigError, load_config, resolve_batch_sizes

KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@pytest.mark.parametrize(
    "given, world_size, expected",
    [
        ((32, 4, 2), 4, (32, 4, 2)),  # all three, consistent
        ((32, 4, None), 2, (32, 4, 4)),  # tb + mb -> gas
        ((32, None, 2), 4, (32, 4, 2)),  # tb + gas -> mb
        ((None, 4, 2), 3, (24, 4, 2)),  # mb + gas -> tb
        ((16, None, None), 4, (16, 4, 1)),  # tb only -> gas 1
        ((None, 4, None), 2, (8, 4, 1)),  # mb only -> gas 1
        ((8, None, None), 1, (8, 8, 1)),  # single process
    ],
)
def test_derivation(given, world_size, expected):
    config = {key: value for key, value in zip(KEYS, given) if value is not None}
    cfg = load_config(config, world_size=world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected
    assert all(type(value) is int for value in expected)


@pytest.mark.parametrize(
    "given, world_size, message",
    [
        (
            (32, 4, 2),
            2,
            "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 "
            "* world_size 2 = 16",
        ),
        (
            (32, 5, None),
            2,
            "cannot derive gradient_accumulation_steps: train_batch_size 32 is not divisible by "
            "train_micro_batch_size_per_gpu 5 * world_size 2 = 10",
        ),
        (
            (30, None, 4),
            2,
            "cannot derive train_micro_batch_size_per_gpu: train_batch_size 30 is not divisible by "
            "gradient_accumulation_steps 4 * world_size 2 = 8",
        ),
        ((2, None, None), 4, "train_batch_size 2 is not divisible by world_size 4"),
        ((4, 8, None), 1, "train_batch_size 4 is not divisible by train_micro_batch_size_per_gpu 8"),
        ((None, None, None), 1, "either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"),
        ((None, None, 4), 1, "gradient_accumulation_steps alone is not enough"),
    ],
)
def test_inconsistent(given, world_size, message):
    config = {key: value for key, value in zip(KEYS, given) if value is not None}
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    assert message in str(info.value)


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True, "2"])
def test_world_size_must_be_positive_int(world_size):
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        resolve_batch_sizes(8, None, None, world_size)
