"""DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2`` estimator helpers (see zerotrain.estimate)."""

from zerotrain.estimate.deepspeed_compat import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero2_model_states_mem_needs_all_cold",
]
