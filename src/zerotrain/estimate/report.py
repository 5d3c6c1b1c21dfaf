"""The ``--json`` schema (pydantic models) and the text tables ``zerotrain estimate`` prints."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from zerotrain.estimate.units import GiB


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuBytes(_Strict):
    parameters: int = Field(ge=0)
    master_parameters: int = Field(ge=0)
    gradients: int = Field(ge=0)
    optimizer_state: int = Field(ge=0)
    model_states: int = Field(ge=0)
    activations: int = Field(ge=0)
    activations_layers: int = Field(ge=0)
    activations_logits: int = Field(ge=0)
    communication_buffers: int = Field(ge=0)
    gathered_parameters: int = Field(ge=0)
    transient: int = Field(ge=0)
    reserve: int = Field(ge=0)
    peak: int = Field(ge=0)


class CpuBytes(_Strict):
    processes: int = Field(ge=0)
    model_build: int = Field(ge=0)
    offloaded: int = Field(ge=0)
    pinned_buffers: int = Field(ge=0)
    peak: int = Field(ge=0)


class RowReport(_Strict):
    stage: Literal[0, 1, 2, 3]
    offload: Literal["none", "optimizer_cpu", "optimizer_params_cpu", "optimizer_params_nvme"]
    recommendable: bool  # the bytes are zerotrain's placement (offload rows are DeepSpeed's)
    micro_batch: int = Field(ge=1)
    activation_checkpointing: bool
    per_gpu: GpuBytes
    per_node_cpu: CpuBytes
    per_node_nvme: int = Field(ge=0)
    fits_gpu: bool | None
    fits_cpu: bool | None
    fits: bool | None


class ModelReport(_Strict):
    name: str
    source: Literal["params", "hf-config", "module"]
    params: int = Field(gt=0)
    largest_layer_params: int = Field(gt=0)
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None


class SetupReport(_Strict):
    gpus_per_node: int = Field(ge=1)
    nodes: int = Field(ge=1)
    gpu_memory: int | None
    cpu_memory: int | None
    micro_batch: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    precision: Literal["fp32", "fp16", "bf16"]
    optimizer: str
    activation_checkpointing: bool
    activation_method: str


class ThumbReport(_Strict):
    method: str
    rule_bytes: float
    refined_bytes: float
    note: str


class RecommendationReport(_Strict):
    fits: bool
    stage: int | None
    micro_batch: int | None
    gradient_accumulation_steps: int | None
    activation_checkpointing: bool | None
    max_micro_batch: int | None
    procedure: list[str]
    why_not: list[str]
    offload_alternative: str | None
    config: dict | None


class EstimateReport(_Strict):
    """The whole ``zerotrain estimate --json`` document (bytes are exact integers)."""

    schema_version: Literal[1] = 1
    model: ModelReport
    setup: SetupReport
    rows: list[RowReport]
    fine_tuning_rules_of_thumb: list[ThumbReport]
    recommendation: RecommendationReport
    notes: list[str]


def _g(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _fit(v: bool | None) -> str:
    return {True: "yes", False: "NO", None: "?"}[v]


def render_text(report: EstimateReport) -> str:
    """The tables ``zerotrain estimate`` prints."""
    m, s = report.model, report.setup
    out = [
        f"Model: {m.name}: {m.params:,} parameters ({m.params / 1e9:.3f}B), largest layer "
        f"{m.largest_layer_params:,}"
        + (f"; {m.layers} layers, hidden {m.hidden}, {m.heads} heads, vocab {m.vocab}" if m.layers else ""),
        f"Setup: {s.nodes} node(s) x {s.gpus_per_node} GPU(s), GPU memory {_g(s.gpu_memory)} GiB, "
        f"host memory per node {_g(s.cpu_memory)} GiB; {s.precision}, {s.optimizer}, micro-batch "
        f"{s.micro_batch}, seq {s.seq_len}, activation checkpointing "
        f"{'on' if s.activation_checkpointing else 'off'}",
        f"Activations: {s.activation_method}",
        "",
    ]
    head = (
        "stage offload                 | params  master  grads   optim  | activ  comm  gather  temp  "
        "reserve | peak/GPU fits | host/node fits | nvme/node"
    )
    out += ["Per GPU (GiB):", head, "-" * len(head)]
    for r in report.rows:
        g, c = r.per_gpu, r.per_node_cpu
        name = r.offload.replace("optimizer_params", "opt+params").replace("optimizer", "opt")
        mark = "" if r.recommendable else " *"
        out.append(
            f"{r.stage:>5} {name + mark:<23} | {_g(g.parameters):>6} {_g(g.master_parameters):>6} "
            f"{_g(g.gradients):>6} {_g(g.optimizer_state):>7} | {_g(g.activations):>6} "
            f"{_g(g.communication_buffers):>5} {_g(g.gathered_parameters):>6} {_g(g.transient):>5} "
            f"{_g(g.reserve):>7} | {_g(g.peak):>8} {_fit(r.fits_gpu):>4} | {_g(c.peak):>9} "
            f"{_fit(r.fits_cpu):>4} | {_g(r.per_node_nvme):>9}"
        )
    out.append(
        "* offload rows follow DeepSpeed's ZeRO-Offload/Infinity placement; zerotrain runs "
        "offload with gradients on the device until the step, so they are not recommended"
    )
    out += ["", "Fine-tuning rules of thumb vs this estimator (whole model, one GPU, activations excluded):"]
    for t in report.fine_tuning_rules_of_thumb:
        out.append(
            f"  {t.method:<42} rule {t.rule_bytes / 1e9:8.2f} GB | refined {t.refined_bytes / 1e9:8.2f} GB  ({t.note})"
        )
    rec = report.recommendation
    out += ["", "Recommendation:"]
    out += [f"  - {line}" for line in rec.procedure]
    if rec.fits and rec.stage is not None:
        out.append(
            f"  => ZeRO stage {rec.stage}, micro-batch {rec.micro_batch}, gradient accumulation "
            f"{rec.gradient_accumulation_steps}, activation checkpointing "
            f"{'on (enable it in the model)' if rec.activation_checkpointing else 'off'}"
            + (f"; largest micro-batch that fits: {rec.max_micro_batch}" if rec.max_micro_batch else "")
        )
    else:
        out.append("  => does not fit without offload:")
        out += [f"     {w}" for w in rec.why_not]
    if rec.offload_alternative:
        out.append(f"  (DeepSpeed alternative: {rec.offload_alternative})")
    if report.notes:
        out += ["", "Notes:"] + [f"  - {n}" for n in report.notes]
    return "\n".join(out)
