"""Collectives and process-group management (``zerotrain.comm``, like ``deepspeed.comm``).

Every collective is issued by its process group's ``Collectives`` object (``Collectives.of(group)``,
``zerotrain.comm.group``): the functions below are its methods. ``configure``/``log_summary``
and the profiling switches are the comms logger's (``zerotrain.comm.logger``);
``CollectiveError`` is raised when a collective times out or a peer fails, naming the ranks that
had not arrived (``zerotrain.comm.hang``).
"""

from zerotrain.comm import objects as _objects  # noqa: F401  (attaches the diagnosis to group creation)
from zerotrain.comm.codec import CastCodec, Codec
from zerotrain.comm.collectives import (
    ReduceOp,
    all_gather_into,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    reduce_scatter_into,
)
from zerotrain.comm.distributed import destroy_distributed, get_local_rank, get_rank, get_world_size, init_distributed
from zerotrain.comm.group import Collectives
from zerotrain.comm.hang import CollectiveError
from zerotrain.comm.hooks import ByteCounter, Call, CollectiveHook
from zerotrain.comm.logger import (
    comms_logger,
    configure,
    log_summary,
    start_profiling_comms,
    start_profiling_op,
    stop_profiling_comms,
    stop_profiling_op,
)

__all__ = [
    "ReduceOp",
    "all_gather_into",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "reduce_scatter_into",
    "Collectives",
    "CollectiveHook",
    "Call",
    "ByteCounter",
    "Codec",
    "CastCodec",
    "destroy_distributed",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "CollectiveError",
    "comms_logger",
    "configure",
    "log_summary",
    "start_profiling_comms",
    "start_profiling_op",
    "stop_profiling_comms",
    "stop_profiling_op",
]
