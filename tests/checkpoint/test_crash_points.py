"""save_checkpoint interrupted before each of its filesystem calls (docs/checkpoint.md's crash
guarantee), and out of space at each call that can run out of it.

One process (1 rank) enumerates the points (tests/checkpoint/crash_runs.py): a fresh tag and a
re-used one, synchronous and asynchronous saves; each crash is an ``os._exit`` of a forked copy
of the process (no clean-up code runs, as with SIGKILL). After every fault, ``load_checkpoint``
with ``tag=None`` and ``get_fp32_state_dict_from_zero_checkpoint`` must return the weights of the
newest complete checkpoint (compared with the weights that were saved), and the next save must
work, leave nothing behind and load. A 2-rank group repeats the out-of-space enumeration on each
rank."""

from __future__ import annotations

import pytest

from tests.checkpoint import crash_runs
from zerotrain.testing import run_on_ranks

VARIANTS = [(reuse, async_save) for reuse in (False, True) for async_save in (False, True)]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    return run_on_ranks(crash_runs.crash_points, 1, args=(str(root),), timeout=1500)[0]["records"]


def _tag(reuse: bool) -> str:
    return crash_runs.OLD_TAG if reuse else "t2"


def _after_the_fault_and_the_next_save(r: dict, where: str) -> None:
    assert r["loaded"] == r["expected"], f"{where}: load_checkpoint gave {r['loaded']}"
    assert r["consolidated"] == r["expected"], f"{where}: zero_to_fp32 gave {r['consolidated']}"
    assert r["next_save"] == "ok", f"{where}: the next save failed: {r['next_save']}"
    assert r["leftovers_after_next_save"] == [], where
    assert r["latest_after_next_save"] == _tag(r["reuse"]), where
    assert r["loaded_after_next_save"] == "new", where


@pytest.mark.parametrize("reuse, async_save", VARIANTS)
def test_a_crash_before_any_filesystem_call_leaves_the_newest_complete_checkpoint(records, reuse, async_save):
    kills = [r for r in records if r["mode"] == "kill" and r["reuse"] == reuse and r["async"] == async_save]
    crashed = [r for r in kills if r["call"] is not None]
    # every call of the save was a crash point, then one run went through
    assert [r["at"] for r in kills] == list(range(1, len(kills) + 1))
    assert kills[-1]["call"] is None and kills[-1]["exit"] == 0 and kills[-1]["expected"] == "new"
    assert len(crashed) >= 45, [r["call"] for r in crashed]
    for r in kills:
        where = f"reuse={reuse} async={async_save}: killed before call {r['at']} {r['call']}"
        assert r["error"] is None, where
        assert r["exit"] == (crash_runs.CRASHED if r["call"] else 0), where
        _after_the_fault_and_the_next_save(r, where)
    calls = [tuple(r["call"]) for r in crashed]
    tag = _tag(reuse)
    for needed in [
        ("mkdir", f".{tag}.partial"),
        ("write", "metadata.json"),
        ("replace", f".{tag}.partial", tag),
        ("replace", ".latest.tmp", "latest"),
    ]:
        assert needed in calls, needed
    # both outcomes occur: the previous checkpoint before the commit point, the new one after it
    assert {r["expected"] for r in crashed} == {"old", "new"}
    # a stale partial folder of a killed save does not block the next one
    assert any(f".{tag}.partial" in r["leftovers"] for r in crashed)
    if reuse:  # killed between moving <tag> aside and renaming the new folder into place
        point = next(r for r in crashed if tuple(r["call"]) == ("replace", f".{tag}.partial", tag))
        assert point["leftovers"] == [f".{tag}.old", f".{tag}.partial"] and point["loaded"] == "old"


@pytest.mark.parametrize("reuse, async_save", VARIANTS)
def test_out_of_space_at_any_point_cleans_up_and_the_next_save_works(records, reuse, async_save):
    faults = [r for r in records if r["mode"] == "enospc" and r["reuse"] == reuse and r["async"] == async_save]
    injected = [r for r in faults if r["injected"]]
    assert faults[-1]["injected"] is False and faults[-1]["raised"] is None
    assert len(injected) >= 30, [r["call"] for r in injected]
    assert ("write", "metadata.json") in [tuple(r["call"]) for r in injected]  # mid-commit
    for r in faults:
        where = f"reuse={reuse} async={async_save}: ENOSPC before call {r['at']} {r['call']}"
        if r["injected"]:
            assert (r["raised"] or "").startswith("CheckpointError: "), f"{where}: {r['raised']}"
            assert "\n" not in r["raised"], where
        assert r["leftovers"] == [], f"{where}: left {r['leftovers']}"
        _after_the_fault_and_the_next_save(r, where)
    assert {r["expected"] for r in injected} == {"old", "new"}


def test_out_of_space_on_either_rank_of_two(tmp_path):
    """2 ranks re-saving a tag; ENOSPC before each call of rank 0, then of rank 1, that can run
    out of space: every rank raises, nothing is left behind, both load the newest complete
    checkpoint, and the next save works."""
    out = run_on_ranks(crash_runs.two_rank_faults, 2, args=(str(tmp_path),), timeout=900)
    for rank, result in enumerate(out):
        records = result["records"]
        for faulty in (0, 1):
            mine = [r for r in records if r["faulty"] == faulty]
            injected = [r for r in mine if r["injected"]]
            assert len(injected) >= (30 if faulty == 0 else 6), len(injected)
            assert mine[-1]["injected"] is False and mine[-1]["raised"] is None
            for r in mine:
                where = f"rank {rank}, ENOSPC on rank {faulty} before its call {r['at']}"
                if r["injected"]:
                    assert (r["raised"] or "").startswith("CheckpointError: "), f"{where}: {r['raised']}"
                    if faulty == 1:
                        assert "rank 1: " in r["raised"], where
                assert r["leftovers"] == [], where
                r["reuse"] = True
                _after_the_fault_and_the_next_save(r, where)
