"""DeepSpeed's rank arithmetic for a Cartesian grid of processes, with no process groups.

``ProcessTopology(axes, dims)`` maps each rank to a coordinate and back, row-major (the last axis
varies fastest), as ``deepspeed.runtime.pipe.topology`` does: with axes ``["pipe", "data"]`` and dims
``[2, 2]`` stage 0 is ranks {0, 1} and stage 1 is {2, 3}, so data-parallel peers are adjacent ranks
(gradient reduction stays inside a node). ``zerotrain.topology.Topology`` builds its groups from the
same layout.
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology"]


class ProcessTopology:
    """Ranks laid out on the axes ``axes`` of sizes ``dims``, row-major."""

    def __init__(self, axes, dims):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names repeat in {axes}")
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {dims}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self.mapping = {
            self.ProcessCoord(*coord): rank for rank, coord in enumerate(itertools.product(*(range(d) for d in dims)))
        }

    def get_rank(self, **coord_kwargs) -> int:
        """The rank at a full coordinate, e.g. ``get_rank(pipe=1, data=0)``."""
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(f"get_rank() needs a value for each axis {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank(): {coord_kwargs} is outside dims {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-") -> str:
        """``"model_01"``-style name of ``rank``'s coordinate on the axes not omitted (checkpoint names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit_axes
        )

    def get_dim(self, axis: str) -> int:
        """The size of ``axis``; 0 when the topology has no such axis (DeepSpeed's answer)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is not in this topology of {self.world_size()} ranks")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists that vary only along ``axis`` (one process group each); ``[]`` for no such axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            where = dict(zip(others, fixed))
            lists.append([self.get_rank(**where, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs) -> list[int]:
        """The ranks whose coordinate matches every ``axis=value`` given, in rank order."""
        return [
            rank
            for coord, rank in sorted(self.mapping.items(), key=lambda item: item[1])
            if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on ``axis`` is ``idx``."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return math.prod(self.dims)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Axes ``["pipe", "data"]``: pipeline stages of data-parallel replicas."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes ``["pipe", "data", "model"]`` with dims ``[num_pp, num_dp, num_mp]`` (the argument order
    is DeepSpeed's, not the axis order)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
