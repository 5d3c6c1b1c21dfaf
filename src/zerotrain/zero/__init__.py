"""ZeRO stages. Every stage shares the flat-buffer core (``zero.flat``, ``zero.partition``) and
the gradient buckets (``zero.gradient_buckets``); a stage differs only in what it shards."""

from __future__ import annotations

from zerotrain.zero.stage0 import ReplicatedGradients
from zerotrain.zero.stage12 import PartitionedOptimizer

# Without an explicit reduce_bucket_size, buckets hold 25 MiB (DDP's size): DeepSpeed's default
# of 5e8 elements is larger than most models, which leaves nothing to overlap with backward and
# costs a model-sized buffer.
DEFAULT_BUCKET_BYTES = 25 * 2**20


def bucket_numel(zero_config, element_size: int) -> int:
    """Elements per gradient bucket / parameter unit."""
    explicit = [int(getattr(zero_config, key)) for key in ("reduce_bucket_size", "allgather_bucket_size")
                if key in zero_config.model_fields_set]
    if zero_config.stage == 0:
        explicit = explicit[:1] if "reduce_bucket_size" in zero_config.model_fields_set else []
    return max(1, min(explicit)) if explicit else DEFAULT_BUCKET_BYTES // element_size


def build_zero_stage(config, module, optimizer):
    """The stage object for ``config.zero_optimization.stage`` over ``module``'s parameters."""
    zero = config.zero_optimization
    params = [p for p in module.parameters() if p.requires_grad]
    numel = bucket_numel(zero, params[0].element_size() if params else 4)
    overlap = zero.overlap_comm is not False
    if zero.stage == 0:
        return ReplicatedGradients(params, numel, overlap=overlap)
    if zero.stage in (1, 2):
        if zero.stage == 2 and overlap:
            numel = max(1, numel // 2)  # two staging buffers together stay within one bucket
        return PartitionedOptimizer(zero.stage, module, optimizer, numel, overlap=overlap,
                                    use_reduce_scatter=zero.reduce_scatter)
    raise NotImplementedError(f"zero_optimization.stage={zero.stage} is not implemented yet")
