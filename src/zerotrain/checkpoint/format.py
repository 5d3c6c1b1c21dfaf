"""The on-disk format of a zerotrain checkpoint, and a reader that needs only torch.

This file imports nothing from zerotrain: it is copied next to ``zero_to_fp32.py`` into every
checkpoint, so the weights can be recovered with torch alone.

A checkpoint is a folder per tag::

    save_dir/latest                         the tag of the newest complete checkpoint
    save_dir/<tag>/metadata.json            layout, dtypes, versions, config, file checksums
    save_dir/<tag>/model.safetensors        rank 0: whole parameters, buffers (and their state)
    save_dir/<tag>/shards.rank00001.safetensors   rank 1's shard of every flat unit: the
                                            parameters, fp32 masters, optimizer state
    save_dir/<tag>/state.rank00001.pt       rank 1's small state: scalars of the optimizer state,
                                            param groups, scheduler, loss scaler, counters, RNG,
                                            dataloader position, client state (weights_only)

Tensor files are safetensors. They are written and read here by byte ranges rather than with
the safetensors package because the writer streams each tensor straight to disk while hashing
it (no serialized copy of the state in memory) and the reader ``pread``s just the elements it
needs (no memory map whose touched pages would count in the resident set); the files are
ordinary safetensors files that ``safetensors.safe_open`` reads too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

FORMAT = "zerotrain-checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
# metadata.json's own checksum, stored inside it: the sha256 of the rest of its content (see
# metadata_digest). Checkpoints written before it existed have none (loaded with a warning).
METADATA_DIGEST = "metadata_sha256"

logger = logging.getLogger("zerotrain")

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked: missing, corrupt, or not matching the model."""


def shard_file(rank: int) -> str:
    return f"shards.rank{rank:05d}.safetensors"


def state_file(rank: int) -> str:
    return f"state.rank{rank:05d}.pt"


# A pipeline engine's checkpoint (metadata "pipeline" section) is in DeepSpeed's layout: one
# folder for every stage, each stage's files named by its stage index (DeepSpeed's mp_rank).
def pipe_model_file(stage: int) -> str:
    """Stage ``stage``'s ``mp_rank_XX_model_states.pt``: DeepSpeed's keys (``module`` None,
    counters, ``lr_scheduler``, ``ds_config``, client state) and the stage's whole parameters,
    their optimizer state and buffers under ``zerotrain_tensors``."""
    return f"mp_rank_{stage:02d}_model_states.pt"


def pipe_optim_file(rank: int, stage: int, bf16: bool = False) -> str:
    """Data rank ``rank`` of stage ``stage``'s shard of every flat unit (``zerotrain_tensors``)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_{stage:02d}_optim_states.pt"


def pipe_state_file(rank: int, stage: int) -> str:
    """Data rank ``rank`` of stage ``stage``'s small state (as ``state_file``)."""
    return f"state.mp_rank_{stage:02d}.rank{rank:05d}.pt"


# The key of a pipeline checkpoint's ``.pt`` tensor files under which its flat {name: tensor} sits.
PT_TENSORS = "zerotrain_tensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint metadata")
    return dtype


def write_safetensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> dict:
    """Write ``tensors`` as a safetensors file, streaming each tensor's bytes (device tensors
    are copied to the host one at a time); returns ``{"sha256", "bytes"}`` of the file."""
    specs = [(name, t.dtype, list(t.shape)) for name, t in tensors.items()]
    return stream_safetensors(path, specs, tensors.__getitem__, metadata)


def stream_safetensors(path, specs, produce, metadata: dict[str, str] | None = None) -> dict:
    """Write a safetensors file whose tensors ``specs`` (``(name, dtype, shape)``) are made one
    at a time by ``produce(name)`` and written at once, so only one is ever held. A produced
    object with ``pieces()`` (``zerotrain.offload.swapper.SwappedTensor``) is written piece by
    piece."""
    header, offset = {}, 0
    for name, dtype, shape in specs:
        if dtype not in _NAMES:
            raise TypeError(f"{name}: dtype {dtype} cannot be stored in safetensors")
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(raw).to_bytes(8, "little"), raw):
            f.write(chunk)
            digest.update(chunk)
        for name, dtype, shape in specs:
            t = produce(name)
            if t.dtype != dtype or list(t.shape) != list(shape):
                raise ValueError(f"{name}: produced {t.dtype} {tuple(t.shape)}, planned {dtype} {tuple(shape)}")
            if t.numel() == 0:
                continue
            # An NVMe-swapped tensor comes in pieces (one chunk in memory at a time).
            for piece in t.pieces() if hasattr(t, "pieces") else (t,):
                data = piece.detach().reshape(-1).to("cpu").contiguous().view(torch.uint8).numpy()
                f.write(data)
                digest.update(data)
                del piece, data
            del t
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": 8 + len(raw) + offset}


def metadata_digest(meta: dict) -> str:
    """sha256 of ``meta`` without its own digest field, serialized canonically (keys in their
    order, no whitespace, ASCII): any change to a name, offset, shape, dtype or checksum in
    metadata.json changes it."""
    body = {k: v for k, v in meta.items() if k != METADATA_DIGEST}
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def encode_metadata(meta: dict) -> bytes:
    """The bytes of metadata.json: ``meta`` with its digest as the last field."""
    body = {k: v for k, v in meta.items() if k != METADATA_DIGEST}
    return json.dumps({**body, METADATA_DIGEST: metadata_digest(body)}, indent=1).encode()


def read_metadata(folder) -> dict:
    """Parse and verify ``folder/metadata.json``; a damaged or edited one raises CheckpointError."""
    path = Path(folder) / METADATA
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError) as error:  # ValueError covers bad UTF-8 and bad JSON
        raise CheckpointError(
            f"{path} cannot be read ({error}): the checkpoint is damaged; load another one with tag=..."
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is damaged (not a JSON object); load another checkpoint with tag=...")
    recorded = meta.get(METADATA_DIGEST)
    if recorded is None:
        if meta.get("format") == FORMAT:
            logger.warning(
                "%s has no %s (written before zerotrain checked its own metadata): "
                "its layout cannot be verified; load it and save a new checkpoint to "
                "protect it",
                path,
                METADATA_DIGEST,
            )
    elif recorded != metadata_digest(meta):
        raise CheckpointError(
            f"{path} does not match its {METADATA_DIGEST}: the file was edited or "
            "is damaged, so its layout cannot be trusted; restore it from a copy "
            "or load another checkpoint with tag=..."
        )
    return meta


def file_digest(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class TensorFile:
    """Reads element ranges of the tensors of one safetensors file with ``os.pread``."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        head = os.pread(self._fd, 8, 0)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        file_size = os.fstat(self._fd).st_size
        if size < 2 or 8 + size > file_size:
            raise CheckpointError(f"{path}: not a safetensors file (truncated or damaged header)")
        try:
            self.header = json.loads(os.pread(self._fd, size, 8))
        except ValueError:
            raise CheckpointError(f"{path}: damaged safetensors header") from None
        self.header.pop("__metadata__", None)
        self._data = 8 + size

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def shape(self, name: str) -> list[int]:
        return self._entry(name)["shape"]

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._entry(name)["dtype"]]

    def read(self, name: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened tensor, as a new 1-D tensor."""
        entry = self._entry(name)
        dtype = _DTYPES[entry["dtype"]]
        total = 1
        for d in entry["shape"]:
            total *= d
        numel = total - start if numel is None else numel
        if start < 0 or start + numel > total:
            raise CheckpointError(f"{self.path}: {name} has {total} elements, asked for [{start}, {start + numel})")
        size = torch.empty((), dtype=dtype).element_size()
        out = torch.empty(numel, dtype=dtype)
        view = memoryview(out.view(torch.uint8).numpy())
        pos = self._data + entry["data_offsets"][0] + start * size
        done = 0
        while done < len(view):  # pread returns at most ~2 GiB per call
            got = os.preadv(self._fd, [view[done:]], pos + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: truncated ({name} ends past the file's end)")
            done += got
        return out

    def _entry(self, name: str) -> dict:
        try:
            return self.header[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r}") from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PickledTensorFile:
    """The ``TensorFile`` interface over a ``torch.save`` file whose ``PT_TENSORS`` entry is a
    flat ``{name: tensor}`` (a pipeline checkpoint's DeepSpeed-named files). Loaded with
    ``weights_only=True`` (no class is unpickled) and memory-mapped (only the pages read count)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # noqa: BLE001 - name the file, whatever went wrong
            raise CheckpointError(f"{path} cannot be loaded safely: {error}") from None
        tensors = raw.get(PT_TENSORS) if isinstance(raw, dict) else None
        if not isinstance(tensors, dict):
            raise CheckpointError(f"{path}: no {PT_TENSORS!r} entry (not written by zerotrain)")
        self.header = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def read(self, name: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        flat = self._entry(name).reshape(-1)
        numel = flat.numel() - start if numel is None else numel
        if start < 0 or start + numel > flat.numel():
            raise CheckpointError(
                f"{self.path}: {name} has {flat.numel()} elements, asked for [{start}, {start + numel})"
            )
        return flat.narrow(0, start, numel).clone()

    def _entry(self, name: str) -> torch.Tensor:
        try:
            return self.header[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r}") from None

    def close(self) -> None:
        self.header = {}


def open_tensor_file(path: Path):
    """A reader of one tensor file: safetensors, or a pipeline checkpoint's ``.pt`` file."""
    return PickledTensorFile(path) if path.suffix == ".pt" else TensorFile(path)


def resolve_tag(load_dir, tag: str | None = None) -> tuple[Path, str]:
    """``(folder of the checkpoint, tag)``: ``tag``, else the one named in ``load_dir/latest``.
    A folder that itself holds ``metadata.json`` is taken as the checkpoint."""
    load_dir = Path(load_dir)
    if tag is None and (load_dir / METADATA).is_file():
        return load_dir, load_dir.name
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            raise CheckpointError(
                f"{latest} does not exist: {load_dir} holds no completed checkpoint (a save "
                "writes 'latest' only after every rank has finished); pass tag= to load a "
                "specific one"
            )
        tag = latest.read_text().strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise CheckpointError(
                f"{latest} is damaged (it holds {tag!r}, not a tag name); pass tag= to load a specific checkpoint"
            )
    folder = load_dir / tag
    if not (folder / METADATA).is_file():
        aside = load_dir / aside_name(tag)
        if (aside / METADATA).is_file():
            # A re-save of this tag was interrupted between moving the old folder aside and
            # renaming the new one into place: the aside copy is the committed checkpoint (the
            # next save_checkpoint into load_dir moves it back).
            logger.warning(
                "checkpoint %s is missing: loading %s, the copy an interrupted re-save of this tag set aside",
                folder,
                aside,
            )
            return aside, tag
        raise CheckpointError(f"checkpoint {folder} is missing or incomplete (no {METADATA})")
    return folder, tag


def aside_name(tag: str) -> str:
    """Where a re-save moves the existing ``tag`` folder until the new one is in place."""
    return f".{tag}.old"


class CheckpointReader:
    """A checkpoint's metadata, and any parameter's values by name and element range.

    Every file's checksum is verified the first time it is opened."""

    def __init__(self, folder, verify: bool = True):
        self.folder = Path(folder)
        self.meta = read_metadata(self.folder)
        if self.meta.get("format") != FORMAT:
            raise CheckpointError(f"{self.folder} is not a zerotrain checkpoint")
        if self.meta.get("format_version", 0) > FORMAT_VERSION:
            raise CheckpointError(
                f"{self.folder} has format version {self.meta['format_version']}; "
                f"this reader knows up to {FORMAT_VERSION}: upgrade zerotrain"
            )
        self.verify = verify
        # A listed file gone is a damaged checkpoint even where this load would not read it.
        for filename in self.meta["files"]:
            if not (self.folder / filename).is_file():
                raise CheckpointError(
                    f"{self.folder / filename} is missing from checkpoint {self.folder} "
                    f"(its {METADATA} lists it): restore the file from a copy, or "
                    "load another tag"
                )
        self._files: dict[str, TensorFile] = {}
        self.sources: dict[str, tuple] = {}  # canonical name -> ("unit", unit, offset, numel, shape) | ("whole", entry)
        for unit in self.meta["units"]:
            for name, offset, numel, shape in unit["params"]:
                self.sources[name] = ("unit", unit, offset, numel, shape)
        for name, entry in self.meta["whole"].items():
            self.sources[name] = ("whole", entry, 0, _numel(entry["shape"]), entry["shape"])
        self.aliases: dict[str, str] = self.meta.get("aliases", {})
        self.buffers: dict[str, dict] = self.meta.get("buffers", {})

    # -- names ---------------------------------------------------------------------------
    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    def keys(self) -> list[str]:
        """Every key of the saved model's state dict, in its order (tied names included)."""
        return list(self.meta["keys"])

    def shape(self, name: str) -> list[int]:
        name = self.canonical(name)
        if name in self.buffers:
            return self.buffers[name]["shape"]
        return self.sources[name][4]

    # -- files ---------------------------------------------------------------------------
    def file(self, filename: str) -> TensorFile:
        if filename not in self._files:
            path = self.folder / filename
            expected = self.meta["files"].get(filename)
            if expected is None:
                raise CheckpointError(f"{path} is not listed in {METADATA}")
            self.check_file(filename)
            self._files[filename] = open_tensor_file(path)
        return self._files[filename]

    def check_file(self, filename: str) -> Path:
        """Verify size and checksum of one listed file; returns its path."""
        path = self.folder / filename
        expected = self.meta["files"][filename]
        if not path.is_file():  # deleted since the reader was made
            raise CheckpointError(
                f"{path} is missing from checkpoint {self.folder} (its {METADATA} lists "
                "it): restore the file from a copy, or load another tag"
            )
        if path.stat().st_size != expected["bytes"]:
            raise CheckpointError(
                f"{path} is {path.stat().st_size} bytes, the checkpoint recorded "
                f"{expected['bytes']}: the file is truncated or was replaced"
            )
        if self.verify and file_digest(path) != expected["sha256"]:
            raise CheckpointError(f"{path} is corrupt: its sha256 does not match the one recorded in {METADATA}")
        return path

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    # -- values --------------------------------------------------------------------------
    def has(self, name: str, what: str) -> bool:
        """Whether ``what`` ("param", "master", "state/<key>") was saved for parameter ``name``."""
        kind, entry = self.sources[self.canonical(name)][:2]
        return what in entry["saved"]

    def read(self, name: str, what: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements ``[start, start+numel)`` of the flattened parameter ``name``'s ``what``
        ("param": its values in the training dtype, "master": fp32 master, "state/<key>":
        an elementwise optimizer state), as saved."""
        name = self.canonical(name)
        kind, entry, offset, total, _ = self.sources[name]
        numel = total - start if numel is None else numel
        if kind == "whole" and "row_files" in entry:
            # a parameter split by rows over several files (fused experts: one file per expert),
            # each holding its rows under the parameter's name
            files = entry["row_files"]
            return self._spanning(files.__getitem__, f"{what}/{name}", total // len(files), start, start + numel)
        if kind == "whole":  # a pipeline checkpoint names the stage's file
            return self.file(entry.get("file", MODEL_FILE)).read(f"{what}/{name}", start, numel)
        file_of = entry["files"].__getitem__ if "files" in entry else shard_file
        return self._spanning(
            file_of, f"{unit_key(entry)}/{what}", entry["shard_numel"], offset + start, offset + start + numel
        )

    def _spanning(self, file_of, key: str, block: int, pos: int, end: int) -> torch.Tensor:
        """Elements ``[pos, end)`` of a tensor whose consecutive blocks of ``block`` elements sit
        in files ``file_of(0), file_of(1), ...`` (one block each) under ``key``."""
        out = []
        while pos < end:  # the range may span several files
            index = pos // block
            take = min(end, (index + 1) * block) - pos
            out.append(self.file(file_of(index)).read(key, pos - index * block, take))
            pos += take
        if not out:
            return self.file(file_of(0)).read(key, 0, 0)
        return out[0] if len(out) == 1 else torch.cat(out)

    def truth(self, name: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """fp32 values: the master where one was kept, else the parameter itself."""
        what = "master" if self.has(name, "master") else "param"
        return self.read(name, what, start, numel).float()

    def buffer(self, name: str) -> torch.Tensor:
        entry = self.buffers[name]
        return self.file(entry.get("file", MODEL_FILE)).read(f"buffer/{name}").view(entry["shape"])


def unit_key(entry: dict) -> str:
    """The prefix of a unit's tensors in its shard files (``u<id>``; a pipeline checkpoint's
    units are ``s<stage>u<id>``, unique over the stages)."""
    return entry.get("key", f"u{entry['id']}")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
