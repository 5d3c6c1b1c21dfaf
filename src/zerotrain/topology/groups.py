"""Creating process groups and device meshes: the only place in zerotrain that does.

Every group the library uses is made here, through a ``Topology`` (its mesh's axes, the
distinct and expert groups, tied-layer and checkpoint-agreement groups), so the rules below hold
for all of them:

- held weakly: torch's registry keeps a group alive until ``destroy_process_group()``; nothing of
  zerotrain may keep one (and with it gloo's worker threads) alive past that, or the threads
  outlive the interpreter's teardown ("terminate called without an active exception"). A
  ``DeviceMesh`` keeps its groups in ``_pg_registry`` (a cache torch.compile reads); the meshes
  made here get a weak one (``weak_mesh``).
- a new group (``new_group``) gets ``default_timeout()`` (``ZEROTRAIN_COMM_TIMEOUT``; torch's
  default for a new group is 30 minutes whatever the default group's timeout is), and a creation
  that a rank never joins raises ``CollectiveError`` naming the absent ranks (``zerotrain.comm.hang``),
  through the ``CreationWatch`` zerotrain.comm attaches.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


class GroupRef:
    """A process group held weakly (see the module's docstring)."""

    __slots__ = ("_ref",)

    def __init__(self, group):
        self._ref = weakref.ref(group) if group is not None else None

    def get(self):
        if self._ref is None:
            return None
        group = self._ref()
        if group is None:
            raise RuntimeError(
                "the topology's process group was destroyed (destroy_process_group()); "
                "build a new engine after initializing torch.distributed again"
            )
        return group


class CreationWatch:
    """What a group's creation runs under: the new group's timeout, and the collective it counts
    as. ``zerotrain.comm`` attaches its own (``watch_group_creation``): ``default_timeout()``, and
    the creation run as a collective of ``within``'s ``Collectives`` object, so hooks see it and a
    rank that never comes is named by the hang diagnosis. Attached from comm, not imported from
    it, because comm's logging asks this package for the process's rank (comm depends on
    topology, never the reverse). Without comm: torch's timeout and torch's error."""

    def timeout(self):
        """The new group's timeout; None: torch's default."""

    def run(self, op: str, within, create):
        """Create the group (``create()``), a collective of ``within`` (None: the world)."""
        return create()


_watch = [CreationWatch()]


def watch_group_creation(watch: CreationWatch) -> None:
    """Run every group creation under ``watch`` (zerotrain.comm attaches its diagnosis)."""
    _watch[0] = watch


def new_group(ranks=None, backend=None, op: str = "new_group", within=None):
    """``torch.distributed.new_group`` with the watch's timeout (comm's ``default_timeout()``) for
    the group's collectives and its error (comm's ``CollectiveError`` naming the absent ranks) if
    they do not all create it (it is a collective of the default group: every rank must call it,
    in the same order).

    ``within``: an existing group holding exactly ``ranks``; then only those ranks create the new
    group (torch's ``use_local_synchronization``: ranks outside take no part), and the creation
    counts as a collective of ``within`` for the error naming an absent rank."""
    watch = _watch[0]

    def create():
        if within is None:
            return dist.new_group(ranks=ranks, backend=backend, timeout=watch.timeout())
        return dist.new_group(ranks=ranks, backend=backend, timeout=watch.timeout(), use_local_synchronization=True)

    return watch.run(op, within, create)


def own_rank_group():
    """A group of this rank alone (the group of an axis of size 1), created by this rank only."""
    return dist.new_group(ranks=[dist.get_rank()], timeout=_watch[0].timeout(), use_local_synchronization=True)


def weak_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` with its group cache holding the groups weakly (torch's registry keeps them
    until ``destroy_process_group()``; the mesh looks them up by name)."""
    # torch annotates the private cache as a dict; a WeakValueDictionary serves its lookups
    mesh._pg_registry = weakref.WeakValueDictionary(mesh._pg_registry)  # type: ignore[assignment]
    return mesh


def mesh_over_world(device_type: str, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """A mesh over the whole world laid out as ``ranks`` (a tensor of global ranks, one dim per
    name), creating one group per axis through each rank (every rank of the world calls this)."""
    return weak_mesh(DeviceMesh(device_type, ranks, mesh_dim_names=names))


def mesh_from_groups(device_type: str, groups: list, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """A mesh over existing groups (one per axis, in ``names`` order; no group is created)."""
    return weak_mesh(DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names))


def split_axis(mesh: DeviceMesh, axis: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with ``axis`` split into ``names`` of ``sizes`` (the last varies fastest),
    creating their groups (every rank of the world calls this). The groups are new ones even
    where an axis spans the world (torch would hand back the default group, which long-lived
    state may then keep alive)."""
    backend = dist.get_backend()
    return mesh._unflatten(axis, sizes, names, backend_override={name: backend for name in names})


def flatten_axes(mesh: DeviceMesh, axes: tuple[str, ...], name: str):
    """The group of ``axes`` taken together through this rank, as the mesh's axis ``name``
    (created on first use; every rank of the world calls this). A new group even where it spans
    the world, as in ``split_axis``."""
    if name not in mesh._get_root_mesh()._flatten_mapping:
        mesh[axes]._flatten(name, backend_override=dist.get_backend())
    return mesh.get_group(name)


__all__ = [
    "GroupRef",
    "CreationWatch",
    "watch_group_creation",
    "new_group",
    "own_rank_group",
    "weak_mesh",
    "mesh_over_world",
    "mesh_from_groups",
    "split_axis",
    "flatten_axes",
]
