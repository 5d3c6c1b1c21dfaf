"""``zerotrain consolidate``: argument parsing and running (registered as a subcommand by
zerotrain.launcher.cli)."""

from __future__ import annotations

import argparse


def add_consolidate(subcommands) -> None:
    from zerotrain.checkpoint.zero_to_fp32 import add_arguments

    parser = subcommands.add_parser(
        "consolidate",
        allow_abbrev=False,
        help="write a checkpoint's whole model as state-dict files (DeepSpeed's zero_to_fp32)",
        description="Rebuild the whole model from a checkpoint's shards, one tensor at a time, "
        "without a process group or GPU, and write it as safetensors or torch.save "
        "files (sharded above --max-shard-size, with an index.json).",
    )
    add_arguments(parser)
    parser.set_defaults(run=_run_consolidate, subparser=parser)


def _run_consolidate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from zerotrain.checkpoint.zero_to_fp32 import run

    return run(args)


def add_convert_deepspeed(subcommands) -> None:
    parser = subcommands.add_parser(
        "convert-deepspeed",
        allow_abbrev=False,
        help="turn a DeepSpeed checkpoint into a zerotrain checkpoint (to continue training)",
        description="Convert a DeepSpeed 0.1x checkpoint (ZeRO stage 0-3, fp32/fp16/bf16: weights, "
        "fp32 masters, optimizer state, LR scheduler, loss scaler, counters, client "
        "state) into a zerotrain checkpoint that engine.load_checkpoint loads on any "
        "world size and stage. DeepSpeed's pickles are read with weights_only=True "
        "and an allow-list of DeepSpeed's own types; DeepSpeed need not be installed.",
    )
    parser.add_argument(
        "checkpoint_dir",
        metavar="DS_CHECKPOINT_DIR",
        help="DeepSpeed's save_dir (with 'latest'), or one tag folder of it",
    )
    parser.add_argument("output_dir", metavar="OUT_DIR", help="where to write OUT_DIR/<tag>/ and OUT_DIR/latest")
    parser.add_argument(
        "--tag",
        "-t",
        default=None,
        help="the checkpoint tag to convert (default: the one DS_CHECKPOINT_DIR/latest names)",
    )
    parser.add_argument(
        "--param-groups",
        "--param_groups",
        dest="param_groups",
        metavar="FILE.json",
        help="stage 0 only, when the optimizer groups cannot be matched by shape: a "
        "JSON list of lists of parameter names, one list per optimizer param "
        "group in the optimizer's order",
    )
    parser.set_defaults(run=_run_convert_deepspeed, subparser=parser)


def _run_convert_deepspeed(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import json
    import sys

    from zerotrain.checkpoint.deepspeed_import import convert_deepspeed_checkpoint
    from zerotrain.checkpoint.format import CheckpointError

    groups = None
    if args.param_groups is not None:
        try:
            with open(args.param_groups) as f:
                groups = json.load(f)
        except (OSError, ValueError) as error:
            parser.error(f"--param-groups: cannot read {args.param_groups}: {error}")
        if not (
            isinstance(groups, list) and all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in groups)
        ):
            parser.error(
                f"--param-groups: {args.param_groups} must hold a list of lists of parameter "
                'names, e.g. [["wte.weight", "h.0.attn.weight"], ["h.0.ln.bias"]]'
            )
    try:
        folder = convert_deepspeed_checkpoint(args.checkpoint_dir, args.output_dir, args.tag, groups)
    except CheckpointError as error:
        print(f"zerotrain convert-deepspeed: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {folder} (load it with engine.load_checkpoint({str(folder.parent)!r}))")
    return 0
