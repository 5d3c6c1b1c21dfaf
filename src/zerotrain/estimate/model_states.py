"""Model states per rank (parameters, fp32 masters, gradients, optimizer state) and the
communication buffers of each ZeRO stage, as zerotrain lays them out (docs/zero.md).

With a model (real or on the meta device) the units are planned with zerotrain's own planners
(``zero.partition.plan_units`` / ``plan_module_units`` and ``FlatLayout`` padding), so the bytes
equal ``engine.memory_breakdown()``; with only a parameter count the same rules are applied to
``P`` (padding, step counters and stage 3's small whole units are then left out: < 0.1%).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from zerotrain.estimate.shapes import ModelShape

# Optimizer state bytes per fp32 master element, and whether it keeps a 4-byte step tensor.
OPTIMIZER_STATE = {
    "adam": (8, True),
    "adamw": (8, True),  # exp_avg + exp_avg_sq
    "adagrad": (4, True),  # sum of squares
    "lion": (4, False),  # exp_avg
    "sgd": (0, False),  # plain SGD keeps nothing
    "sgd_momentum": (4, False),  # momentum_buffer
    "none": (0, False),
}
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def optimizer_key(name: str, momentum: float = 0.0) -> str:
    key = name.lower().replace("-", "_")
    if key == "sgd" and momentum:
        key = "sgd_momentum"
    if key not in OPTIMIZER_STATE:
        raise ValueError(
            f"--optimizer: {name!r} is not one the estimator knows; use one of {', '.join(sorted(OPTIMIZER_STATE))}"
        )
    return key


@dataclass(frozen=True)
class Settings:
    """The training set-up the bytes depend on."""

    world_size: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    bucket_numel: int | None = None  # None: zerotrain's default (25 MiB of parameters)
    overlap_comm: bool = True
    grad_accum_precision: str | None = None  # data_types.grad_accum_dtype (default: params')
    comm_precision: str | None = None  # communication_data_type (default: gradients')
    param_persistence_threshold: int = int(1e5)
    prefetch_numel: int | None = None  # None: one bucket
    max_live_parameters: int = int(1e9)

    def __post_init__(self):
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"--precision: {self.precision!r}; use fp32, fp16 or bf16")
        optimizer_key(self.optimizer)

    @property
    def param_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def grad_bytes(self) -> int:
        return PRECISION_BYTES[self.grad_accum_precision or self.precision]

    @property
    def comm_bytes(self) -> int:
        return PRECISION_BYTES[self.comm_precision or self.grad_accum_precision or self.precision]

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def bucket(self) -> int:
        from zerotrain.zero import DEFAULT_BUCKET_BYTES

        return self.bucket_numel or DEFAULT_BUCKET_BYTES // self.param_bytes


@dataclass(frozen=True)
class StageBytes:
    """Bytes one rank holds at a ZeRO stage (no offload), by ``memory_breakdown()`` category.

    ``gathered``: stage 3's peak of whole units resident at once (gathered + pooled);
    ``step_transient``: what the optimizer step allocates for its duration (fp32 copies of
    16-bit gradients); ``derived_shards``: the 16-bit stage-3 shards not kept because the fp32
    master beside them is cast at each gather (kept again when the master is offloaded)."""

    stage: int
    parameters: int
    master_parameters: int
    gradients: int
    optimizer_state: int
    communication_buffers: int
    gathered: int = 0
    step_transient: int = 0
    shard_numel: int = 0
    largest_unit_numel: int = 0
    derived_shards: int = 0

    @property
    def model_states(self) -> int:
        return self.parameters + self.master_parameters + self.gradients + self.optimizer_state

    def breakdown(self) -> dict[str, int]:
        """The categories ``engine.memory_breakdown()`` reports (stage 3's gathered bytes apart)."""
        return {
            "parameters": self.parameters,
            "master_parameters": self.master_parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "communication_buffers": self.communication_buffers,
        }


@dataclass(frozen=True)
class _Unit:
    numel: int
    padded: int
    shard: int


def _units_from_module(stage: int, module: nn.Module, settings: Settings, shard_world: int) -> list[_Unit]:
    from zerotrain.zero.flat import FlatLayout
    from zerotrain.zero.partition import plan_module_units, plan_units

    params = []
    for p in module.parameters():
        if p.requires_grad and all(p is not q for q in params):
            params.append(p)
    groups = [{"params": params}]
    unit_numel = settings.bucket if stage < 2 else max(1, settings.bucket // 4)
    if stage == 3:
        plan = plan_module_units(groups, module)
    else:
        plan = plan_units(groups, unit_numel, list(module.parameters())[::-1])
    align = max(1, 16 // settings.param_bytes)
    units = []
    for _, unit_params in plan:
        layout = FlatLayout(unit_params, shard_world, align)
        units.append(_Unit(layout.numel, layout.padded_numel, layout.shard_numel))
    return units


def _units_from_count(stage: int, shape: ModelShape, settings: Settings, shard_world: int) -> list[_Unit]:
    """P elements in units of the stage's size (a larger parameter is a unit of its own)."""
    if stage == 3:
        size = shape.largest_layer_params
    else:
        size = max(settings.bucket if stage < 2 else settings.bucket // 4, shape.largest_param)
    full, rest = divmod(shape.params, size)
    sizes = [size] * full + ([rest] if rest else [])
    return [_Unit(n, n, -(-n // shard_world)) for n in sizes]


def stage_bytes(stage: int, shape: ModelShape, settings: Settings) -> StageBytes:
    """Per-rank bytes of ``shape`` at ``stage`` under ``settings``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage={stage}: stages are 0, 1, 2, 3")
    world = settings.world_size
    e, g, c = settings.param_bytes, settings.grad_bytes, settings.comm_bytes
    per_elem, has_step = OPTIMIZER_STATE[optimizer_key(settings.optimizer)]
    frozen = shape.frozen_params * e
    if stage == 0 and not settings.mixed:
        # The user's optimizer on the module's own parameters; gradients in flat unpadded buckets.
        tensors = sum(1 for p in shape.module.parameters() if p.requires_grad) if shape.module is not None else 0
        optimizer = per_elem * shape.params + (4 * tensors if has_step else 0)
        return StageBytes(0, 4 * shape.params + frozen, 0, 4 * shape.params, optimizer, 0, shard_numel=shape.params)
    shard_world = world if stage >= 1 else 1
    if shape.module is not None:
        units = _units_from_module(stage, shape.module, settings, shard_world)
    else:
        units = _units_from_count(stage, shape, settings, shard_world)
    shard = sum(u.shard for u in units)
    padded = sum(u.padded for u in units)
    largest = max(u.padded for u in units)
    resharded = [u for u in units if stage == 3 and u.numel >= settings.param_persistence_threshold]
    whole = [u for u in units if u not in resharded] if stage == 3 else units
    # A 16-bit stage 3 keeps no 16-bit shard of a resharded unit: gathers cast the fp32 master.
    derived = e * sum(u.shard for u in resharded) if settings.mixed else 0
    parameters = e * (sum(u.padded for u in whole) + sum(u.shard for u in resharded)) + frozen - derived
    masters = 4 * shard if settings.mixed else 0
    gradients = g * (padded if stage < 2 else shard)
    optimizer = per_elem * shard + (4 * len(units) if has_step and shape.module is not None else 0)
    unit_numel = settings.bucket if stage < 2 else max(1, settings.bucket // 4)
    if stage >= 2:
        slot = min(largest, max(unit_numel, shard_world))
        comm = (4 if settings.overlap_comm else 1) * slot * c
    elif c != g and world > 1:
        comm = (2 if settings.overlap_comm else 1) * largest * c
    else:
        comm = 0
    gathered = 0
    if stage == 3 and resharded:
        biggest = max(u.padded for u in resharded)
        total = sum(u.padded for u in resharded)
        prefetch = settings.prefetch_numel if settings.prefetch_numel is not None else settings.bucket
        window = min(biggest + prefetch, max(settings.max_live_parameters, biggest))
        gathered = e * min(total, window)
    # Step: fp32 copies of 16-bit shard gradients (zerotrain builds Adam/AdamW with fused
    # kernels, which allocate no per-element temporaries), one chunk at a time.
    from zerotrain.zero.step_chunks import plan_step_chunks

    shards = [u.shard for u in units]
    chunk = max(sum(shards[i] for i in c) for c in plan_step_chunks(shards))
    transient = 4 * chunk if g != 4 else 0
    return StageBytes(
        stage,
        parameters,
        masters,
        gradients,
        optimizer,
        comm,
        gathered,
        transient,
        shard_numel=shard,
        largest_unit_numel=largest,
        derived_shards=derived,
    )
