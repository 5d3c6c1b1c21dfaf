"""``deepspeed.utils.groups``: re-exports of zerotrain.topology.process_wide's getters (DeepSpeed's names)."""

from zerotrain.topology.process_wide import (  # noqa: F401
    _create_expert_and_data_parallel, _get_broadcast_src_rank, _get_data_parallel_group,
    _get_data_parallel_rank, _get_data_parallel_world_size, _get_expert_broadcast_src_rank,
    _get_expert_data_parallel_group, _get_expert_data_parallel_group_dict, _get_expert_data_parallel_rank,
    _get_expert_data_parallel_world_size, _get_expert_parallel_group, _get_expert_parallel_group_dict,
    _get_expert_parallel_rank, _get_expert_parallel_world_size, _get_max_expert_parallel_group,
    _get_max_expert_size, _get_max_expert_size_name, _get_model_parallel_world_size,
    _get_sequence_data_parallel_world_size, _get_sequence_parallel_world_size, initialize,
)

__all__ = [
    "_create_expert_and_data_parallel", "_get_broadcast_src_rank", "_get_data_parallel_group",
    "_get_data_parallel_rank", "_get_data_parallel_world_size", "_get_expert_broadcast_src_rank",
    "_get_expert_data_parallel_group", "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_rank", "_get_expert_data_parallel_world_size", "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict", "_get_expert_parallel_rank", "_get_expert_parallel_world_size",
    "_get_max_expert_parallel_group", "_get_max_expert_size", "_get_max_expert_size_name",
    "_get_model_parallel_world_size", "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_world_size", "initialize",
]
