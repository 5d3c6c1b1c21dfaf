"""docs/engine.md's table of DeepSpeed's engine methods stays true: it names every public
method of DeepSpeed's engine, the ones marked *yes* exist on ZeroTrainEngine, the ones marked
*no* do not (so adding one means updating the table)."""

from __future__ import annotations

import re
from pathlib import Path

from zerotrain.engine.engine import ZeroTrainEngine

# Public methods of DeepSpeed's DeepSpeedEngine (deepspeed/runtime/engine.py, v0.19.6,
# deepspeedai/DeepSpeed edaa722): every `def name` of the class not starting with "_".
DEEPSPEED_ENGINE_METHODS = set(
    """
aio_config all_gather_scalar allreduce_and_copy allreduce_bucket allreduce_gradients allreduce_no_retain
amp_enabled amp_params autotp_size autotuning_enabled autotuning_end_profile_step autotuning_metric
autotuning_metric_path autotuning_model_info_path autotuning_profile_model_info autotuning_start_profile_step
backward bf16_master_weights_and_gradients bf16_optimizer_states bfloat16_enabled buffered_allreduce_fallback
checkpoint_serialization_enabled checkpoint_tag_validation_enabled checkpoint_tag_validation_fail
checkpoint_writer_enabled clip_fp32_gradients coalesce_grad_reduction communication_data_type compile
compile_autosp compile_autotp compile_zero_optimization_stage cpuadam_cores_perc curriculum_enabled_legacy
curriculum_learning_config curriculum_learning_enabled curriculum_params_legacy data_efficiency_config
data_efficiency_enabled data_sampling_config data_sampling_enabled dataloader_drop_last deepspeed_io destroy
dump_state dynamic_loss_scale dynamic_loss_scale_args eigenvalue_enabled eigenvalue_gas_boundary_resolution
eigenvalue_layer_name eigenvalue_layer_num eigenvalue_max_iter eigenvalue_stability eigenvalue_tol
eigenvalue_verbose elasticity_enabled empty_partition_cache eval flops_profiler_detailed flops_profiler_enabled
flops_profiler_module_depth flops_profiler_output_file flops_profiler_profile_step
flops_profiler_recompute_fwd_factor flops_profiler_top_modules forward fp16_auto_cast fp16_enabled
fp16_master_weights_and_gradients get_autosp_backend get_autotp_backend get_batch_info get_compile_time
get_data_parallel_rank get_data_types get_deepcompile_backend get_deepspeed_compile_backend
get_global_grad_norm get_lr get_model_parallel_rank get_mom get_pld_theta get_sequence_parallel_group
get_tensor_parallel_rank get_type get_wall_clock_timers gradient_accumulation_steps gradient_clipping
gradient_predivide_factor graph_harvesting initial_dynamic_scale is_compiled is_deepcompile_active
is_deepcompile_enabled is_elastic_model_parallel_supported is_first_weights_partition_group
is_gradient_accumulation_boundary is_iterable_style_dataset is_map_style_dataset is_sanity_checks_enabled
load_checkpoint load_module_state_dict load_moe_state_dict load_universal_checkpoint log_level loss_scale
managed_gradient_accumulation memory_breakdown mics_shard_size module_state_dict no_sync offload_states
optimizer_legacy_fusion optimizer_name optimizer_params pld_enabled pld_gamma pld_params pld_theta
postscale_gradients print_forward_breakdown quantize_training random_ltd_config random_ltd_enabled
random_ltd_initialize register_compile_pass reload_states save_16bit_model save_checkpoint save_fp16_model
scale scheduler_name scheduler_params set_custom_curriculum_learning_schedule set_data_post_process_func
set_gradient_accumulation_boundary set_train_batch_size set_train_micro_batch_size sparse_all_gather
sparse_allreduce sparse_allreduce_bucket sparse_allreduce_no_retain sparse_gradients_enabled step
steps_per_print super_offload swap_tensor_config tensor_parallel_config torch_autocast_dtype
torch_autocast_enabled torch_autocast_lower_precision_safe_modules train train_batch_size
train_micro_batch_size_per_gpu use_node_local_storage uses_parallelization_pass_only wall_clock_breakdown
was_step_applied zenflow_config zero_allgather_bucket_size zero_allgather_partitions zero_allgather_sequential
zero_allow_untested_optimizer zero_contiguous_gradients zero_cpu_offload zero_elastic_checkpoint
zero_force_ds_cpu_optimizer zero_gather_16bit_weights_on_model_save zero_grad zero_grad_hooks
zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1 zero_load_from_fp32_weights
zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance zero_model_persistence_threshold
zero_module_granularity_threshold zero_multi_rank_bucket_allreduce zero_nvme_offload_optimizer
zero_offload_optimizer zero_offload_param zero_optimization zero_optimization_partition_gradients
zero_optimization_partition_weights zero_optimization_stage zero_overlap_comm zero_param_persistence_threshold
zero_partial_offload zero_prefetch_bucket_size zero_quantized_gradients zero_quantized_nontrainable_weights
zero_quantized_weights zero_reduce_bucket_size zero_reduce_scatter zero_round_robin_gradients
zero_save_muon_momentum_buffer_in_memory zero_sub_group_size zero_use_cpu_optimizer zeropp_loco_param
""".split()
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def _table() -> dict[str, str]:
    text = DOC.read_text()
    section = text[text.index("## DeepSpeed's engine methods") :]
    status = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[1] not in ("yes", "no", "not yet"):
            continue
        for name in re.findall(r"`([A-Za-z_0-9]+)`", cells[0]):
            assert name not in status, f"{name} is listed twice"
            status[name] = cells[1]
    return status


def test_table_lists_every_deepspeed_engine_method():
    assert sorted(DEEPSPEED_ENGINE_METHODS - set(_table())) == []
    assert sorted(set(_table()) - DEEPSPEED_ENGINE_METHODS) == []


def test_table_says_what_the_engine_has():
    status = _table()
    said_yes_missing = [n for n, s in status.items() if s == "yes" and not hasattr(ZeroTrainEngine, n)]
    said_no_present = [n for n, s in status.items() if s == "no" and hasattr(ZeroTrainEngine, n)]
    assert said_yes_missing == [] and said_no_present == [], "update docs/engine.md's table"
