"""Loading a checkpoint into an engine of any world size and ZeRO stage.

Everything is matched by parameter name: for each flat unit of the *new* engine, this rank
reads, from the checkpoint's shard files, just the element ranges its own shard covers (and the
whole unit where the stage keeps full parameters), for the parameters, fp32 masters and every
elementwise optimizer state. A checkpoint saved on N ranks at stage S thus loads on M ranks at
stage S'; on the same layout the ranges are exactly the saved shards, so the resume is
bit-identical. No collective is issued and one unit is handled at a time.

Ranks are the engine's (``engine.topology``): a unit's shard is the one of this rank's position in
its unit's group (``shard_rank``), and the per-rank state file read (counters, random state) is
the one of this rank's position in the engine's data-parallel group (``data_rank``), never the
global rank: a checkpoint saved by ranks {2, 3} of a job loads on ranks {0, 1} of another, on a
2-rank world or on one rank.
"""

from __future__ import annotations

import logging

import torch

from zerotrain.checkpoint.experts import expert_names, expert_scalars
from zerotrain.checkpoint.format import CheckpointError, CheckpointReader, pipe_state_file, state_file, unit_key
from zerotrain.checkpoint.layout import (
    data_rank,
    group_of_whole,
    optimizer_key,
    parameter_names,
    persistent_buffers,
    shard_rank_of,
    stage_units,
    swapper_of,
    whole_parameters,
)
from zerotrain.checkpoint.training_state import read_rank_state, restore_engine, restore_rng

logger = logging.getLogger("zerotrain")


class ModuleMatch:
    """Which of the model's parameters and buffers the checkpoint has, by name."""

    def __init__(self, reader: CheckpointReader, engine, strict: bool, experts=None):
        module = engine.module
        self.reader = reader
        # The checkpoint's name of each of the model's names (experts: by global expert id).
        rename = experts.checkpoint_name if experts else (lambda name: name)
        first, self.aliases = parameter_names(module)
        saved = set(reader.sources) | set(reader.buffers)
        excluded = set(reader.meta.get("excluded_frozen", []))
        model_names = [rename(n) for n in list(first.values()) + [n for n, _ in persistent_buffers(module)[0]]]
        self.missing = [n for n in model_names if n not in saved and n not in excluded]
        # A pipeline stage holds some layers, an expert-parallel rank some experts: the others'
        # names are expected elsewhere.
        stage_elsewhere = engine.checkpoint_layout().elsewhere
        self.unexpected = sorted(
            n for n in saved - set(model_names) if not stage_elsewhere(n) and not (experts and experts.elsewhere(n))
        )
        global_shape = experts.checkpoint_shape if experts else (lambda name, shape: list(shape))
        shapes = {rename(n): global_shape(n, shape) for n, shape in _named_parameter_shapes(engine)}
        shapes.update({rename(n): list(b.shape) for n, b in persistent_buffers(module)[0]})
        self.mismatched = [
            (n, reader.shape(n), shapes[n]) for n in model_names if n in saved and list(reader.shape(n)) != shapes[n]
        ]
        if strict and (self.missing or self.unexpected or self.mismatched):
            raise CheckpointError(
                f"checkpoint {reader.folder} does not match the model: "
                + self.describe()
                + "; pass load_module_strict=False to load what matches"
            )
        self.skip = set(self.missing) | {n for n, _, _ in self.mismatched}

    def loadable(self, name: str) -> bool:
        return name not in self.skip and name in self.reader.sources

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"missing {_some(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected {_some(self.unexpected)}")
        for name, saved, now in self.mismatched[:10]:
            parts.append(f"{name} has shape {tuple(saved)} in the checkpoint but {tuple(now)} in the model")
        return "; ".join(parts)


def _named_parameter_shapes(engine):
    """Every parameter's full shape (stage 3 placeholders are empty: use the unit's slots)."""
    in_units = {}
    for unit in stage_units(engine):
        for name, slot in unit.named_slots():
            in_units[name] = slot.shape
    for name, p in engine.module.named_parameters():
        yield name, in_units.get(name, p.shape)


def _some(names) -> str:
    names = list(names)
    return ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")


@torch.no_grad()
def load_into(
    engine,
    reader: CheckpointReader,
    strict: bool,
    load_optimizer: bool,
    load_scheduler: bool,
    module_only: bool,
    from_fp32: bool = True,
) -> dict:
    """Restore ``engine`` from ``reader``; returns the checkpoint's client state."""
    experts = expert_names(engine)
    rename = experts.checkpoint_name
    match = ModuleMatch(reader, engine, strict, experts)
    optimizer = engine.optimizer
    load_optimizer = load_optimizer and not module_only and optimizer is not None
    saved_stages = reader.meta.get("pipeline", {}).get("stages", 1)
    scalars0 = {}
    if load_optimizer:  # every saved stage's units (their keys are unique over the stages)
        for stage in range(saved_stages):
            scalars0.update(_rank_state(reader, 0, stage)["scalars"])
    if load_optimizer and reader.meta["param_groups"] != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {reader.folder} has {reader.meta['param_groups']} optimizer param groups, "
            f"the optimizer has {len(optimizer.param_groups)}: build the optimizer with the same "
            "groups, or pass load_optimizer_states=False"
        )
    if load_optimizer and experts:  # experts' scalar state is in their own files
        scalars0.update(expert_scalars(reader, [rename(n) for n in [*experts.local, *experts.rows]]))
    shard_rank = shard_rank_of(engine)
    swapper = swapper_of(engine)
    for unit in stage_units(engine):
        # fused HF expert rows start at this rank's first row in the saved parameter
        shifts = [experts.row_offset(n, s.shape) for n, s in zip(unit.names, unit.layout.slots)]
        _load_unit(
            unit,
            experts.unit_shard_rank(unit, shard_rank),
            reader,
            match,
            optimizer if load_optimizer and unit.group is not None else None,
            scalars0,
            from_fp32,
            swapper if unit.group is not None else None,
            rename,
            shifts,
        )
    groups = group_of_whole(engine)
    for local_name, p in whole_parameters(engine):
        name = rename(local_name)
        if not match.loadable(name):
            continue
        at = experts.row_offset(local_name, p.shape)
        p.copy_(_values(reader, name, p.dtype, at, p.numel()).view(p.shape))
        if load_optimizer and id(p) in groups:
            _set_state(optimizer, p, reader, [(name, at, 0, p.numel())], p.numel(), scalars0, p.shape)
    for local_name, b in persistent_buffers(engine.module)[0]:
        name = rename(local_name)
        if name in reader.buffers and name not in match.skip:
            b.copy_(reader.buffer(name))
    if match.missing or match.unexpected or match.mismatched:
        logger.warning("load_checkpoint (load_module_strict=False): %s", match.describe())
    if module_only:
        return {}
    rank = data_rank(engine)
    stage, stages = _stage_of(engine)
    # This rank's own state (random streams) where the saved run had the same stage and data rank.
    mine = _rank_state(reader, rank, stage) if stages == saved_stages else None
    main = _rank_state(reader, 0, 0)
    if load_optimizer:
        for group, saved in zip(optimizer.param_groups, main["param_groups"]):
            # hyperparameters; a group's name and MoE mark describe this engine's layout
            # (an expert group saved as "ep_size_2" may load into "ep_size_1")
            group.update({k: v for k, v in saved.items() if k not in ("name", "moe")})
    restore_engine(engine, main["engine"] if mine is None else mine["engine"], load_scheduler)
    _realign_accumulation(engine, reader.meta.get("gradient_accumulation_steps"))
    if mine is not None and "rng" in mine:
        restore_rng(mine["rng"])
    elif "converted_from" in reader.meta:  # DeepSpeed saves no random state
        logger.info(
            "checkpoint %s was converted from %s, which saves no random state: rank %d keeps its own",
            reader.folder,
            reader.meta["converted_from"]["program"],
            rank,
        )
    elif stages != saved_stages:
        logger.warning(
            "checkpoint %s was saved with %d pipeline stages, this engine has %d: rank %d "
            "of the data group of stage %d keeps its own random state",
            reader.folder,
            saved_stages,
            stages,
            rank,
            stage,
        )
    else:
        logger.warning(
            "checkpoint %s was saved on %d ranks: rank %d of the data group keeps its own random state",
            reader.folder,
            reader.meta["world_size"],
            rank,
        )
    return main["client_state"]


def _realign_accumulation(engine, saved: int | None) -> None:
    """A checkpoint saved with another accumulation window (another world size, the same global
    batch) resumes at the start of a window: the saved run's windows begun times this engine's
    window. The saved ``micro_steps`` as it is would put the next boundary mid-window (2 micro-steps
    saved at 1 per window, loaded at 4 per window: the first step would come after 2 micro-batches)."""
    now = engine.gradient_accumulation_steps()
    if saved is None or saved == now:
        return
    engine.micro_steps = -(-engine.micro_steps // saved) * now


def _stage_of(engine) -> tuple[int, int]:
    """``(pipeline stage, stages)`` of ``engine``; ``(0, 1)`` for an engine without a pipeline."""
    layout = engine.checkpoint_layout()
    return (layout.stage, layout.stages) if layout.pipeline else (0, 1)


def _rank_state(reader: CheckpointReader, rank: int, stage: int = 0) -> dict | None:
    cache = reader.__dict__.setdefault("_rank_states", {})
    if (stage, rank) not in cache:
        pipeline = "pipeline" in reader.meta
        name = pipe_state_file(rank, stage) if pipeline else state_file(rank)
        if name not in reader.meta["files"]:
            return None
        cache[(stage, rank)] = read_rank_state(reader, name)
    return cache[(stage, rank)]


def _values(reader, name, dtype, start, numel) -> torch.Tensor:
    """``name``'s elements in ``dtype``: as saved when the dtype matches, else cast from the
    fp32 master (when one was saved) or from the saved values."""
    saved = reader.read(name, "param", start, numel)
    if saved.dtype == dtype or not reader.has(name, "master"):
        return saved.to(dtype)
    return reader.read(name, "master", start, numel).to(dtype)


def _load_unit(
    unit, rank, reader, match, optimizer, scalars0, from_fp32, swapper=None, rename=lambda name: name, shifts=None
) -> None:
    """``unit``'s shard ``rank`` (and the whole unit where the stage keeps it whole) by the
    checkpoint names of its parameters (``rename``: the model's name -> the checkpoint's;
    ``shifts``: per slot, where its values start in the saved parameter: 0 but for a rank's
    rows of a fused expert parameter)."""
    layout = unit.layout
    dtype = unit.dtype
    shifts = shifts or [0] * len(layout.slots)
    if not unit.resharded:  # the stage keeps the whole unit on every rank: fill all of it
        for name, slot, shift in zip(map(rename, unit.names), layout.slots, shifts):
            if match.loadable(name):
                unit.flat.narrow(0, slot.offset, slot.numel).copy_(_values(reader, name, dtype, shift, slot.numel))
    pieces = [
        (rename(name_of(unit, p)), p.param_start + shifts[p.slot.index], p.shard_start, p.numel)
        for p in layout.shard_pieces(rank)
    ]
    pieces = [p for p in pieces if match.loadable(p[0])]
    if unit.resharded and not unit.derived and pieces:  # a derived shard: the master is written
        shard = unit.resident_shard(dirty=True).data  # NVMe parameter offload: read back first
        for name, start, at, n in pieces:
            shard.narrow(0, at, n).copy_(_values(reader, name, dtype, start, n))
    if unit.master is not None:
        for name, start, at, n in pieces:
            what = "master" if from_fp32 and reader.has(name, "master") else "param"
            unit.master.data.narrow(0, at, n).copy_(reader.read(name, what, start, n))
    if swapper is not None:  # NVMe offload: master and state go to the swap files chunk by chunk
        _load_swapped(unit, swapper, reader, pieces, optimizer is not None, scalars0, from_fp32)
    elif optimizer is not None:
        # a shard of padding alone (stage 3, a unit smaller than its group) keeps zero state
        # and its unit's scalars, as the step left it
        in_unit = [n for n in map(rename, unit.names) if match.loadable(n)]
        _set_state(optimizer, optimizer_key(unit), reader, pieces, layout.shard_numel, scalars0, padding_of=in_unit[:1])
    unit.record_versions()


def _load_swapped(unit, swapper, reader, pieces, load_state: bool, scalars0, from_fp32) -> None:
    """Each chunk's master and optimizer state from the saved parameters its elements cover
    (only one chunk's worth in memory at a time); elements no saved parameter covers keep
    their master and get zero state."""
    state_keys = _state_keys(reader, pieces) if load_state else None
    scalars = (
        _copy_scalars(scalars0.get(_scalar_key(reader, pieces[0][0]), {}))
        if (load_state and pieces and state_keys)
        else {}
    )
    dtypes = {what: reader.read(pieces[0][0], what, pieces[0][1], 1).dtype for what in state_keys or ()}
    for chunk in swapper.chunks_of(unit):
        lo_chunk, hi_chunk = chunk.start, chunk.start + chunk.numel
        tensors = {what.removeprefix("state/"): torch.zeros(chunk.numel, dtype=dtype) for what, dtype in dtypes.items()}
        if chunk.swap_master:
            tensors["master"] = swapper.read_key(chunk, "master").clone()
        if state_keys is None:  # optimizer state not loaded: keep what the chunk has
            tensors.update({k: swapper.read_key(chunk, k).clone() for k in chunk.state_dtypes})
            chunk_scalars = chunk.scalars
        else:
            chunk_scalars = _copy_scalars(scalars) if state_keys else {}
        for name, start, at, n in pieces:
            lo, hi = max(at, lo_chunk), min(at + n, hi_chunk)
            if lo >= hi:
                continue
            offset = start + lo - at
            if chunk.swap_master:
                what = "master" if from_fp32 and reader.has(name, "master") else "param"
                tensors["master"].narrow(0, lo - lo_chunk, hi - lo).copy_(reader.read(name, what, offset, hi - lo))
            for what in state_keys or ():
                tensors[what.removeprefix("state/")].narrow(0, lo - lo_chunk, hi - lo).copy_(
                    reader.read(name, what, offset, hi - lo)
                )
        swapper.store_chunk(chunk, tensors, chunk_scalars)


def _state_keys(reader, pieces) -> list[str]:
    """The saved elementwise state keys (``state/<key>``) shared by the parameters of ``pieces``."""
    state_keys = None
    for name, *_ in pieces:
        keys = [w for w in _saved_of(reader, name) if w.startswith("state/")]
        if state_keys is None:
            state_keys = keys
        elif sorted(keys) != sorted(state_keys):
            raise CheckpointError(
                f"{name}: its saved optimizer state ({keys}) differs from that of "
                f"the parameters it now shares a unit with ({state_keys})"
            )
    return state_keys or []


def name_of(unit, piece) -> str:
    return unit.names[piece.slot.index]


def _set_state(optimizer, key, reader, pieces, numel, scalars0, shape=None, padding_of=()) -> None:
    """The optimizer state of the stepped tensor ``key`` from the saved state of the
    parameters its ``pieces`` cover; elements no saved parameter covers (padding) are zero.
    Without pieces, ``padding_of`` (a parameter of the same unit) tells whether state was saved."""
    sources = list(pieces)
    probe = sources or [(name, 0, 0, 0) for name in padding_of]
    state_keys = _state_keys(reader, probe)
    if not state_keys:
        optimizer.state.pop(key, None)  # saved before any step: fresh state
        return
    state = {}
    for what in state_keys:
        dtype = reader.read(probe[0][0], what, 0, 1).dtype
        flat = torch.zeros(numel, dtype=dtype, device=key.device)
        for name, start, at, n in sources:
            flat.narrow(0, at, n).copy_(reader.read(name, what, start, n))
        state[what.removeprefix("state/")] = flat if shape is None else flat.view(shape)
    scalars = _copy_scalars(scalars0.get(_scalar_key(reader, probe[0][0]), {}))
    state.update(_place_scalars(optimizer, key, scalars))
    optimizer.state[key] = state


def _saved_of(reader, name) -> list[str]:
    return reader.sources[reader.canonical(name)][1]["saved"]


def _scalar_key(reader, name) -> str:
    kind, entry = reader.sources[reader.canonical(name)][:2]
    return unit_key(entry) if kind == "unit" else f"param/{name}"


def _copy_scalars(scalars: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}


def _place_scalars(optimizer, key: torch.Tensor, scalars: dict) -> dict:
    """Scalar state tensors (loaded on the host) where ``torch.optim.Optimizer.load_state_dict``
    would put them: ``step`` on the stepped tensor's device in fp32 when its group is fused or
    capturable (torch's fused/capturable kernels read it there), else left on the host; any other
    tensor on the stepped tensor's device."""
    group = next((g for g in optimizer.param_groups if any(p is key for p in g["params"])), {})
    out = {}
    for k, v in scalars.items():
        if torch.is_tensor(v):
            if k != "step":
                v = v.to(device=key.device)
            elif group.get("fused") or group.get("capturable"):
                v = v.to(dtype=torch.float32, device=key.device)
        out[k] = v
    return out
