"""Rules on the source text of src/zerotrain that no single package's tests own.

- No project history in the code: a comment or docstring says what the code does and why, not
  which issue, seed document or work session it came from ("issue 15", "Seed 001", "session 16").
  Those numbers mean nothing to a reader of the code; the git log keeps the history.
"""

from __future__ import annotations

import re

from tests.source_tree import SRC

#: A reference to the project's history: an issue, a seed document or a work session by number.
HISTORY = re.compile(r"\b(?:[Ii]ssue #?[0-9]+|[Ss]eed 0[0-9]+|[Ss]ession [0-9]+)")


def history_references() -> list[str]:
    """``path:line: text`` for every history reference in src/zerotrain's Python files."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(SRC.parent)}:{number}: {line.strip()}")
    return found


def test_no_history_references_in_src():
    found = history_references()
    assert found == [], "say what and why instead of naming an issue, seed or session:\n" + "\n".join(found)


def test_the_history_pattern_matches_what_it_is_for():
    for text in (
        "# issue 15 parts 5-6",
        "(Issue #40)",
        "Seed 001's idle time",
        "seed 000",
        'docs/benchmarks.md "Session 16"',
    ):
        assert HISTORY.search(text), text
    for text in ("seed_layers", "base_seed + idx", "manual_seed(1234)", "session_id", "tissue 3", "the seed's table"):
        assert not HISTORY.search(text), text
