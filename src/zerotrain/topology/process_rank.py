"""This process's rank, for messages about the process itself (the log prefix), without building
a topology.

``zerotrain.log`` sits below ``zerotrain.comm`` in the import order (comm logs), so it cannot ask
comm; and building a topology creates process groups, a collective no log call may start. Every
``Topology``'s ``global_rank`` is this same number (torch's rank of the process in the default
group), so the answer is the current topology's whenever one exists.
"""

from __future__ import annotations


def process_rank() -> int:
    """The process's global rank; -1 before torch.distributed is initialized (DeepSpeed's
    ``log_dist`` prints rank -1 then)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return -1
    return dist.get_rank()


def process_world_size() -> int:
    """How many processes the job's default group holds (1 before torch.distributed is
    initialized): what a ``PipelineModule`` divides into stages before any topology exists."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()
