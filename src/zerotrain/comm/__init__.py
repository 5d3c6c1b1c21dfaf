"""Collectives and process-group management (``zerotrain.comm``, like ``deepspeed.comm``).

``configure``/``log_summary`` and the profiling switches are the comms logger's
(``zerotrain.comm.logger``); ``CollectiveError`` is raised when a collective times out or a peer
fails, naming the ranks that had not arrived (``zerotrain.comm.hang``).
"""

from zerotrain.comm.collectives import (ReduceOp, all_gather_into, all_reduce, barrier, broadcast,
                                        reduce_scatter_into)
from zerotrain.comm.distributed import (destroy_distributed, get_local_rank, get_rank,
                                        get_world_size, init_distributed)
from zerotrain.comm.hang import CollectiveError
from zerotrain.comm import objects as _objects  # noqa: F401  (attaches the diagnosis to group creation)
from zerotrain.comm.logger import (comms_logger, configure, log_summary, start_profiling_comms,
                                   start_profiling_op, stop_profiling_comms, stop_profiling_op)

__all__ = [
    "ReduceOp", "all_gather_into", "all_reduce", "barrier", "broadcast", "reduce_scatter_into",
    "destroy_distributed", "get_local_rank", "get_rank", "get_world_size", "init_distributed",
    "CollectiveError", "comms_logger", "configure", "log_summary", "start_profiling_comms",
    "start_profiling_op", "stop_profiling_comms", "stop_profiling_op",
]
