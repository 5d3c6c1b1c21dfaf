"""``estimate(...)``: every stage's row, the recommendation, and the ds_config to run it."""

from __future__ import annotations

from dataclasses import dataclass, field

from zerotrain.estimate import activations as act_mod
from zerotrain.estimate.activations import ActivationBytes
from zerotrain.estimate.model_states import PRECISION_BYTES, Settings
from zerotrain.estimate.planner import (
    OFFLOAD_NOT_MODELLED,
    OFFLOAD_ROWS,
    Hardware,
    Recommendation,
    Row,
    Workload,
    build_row,
    recommend,
)
from zerotrain.estimate.report import (
    CpuBytes,
    EstimateReport,
    GpuBytes,
    ModelReport,
    RecommendationReport,
    RowReport,
    SetupReport,
    ThumbReport,
)
from zerotrain.estimate.rules_of_thumb import fine_tuning_rows
from zerotrain.estimate.shapes import ModelShape

_CONFIG_OPTIMIZER = {
    "adam": "Adam",
    "adamw": "AdamW",
    "sgd": "SGD",
    "sgd_momentum": "SGD",
    "adagrad": "Adagrad",
    "lion": "Lion",
}


@dataclass
class Estimate:
    """The result of ``estimate``: rows per stage/offload, the recommendation, notes."""

    shape: ModelShape
    hardware: Hardware
    workload: Workload
    settings: Settings
    rows: list[Row]
    recommendation: Recommendation
    activation_method: str
    notes: list[str] = field(default_factory=list)
    zero_extra: dict = field(default_factory=dict)
    lr: float = 1e-4

    def row(self, stage: int, offload: str = "none") -> Row:
        return next(r for r in self.rows if r.stage == stage and r.offload == offload)

    def ds_config(self) -> dict | None:
        """A ready ds_config.json for the recommended configuration (None when nothing fits).

        The optimizer's learning rate is a placeholder (``lr``) to edit."""
        rec = self.recommendation
        if rec.row is None:
            return None
        opt = _CONFIG_OPTIMIZER.get(self.settings.optimizer)
        cfg: dict = {
            "train_micro_batch_size_per_gpu": rec.row.micro_batch,
            "gradient_accumulation_steps": rec.gradient_accumulation_steps,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": rec.row.stage, **self.zero_extra},
        }
        if opt is not None:
            params = {"lr": self.lr}
            if self.settings.optimizer == "sgd_momentum":
                params["momentum"] = 0.9
            cfg["optimizer"] = {"type": opt, "params": params}
        if self.settings.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif self.settings.precision == "fp16":
            cfg["fp16"] = {"enabled": True, "loss_scale": 0}
        return cfg

    def report(self) -> EstimateReport:
        s, hw, w, rec = self.shape, self.hardware, self.workload, self.recommendation
        rows = [
            RowReport(
                stage=r.stage,
                offload=r.offload,
                recommendable=r.recommendable,
                micro_batch=r.micro_batch,
                activation_checkpointing=r.activation_checkpointing,
                per_gpu=GpuBytes(**r.gpu),
                per_node_cpu=CpuBytes(**r.cpu_per_node),
                per_node_nvme=r.nvme_per_node,
                fits_gpu=r.fits_gpu,
                fits_cpu=r.fits_cpu,
                fits=r.fits,
            )
            for r in self.rows
        ]
        thumbs = [
            ThumbReport(
                method=t.method, rule_bytes=t.rule_bytes(s.params), refined_bytes=t.refined_bytes(s.params), note=t.note
            )
            for t in fine_tuning_rows()
        ]
        alt = rec.offload_alternative
        recommendation = RecommendationReport(
            fits=rec.row is not None,
            stage=rec.row.stage if rec.row else None,
            micro_batch=rec.row.micro_batch if rec.row else None,
            gradient_accumulation_steps=rec.gradient_accumulation_steps if rec.row else None,
            activation_checkpointing=rec.row.activation_checkpointing if rec.row else None,
            max_micro_batch=rec.max_micro_batch,
            procedure=rec.steps,
            why_not=rec.why_not,
            offload_alternative=(
                f"{alt.label}: {alt.gpu_total / 2**30:.2f} GiB per GPU, "
                f"{alt.cpu_per_node['peak'] / 2**30:.2f} GiB host per node "
                f"({OFFLOAD_NOT_MODELLED})"
            )
            if alt
            else None,
            config=self.ds_config(),
        )
        return EstimateReport(
            model=ModelReport(
                name=str(s.name),
                source=s.source,
                params=s.params,
                largest_layer_params=s.largest_layer_params,
                layers=s.layers,
                hidden=s.hidden,
                heads=s.heads,
                vocab=s.vocab,
            ),
            setup=SetupReport(
                gpus_per_node=hw.gpus_per_node,
                nodes=hw.nodes,
                gpu_memory=hw.gpu_memory,
                cpu_memory=hw.cpu_memory,
                micro_batch=w.micro_batch,
                seq_len=w.seq_len,
                precision=self.settings.precision,
                optimizer=self.settings.optimizer,
                activation_checkpointing=w.activation_checkpointing,
                activation_method=self.activation_method,
            ),
            rows=rows,
            fine_tuning_rules_of_thumb=thumbs,
            recommendation=recommendation,
            notes=self.notes,
        )

    def text(self) -> str:
        from zerotrain.estimate.report import render_text

        return render_text(self.report())


def activation_function(shape: ModelShape, workload: Workload, settings: Settings, flash_attention: bool = False):
    """``f(micro_batch, checkpointing) -> ActivationBytes`` for the rows, and its description.

    A model is measured once (one forward at the requested micro-batch; activations scale
    linearly with the micro-batch); with checkpointing the formula is used when the shape is
    known. Otherwise the Korthikanti formula, or "unknown" without a transformer shape."""
    e = PRECISION_BYTES[settings.precision]
    measured: ActivationBytes | None = None
    if shape.module is not None:
        measured = act_mod.measured_activations(shape.module, workload.micro_batch, workload.seq_len, shape.vocab, e)

    def fn(micro: int, checkpointing: bool) -> ActivationBytes:
        if measured is not None and not (checkpointing and shape.has_transformer_shape):
            scale = micro / workload.micro_batch
            return ActivationBytes(
                int(measured.layers * scale),
                int(measured.logits * scale),
                measured.method + (" (checkpointing not modelled)" if checkpointing else ""),
                checkpointing,
            )
        return act_mod.formula_activations(shape, micro, workload.seq_len, e, checkpointing, flash_attention)

    return fn, fn(workload.micro_batch, workload.activation_checkpointing).method


def estimate(
    shape: ModelShape,
    hardware: Hardware | None = None,
    workload: Workload | None = None,
    settings: Settings | None = None,
    flash_attention: bool = False,
    zero_extra: dict | None = None,
) -> Estimate:
    """Estimate every ZeRO stage (and DeepSpeed-style offload) for ``shape`` and recommend one.

    ``zero_extra``: ``zero_optimization`` keys (bucket sizes) to carry into the written config."""
    hardware = hardware or Hardware()
    workload = workload or Workload()
    settings = settings or Settings(world_size=hardware.world_size)
    if settings.world_size != hardware.world_size:
        raise ValueError(
            f"settings.world_size={settings.world_size} but the hardware has {hardware.world_size} GPUs in all"
        )
    act_fn, method = activation_function(shape, workload, settings, flash_attention)
    logit_grad = workload.seq_len * shape.vocab * 4 if shape.vocab else 0
    cache: dict = {}

    def make_row(stage: int, offload: str, micro: int, ckpt: bool) -> Row:
        key = (stage, offload, micro, ckpt)
        if key not in cache:
            cache[key] = build_row(stage, offload, shape, settings, hardware, micro, ckpt, act_fn, logit_grad)
        return cache[key]

    rows = [make_row(s, off, workload.micro_batch, workload.activation_checkpointing) for s, off in OFFLOAD_ROWS]
    rec = recommend(make_row, workload, hardware)
    notes = []
    if not rows[0].activations_known:
        notes.append("activations are not included: only a parameter count was given")
    if shape.source == "params":
        notes.append("largest layer assumed (no model given): stage 3's gather window is approximate")
    notes.append(
        f"zerotrain's default gradient bucket is 25 MiB of parameters (DeepSpeed's 5e8 "
        f"elements would cost {5e8 * settings.grad_bytes / 1e9:.1f} GB of buffers); this "
        f"estimate uses {settings.bucket:,} elements"
    )
    return Estimate(shape, hardware, workload, settings, rows, rec, method, notes, dict(zero_extra or {}))
