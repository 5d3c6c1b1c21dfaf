"""The process's current topology, and DeepSpeed's ``deepspeed.utils.groups`` getters over it.

DeepSpeed keeps its groups in module globals that layers read while a model is built (before
any engine exists): MoE layers ask for ``ep_size_N`` groups, scripts for the data-parallel group.
zerotrain's engines each own a ``Topology``; this module holds the one those global getters
answer from: the last one ``initialize`` built (or registered with ``set_current``), else the
world as one data-parallel group, built on first use. It is one of the few process-wide values
(docs/design.md, "Process-wide state"): a name lookup for code that has no engine in hand.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

from zerotrain.topology.topology import ExpertGroups, Topology

# (topology, the default group it was built under, held weakly: nothing here may keep torch's
# groups, and gloo's threads, alive past destroy_process_group()).
_current: list[tuple[Topology, weakref.ref | None]] = []


def _world_ref():
    return weakref.ref(dist.group.WORLD) if dist.is_initialized() else None


def _same_world(ref) -> bool:
    if ref is None:
        return not dist.is_initialized()
    return dist.is_initialized() and ref() is dist.group.WORLD


def set_current(topology: Topology) -> None:
    """Make ``topology`` the one DeepSpeed's global getters answer from."""
    _current[:] = [(topology, _world_ref())]


def current() -> Topology:
    """The current topology (the world as data parallelism when none was set). One built under a
    default process group that has since been destroyed is forgotten: its groups are gone."""
    if _current and not _same_world(_current[0][1]):
        _current.clear()
    if not _current:
        _current.append((Topology.build(), _world_ref()))
    return _current[0][0]


def reset(topology: Topology | None = None) -> None:
    """Forget the current topology (only if it is ``topology``, when given): an engine's
    ``destroy()`` calls it; the groups themselves belong to torch."""
    if topology is None or (_current and _current[0][0] is topology):
        _current.clear()


# -- DeepSpeed's deepspeed.utils.groups names -----------------------------------------------
def _get_data_parallel_group():
    return current().data_group


def _get_data_parallel_world_size() -> int:
    return current().data_size


def _get_data_parallel_rank() -> int:
    return current().data_rank


def _get_broadcast_src_rank() -> int:
    return current().first_global_rank("data")


def _get_model_parallel_world_size() -> int:
    return current().size("model")


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_data_parallel_world_size() -> int:
    return current().data_size


def _create_expert_and_data_parallel(expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False):
    """Build the ``ep_size_N`` groups (every rank, same order); returns nothing, as DeepSpeed's."""
    current().expert_groups(expert_parallel_size_, use_data_before_expert_parallel_)


def _expert(group_name: str) -> ExpertGroups:
    topology = current()
    for size in topology.expert_group_sizes():
        groups = topology.expert_groups(size)
        if groups.name == group_name:
            return groups
    known = ", ".join(topology.expert_groups(s).name for s in topology.expert_group_sizes()) or "none yet"
    raise KeyError(
        f"no expert group named {group_name!r} (built: {known}); "
        "_create_expert_and_data_parallel(ep_size) builds ep_size_N"
    )


def _get_expert_parallel_group(group_name: str):
    return _expert(group_name).expert_group


def _get_expert_parallel_group_dict() -> dict:
    topology = current()
    return {
        topology.expert_groups(s).name: topology.expert_groups(s).expert_group for s in topology.expert_group_sizes()
    }


def _get_expert_data_parallel_group(group_name: str):
    return _expert(group_name).expert_data_group


def _get_expert_data_parallel_group_dict() -> dict:
    topology = current()
    return {
        topology.expert_groups(s).name: topology.expert_groups(s).expert_data_group
        for s in topology.expert_group_sizes()
    }


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _expert(group_name).expert_size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _expert(group_name).expert_rank


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _expert(group_name).expert_data_size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert(group_name).expert_data_rank


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank at position 0 of this rank's expert-data group."""
    group = _expert(group_name).expert_data_group
    return dist.get_global_rank(group, 0) if group is not None else current().global_rank


def _get_max_expert_size() -> int | None:
    sizes = current().expert_group_sizes()
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    size = _get_max_expert_size()
    return f"ep_size_{size}" if size else "ep_size_1"


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


def initialize(ep_size: int = 1, mpu=None):
    raise RuntimeError(
        "deepspeed.utils.groups.initialize() is deprecated (as in DeepSpeed): expert groups "
        "are built by the MoE layers, or call _create_expert_and_data_parallel(ep_size)"
    )


DEEPSPEED_NAMES = [name for name in dir() if name.startswith("_get_") or name.startswith("_create_")] + ["initialize"]
