"""Writing a checkpoint: every rank its own files into a temporary folder, then an agreed commit.

Every rank decision comes from the engine's topology: "the ranks" are those of the engine's
data-parallel group (``engine.topology``), "rank 0" is the group's first rank, and files are
named by the rank within the group, so two engines on disjoint groups of one job save side by
side, and a group's checkpoint holds the files of the same run on a world of the group's size.

Order of a save (every rank of the group calls it):

1. the ranks agree on the tag (``checkpoint.tag_validation``);
2. rank 0 creates ``save_dir/.<tag>.partial``; every rank writes its files there (each file is
   fsynced and hashed as it is written);
3. the ranks exchange their outcome and checksums; if any rank failed, every rank raises and
   the partial folder is removed;
4. rank 0 commits (``zerotrain.checkpoint.commit``): writes ``metadata.json`` (with every
   file's checksum and its own), renames the folder to ``save_dir/<tag>``, copies the standalone
   recovery script, and only then replaces ``save_dir/latest`` (write to a temporary name,
   fsync, rename);
5. the ranks learn whether the commit succeeded.

A crash at any point leaves ``latest`` naming a complete checkpoint (see ``commit``); the next
save removes what an interrupted one left behind.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from zerotrain.checkpoint.commit import SCRIPT_NAMES, SCRIPTS, commit, partial_name, recover
from zerotrain.checkpoint.experts import describe_experts, expert_files, expert_names, merge_experts
from zerotrain.checkpoint.format import (
    LATEST,
    MODEL_FILE,
    CheckpointError,
    encode_metadata,
    shard_file,
    state_file,
    write_safetensors,
)
from zerotrain.checkpoint.layout import (
    data_rank,
    describe,
    first_of_group,
    group_of_whole,
    persistent_buffers,
    shard_writer,
    split_state,
    stage_units,
    unit_param,
    unit_training_state,
    whole_parameters,
)
from zerotrain.checkpoint.pipeline import (
    annotate_stage,
    file_names,
    is_pipeline,
    layer_files,
    merge_stages,
    model_states,
    shard_content,
)
from zerotrain.checkpoint.training_state import capture_engine, capture_rng, plain

logger = logging.getLogger("zerotrain")

__all__ = ["SCRIPTS", "SCRIPT_NAMES", "PendingSave", "capture", "prepare"]


@dataclass
class RankSnapshot:
    """What one rank writes: tensor files by name, ``torch.save`` files by name (a pipeline
    checkpoint's DeepSpeed-named files), and its small state (``torch.save``, ``state_name``).
    ``rank`` is the rank within the engine's data-parallel group (files are named by it)."""

    rank: int
    tensor_files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    pt_files: dict[str, dict] = field(default_factory=dict)
    state_name: str | None = None

    def detached(self) -> RankSnapshot:
        """A copy on the CPU that training can no longer change (for a background write). State
        in NVMe swap files is read into memory here: the next step rewrites those files."""
        files = {name: {k: _cpu_copy(t) for k, t in tensors.items()} for name, tensors in self.tensor_files.items()}
        memo: dict[int, torch.Tensor] = {}  # a tensor under two keys (an expert file's) stays one
        pt_files = {name: _tree_copy(content, memo) for name, content in self.pt_files.items()}
        return RankSnapshot(self.rank, files, plain(self.state, "state"), pt_files, self.state_name)


def _tree_copy(value, memo: dict):
    if torch.is_tensor(value) or hasattr(value, "pieces"):
        if id(value) not in memo:
            memo[id(value)] = _cpu_copy(value)
        return memo[id(value)]
    if isinstance(value, dict):
        return {k: _tree_copy(v, memo) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tree_copy(v, memo) for v in value)
    return value


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "pieces") and not torch.is_tensor(t):  # NVMe-swapped: read it now
        return torch.cat([p.reshape(-1) for p in t.pieces()]).view(t.shape)
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    return t.to("cpu", non_blocking=False)


def capture(engine, client_state, exclude_frozen: bool) -> RankSnapshot:
    """References to this rank's live state (no copies)."""
    rank, optimizer = data_rank(engine), engine.optimizer
    names, pipeline = file_names(engine), is_pipeline(engine)
    snap = RankSnapshot(rank, state_name=names.state(rank))
    experts = expert_names(engine)
    if experts:  # each expert once, by the first rank of its expert-data group (collective)
        snap.pt_files.update(expert_files(engine, experts, exclude_frozen))
    scalars: dict[str, dict] = {}
    if shard_writer(engine, experts):
        tensors = {}
        for i, unit in enumerate(stage_units(engine)):
            if exclude_frozen and unit.group is None or experts.expert_unit(unit):
                continue
            key = names.unit_key(i)
            tensors[f"{key}/param"] = unit_param(unit)
            master, elementwise, unit_scalars = unit_training_state(engine, unit, optimizer)
            if master is not None:
                tensors[f"{key}/master"] = master
            if optimizer is not None and unit.group is not None:
                tensors.update({f"{key}/state/{k}": v for k, v in elementwise.items()})
                scalars[key] = unit_scalars
        if pipeline:  # DeepSpeed's zero_pp_rank_<d>_mp_rank_<s>_optim_states.pt
            snap.pt_files[names.shard(rank)] = shard_content(tensors)
        else:
            snap.tensor_files[shard_file(rank)] = tensors
    if pipeline:  # each stage's layer files (its first data rank, or split over them)
        snap.pt_files.update(layer_files(engine, exclude_frozen))
    if first_of_group(engine):
        tensors = {}
        groups = group_of_whole(engine)
        for name, p in whole_parameters(engine):
            if exclude_frozen and not p.requires_grad or experts.is_expert(name):
                continue
            tensors[f"param/{name}"] = p.detach()
            if optimizer is not None and id(p) in groups:
                elementwise, whole_scalars = split_state(optimizer.state.get(p, {}), shape=p.shape)
                tensors.update({f"state/{k}/{name}": v for k, v in elementwise.items()})
                scalars[f"param/{name}"] = whole_scalars
        tensors.update(
            {
                f"buffer/{name}": b.detach()
                for name, b in persistent_buffers(engine.module)[0]
                if not experts.is_expert(name)
            }
        )
        if not pipeline:
            snap.tensor_files[MODEL_FILE] = tensors
        whole_tensors = tensors
    snap.state = {
        "rank": rank,
        "world_size": engine.dp_world_size,
        "scalars": plain(scalars, "optimizer state"),
        "param_groups": (
            [
                plain({k: v for k, v in g.items() if k != "params"}, f"param_groups[{i}]")
                for i, g in enumerate(optimizer.param_groups)
            ]
            if optimizer is not None
            else []
        ),
        "engine": capture_engine(engine),
        "rng": capture_rng(),
        "client_state": plain(dict(client_state or {}), "client_state"),
    }
    if pipeline and first_of_group(engine):  # DeepSpeed's mp_rank_<s>_model_states.pt
        snap.pt_files[names.model] = model_states(
            engine, whole_tensors, snap.state["engine"], snap.state["client_state"]
        )
    return snap


def write_rank_files(snap: RankSnapshot, folder: Path) -> dict[str, dict]:
    """Write ``snap``'s files into ``folder``; returns ``{file name: {sha256, bytes}}``."""
    from zerotrain.checkpoint.format import file_digest

    out = {}
    for name, tensors in snap.tensor_files.items():
        out[name] = write_safetensors(folder / name, tensors, {"format": "pt"})
    pickled = dict(snap.pt_files)
    pickled[snap.state_name or state_file(snap.rank)] = snap.state
    for name, content in pickled.items():
        path = folder / name
        with open(path, "wb") as f:
            torch.save(content, f)
            f.flush()
            os.fsync(f.fileno())
        out[name] = {"sha256": file_digest(path), "bytes": path.stat().st_size}
    return out


def agree(value, group=None) -> list:
    """Every rank's ``value`` over ``group`` (the engine's checkpoint group: the ranks of its
    data-parallel group), ordered by group rank; just ``[value]`` when ``group`` is None (a
    group of one rank needs no exchange)."""
    from zerotrain.comm.objects import all_gather_object

    # None never means the world here: an engine on part of the job must not wait for ranks
    # outside its group, and an asynchronous save's background thread stays off the default
    # group (NCCL on a GPU, which training uses meanwhile).
    if group is None or not dist.is_initialized():
        return [value]
    # The group's timeout, and a CollectiveError naming a rank that never arrives (a rank that
    # skipped or hangs before save_checkpoint), as for every other collective.
    return all_gather_object(value, group, op="all_gather_object (save_checkpoint)")


def check_tag(tag: str, mode: str, group=None) -> None:
    """``checkpoint.tag_validation``: all ranks must save under the same tag."""
    if not isinstance(tag, str) or not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(
            f"checkpoint tag {tag!r}: use a non-empty name without '/' that does "
            "not start with '.' and is not 'latest' (e.g. 'global_step100')"
        )
    if mode == "Ignore":
        return
    tags = agree(tag, group)
    if len(set(tags)) > 1:
        message = (
            f"ranks disagree on the checkpoint tag: {dict(enumerate(tags))}; pass the same "
            "tag on every rank (or none: global_step<N> is the same everywhere)"
        )
        if mode == "Fail":
            raise ValueError(message)
        logger.warning(message + " (checkpoint.tag_validation: Warn)")


class PendingSave:
    """A save whose files are being written; ``finish()`` agrees and commits (every rank of the
    engine's data group, or of every stage of a pipeline engine; ``self.rank`` is the rank within
    the data group; the group's first rank, a pipeline's first stage's, commits)."""

    def __init__(
        self, engine, save_dir, tag: str, snap: RankSnapshot, meta: dict | None, save_latest: bool, group=None
    ):
        self.save_dir, self.tag, self.snap = Path(save_dir), tag, snap
        self.meta, self.save_latest, self.group = meta, save_latest, group
        self.rank = snap.rank
        self.global_rank = engine.global_rank
        self.pipeline = is_pipeline(engine)
        self.committer = committer(engine)
        self.who = _who(self.rank, self.global_rank, engine.checkpoint_layout().stage)
        self.partial = self.save_dir / partial_name(tag)
        self.files: dict | None = None
        self.error: str | None = None

    def write(self) -> None:
        """This rank's files (safe to run in a background thread: no collectives)."""
        try:
            self.files = write_rank_files(self.snap, self.partial)
        except BaseException as error:  # reported to every rank by finish()
            self.error = f"{type(error).__name__}: {error}"
            if not isinstance(error, Exception):
                raise
        finally:
            self.snap = None  # free the snapshot as soon as it is on disk

    def finish(self) -> Path:
        # A pipeline's stages describe their own layouts: the committer merges them.
        stage_meta = self.meta if self.pipeline else None
        outcomes = agree((self.who, self.error, self.files, stage_meta), self.group)
        failed = [(who, e) for who, e, _, _ in outcomes if e is not None]
        final = self.save_dir / self.tag
        if failed:
            if self.committer:
                shutil.rmtree(self.partial, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint {final} was not saved: "
                + "; ".join(f"{who}: {e}" for who, e in failed)
                + f" ({self.save_dir / LATEST} still names "
                "the previous checkpoint)"
            )
        error = None
        if self.committer:
            try:
                files = {}
                for _, _, rank_files, _ in outcomes:
                    files.update(rank_files)
                if self.pipeline:
                    self.meta = merge_stages([m for *_, m in outcomes if m is not None])
                self._commit(files, final)
            except CheckpointError as e:  # says what state save_dir is in
                error = str(e)
            except Exception as e:  # noqa: BLE001 - every rank must hear about it
                error = f"{type(e).__name__}: {e}"
        errors = [e for e in agree(error, self.group) if e is not None]
        if errors:
            where = "the first rank" if self.pipeline else "rank 0 of the data group"
            raise CheckpointError(f"checkpoint {final}: the commit failed on {where}: {errors[0]}")
        return final

    def _commit(self, files: dict, final: Path) -> None:
        meta = dict(self.meta, files=files)
        commit(self.partial, self.save_dir, self.tag, encode_metadata(meta), self.save_latest)


def _who(rank: int, global_rank: int, stage: int | None = None) -> str:
    """A rank as messages name it: its data-group rank, with its global rank where they differ
    (and its pipeline stage)."""
    if stage is not None:
        return f"stage {stage} data rank {rank} (global rank {global_rank})"
    return f"rank {rank}" if rank == global_rank else f"rank {rank} of the data group (global rank {global_rank})"


def committer(engine) -> bool:
    """Whether this rank commits: the data group's first rank; for a pipeline engine, the first
    rank of the first stage (every stage's files go into one tag folder)."""
    if is_pipeline(engine):
        return first_of_group(engine) and engine.topology.is_first("pipe")
    return first_of_group(engine)


def prepare(engine, save_dir, tag, exclude_frozen: bool, group=None) -> dict | None:
    """Create the partial folder (the group's first rank) once every rank of the group is here;
    the first rank gets the metadata."""
    save_dir = Path(save_dir)
    first = first_of_group(engine)
    experts = expert_names(engine)
    meta = describe(engine, tag, exclude_frozen, experts) if first else None
    if experts:  # every rank describes the experts it holds; the first merges them
        described = agree(describe_experts(engine, experts, exclude_frozen), group)
        if first:
            meta = merge_experts(meta, described, experts)
    if meta is not None and is_pipeline(engine):
        meta = annotate_stage(meta, engine, file_names(engine))
    error = None
    if committer(engine):
        try:
            recover(save_dir)  # what interrupted saves left behind
            if not save_dir.is_dir():
                save_dir.mkdir(parents=True, exist_ok=True)
            (save_dir / partial_name(tag)).mkdir()
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    errors = [e for e in agree(error, group) if e is not None]
    if errors:
        raise CheckpointError(f"cannot create the checkpoint folder under {save_dir}: {errors[0]}")
    return meta
