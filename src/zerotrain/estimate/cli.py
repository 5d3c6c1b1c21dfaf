"""``zerotrain estimate``: argument parsing and output (tables, ``--json``, ``--plot``,
``--write-config``). The launcher's ``zerotrain`` command dispatches here."""

from __future__ import annotations

import argparse
import json
import sys

from zerotrain.estimate.units import parse_bytes, parse_count


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (one of)")
    source = model.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    source.add_argument("--params", metavar="N", help="parameter count, e.g. 7e9, 7B, 560M")
    source.add_argument(
        "--model",
        metavar="PKG.MOD:FN",
        help="a function building the model (called on the meta device: no memory used)",
    )
    model.add_argument("--layers", type=int, help="with --params: transformer layers (for activations)")
    model.add_argument("--hidden", type=int, help="with --params: hidden size")
    model.add_argument("--heads", type=int, help="with --params: attention heads")
    model.add_argument("--vocab", type=int, help="with --params: vocabulary size")
    model.add_argument("--largest-layer", metavar="N", help="with --params: largest layer's parameters")
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--num-gpus", type=int, default=1, help="GPUs (ranks) per node (default 1)")
    hw.add_argument("--num-nodes", type=int, default=1, help="nodes (default 1)")
    hw.add_argument(
        "--gpu-memory", metavar="SIZE", help="memory per GPU, e.g. 24GiB or 80GB (default: this machine's GPU, if any)"
    )
    hw.add_argument("--cpu-memory", metavar="SIZE", help="host memory per node, e.g. 60GiB (default: not judged)")
    hw.add_argument(
        "--gpu-reserve",
        metavar="SIZE",
        default="1GiB",
        help="per GPU for the CUDA context, NCCL and fragmentation (default 1GiB)",
    )
    run = parser.add_argument_group("training")
    run.add_argument(
        "--config",
        metavar="DS_CONFIG",
        help="a ds_config.json: its bucket sizes, precision, optimizer and batch are used unless given here",
    )
    run.add_argument("--micro-batch", type=int, help="train_micro_batch_size_per_gpu (default 1)")
    run.add_argument("--gradient-accumulation-steps", type=int, help="(default 1)")
    run.add_argument("--seq-len", type=int, default=512, help="sequence length (default 512)")
    run.add_argument("--precision", choices=("fp32", "fp16", "bf16"), help="(default bf16)")
    run.add_argument("--optimizer", help="adamw (default), adam, sgd, sgd_momentum, adagrad, lion, none")
    run.add_argument("--activation-checkpointing", action="store_true", help="the model checkpoints each layer")
    run.add_argument(
        "--flash-attention", action="store_true", help="attention keeps no a*s^2 score matrix (SDPA/flash kernels)"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the estimate as JSON (schema: EstimateReport)")
    out.add_argument("--plot", metavar="PNG", help="draw per-stage stacked bars (needs zerotrain[plot])")
    out.add_argument("--write-config", metavar="PATH", help="write the recommended ds_config.json")
    out.add_argument("--lr", type=float, default=1e-4, help="learning rate written into --write-config")


def _read_ds_config(path: str, world_size: int):
    """(validated zero_optimization section, the raw dict) of a ds_config.json."""
    from zerotrain.config import load_config
    from zerotrain.config.load import read_config

    raw = read_config(path)
    zero = {k: v for k, v in dict(raw.get("zero_optimization") or {}).items() if v != "auto"}
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=1)
    return cfg.zero_optimization, raw, zero


def _enabled(section) -> bool:
    return isinstance(section, dict) and section.get("enabled") is True


def build_estimate(args: argparse.Namespace):
    """An ``Estimate`` from parsed ``zerotrain estimate`` arguments."""
    from zerotrain.estimate import Hardware, Settings, Workload, estimate
    from zerotrain.estimate.model_states import PRECISION_BYTES
    from zerotrain.estimate.shapes import build_on_meta, from_hf_config, from_module, from_params, load_builder

    world = args.num_gpus * args.num_nodes
    raw, zero_extra, zero_cfg = {}, {}, None
    if args.config:
        zero_cfg, raw, zero = _read_ds_config(args.config, world)
        offload = [k for k in ("offload_optimizer", "offload_param") if zero.get(k)]
        if offload:
            print(
                f"note: {', '.join(offload)} in {args.config}: the offload rows follow DeepSpeed's "
                "placement (zerotrain keeps gradients on the device until the step), and the "
                "recommendation is chosen among the rows without offload",
                file=sys.stderr,
            )
        # Carried into --write-config (5e5 read as a float is written as 500000).
        zero_extra = {
            k: int(v) if isinstance(v, float) and v.is_integer() else v
            for k, v in zero.items()
            if k != "stage" and not k.startswith("offload")
        }
    precision = args.precision or (
        "bf16"
        if _enabled(raw.get("bf16"))
        else "fp16"
        if _enabled(raw.get("fp16"))
        else "fp32"
        if args.config
        else "bf16"
    )
    optimizer, momentum = args.optimizer, 0.0
    if optimizer is None:
        section = raw.get("optimizer") or {}
        optimizer = str(section.get("type", "adamw")).lower() if args.config else "adamw"
        momentum = float((section.get("params") or {}).get("momentum", 0.0) or 0.0)
    if optimizer == "sgd" and momentum:
        optimizer = "sgd_momentum"
    micro = args.micro_batch or _int_or(raw.get("train_micro_batch_size_per_gpu"), 1)
    gas = args.gradient_accumulation_steps or _int_or(raw.get("gradient_accumulation_steps"), 1)
    if args.params is not None:
        shape_kw = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab") if getattr(args, k)}
        largest = parse_count(args.largest_layer, "--largest-layer") if args.largest_layer else None
        shape = from_params(parse_count(args.params, "--params"), largest, **shape_kw)
    elif args.hf_config is not None:
        shape = from_hf_config(args.hf_config)
    else:
        shape = from_module(build_on_meta(load_builder(args.model)), name=args.model)
    e = PRECISION_BYTES[precision]
    settings = Settings(world_size=world, precision=precision, optimizer=optimizer)
    if zero_cfg is not None:
        from zerotrain.zero import bucket_numel

        explicit = zero_cfg.model_fields_set
        settings = Settings(
            world_size=world,
            precision=precision,
            optimizer=optimizer,
            bucket_numel=bucket_numel(zero_cfg, e),
            overlap_comm=zero_cfg.overlap_comm is not False,
            param_persistence_threshold=int(zero_cfg.param_persistence_threshold),
            prefetch_numel=int(zero_cfg.prefetch_bucket_size) if "prefetch_bucket_size" in explicit else None,
            max_live_parameters=int(zero_cfg.max_live_parameters),
        )
    gpu_memory = parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory else _local_gpu_memory()
    hardware = Hardware(
        gpus_per_node=args.num_gpus,
        nodes=args.num_nodes,
        gpu_memory=gpu_memory,
        cpu_memory=parse_bytes(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None,
        gpu_reserve=parse_bytes(args.gpu_reserve, "--gpu-reserve"),
    )
    workload = Workload(
        micro_batch=micro,
        seq_len=args.seq_len,
        gradient_accumulation_steps=gas,
        activation_checkpointing=args.activation_checkpointing,
    )
    est = estimate(shape, hardware, workload, settings, flash_attention=args.flash_attention, zero_extra=zero_extra)
    est.lr = args.lr
    if gpu_memory is None:
        est.notes.insert(0, "no --gpu-memory given and no GPU here: fits are not judged per GPU")
    return est


def _int_or(value, default: int) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _local_gpu_memory() -> int | None:
    from zerotrain.accelerator import get_accelerator

    accel = get_accelerator()
    return accel.total_memory() if accel.name != "cpu" else None


def run_estimate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``zerotrain estimate``: print tables (or JSON); write the plot and config when asked."""
    for flag, value in (
        ("--num-gpus", args.num_gpus),
        ("--num-nodes", args.num_nodes),
        ("--seq-len", args.seq_len),
        ("--micro-batch", args.micro_batch or 1),
        ("--gradient-accumulation-steps", args.gradient_accumulation_steps or 1),
    ):
        if value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    if args.plot:
        from zerotrain.estimate.plot import MissingExtra, pyplot

        try:
            pyplot()  # before any work: a missing extra is one line, not a traceback after the tables
        except MissingExtra as err:
            print(err, file=sys.stderr)
            return 1
    try:
        est = build_estimate(args)
    except ValueError as err:
        parser.error(str(err))
    report = est.report()
    print(report.model_dump_json(indent=2) if args.json else est.text())
    if args.plot:
        from zerotrain.estimate.plot import plot_rows

        try:
            plot_rows(report, args.plot)
        except OSError as err:
            print(f"--plot: cannot write {args.plot!r} ({err.strerror or err})", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.write_config:
        config = est.ds_config()
        if config is None:
            print("--write-config: nothing without offload fits, so no config was written", file=sys.stderr)
            return 1
        try:
            with open(args.write_config, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
        except OSError as err:
            print(f"--write-config: cannot write {args.write_config!r} ({err.strerror or err})", file=sys.stderr)
            return 1
        print(f"wrote {args.write_config}", file=sys.stderr)
    return 0
