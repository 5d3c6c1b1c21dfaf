"""The small per-rank state a checkpoint carries besides tensors: the engine's checkpointed
components (counters, loss scaler, LR scheduler, dataloader position, PLD: each a ``Stateful``
the engine declares, ``zerotrain.checkpoint.stateful``) and the random number generators.

Everything here is stored with ``torch.save`` and read back with ``torch.load(...,
weights_only=True)``: containers, numbers, strings and tensors, with numpy values, enums,
namedtuples, ordered/default dicts and sets written as tagged dicts that :func:`read_rank_state`
turns back into their types (``zerotrain.checkpoint.state_codec``).
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from zerotrain.accelerator import get_accelerator
from zerotrain.checkpoint.format import CheckpointError
from zerotrain.checkpoint.state_codec import StateDecodeError, decode, encode
from zerotrain.checkpoint.stateful import LR_SCHEDULER, DerivedWhenAbsent, check_components

logger = logging.getLogger("zerotrain")


def capture_rng() -> dict:
    """torch (CPU and the accelerator), numpy and python RNG states of this process."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": _python_state(random.getstate()),
    }
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" and accelerator.is_available():
        state["accelerator"] = accelerator.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    accelerator = get_accelerator()
    if "accelerator" in state and accelerator.device_name() != "cpu":
        accelerator.set_rng_state(state["accelerator"])


def _python_state(state):
    version, internal, gauss = state
    return [version, list(internal), gauss]


def capture_engine(engine) -> dict:
    """Each of the engine's checkpointed components' state (``engine.checkpoint_components()``,
    ``zerotrain.checkpoint.stateful``) under its key, encoded for ``weights_only`` loading."""
    components = engine.checkpoint_components()
    check_components(components)
    return {name: _plain(component.state_dict(), name) for name, component in components.items()}


def restore_engine(engine, state: dict, load_lr_scheduler: bool) -> None:
    """Hand each declared component its saved state (in the format's order: counters first); a
    component without saved state keeps its own, or derives it (``DerivedWhenAbsent``). With
    ``load_lr_scheduler`` False the scheduler keeps its own state."""
    components = engine.checkpoint_components()
    check_components(components)
    for name, component in components.items():
        if name == LR_SCHEDULER and not load_lr_scheduler:
            continue
        if name in state:
            component.load_state_dict(state[name])
        elif isinstance(component, DerivedWhenAbsent):
            component.load_absent()
    for name in state.keys() - components.keys():  # e.g. a loader position for an IterableDataset loader
        logger.warning("the checkpoint's %r state has nothing in this engine to restore it into: not restored", name)


def _plain(value, where: str):
    """A copy of ``value`` made of what ``weights_only`` loading accepts, from which
    :func:`read_rank_state` rebuilds equal values of the same types; anything else (a function
    in a LambdaLR state, a custom object) raises ``TypeError`` naming the key path (``where``)."""
    return encode(value, where)


plain = _plain


def read_rank_state(reader, name: str) -> dict:
    """The per-rank state file ``name`` of the checkpoint ``reader`` reads: checked against
    ``metadata.json``, loaded without unpickling any class, and decoded. Every failure (a
    missing, truncated or corrupt file, a stored enum whose module is not imported) raises
    ``CheckpointError`` naming the file."""
    path = reader.folder / name
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the checkpoint {reader.folder} is incomplete "
            "(restore the file or load another checkpoint)"
        )
    reader.check_file(name)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - name the file, whatever went wrong
        raise CheckpointError(f"{path} cannot be loaded safely: {error}") from None
    try:
        return decode(raw, "state")
    except StateDecodeError as error:
        raise CheckpointError(f"{path}: {error}") from None
