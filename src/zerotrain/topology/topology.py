"""``Topology``: every rank and process group of one engine, on torch's ``DeviceMesh``.

The axes are DeepSpeed's: ``pipe`` (pipeline stages), ``data`` (replicas that shard and average
gradients: ZeRO's group) and ``model`` (ranks holding different slices of a layer), laid out
row-major with ``model`` fastest (``PipeModelDataParallelTopology``'s order), so data-parallel
peers are adjacent ranks. Experts split the data axis further (``expert_groups``).

Everything in zerotrain that needs a rank or a group asks the engine's topology: checkpoints
(which rank writes what), the rank-0 decisions, collectives, the gradient norm. Nothing outside
``zerotrain.comm`` and this package asks ``torch.distributed`` for a rank or a world size
without a group (``tests/test_layout.py`` checks).

Three ways to build one:
- ``Topology.build(pipe=, model=, data=)``: the world as a pipe x data x model grid.
- ``Topology.from_group(group)``: the ranks of one existing group as the data axis (an engine on
  part of the world; ``initialize(data_parallel_group=...)``).
- ``Topology.from_grid(process_topology)``: DeepSpeed's ``ProcessTopology`` layout.

Building creates process groups: every rank of the world (``from_group``: of the group) must
build the same topologies in the same order, as with ``torch.distributed.new_group``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zerotrain.topology.grid import ProcessTopology

AXES = ("pipe", "data", "model")


class _GroupRef:
    """A process group held weakly: torch's registry keeps it alive until
    ``destroy_process_group()``; a topology (or an engine holding one) must not keep it, and
    with it gloo's worker threads, alive past that (they would outlive the interpreter's
    teardown: "terminate called without an active exception")."""

    __slots__ = ("_ref",)

    def __init__(self, group):
        self._ref = weakref.ref(group) if group is not None else None

    def get(self):
        if self._ref is None:
            return None
        group = self._ref()
        if group is None:
            raise RuntimeError("the topology's process group was destroyed (destroy_process_group()); "
                               "build a new engine after initializing torch.distributed again")
        return group


@dataclass(frozen=True)
class ExpertGroups:
    """The groups of one expert-parallel size (DeepSpeed's ``ep_size_N``): ``expert`` holds the
    ranks that split the experts among them (all-to-all), ``expert_data`` the ranks that hold the
    same experts (their gradients are averaged there)."""

    name: str
    _expert: _GroupRef
    _expert_data: _GroupRef
    expert_rank: int
    expert_size: int
    expert_data_rank: int
    expert_data_size: int

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

    def __init__(self, grid: ProcessTopology, members: list[int], groups: dict | None,
                 distinct_group=None):
        self.grid = grid              # DeepSpeed's ProcessTopology over positions 0..n-1 of ``members``
        self.members = list(members)  # global ranks, in grid order
        self.distributed = groups is not None  # False: a single process without torch.distributed
        # axis -> the group along it through this rank (weakly: see _GroupRef); axes of size 1
        # without one get a group of this rank alone on first use.
        self._groups = {axis: _GroupRef(g) for axis, g in (groups or {}).items()}
        self._distinct = _GroupRef(distinct_group)
        self._expert: dict[int, ExpertGroups] = {}
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
    def single(cls) -> "Topology":
        """One process and no process group (torch.distributed not initialized)."""
        return cls(ProcessTopology(list(AXES), [1, 1, 1]), [0], None)

    @classmethod
    def build(cls, pipe: int = 1, model: int = 1, data: int | None = None) -> "Topology":
        """The world as ``pipe x data x model``; ``data`` defaults to what the others leave."""
        if not dist.is_initialized():
            if pipe * model * (data or 1) != 1:
                raise ValueError("Topology.build: a pipe/model/data size above 1 needs torch.distributed "
                                 "initialized (zerotrain.init_distributed())")
            return cls.single()
        world = dist.get_world_size()
        if world % (pipe * model):
            raise ValueError(f"Topology: the world's {world} ranks do not divide into pipe={pipe} x model={model}; "
                             "choose sizes whose product divides the world size")
        data = world // (pipe * model) if data is None else data
        if pipe * data * model != world:
            raise ValueError(f"Topology: pipe={pipe} x data={data} x model={model} is not the world size {world}")
        if pipe == model == 1:  # data parallelism alone: the world's own group, no new one
            return cls.from_group(dist.group.WORLD)
        return cls.from_grid(ProcessTopology(list(AXES), [pipe, data, model]))

    @classmethod
    def from_grid(cls, grid: ProcessTopology) -> "Topology":
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
            raise ValueError(f"the topology has {full.world_size()} ranks ({dict(zip(AXES, dims))}) but the "
                             f"world has {world}; make the product of its dims the world size")
        # The grid's rank at each (pipe, data, model) position, in DeepSpeed's own axis order.
        order = [grid.get_rank(**{a: c for a, c in zip(AXES, coord) if a in grid.get_axis_names()})
                 for coord in full.mapping]
        if dims[0] == dims[2] == 1 and order == list(range(world)):
            return cls.from_group(dist.group.WORLD)  # data parallelism alone: no new group
        # The mesh creates one group per axis through each rank; torch's registry keeps them.
        mesh = DeviceMesh(_device_type(), torch.tensor(order).view(*dims), mesh_dim_names=AXES)
        groups = {axis: mesh.get_group(axis) for axis in AXES}
        # Ranks with the same data coordinate hold distinct parameters (pipeline stages, model
        # slices): the gradient norm sums over them. Every rank creates every group, in order.
        distinct = None
        for d in range(dims[1]):
            ranks = [order[p] for p in full.filter_match(data=d)]
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if dist.get_rank() in ranks:
                distinct = group
        return cls(full, order, groups, distinct)

    @classmethod
    def from_group(cls, group) -> "Topology":
        """The ranks of ``group`` as the data axis (no pipe or model axis); None is the world."""
        if not dist.is_initialized():
            return cls.single()
        if group is None:
            group = dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        if dist.get_rank() not in ranks:
            raise ValueError("initialize(data_parallel_group=...): this rank is not a member of the group; "
                             "build the engine only on the group's ranks")
        return cls(ProcessTopology(list(AXES), [1, len(ranks), 1]), ranks, {"data": group})

    # -- the axes -------------------------------------------------------------------------
    def size(self, axis: str) -> int:
        return self.grid.get_dim(_axis(axis))

    def rank(self, axis: str) -> int:
        """This rank's position on ``axis`` (0 .. size-1)."""
        return getattr(self.coord, _axis(axis))

    def group(self, axis: str):
        """The process group along ``axis`` through this rank (torch's group; a group of this rank
        alone when the axis has size 1)."""
        axis = _axis(axis)
        if not self.distributed:
            return None
        if axis not in self._groups:  # an axis of size 1 built without a group
            self._groups[axis] = _GroupRef(dist.new_group([self.global_rank], use_local_synchronization=True))
        return self._groups[axis].get()

    def collective_group(self, axis: str):
        """``group(axis)`` as the ``group=`` argument of long-lived state (the stage object,
        units): None when it is torch's default group (the whole world), which torch's
        collectives take as the world, so nothing holds the default group itself."""
        group = self.group(axis)
        return None if group is dist.group.WORLD else group

    @property
    def mesh(self) -> DeviceMesh | None:
        """The topology as a torch ``DeviceMesh`` (dims pipe, data, model) over its existing
        groups, for DTensor and FSDP2 code; built on each access (keep it only while needed:
        it holds the groups); None without torch.distributed."""
        if not self.distributed:
            return None
        dims = [self.size(axis) for axis in AXES]
        return DeviceMesh.from_group([self.group(axis) for axis in AXES], _device_type(),
                                     mesh=torch.tensor(self.members).view(*dims), mesh_dim_names=AXES)

    def axis_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's ``axis`` group, in axis order."""
        axis = _axis(axis)
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
        replica): the group a gradient norm of replicated gradients sums over; None when it is
        this rank alone."""
        return self._distinct.get()

    @property
    def is_world(self) -> bool:
        """True when this topology spans every rank of the job."""
        return not self.distributed or len(self.members) == dist.get_world_size()

    # -- experts --------------------------------------------------------------------------
    def expert_groups(self, ep_size: int, data_before_expert: bool = False) -> ExpertGroups:
        """The groups for experts split ``ep_size`` ways over the data axis (DeepSpeed's
        ``ep_size_N`` layout: expert groups are contiguous blocks of each stage's data ranks,
        expert-data groups stride by ``ep_size``; ``data_before_expert`` swaps the two). Built on
        first use: every rank of the world must ask for the same sizes in the same order."""
        if ep_size in self._expert:
            return self._expert[ep_size]
        dp = self.data_size
        if ep_size < 1 or dp % ep_size:
            raise ValueError(f"ep_size={ep_size} must divide the data-parallel size {dp}")
        if self.size("model") != 1:
            raise NotImplementedError("expert groups with a model (tensor) parallel axis are not supported")
        if not self.is_world:
            raise NotImplementedError("expert groups need a topology over the whole world, not "
                                      "initialize(data_parallel_group=...)")
        mine_ep = mine_edp = None
        for pipe in range(self.size("pipe")):
            data = [self.members[p] for p in self.grid.filter_match(pipe=pipe, model=0)]
            blocks = [data[i:i + ep_size] for i in range(0, dp, ep_size)]
            strides = [data[i::ep_size] for i in range(ep_size)]
            ep_lists, edp_lists = (strides, blocks) if data_before_expert else (blocks, strides)
            for ranks in ep_lists:
                group = dist.new_group(ranks)
                if self.global_rank in ranks:
                    mine_ep = (group, ranks)
            for ranks in edp_lists:
                group = dist.new_group(ranks)
                if self.global_rank in ranks:
                    mine_edp = (group, ranks)
        (ep_group, ep_ranks), (edp_group, edp_ranks) = mine_ep, mine_edp
        groups = ExpertGroups(f"ep_size_{ep_size}", _GroupRef(ep_group), _GroupRef(edp_group),
                              ep_ranks.index(self.global_rank),
                              len(ep_ranks), edp_ranks.index(self.global_rank), len(edp_ranks))
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
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; the axes are {', '.join(AXES)}")
    return axis
