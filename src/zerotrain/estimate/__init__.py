"""Memory estimator and sizing planner: know before launch whether a job fits, and how.

    from zerotrain.estimate import estimate, from_hf_config, Hardware, Workload, Settings
    est = estimate(from_hf_config("config.json"), Hardware(gpus_per_node=4, gpu_memory=24 * 2**30),
                   Workload(micro_batch=1, seq_len=512))
    print(est.text()); est.ds_config()

See docs/estimate.md. ``zerotrain estimate`` is the command line of the same.
"""

from zerotrain.estimate.activations import (
    ActivationBytes,
    formula_activations,
    korthikanti_layer_bytes,
    measure_saved_bytes,
    measured_activations,
)
from zerotrain.estimate.deepspeed_compat import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from zerotrain.estimate.estimator import Estimate, estimate
from zerotrain.estimate.model_states import Settings, StageBytes, stage_bytes
from zerotrain.estimate.planner import Hardware, Recommendation, Row, Workload
from zerotrain.estimate.report import EstimateReport
from zerotrain.estimate.rules_of_thumb import fine_tuning_rows
from zerotrain.estimate.shapes import ModelShape, from_hf_config, from_module, from_params

__all__ = [
    "estimate",
    "Estimate",
    "EstimateReport",
    "Hardware",
    "Workload",
    "Settings",
    "Row",
    "Recommendation",
    "ModelShape",
    "from_hf_config",
    "from_module",
    "from_params",
    "stage_bytes",
    "StageBytes",
    "ActivationBytes",
    "formula_activations",
    "korthikanti_layer_bytes",
    "measure_saved_bytes",
    "measured_activations",
    "fine_tuning_rows",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs_all_cold",
]
