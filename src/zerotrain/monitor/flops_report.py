"""The FLOPs profiler's printout (DeepSpeed's layout: summary, top modules per depth, module tree)
and DeepSpeed's number formatters (``number_to_string`` ... ``duration_to_string``)."""

from __future__ import annotations

import os

_LINE = "{:<70}  {}"


def _scaled(num: float, units: str | None, precision: int) -> tuple[str, str]:
    scales = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0}
    if units is None:
        units = next((u for u, scale in scales.items() if abs(num) >= scale), "")
    return f"{round(num / scales[units], precision):g}", units


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """``7.6 M`` style: the largest of T, G, M, K that leaves at least 1 (or ``units``)."""
    value, units = _scaled(num, units, precision)
    return f"{value} {units}".rstrip()


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    value, units = _scaled(flops, units, precision)
    return f"{value} {units}FLOPS"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    value, units = _scaled(macs, units, precision)
    return f"{value} {units}MACs"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(params, units, precision)


def duration_to_string(seconds: float, units: str | None = None, precision: int = 2) -> str:
    if units is None:
        units = "s" if seconds >= 1 else "ms" if seconds >= 1e-3 else "us"
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}[units]
    return f"{round(seconds / scale, precision):g} {units}"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0%"


def _summary(profiler, step: int) -> list[str]:
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    facts = profiler.run_facts or {}
    lines = [
        "",
        "-------------------------- zerotrain Flops Profiler --------------------------",
        f"Profile Summary at step {step}:",
        "Counted by torch.utils.flop_counter.FlopCounterMode: matrix products, convolutions and attention",
        "kernels at 2 flops per MAC; elementwise ops are not counted.",
        "",
    ]
    if facts:
        lines += [
            _LINE.format("world size: ", facts["world_size"]),
            _LINE.format("data parallel size: ", facts["dp_size"]),
            _LINE.format("batch size per GPU: ", facts["micro_batch"]),
        ]
    lines += [
        _LINE.format("forward calls profiled: ", profiler.forwards),
        _LINE.format("params per GPU: ", params_to_string(params)),
        _LINE.format("fwd MACs per GPU: ", macs_to_string(macs)),
        _LINE.format("fwd flops per GPU: ", f"{number_to_string(flops)} ({flops})"),
    ]
    times = facts.get("times_ms")
    fwd = times["forward"] / 1e3 if times and "forward" in times else profiler.get_total_duration()
    lines += [
        _LINE.format("fwd latency: ", duration_to_string(fwd)),
        _LINE.format(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(flops / fwd if fwd else 0)
        ),
    ]
    achieved = None
    if times and "backward" in times and "step" in times:
        factor = 2 + profiler.recompute_fwd_factor
        bwd, opt = times["backward"] / 1e3, times["step"] / 1e3
        iteration = fwd + bwd + opt
        achieved = (factor + 1) * flops / iteration
        lines += [
            _LINE.format("bwd latency: ", duration_to_string(bwd)),
            _LINE.format(
                f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                flops_to_string(factor * flops / bwd if bwd else 0),
            ),
            _LINE.format(
                f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                flops_to_string((factor + 1) * flops / (fwd + bwd)),
            ),
            _LINE.format("step latency: ", duration_to_string(opt)),
            _LINE.format("iter latency: ", duration_to_string(iteration)),
            _LINE.format(
                f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ", flops_to_string(achieved)
            ),
            _LINE.format("samples/second: ", f"{facts['samples_per_step'] / iteration:.2f}"),
        ]
    if facts:
        peak = facts.get("peak_flops")
        lines.append(_LINE.format("peak FLOPS per GPU: ", flops_to_string(peak) if peak else "n/a"))
        mfu = f"{100 * achieved / peak:.2f}%" if peak and achieved is not None else "n/a"
        lines.append(_LINE.format("MFU = FLOPS per GPU / peak FLOPS per GPU: ", mfu))
    return lines


def _aggregated(rows, module_depth: int, top_modules: int) -> list[str]:
    """The ``top_modules`` largest module types at each depth, by params, flops and latency
    (modules of one type at one depth are summed, as DeepSpeed does)."""
    by_depth: dict[int, dict[str, list[float]]] = {}
    for name, module, params, flops, seconds in rows:
        depth = 0 if not name else name.count(".") + 1
        totals = by_depth.setdefault(depth, {}).setdefault(type(module).__name__, [0, 0, 0.0])
        totals[0] += params
        totals[1] += flops
        totals[2] += seconds
    deepest = max(by_depth)
    last = deepest if module_depth < 0 else min(module_depth, deepest)
    lines = [
        "",
        "----------------------------- Aggregated Profile per GPU -----------------------------",
        "Top modules in terms of params, flops or fwd latency at different model depths:",
    ]
    for depth in range(last + 1):
        kinds = by_depth[depth]

        def top(i, fmt):
            ranked = sorted(kinds.items(), key=lambda kv: kv[1][i], reverse=True)[:top_modules]
            return {kind: fmt(values[i]) for kind, values in ranked}

        lines += [
            f"depth {depth}:",
            f"    params      - {top(0, params_to_string)}",
            f"    flops       - {top(1, number_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return lines


def _detailed(rows, total_params: int, total_flops: int, total_seconds: float) -> list[str]:
    lines = [
        "",
        "------------------------------ Detailed Profile per GPU ------------------------------",
        "Each module profile is listed after its name in the following order:",
        "params, percentage of total params, flops, percentage of total flops, MACs, fwd latency, "
        "percentage of total fwd latency, fwd FLOPS",
        "",
    ]
    for name, module, params, flops, seconds in rows:
        depth = 0 if not name else name.count(".") + 1
        label = type(module).__name__ if not name else f"({name.rpartition('.')[2]}): {type(module).__name__}"
        lines.append(
            "  " * depth + f"{label}({params_to_string(params)}, {_pct(params, total_params)} Params, "
            f"{number_to_string(flops)} = {_pct(flops, total_flops)} flops, {macs_to_string(flops // 2)}, "
            f"{duration_to_string(seconds)} = {_pct(seconds, total_seconds)} latency, "
            f"{flops_to_string(flops / seconds if seconds else 0)})"
        )
    return lines


def write_report(
    profiler, profile_step: int, module_depth: int, top_modules: int, detailed: bool, output_file: str | None
) -> str:
    """The profile as text, printed, or written to ``output_file`` (its folder is created)."""
    rows = profiler.module_rows()
    lines = _summary(profiler, profile_step) + _aggregated(rows, module_depth, top_modules)
    if detailed:
        lines += _detailed(rows, profiler.get_total_params(), profiler.get_total_flops(), profiler.get_total_duration())
    lines.append("-" * 78)
    text = "\n".join(lines) + "\n"
    if output_file:
        folder = os.path.dirname(os.path.abspath(output_file))
        os.makedirs(folder, exist_ok=True)
        with open(output_file, "w") as handle:
            handle.write(text)
    else:
        print(text, end="", flush=True)
    return text
