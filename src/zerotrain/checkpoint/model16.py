"""Whole-model weights in the training dtype, gathered to the first rank of the engine's
data-parallel group (``engine.save_16bit_model``).

"Rank 0" is the first rank of ``group`` (the engine's data group, ``engine.topology.data_group``),
else of the stage-3 coordinator's group, else of the world: two engines on disjoint groups of one
job each write their own model file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.topology.process_rank import process_rank


def _first_rank_group(coordinator, group):
    """The group whose first rank keeps the gathered weights (see the module's docstring)."""
    if group is not None:
        return group
    return coordinator.group if coordinator is not None else None


def _is_first(group) -> bool:
    if not dist.is_initialized():
        return True
    if group is None:  # no engine group given: the job's rank 0 (-1: no process group)
        return process_rank() <= 0
    return dist.get_rank(group) == 0


def full_state_dict(
    module: nn.Module, coordinator=None, exclude_frozen_parameters: bool = False, rank0_only: bool = True, group=None
) -> dict[str, torch.Tensor]:
    """The module's state dict with every partitioned parameter gathered, as CPU tensors.

    Collective at stage 3 (every rank of the coordinator's group must call it); units are
    gathered one at a time, so the peak is one unit plus the growing CPU copy (on the first rank
    of ``group``, the engine's data group, only, with ``rank0_only``).
    """
    keep = not rank0_only or _is_first(_first_rank_group(coordinator, group))
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if exclude_frozen_parameters and not p.requires_grad:
            continue
        names_of.setdefault(id(p), []).append(name)
    out: dict[str, torch.Tensor] = {}
    units = coordinator.units if coordinator is not None else []
    in_units = {id(p) for u in units for p in u.params}
    for unit in units:
        coordinator.fetch(unit)
        if keep:
            for p in unit.params:
                for name in names_of.get(id(p), []):
                    out[name] = p.detach().to("cpu", copy=True)
        coordinator.release(unit)
    if keep:
        for name, t in module.state_dict(keep_vars=True).items():
            if name in out or id(t) in in_units:
                continue
            if isinstance(t, nn.Parameter) and id(t) not in names_of:
                continue  # an excluded frozen parameter
            out[name] = t.detach().to("cpu", copy=True)
    # Order as the module lists its state, so a reader sees the familiar layout.
    order = list(module.state_dict(keep_vars=True).keys())
    return {k: out[k] for k in order if k in out}


def save_16bit_model(
    module: nn.Module,
    save_dir,
    save_filename: str,
    coordinator=None,
    exclude_frozen_parameters: bool = False,
    group=None,
) -> Path | None:
    """Write the gathered weights on the first rank of ``group`` (the engine's data group; see
    the module's docstring): safetensors for ``*.safetensors``, else a ``torch.save`` state dict
    (readable with ``torch.load(..., weights_only=True)``). The file is written to a temporary
    name and renamed, so a crash never leaves a half-written model. Returns its path there,
    None on the other ranks."""
    state = full_state_dict(module, coordinator, exclude_frozen_parameters, group=group)
    if not _is_first(_first_rank_group(coordinator, group)):
        return None
    path = Path(save_dir) / save_filename
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt"})
        else:
            torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
