"""``PipelineParallelGrid``: DeepSpeed's ``mpu`` for a pipe x data (x model) layout, answering
from a ``Topology``. Pass it as ``initialize(mpu=grid)``; the engine then uses the same topology."""

from __future__ import annotations

from zerotrain.topology.grid import PipeDataParallelTopology, ProcessTopology
from zerotrain.topology.process_rank import process_world_size
from zerotrain.topology.topology import Topology


def _split_world(world: int) -> tuple[int, int]:
    """DeepSpeed's default without a topology: the world's prime factors go alternately to the
    pipe and data sizes, smallest first."""
    factors, n, p = [], world, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    pipe = data = 1
    for i, f in enumerate(factors):
        if i % 2 == 0:
            pipe *= f
        else:
            data *= f
    return pipe, data


class PipelineParallelGrid:
    """Ranks and groups of a pipeline-parallel job, under DeepSpeed's method names."""

    def __init__(self, topology: ProcessTopology | None = None, process_group=None):
        if process_group is not None:
            raise NotImplementedError(
                "PipelineParallelGrid(process_group=...) is not supported; the grid spans the world"
            )
        if topology is None:
            topology = PipeDataParallelTopology(*_split_world(process_world_size()))
        self._topo = topology
        self.topology_ = Topology.from_grid(topology)
        t = self.topology_
        self.global_rank = t.global_rank
        self.world_size = t.world_size
        self.pipe_parallel_size = t.size("pipe")
        self.data_parallel_size = t.size("data")
        self.model_parallel_size = t.size("model")
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = t.rank("pipe")
        self.data_parallel_id = t.rank("data")
        self.p2p_groups = self._p2p_pairs()

    @classmethod
    def from_topology(cls, topology: Topology) -> PipelineParallelGrid:
        """A grid answering from an existing ``Topology`` (no new process groups)."""
        grid = cls.__new__(cls)
        grid._topo = topology.grid
        grid.topology_ = topology
        grid.global_rank, grid.world_size = topology.global_rank, topology.world_size
        grid.pipe_parallel_size, grid.data_parallel_size = topology.size("pipe"), topology.size("data")
        grid.model_parallel_size = grid.slice_parallel_size = topology.size("model")
        grid.stage_id, grid.data_parallel_id = topology.rank("pipe"), topology.rank("data")
        grid.p2p_groups = grid._p2p_pairs()
        return grid

    def _p2p_pairs(self) -> list[list[int]]:
        # [rank, the same replica's rank on the next stage] for every rank (the last stage wraps).
        t, pairs = self.topology_, []
        for position, rank in enumerate(t.members):
            coord = t.grid.get_coord(position)
            nxt = t.grid.get_rank(pipe=(coord.pipe + 1) % t.size("pipe"), data=coord.data, model=coord.model)
            pairs.append([rank, t.members[nxt]])
        return pairs

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe_parallel_size - 1

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The global rank of ``stage_id`` with this rank's other coordinates (``kwargs`` override)."""
        t = self.topology_
        coord = {axis: getattr(t.coord, axis) for axis in ("pipe", "data", "model")}
        coord.update(kwargs, pipe=stage_id)
        return t.members[t.grid.get_rank(**coord)]

    # pipe axis
    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.topology_.group("pipe")

    # data axis
    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.topology_.data_group

    # DeepSpeed's "model parallel": every stage and slice of one replica (norm, overflow)
    def get_model_parallel_rank(self) -> int:
        t = self.topology_
        return t.rank("pipe") * t.size("model") + t.rank("model")

    def get_model_parallel_world_size(self) -> int:
        return self.topology_.distinct_size

    def get_model_parallel_group(self):
        t = self.topology_
        return t.distinct_group if t.distinct_group is not None else t.group("model")

    # the model axis (tensor slices)
    def get_slice_parallel_rank(self) -> int:
        return self.topology_.rank("model")

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self.topology_.group("model")
