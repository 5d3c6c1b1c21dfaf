"""DeepSpeed's model-state estimators, under their names and signatures.

``estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1)`` and
the ``zero3`` / ``_all_cold`` variants print DeepSpeed's table (per CPU | per GPU | options) with
DeepSpeed's own formulas, so numbers match DeepSpeed's documentation and the scripts written
against it, then one line with zerotrain's count without offload.
They are importable from ``zerotrain.runtime.zero.stage_1_and_2`` / ``...stage3`` as well.
"""

from __future__ import annotations

from torch import nn

from zerotrain.estimate.model_states import Settings, stage_bytes
from zerotrain.estimate.shapes import ModelShape, from_module, from_params

_GiB = 2**30


def estimate_zero2_model_states_mem_needs(
    total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5
):
    """(cpu bytes, gpu bytes) of DeepSpeed's ZeRO-2 estimate (mixed-precision Adam)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 4 * total_params + int(16 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def estimate_zero3_model_states_mem_needs(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    cpu_offload=True,
    cpu_offload_params=True,
    zero_init=True,
    additional_buffer_factor=1.5,
):
    """(cpu bytes, gpu bytes, largest layer bytes) of DeepSpeed's ZeRO-3 estimate."""
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu = largest
        factor = 18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node)
        cpu = total_params * factor * additional_buffer_factor
    elif cpu_offload:
        gpu = largest + int(2 * total_params / total_gpus)
        factor = 16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node)
        cpu = total_params * factor * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest


def _header(total, largest, num_gpus_per_node, num_nodes) -> None:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    print(
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
        f"SW: Model with {int(total / 1e6)}M total params"
        + (f", {int(largest / 1e6)}M largest layer params." if largest is not None else ".")
    )
    print("  per CPU  |  per GPU |   Options")


def _zerotrain_line(stage: int, shape: ModelShape, world: int) -> None:
    sb = stage_bytes(stage, shape, Settings(world_size=world, precision="bf16", optimizer="adamw"))
    print(
        f"zerotrain (bf16 + AdamW, no offload): {sb.model_states / _GiB:.2f}GB of model states per GPU "
        f"at stage {stage}, + {sb.communication_buffers / _GiB:.2f}GB buffers"
        + (f" + {sb.gathered / _GiB:.2f}GB gathered" if stage == 3 else "")
        + " (see `zerotrain estimate` for activations)"
    )


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
):
    """Print DeepSpeed's ZeRO-2 table for a hypothetical model of ``total_params``."""
    _header(total_params, None, num_gpus_per_node, num_nodes)
    for cpu_offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor
        )
        device = "cpu " if cpu_offload else "none"
        print(f" {cpu / _GiB:7.2f}GB | {gpu / _GiB:6.2f}GB | offload_optimizer={device}")
    _zerotrain_line(2, from_params(int(total_params)), num_gpus_per_node * num_nodes)


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
):
    """Print DeepSpeed's ZeRO-2 table for ``model`` (tied parameters counted once)."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    additional_buffer_factor=1.5,
    _shape: ModelShape | None = None,
):
    """Print DeepSpeed's ZeRO-3 table for a hypothetical model."""
    _header(total_params, largest_layer_params, num_gpus_per_node, num_nodes)
    for cpu_offload, offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params,
                largest_layer_params,
                num_gpus_per_node,
                num_nodes,
                cpu_offload,
                offload_params,
                zero_init,
                additional_buffer_factor,
            )
            options = (
                f"offload_param={'cpu ' if offload_params else 'none'}, "
                f"offload_optimizer={'cpu ' if cpu_offload else 'none'}, zero_init={int(zero_init)}"
            )
            print(f" {cpu / _GiB:7.2f}GB | {gpu / _GiB:6.2f}GB | {options}")
    shape = _shape or from_params(int(total_params), int(largest_layer_params))
    _zerotrain_line(3, shape, num_gpus_per_node * num_nodes)


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
):
    """Print DeepSpeed's ZeRO-3 table for ``model``."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor, _shape=from_module(model)
    )


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """(total parameters, largest layer's own parameters), tied parameters counted once."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest
