"""``--plot``: per-row stacked bars of per-GPU memory (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from zerotrain.estimate.report import EstimateReport

_PARTS = (
    ("parameters", "parameters"),
    ("master_parameters", "fp32 masters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state"),
    ("activations", "activations"),
    ("communication_buffers", "comm buffers"),
    ("gathered_parameters", "gathered (stage 3)"),
    ("transient", "temporaries"),
    ("reserve", "reserve"),
)


MISSING_MATPLOTLIB = "zerotrain estimate --plot needs matplotlib: pip install 'zerotrain[plot]'"


class MissingExtra(Exception):
    """An optional dependency (an extra of the zerotrain package) is not installed."""


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend; MissingExtra when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtra(MISSING_MATPLOTLIB) from None
    return plt


def plot_rows(report: EstimateReport, path: str) -> None:
    """Write a PNG (or any format matplotlib infers from ``path``) of the rows' per-GPU bytes,
    with the GPU's memory as a line when known."""
    plt = pyplot()
    labels = [
        f"s{r.stage}"
        + (
            ""
            if r.offload == "none"
            else "\n" + r.offload.replace("optimizer", "opt").replace("_params", "+p").replace("_", " ")
        )
        for r in report.rows
    ]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(labels)), 5))
    bottoms = [0.0] * len(report.rows)
    for key, name in _PARTS:
        values = [getattr(r.per_gpu, key) / 2**30 for r in report.rows]
        ax.bar(labels, values, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if report.setup.gpu_memory:
        ax.axhline(report.setup.gpu_memory / 2**30, color="black", linestyle="--", label="GPU memory")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(
        f"{report.model.name}: {report.model.params / 1e9:.2f}B params, "
        f"{report.setup.nodes}x{report.setup.gpus_per_node} GPUs, micro-batch "
        f"{report.setup.micro_batch}, {report.setup.precision}"
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
