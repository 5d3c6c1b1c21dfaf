"""DeepSpeed's ``deepspeed.runtime.zero.stage3`` estimator helpers (see zerotrain.estimate)."""

from zerotrain.estimate.deepspeed_compat import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    model_to_params,
)

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "model_to_params",
]
