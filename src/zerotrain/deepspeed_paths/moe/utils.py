"""``deepspeed.moe.utils``: tell expert parameters apart and give them their own optimizer groups
(implemented in ``zerotrain.optim.expert_groups``)."""

from zerotrain.optim.expert_groups import (
    DEFAULT_MAX_GROUP_SIZE,
    configure_moe_param_groups,
    is_moe_param,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)

__all__ = [
    "is_moe_param",
    "is_moe_param_group",
    "split_params_into_shared_and_expert_params",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "configure_moe_param_groups",
    "DEFAULT_MAX_GROUP_SIZE",
]
