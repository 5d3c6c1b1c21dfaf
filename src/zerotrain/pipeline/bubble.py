"""The ideal bubble of each pipeline schedule: every rank's idle share in a batch with equal stages
(each chunk's forward and backward taking the same time on every rank) and free communication,
the reference the bubble report (``zerotrain.pipeline.timeline``) prints beside the measured
idle share. Sources, and the check against torch's action orders, in docs/pipeline.md ("The
bubble"); tests/pipeline/test_timeline_schedules.py.
"""

from __future__ import annotations

# P ranks, M micro-batches, V chunks (virtual stages) per rank.
_ONE_CHUNK = "(P-1)/(M+P-1)"  # GPipe (Huang et al. 2019), 1F1B (Narayanan et al. 2019/2021)
_LOOPED = "(P-1)/(V*M+P-1)"  # M >= P: interleaved 1F1B (Narayanan et al. 2021), looped BFS (Lamy-Poirier 2023)
_LOOPED_FEW = "1-V*M/(V*P+M-1)"  # M < P: every loop waits for the micro-batches to cross all P ranks
# Split-backward schedules: the papers' bubbles hold for their own orders and only when T_F = T_B = T_W;
# torch's orders and the measured step times differ, so no number is claimed (the measured idle share is).
NO_CLOSED_FORM = {
    "zero_bubble": "n/a: torch's interleaved ZB1P over V chunks has no closed form (Qi et al. 2023 give "
    "(P-1)/(3(M+P-1)) for one chunk, only if T_F=T_B=T_W)",
    "zbv": "n/a: ZB-V is bubble-free only if T_F=T_B=T_W (Qi et al. 2023, sec. 6); no closed form otherwise",
    "dualpipev": "n/a: DualPipeV's bubble depends on T_F, T_B, T_W and overlapped F&B pairs "
    "(DeepSeek-AI 2024); no closed form for torch's order",
}
LOOPED_SCHEDULES = ("interleaved_1f1b", "looped_bfs")
ONE_CHUNK_SCHEDULES = ("1f1b", "gpipe")


def ideal_bubble(num_stages: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float | None:
    """The idle share of every rank with equal stages and free communication, for ``schedule``
    (``bubble_formula`` names it); None where no closed form holds (``NO_CLOSED_FORM``).

    GPipe/1F1B: (P-1)/(M+P-1). Interleaved 1F1B and looped BFS with V chunks per rank:
    1 - V*M / (V*max(M,P) + min(M,P) - 1), i.e. (P-1)/(V*M+P-1) for M >= P (Narayanan et al.
    2021's (1/V)(P-1)/M of the ideal time, as a share of the batch) and 1 - V*M/(V*P+M-1) for
    M < P; checked against torch's action orders by a dependency simulation (docs/pipeline.md)."""
    p, m, v = num_stages, micro_batches, virtual_stages
    if schedule in ONE_CHUNK_SCHEDULES and v == 1:
        return (p - 1) / (m + p - 1)
    if schedule in LOOPED_SCHEDULES and v >= 1:
        return 1.0 - v * m / (v * max(m, p) + min(m, p) - 1)
    return None


def bubble_formula(num_stages: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> str:
    """The formula ``ideal_bubble`` uses, or why it gives none (an ``n/a: ...`` line)."""
    if schedule in ONE_CHUNK_SCHEDULES and virtual_stages == 1:
        return _ONE_CHUNK
    if schedule in LOOPED_SCHEDULES and virtual_stages >= 1:
        return _LOOPED if micro_batches >= num_stages else _LOOPED_FEW
    if schedule in LOOPED_SCHEDULES:
        return "n/a: the timeline file does not record virtual_stages"
    return NO_CLOSED_FORM.get(schedule, f"n/a: no ideal bubble known for schedule {schedule!r}")
