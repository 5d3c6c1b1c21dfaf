"""Command-line flags for passing a config, DeepSpeed-compatible (`deepspeed.add_config_arguments`)."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the config flags to `parser` and return it.

    --deepspeed / --zerotrain are plain flags for user code; --deepspeed_config and
    --zerotrain_config both store the config path in `args.deepspeed_config` (what load_config
    reads). --deepscale / --deepscale_config are DeepSpeed's deprecated spellings.
    """
    group = parser.add_argument_group("zerotrain", "zerotrain / DeepSpeed configuration")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable zerotrain (DeepSpeed spelling; for user code, the engine does not read it)",
    )
    group.add_argument(
        "--zerotrain",
        default=False,
        action="store_true",
        help="enable zerotrain (for user code, the engine does not read it)",
    )
    group.add_argument(
        "--deepspeed_config",
        "--zerotrain_config",
        dest="deepspeed_config",
        default=None,
        type=str,
        metavar="PATH",
        help="path to the JSON config (ds_config.json)",
    )
    group.add_argument(
        "--deepscale", default=False, action="store_true", help="deprecated: use --deepspeed or --zerotrain"
    )
    group.add_argument(
        "--deepscale_config",
        default=None,
        type=str,
        metavar="PATH",
        help="deprecated: use --deepspeed_config or --zerotrain_config",
    )
    return parser
