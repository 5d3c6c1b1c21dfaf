"""ZeRO stages. Every stage shares the flat units (``zero.flat``, ``zero.partition``) and the
gradient buckets (``zero.gradient_buckets``); a stage differs only in what it shards
(``zero.strategy``). ``build_zero_stage`` (zero/build.py) makes the engine's stage object."""

from __future__ import annotations

# The package's names (importers write ``zerotrain.zero.X``; DeepSpeed's ``deepspeed.zero.X``).
from zerotrain.zero.build import (  # noqa: F401
    DEFAULT_BUCKET_BYTES,
    StageOptions,
    autocast_reductions,
    bucket_numel,
    build_sharded_stage,
    build_zero_stage,
    expert_reductions,
)
from zerotrain.zero.full_parameters import named_full_parameters
from zerotrain.zero.gathered import GatheredParameters
from zerotrain.zero.init import Init, is_partitioned, materialize  # noqa: F401
from zerotrain.zero.parameter_offload import register_external_parameter, unregister_external_parameter
from zerotrain.zero.reduce_groups import UnitReduction  # noqa: F401
from zerotrain.zero.stage0 import ReplicatedGradients  # noqa: F401
from zerotrain.zero.zero_stage import ZeroStage  # noqa: F401

__all__ = [
    "Init",
    "GatheredParameters",
    "build_zero_stage",
    "named_full_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]
