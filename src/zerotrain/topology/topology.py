"""``Topology``: every rank and process group of one engine, on one torch ``DeviceMesh``.

The axes are DeepSpeed's: ``pipe`` (pipeline stages), ``data`` (replicas that shard and average
gradients: ZeRO's group) and ``model`` (ranks holding different slices of a layer; ``tensor`` is
another name for it), laid out row-major with ``model`` fastest (``PipeModelDataParallelTopology``'s
order), so data-parallel peers are adjacent ranks. The mesh (``topology.mesh``, built once with
the topology, the one DTensor/FSDP2 code uses) has a ``sequence`` axis of size 1 between data
and model besides. Experts split the data axis further (``expert_groups``). Every group the
library uses is created by a topology (``zerotrain.topology.groups``): the axes' (the mesh's),
``distinct``, expert, tied-layer and checkpoint-agreement groups.

Everything in zerotrain that needs a rank or a group asks the engine's topology: checkpoints
(which rank writes what), the rank-0 decisions, collectives, the gradient norm. Nothing outside
``zerotrain.comm`` and this package asks ``torch.distributed`` for a rank or a world size
without a group (``tests/test_layout.py`` checks).

Three ways to build one:
- ``Topology.build(pipe=, model=, data=)``: the world as a pipe x data x model grid.
- ``Topology.from_group(group)``: the ranks of one existing group as the data axis (an engine on
  part of the world; ``initialize(data_parallel_group=...)``).
- ``Topology.from_grid(process_topology)``: DeepSpeed's ``ProcessTopology`` layout.

Building a grid creates process groups: every rank of the world must build the same topologies in
the same order, as with ``torch.distributed.new_group``. ``from_group`` creates none (its mesh, on
first use, adds a group of each rank alone, made by that rank only).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerotrain.topology.grid import ProcessTopology
from zerotrain.topology.groups import (
    GroupRef,
    flatten_axes,
    mesh_from_groups,
    mesh_over_world,
    new_group,
    own_rank_group,
    split_axis,
)

#: DeepSpeed's axes (``ProcessTopology``, ``PipelineParallelGrid``), row-major, model fastest.
AXES = ("pipe", "data", "model")
#: The mesh's axes: DeepSpeed's with ``sequence`` (size 1 until sequence parallelism) between data
#: and model, so the rank layout is DeepSpeed's. ``model`` is the tensor-parallel axis; ``tensor``
#: names it too (``size("tensor")``).
MESH_AXES = ("pipe", "data", "sequence", "model")
ALIASES = {"tensor": "model"}
#: The mesh axes whose ranks hold distinct parameters of one data replica (the ``distinct`` group).
DISTINCT_AXES = ("pipe", "sequence", "model")


@dataclass(frozen=True)
class ExpertGroups:
    """The groups of one expert-parallel size (DeepSpeed's ``ep_size_N``): ``expert`` holds the
    ranks that split the experts among them (all-to-all), ``expert_data`` the ranks that hold the
    same experts (their gradients are averaged there). ``mesh``: the topology's mesh with its data
    axis split into ``expert_data`` x ``expert`` (``expert`` x ``expert_data`` for DeepSpeed's
    ``use_data_before_expert_parallel_``)."""

    name: str
    _expert: GroupRef
    _expert_data: GroupRef
    expert_rank: int
    expert_size: int
    expert_data_rank: int
    expert_data_size: int
    mesh: Any = None

    @property
    def expert_group(self):
        return self._expert.get()

    @property
    def expert_data_group(self):
        return self._expert_data.get()


def _device_type() -> str:
    from zerotrain.accelerator import get_accelerator

    return get_accelerator().device_name()


class Topology:
    """The ranks and groups of one engine. Build with ``build``, ``from_group`` or ``from_grid``."""

    def __init__(self, grid: ProcessTopology, members: list[int], groups: dict | None, mesh=None, distinct_group=None):
        self.grid = grid  # DeepSpeed's ProcessTopology over positions 0..n-1 of ``members``
        self.members = list(members)  # global ranks, in grid order
        self.distributed = groups is not None  # False: a single process without torch.distributed
        self._mesh = mesh
        # axis -> the group along it through this rank (the mesh's), weakly (topology/groups.py);
        # axes of size 1 without one share a group of this rank alone, made on first use.
        self._groups = {axis: GroupRef(g) for axis, g in (groups or {}).items()}
        self._distinct = GroupRef(distinct_group)
        self._expert: dict[int, ExpertGroups] = {}
        self._agreement: dict[tuple[int, ...], weakref.ref] = {}
        if not self.distributed:
            self.global_rank = 0
        else:
            self.global_rank = dist.get_rank()  # the process's own rank: the world is comm's, not ours
        position = self.members.index(self.global_rank) if self.global_rank in self.members else -1
        if position < 0:
            raise ValueError(f"rank {self.global_rank} is not one of this topology's ranks {self.members}")
        self.coord = grid.get_coord(position)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def single(cls) -> Topology:
        """One process and no process group (torch.distributed not initialized): no mesh."""
        return cls(ProcessTopology(list(AXES), [1, 1, 1]), [0], None)

    @classmethod
    def build(cls, pipe: int = 1, model: int = 1, data: int | None = None) -> Topology:
        """The world as ``pipe x data x model``; ``data`` defaults to what the others leave."""
        if not dist.is_initialized():
            if pipe * model * (data or 1) != 1:
                raise ValueError(
                    "Topology.build: a pipe/model/data size above 1 needs torch.distributed "
                    "initialized (zerotrain.init_distributed())"
                )
            return cls.single()
        world = dist.get_world_size()
        if world % (pipe * model):
            raise ValueError(
                f"Topology: the world's {world} ranks do not divide into pipe={pipe} x model={model}; "
                "choose sizes whose product divides the world size"
            )
        data = world // (pipe * model) if data is None else data
        if pipe * data * model != world:
            raise ValueError(f"Topology: pipe={pipe} x data={data} x model={model} is not the world size {world}")
        if pipe == model == 1:  # data parallelism alone: the world's own group, no new one
            return cls.from_group(dist.group.WORLD)
        return cls.from_grid(ProcessTopology(list(AXES), [pipe, data, model]))

    @classmethod
    def from_grid(cls, grid: ProcessTopology) -> Topology:
        """DeepSpeed's layout over the whole world (every rank must call this)."""
        unknown = [axis for axis in grid.get_axis_names() if axis not in AXES]
        if unknown:
            raise ValueError(f"topology axes {unknown} are not supported; use {list(AXES)}")
        dims = [grid.get_dim(axis) or 1 for axis in AXES]
        full = ProcessTopology(list(AXES), dims)
        if not dist.is_initialized():
            if full.world_size() != 1:
                raise ValueError("a topology of more than one rank needs torch.distributed initialized")
            return cls.single()
        world = dist.get_world_size()
        if full.world_size() != world:
            raise ValueError(
                f"the topology has {full.world_size()} ranks ({dict(zip(AXES, dims))}) but the "
                f"world has {world}; make the product of its dims the world size"
            )
        # The grid's rank at each (pipe, data, model) position, in DeepSpeed's own axis order.
        order = [
            grid.get_rank(**{a: c for a, c in zip(AXES, coord) if a in grid.get_axis_names()}) for coord in full.mapping
        ]
        if dims[0] == dims[2] == 1 and order == list(range(world)):
            return cls.from_group(dist.group.WORLD)  # data parallelism alone: no new group
        # The mesh creates one group per axis through each rank (sequence: this rank alone).
        pipe, data, model = dims
        mesh = mesh_over_world(_device_type(), torch.tensor(order).view(pipe, data, 1, model), MESH_AXES)
        # Ranks with the same data coordinate hold distinct parameters (pipeline stages, model
        # slices): the gradient norm sums over them. Every rank creates every group, in order.
        distinct = flatten_axes(mesh, DISTINCT_AXES, "distinct") if pipe * model > 1 else None
        return cls(full, order, {axis: mesh.get_group(axis) for axis in MESH_AXES}, mesh, distinct)

    @classmethod
    def from_group(cls, group) -> Topology:
        """The ranks of ``group`` as the data axis (the other axes of size 1); None is the world.
        Creates no group: its mesh is built over ``group`` and a group of this rank alone (created
        by this rank only) when first asked for. Only the group's ranks call this."""
        if not dist.is_initialized():
            return cls.single()
        if group is None:
            group = dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        if dist.get_rank() not in ranks:
            raise ValueError(
                "initialize(data_parallel_group=...): this rank is not a member of the group; "
                "build the engine only on the group's ranks"
            )
        return cls(ProcessTopology(list(AXES), [1, len(ranks), 1]), ranks, {"data": group})

    # -- the axes -------------------------------------------------------------------------
    def size(self, axis: str) -> int:
        axis = _axis(axis)
        return self.grid.get_dim(axis) if axis in AXES else 1

    def rank(self, axis: str) -> int:
        """This rank's position on ``axis`` (0 .. size-1)."""
        axis = _axis(axis)
        return getattr(self.coord, axis) if axis in AXES else 0

    def group(self, axis: str):
        """The process group along ``axis`` through this rank (the mesh's; a group of this rank
        alone when the axis has size 1); None without torch.distributed."""
        axis = _axis(axis)
        if not self.distributed:
            return None
        if axis not in self._groups:  # an axis of size 1 built without a group
            if "alone" not in self._groups:
                data = self.group("data")
                self._groups["alone"] = GroupRef(data if self.data_size == 1 else own_rank_group())
            self._groups[axis] = self._groups["alone"]
        return self._groups[axis].get()

    def collective_group(self, axis: str):
        """``group(axis)`` as the ``group=`` argument of long-lived state (the stage object,
        units): None when it is torch's default group (the whole world), which torch's
        collectives take as the world, so nothing holds the default group itself."""
        group = self.group(axis)
        return None if group is dist.group.WORLD else group

    @property
    def mesh(self):
        """The topology as torch's ``DeviceMesh`` (dims ``MESH_AXES``: pipe, data, sequence,
        model), holding its groups weakly: the mesh DTensor and FSDP2 code uses. One per topology,
        kept: a grid's is built with it (it creates the groups), a group's on first use over its
        groups. None without torch.distributed."""
        if self._mesh is None and self.distributed:
            ranks = torch.tensor(self.members).view(*(self.size(axis) for axis in MESH_AXES))
            self._mesh = mesh_from_groups(_device_type(), [self.group(axis) for axis in MESH_AXES], ranks, MESH_AXES)
        return self._mesh

    def axis_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's ``axis`` group, in axis order."""
        axis = _axis(axis)
        if axis not in AXES:  # an axis of size 1 outside DeepSpeed's grid
            return [self.global_rank]
        where = {a: getattr(self.coord, a) for a in AXES if a != axis}
        return [self.members[p] for p in self.grid.filter_match(**where)]

    def first_global_rank(self, axis: str) -> int:
        """The global rank at position 0 of this rank's ``axis`` group (a broadcast's source)."""
        return self.axis_ranks(axis)[0]

    def is_first(self, axis: str) -> bool:
        return self.rank(axis) == 0

    @property
    def world_size(self) -> int:
        """The ranks of this topology (the world, or the group it was built from)."""
        return len(self.members)

    # DeepSpeed's and the engine's most asked-for values.
    @property
    def data_group(self):
        return self.group("data")

    @property
    def data_rank(self) -> int:
        return self.rank("data")

    @property
    def data_size(self) -> int:
        return self.size("data")

    @property
    def distinct_size(self) -> int:
        """How many ranks hold distinct parameters beside this one's data replica (pipe x model)."""
        return self.size("pipe") * self.size("model")

    @property
    def distinct_group(self):
        """The ranks with this rank's data coordinate (every pipeline stage and model slice of one
        replica; the mesh's flattened ``distinct`` axis): the group a gradient norm of replicated
        gradients sums over; None when it is this rank alone."""
        return self._distinct.get()

    @property
    def is_world(self) -> bool:
        """True when this topology spans every rank of the job."""
        return not self.distributed or len(self.members) == dist.get_world_size()

    # -- groups beyond the axes -----------------------------------------------------------
    def tied_group(self, ranks: list[int], key: str):
        """A group over ``ranks``: the ranks of the pipeline stages holding one tied layer
        (``TiedLayerSpec`` ``key``). A collective of the world: every rank creates every tied
        group, in the same order, member or not."""
        return new_group(ranks=list(ranks), op=f"new_group (tied layer {key!r})")

    def agreement_group(self, ranks: list[int], within):
        """The checkpoint agreement's gloo group over ``ranks``, the ranks of ``within`` (this
        rank among them): host-side object exchanges, safe from a background thread while
        training uses ``within``. Created on first use by those ranks only (an engine on part of
        the job never waits for ranks outside it), then kept (weakly) by this topology."""
        key = tuple(sorted(ranks))
        ref = self._agreement.get(key)
        group = ref() if ref is not None else None
        if group is None:
            group = new_group(list(key), backend="gloo", op="new_group (save_checkpoint)", within=within)
            self._agreement[key] = weakref.ref(group)
        return group

    # -- experts --------------------------------------------------------------------------
    def expert_groups(self, ep_size: int, data_before_expert: bool = False) -> ExpertGroups:
        """The groups for experts split ``ep_size`` ways over the data axis (DeepSpeed's
        ``ep_size_N`` layout: the mesh's data axis split into ``expert_data`` x ``expert``, so
        expert groups are contiguous blocks of each stage's data ranks and expert-data groups
        stride by ``ep_size``; ``data_before_expert`` swaps the two). Built on first use: every
        rank of the world must ask for the same sizes in the same order."""
        if ep_size in self._expert:
            return self._expert[ep_size]
        dp = self.data_size
        if ep_size < 1 or dp % ep_size:
            raise ValueError(f"ep_size={ep_size} must divide the data-parallel size {dp}")
        if self.size("model") != 1:
            raise NotImplementedError("expert groups with a model (tensor) parallel axis are not supported")
        if not self.is_world:
            raise NotImplementedError(
                "expert groups need a topology over the whole world, not initialize(data_parallel_group=...)"
            )
        if data_before_expert:
            mesh = split_axis(self.mesh, "data", (ep_size, dp // ep_size), ("expert", "expert_data"))
        else:
            mesh = split_axis(self.mesh, "data", (dp // ep_size, ep_size), ("expert_data", "expert"))
        ep_group, edp_group = mesh.get_group("expert"), mesh.get_group("expert_data")
        groups = ExpertGroups(
            f"ep_size_{ep_size}",
            GroupRef(ep_group),
            GroupRef(edp_group),
            ep_group.rank(),
            ep_group.size(),
            edp_group.rank(),
            edp_group.size(),
            mesh,
        )
        self._expert[ep_size] = groups
        return groups

    def expert_group_sizes(self) -> list[int]:
        return sorted(self._expert)

    def describe(self) -> str:
        sizes = " x ".join(f"{axis} {self.size(axis)}" for axis in AXES)
        return f"{sizes} ({self.world_size} ranks)"

    def __repr__(self) -> str:
        return f"Topology({self.describe()}, rank {self.global_rank} at {tuple(self.coord)})"


def _axis(axis: str) -> str:
    axis = ALIASES.get(axis, axis)
    if axis not in MESH_AXES:
        raise ValueError(f"unknown axis {axis!r}; the axes are {', '.join(MESH_AXES)} ({', '.join(ALIASES)} is model)")
    return axis
