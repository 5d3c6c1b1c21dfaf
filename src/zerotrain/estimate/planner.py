"""Per-stage memory rows (with and without DeepSpeed-style offload), whether each fits, and the
recommended configuration.

The recommendation follows the seeds' "finding the optimal configuration" procedure, restricted
to the rows whose bytes are zerotrain's own: the lowest ZeRO stage that fits at the requested micro-batch;
if none does, offload (reported, but modelled on DeepSpeed's placement, so never recommended),
then activation checkpointing, then a smaller micro-batch with gradient accumulation (same
samples per step); finally the largest micro-batch that fits the chosen configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from zerotrain.estimate.activations import ActivationBytes
from zerotrain.estimate.model_states import OPTIMIZER_STATE, Settings, StageBytes, optimizer_key, stage_bytes
from zerotrain.estimate.shapes import ModelShape
from zerotrain.estimate.units import GiB

OFFLOADS = ("none", "optimizer_cpu", "optimizer_params_cpu", "optimizer_params_nvme")
OFFLOAD_ROWS = (
    (0, "none"),
    (1, "none"),
    (1, "optimizer_cpu"),
    (2, "none"),
    (2, "optimizer_cpu"),
    (3, "none"),
    (3, "optimizer_cpu"),
    (3, "optimizer_params_cpu"),
    (3, "optimizer_params_nvme"),
)
# zerotrain runs every offload row (docs/offload.md), but keeps gradients on the device until the
# step where DeepSpeed moves them to the host as they are reduced: these bytes are DeepSpeed's.
OFFLOAD_NOT_MODELLED = (
    "the offload rows follow DeepSpeed's placement, not zerotrain's (which keeps "
    "gradients on the device until the step, docs/offload.md), so they are not "
    "recommended"
)
MAX_MICRO_BATCH = 1 << 16


@dataclass(frozen=True)
class Hardware:
    """Per-GPU and per-node limits; ``None`` means "not given: fit not judged".

    ``gpu_reserve``: per GPU, what the framework itself takes (CUDA context, NCCL buffers,
    allocator fragmentation). ``process_bytes``: per rank, host memory of the Python process
    with torch imported."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_memory: int | None = None
    cpu_memory: int | None = None
    gpu_reserve: int = GiB
    process_bytes: int = GiB

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError("--num-gpus and --num-nodes must be at least 1")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Workload:
    micro_batch: int = 1
    seq_len: int = 512
    gradient_accumulation_steps: int = 1
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class Row:
    """One stage/offload combination: bytes per GPU and per node, and whether it fits."""

    stage: int
    offload: str
    micro_batch: int
    activation_checkpointing: bool
    gpu: dict[str, int]
    cpu_per_node: dict[str, int]
    nvme_per_node: int
    fits_gpu: bool | None
    fits_cpu: bool | None
    activation_method: str
    activations_known: bool

    @property
    def recommendable(self) -> bool:
        """Whether the bytes are zerotrain's own (offload rows are DeepSpeed's placement)."""
        return self.offload == "none"

    @property
    def gpu_total(self) -> int:
        return self.gpu["peak"]

    @property
    def fits(self) -> bool | None:
        checks = [f for f in (self.fits_gpu, self.fits_cpu) if f is not None]
        return all(checks) if checks else None

    @property
    def label(self) -> str:
        names = {
            "none": "no offload",
            "optimizer_cpu": "offload optimizer->cpu",
            "optimizer_params_cpu": "offload optimizer+params->cpu",
            "optimizer_params_nvme": "offload optimizer+params->nvme",
        }
        return f"stage {self.stage}, {names[self.offload]}"


ActivationFn = Callable[[int, bool], ActivationBytes]


def build_row(
    stage: int,
    offload: str,
    shape: ModelShape,
    settings: Settings,
    hw: Hardware,
    micro_batch: int,
    checkpointing: bool,
    activations: ActivationFn,
    vocab_logit_grad: int = 0,
) -> Row:
    """Bytes per GPU and per node of one configuration. ``vocab_logit_grad``: bytes per sample
    of the logits' gradient (backward's largest temporary)."""
    if offload != "none" and (stage == 0 or (offload != "optimizer_cpu" and stage != 3)):
        raise ValueError(f"offload {offload!r} needs stage {'1-3' if offload == 'optimizer_cpu' else 3}")
    sb: StageBytes = stage_bytes(stage, shape, settings)
    act = activations(micro_batch, checkpointing)
    world, ranks = hw.world_size, hw.gpus_per_node
    e = settings.param_bytes
    per_elem, _ = OPTIMIZER_STATE[optimizer_key(settings.optimizer)]
    params, masters, grads, opt = sb.parameters, sb.master_parameters, sb.gradients, sb.optimizer_state
    step = sb.step_transient
    offloaded = 0
    if offload != "none":
        # DeepSpeed's ZeRO-Offload/Infinity: fp32 masters, optimizer state and fp32 gradients of
        # this rank's partition live on the host; the GPU keeps 16-bit params (and buckets).
        shard = -(-shape.params // world)
        offloaded = ranks * shard * (4 + per_elem + 4)
        masters, opt, grads, step = 0, 0, 0, 0
        params += sb.derived_shards  # the master is on the host: the 16-bit shard is kept
        if offload != "optimizer_cpu":
            offloaded += ranks * shard * e
            params = 0
    # Backward's temporaries: the logits' gradient, and at stages 2-3 a unit's full-size
    # gradients waiting for their reduction.
    bucket_grads = settings.grad_bytes * max(1, settings.bucket // 4) if stage >= 2 else 0
    backward_extra = vocab_logit_grad * micro_batch + min(bucket_grads, settings.grad_bytes * shape.params)
    states = params + masters + grads + opt
    working = max(act.total + backward_extra, step)
    peak = states + sb.communication_buffers + sb.gathered + working + hw.gpu_reserve
    gpu = {
        "parameters": params,
        "master_parameters": masters,
        "gradients": grads,
        "optimizer_state": opt,
        "model_states": states,
        "activations": act.total,
        "activations_layers": act.layers,
        "activations_logits": act.logits,
        "communication_buffers": sb.communication_buffers,
        "gathered_parameters": sb.gathered,
        "transient": working - act.total,
        "reserve": hw.gpu_reserve,
        "peak": peak,
    }
    # Host, per node: every rank's process; the model as built before initialize (whole in
    # fp32 on every rank, except stage 3 under zero.Init: one module at a time); offloaded state.
    built = ranks * 4 * (shape.largest_layer_params if stage == 3 else shape.params)
    nvme, pinned = 0, 0
    if offload == "optimizer_params_nvme":
        nvme, offloaded = offloaded, 0
        shard = -(-shape.params // world)
        # Swap buffers: 4 optimizer sub-groups (sub_group_size 1e9) and 5 parameter buffers
        # (buffer_size 1e8), DeepSpeed's defaults.
        pinned = ranks * (4 * min(int(1e9), shard) * 4 + 5 * min(int(1e8), shard) * e)
    cpu = {
        "processes": ranks * hw.process_bytes,
        "model_build": built,
        "offloaded": offloaded,
        "pinned_buffers": pinned,
    }
    cpu["peak"] = cpu["processes"] + max(built, offloaded + pinned)
    fits_gpu = None if hw.gpu_memory is None else peak <= hw.gpu_memory
    fits_cpu = None if hw.cpu_memory is None else cpu["peak"] <= hw.cpu_memory
    return Row(stage, offload, micro_batch, checkpointing, gpu, cpu, nvme, fits_gpu, fits_cpu, act.method, act.known)


@dataclass
class Recommendation:
    """What to run: a zerotrain-runnable row (or None), the procedure's log, the offload option
    a DeepSpeed user could use, and the largest micro-batch that fits the chosen row."""

    row: Row | None
    gradient_accumulation_steps: int
    max_micro_batch: int | None
    steps: list[str] = field(default_factory=list)
    offload_alternative: Row | None = None
    why_not: list[str] = field(default_factory=list)


def explain(row: Row, hw: Hardware, checkpointed: Row | None = None) -> str:
    """Why ``row`` does not fit, by component, e.g. "activations: 14.20 GiB of 24.00 GiB at
    micro-batch 8; with activation checkpointing 3.10 GiB"."""
    g = row.gpu
    parts = []
    if row.fits_gpu is False:
        limit = hw.gpu_memory
        parts.append(f"needs {g['peak'] / GiB:.2f} GiB per GPU of {limit / GiB:.2f} GiB")
        parts.append(
            f"model states: {g['model_states'] / GiB:.2f} GiB (parameters "
            f"{g['parameters'] / GiB:.2f}, fp32 masters {g['master_parameters'] / GiB:.2f}, "
            f"gradients {g['gradients'] / GiB:.2f}, optimizer {g['optimizer_state'] / GiB:.2f})"
        )
        if row.activations_known:
            text = (
                f"activations: {g['activations'] / GiB:.2f} GiB of {limit / GiB:.2f} GiB at "
                f"micro-batch {row.micro_batch}"
            )
            if checkpointed is not None and not row.activation_checkpointing:
                text += f"; with activation checkpointing {checkpointed.gpu['activations'] / GiB:.2f} GiB"
            parts.append(text)
        else:
            parts.append("activations: not included (model shape unknown)")
        extra = g["communication_buffers"] + g["gathered_parameters"] + g["transient"] + g["reserve"]
        parts.append(f"buffers, temporaries and reserve: {extra / GiB:.2f} GiB")
    if row.fits_cpu is False:
        c = row.cpu_per_node
        parts.append(
            f"needs {c['peak'] / GiB:.2f} GiB of host memory per node of "
            f"{hw.cpu_memory / GiB:.2f} GiB (model built on every rank "
            f"{c['model_build'] / GiB:.2f}, offloaded {c['offloaded'] / GiB:.2f}, "
            f"pinned buffers {c['pinned_buffers'] / GiB:.2f})"
        )
    return "; ".join(parts)


def recommend(make_row: Callable[[int, str, int, bool], Row], workload: Workload, hw: Hardware) -> Recommendation:
    """The procedure of the module docstring over ``make_row(stage, offload, micro, ckpt)``."""
    micro, ckpt = workload.micro_batch, workload.activation_checkpointing
    log: list[str] = []
    rows = [make_row(s, "none", micro, ckpt) for s in range(4)]
    judged = any(r.fits is not None for r in rows)
    for r in rows:
        if r.fits is not False:
            log.append(
                f"stage {r.stage} fits at micro-batch {micro}"
                if judged
                else f"no memory limits given: stage {r.stage} (lowest) chosen without a fit check"
            )
            return _finish(r, workload.gradient_accumulation_steps, make_row, hw, log)
        log.append(f"stage {r.stage} does not fit: {explain(r, hw, make_row(r.stage, 'none', micro, True))}")
    offload = next(
        (o for o in (make_row(s, off, micro, ckpt) for s, off in OFFLOAD_ROWS if off != "none") if o.fits), None
    )
    if offload is not None:
        log.append(f"{offload.label} would fit ({offload.gpu_total / GiB:.2f} GiB per GPU), but {OFFLOAD_NOT_MODELLED}")
    if not ckpt:
        for s in range(4):
            r = make_row(s, "none", micro, True)
            if r.fits:
                log.append(f"stage {s} fits with activation checkpointing at micro-batch {micro}")
                return _finish(r, workload.gradient_accumulation_steps, make_row, hw, log, offload)
        log.append("activation checkpointing alone is not enough")
    samples = micro * workload.gradient_accumulation_steps
    for smaller in _smaller_batches(micro):
        for use_ckpt in [ckpt] if ckpt else [False, True]:
            for s in range(4):
                r = make_row(s, "none", smaller, use_ckpt)
                if r.fits:
                    gas = -(-samples // smaller)
                    log.append(
                        f"stage {s} fits at micro-batch {smaller} with gradient accumulation "
                        f"{gas}{' and activation checkpointing' if use_ckpt else ''} "
                        f"({smaller * gas} samples per step per GPU)"
                    )
                    return _finish(r, gas, make_row, hw, log, offload)
    why = [f"{r.label}: {explain(r, hw, make_row(r.stage, 'none', micro, True))}" for r in rows]
    log.append("nothing without offload fits, even at micro-batch 1 with activation checkpointing at stage 3")
    return Recommendation(None, workload.gradient_accumulation_steps, None, log, offload, why)


def _smaller_batches(micro: int) -> list[int]:
    out, m = [], micro
    while m > 1:
        m = max(1, m // 2)
        out.append(m)
    return out


def _finish(row: Row, gas: int, make_row, hw: Hardware, log: list[str], offload: Row | None = None) -> Recommendation:
    best = None
    if row.fits is not None and row.activations_known:
        best = largest_micro_batch(
            lambda m: make_row(row.stage, row.offload, m, row.activation_checkpointing).fits, row.micro_batch
        )
        log.append(
            f"largest micro-batch that fits stage {row.stage}"
            f"{' with checkpointing' if row.activation_checkpointing else ''}: {best}"
        )
    return Recommendation(row, gas, best, log, offload)


def largest_micro_batch(fits: Callable[[int], bool], start: int = 1) -> int:
    """The largest m with ``fits(m)`` (memory grows with m), given ``fits(start)``."""
    lo, hi = start, start * 2
    while hi <= MAX_MICRO_BATCH and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_MICRO_BATCH + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
