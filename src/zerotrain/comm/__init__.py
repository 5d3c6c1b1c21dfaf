"""Collectives and process-group management (``zerotrain.comm``, like ``deepspeed.comm``)."""

from zerotrain.comm.collectives import (ReduceOp, all_gather_into, all_reduce, barrier, broadcast,
                                        reduce_scatter_into)
from zerotrain.comm.distributed import (destroy_distributed, get_local_rank, get_rank,
                                        get_world_size, init_distributed)

__all__ = [
    "ReduceOp", "all_gather_into", "all_reduce", "barrier", "broadcast", "reduce_scatter_into",
    "destroy_distributed", "get_local_rank", "get_rank", "get_world_size", "init_distributed",
]
