#!/usr/bin/env python
"""Consolidate a zerotrain checkpoint into one (or a few) ordinary state-dict files.

DeepSpeed's ``zero_to_fp32`` job, for zerotrain checkpoints. It needs only torch (and the
``zerotrain_checkpoint_format.py`` that sits beside it in every checkpoint): no process group,
no GPU, no zerotrain install::

    python save_dir/zero_to_fp32.py save_dir OUTPUT_DIR [--tag T] [--dtype fp32|bf16|fp16]
        [--max_shard_size 5GB] [--safe_serialization] [--exclude_frozen_parameters]

It streams: parameters are rebuilt one at a time from the ranks' shards and written straight
into the output file, so memory holds one tensor at a time (safetensors output), or one output
shard (``torch.save`` output, which needs the whole dict of a file in memory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

try:  # inside the zerotrain package
    from zerotrain.checkpoint.format import CheckpointError, CheckpointReader, resolve_tag, stream_safetensors
except ImportError:  # the copy inside a checkpoint folder: its sibling file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from zerotrain_checkpoint_format import CheckpointError, CheckpointReader, resolve_tag, stream_safetensors  # type: ignore

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(text) -> int:
    """``"5GB"``, ``"500MB"``, ``"1.5GiB"`` or a number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size: cannot read {text!r}; use e.g. 5GB, 500MB or a byte count")
    number, prefix, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(prefix.upper() or " "))


class Consolidator:
    """The model's whole state dict, tensor by tensor, from a checkpoint's shards."""

    def __init__(
        self,
        checkpoint_dir,
        tag=None,
        dtype: torch.dtype | None = torch.float32,
        exclude_frozen_parameters: bool = False,
    ):
        folder, self.tag = resolve_tag(checkpoint_dir, tag)
        self.reader = CheckpointReader(folder)
        self.dtype = dtype
        frozen = set(self.reader.meta.get("frozen", []))
        keys = self.reader.keys()
        if exclude_frozen_parameters:
            keys = [k for k in keys if self.reader.canonical(k) not in frozen]
        self.keys = keys

    def spec(self, key: str) -> tuple[str, torch.dtype, list[int]]:
        name = self.reader.canonical(key)
        saved = self._saved_dtype(name)
        dtype = self.dtype if self.dtype is not None and saved.is_floating_point else saved
        return key, dtype, list(self.reader.shape(name))

    def _saved_dtype(self, name: str) -> torch.dtype:
        if name in self.reader.buffers:
            return getattr(torch, self.reader.buffers[name]["dtype"])
        return getattr(torch, self.reader.sources[name][1]["dtype"])

    def tensor(self, key: str) -> torch.Tensor:
        """One entry of the state dict: exactly the saved values in the saved dtype, else the
        fp32 master (where one was kept) cast to the requested dtype."""
        _, dtype, shape = self.spec(key)
        name = self.reader.canonical(key)
        if name in self.reader.buffers:
            return self.reader.buffer(name).to(dtype)
        use_master = self._saved_dtype(name) != dtype and self.reader.has(name, "master")
        return self.reader.read(name, "master" if use_master else "param").to(dtype).view(shape)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self.tensor(k) for k in self.keys}

    def plan(self, max_shard_bytes: int) -> list[list[str]]:
        """Keys split into consecutive files of at most ``max_shard_bytes`` (a bigger tensor
        gets a file of its own)."""
        shards, current, size = [], [], 0
        for key in self.keys:
            _, dtype, shape = self.spec(key)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append(key)
            size += nbytes
        return shards + [current] if current or not shards else shards

    def close(self) -> None:
        self.reader.close()


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization: bool = False,
    tag=None,
    exclude_frozen_parameters: bool = False,
    dtype: str = "fp32",
) -> list[Path]:
    """Write the consolidated model into ``output_dir``: ``model.safetensors`` or
    ``pytorch_model.bin``; when larger than ``max_shard_size``, numbered files
    (``model-00001-of-00003.safetensors``) plus an ``.index.json`` with the ``weight_map``.
    Returns the files written."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    source = Consolidator(checkpoint_dir, tag, DTYPES[dtype], exclude_frozen_parameters)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem, suffix = ("model", ".safetensors") if safe_serialization else ("pytorch_model", ".bin")
    try:
        shards = source.plan(parse_size(max_shard_size))
        written, weight_map, total = [], {}, 0
        for i, keys in enumerate(shards):
            name = f"{stem}{suffix}" if len(shards) == 1 else f"{stem}-{i + 1:05d}-of-{len(shards):05d}{suffix}"
            path, tmp = out / name, out / f".{name}.tmp"
            if safe_serialization:
                specs = [source.spec(k) for k in keys]
                total += stream_safetensors(tmp, specs, source.tensor, {"format": "pt"})["bytes"]
            else:
                torch.save({k: source.tensor(k) for k in keys}, tmp)
                total += tmp.stat().st_size
            os.replace(tmp, path)
            written.append(path)
            weight_map.update({k: name for k in keys})
        if len(shards) > 1:
            index = out / f"{stem}{suffix}.index.json"
            index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
            written.append(index)
        return written
    finally:
        source.close()


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, torch.Tensor]:
    """The whole model as an fp32 state dict on the CPU (from the fp32 masters where the run
    kept them), read from a checkpoint of any world size and stage; no process group needed."""
    if lazy_mode:
        raise NotImplementedError(
            "get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is not "
            "supported; use convert_zero_checkpoint_to_fp32_state_dict (or "
            "`zerotrain consolidate`), which streams to disk one tensor at a time"
        )
    source = Consolidator(checkpoint_dir, tag, torch.float32, exclude_frozen_parameters)
    try:
        return source.state_dict()
    finally:
        source.close()


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load the checkpoint's fp32 weights into ``model`` (moved to the CPU), as DeepSpeed's
    function of this name does; returns the model. Use it after training, not to resume."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "checkpoint_dir",
        help="the save_dir of engine.save_checkpoint (its 'latest' is used), or one checkpoint's tag folder",
    )
    add("output_dir", help="folder for the consolidated weights")
    add("-t", "--tag", help="checkpoint tag to read (default: the one in checkpoint_dir/latest)")
    add(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="dtype of the floating tensors written (default fp32: the fp32 masters)",
    )
    add(
        "--max_shard_size", "--max-shard-size", default="5GB", help="largest output file before splitting (default 5GB)"
    )
    add(
        "--safe_serialization",
        "--safetensors",
        action="store_true",
        help="write safetensors (streamed) instead of torch.save files",
    )
    add(
        "--exclude_frozen_parameters",
        "--exclude-frozen",
        action="store_true",
        help="leave out parameters with requires_grad=False",
    )


def run(args) -> int:
    try:
        files = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            args.max_shard_size,
            args.safe_serialization,
            args.tag,
            args.exclude_frozen_parameters,
            args.dtype,
        )
    except (CheckpointError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for path in files:
        print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
