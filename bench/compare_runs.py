"""Compare two sets of `bench/gpt_workload.py` records (e.g. two revisions, see run_revision.sh).

    python bench/compare_runs.py BEFORE.jsonl AFTER.jsonl [--skip 2]

Prints whether the losses are bit-identical run for run, and the medians over every run and rank
of the per-step seconds (the first --skip steps left out), forward/backward/step split, and peak
RSS, with the ratio after/before.
"""

from __future__ import annotations

import argparse
import json
import statistics


def _load(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def _median_steps(rows, key, skip):
    return statistics.median(v for r in rows for v in r[key][skip:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--skip", type=int, default=2)
    args = p.parse_args()
    before, after = _load(args.before), _load(args.after)
    same = {tuple(r["losses"]) for r in before} == {tuple(r["losses"]) for r in after}
    print(f"runs: before {len(before)} records, after {len(after)}; losses bit-identical: {'yes' if same else 'NO'}")
    print(f"{'figure':<22}{'before':>10}{'after':>10}{'ratio':>8}")
    figures = [
        ("step s", lambda rows: _median_steps(rows, "step_s", args.skip)),
        ("peak RSS MiB", lambda rows: statistics.median(r["peak_rss_mib"] for r in rows)),
    ]
    for i, phase in enumerate(("forward", "backward", "optimizer step")):  # phase_s rows
        figures.append(
            (
                f"{phase} s",
                lambda rows, i=i: statistics.median(step[i] for r in rows for step in r["phase_s"][args.skip :]),
            )
        )
    for name, fn in figures:
        b, a = fn(before), fn(after)
        print(f"{name:<22}{b:>10.4f}{a:>10.4f}{a / b:>8.3f}")


if __name__ == "__main__":
    main()
