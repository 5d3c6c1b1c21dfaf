"""The runs behind tests/checkpoint/test_crash_points.py (module-level: run_on_ranks spawns them).

``crash_points`` (1 rank): saves a checkpoint, trains a step, then saves again -- under a fresh
tag and under the same tag, synchronously and with ``async_save`` -- crashing that save before
each of its filesystem calls in turn (``os._exit`` in a forked copy of the process: nothing is
cleaned up, like SIGKILL), and separately making each call that can fail with ENOSPC raise it
(in process). After every fault it records which weights ``load_checkpoint`` (``tag=None``) and
``get_fp32_state_dict_from_zero_checkpoint`` return, what was left in ``save_dir``, and whether
the next save works and loads.

``two_rank_faults`` (2 ranks): the same ENOSPC enumeration on each rank of a 2-rank save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from tests.checkpoint.faults import CAN_RUN_OUT_OF_SPACE, FileSystemCalls, no_space
from tests.checkpoint.workloads import build, config, train

CRASHED = 86
OLD_TAG = "t1"


def _weights(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module_state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def _which(got: dict, old: dict, new: dict) -> str:
    return "new" if _same(got, new) else "old" if _same(got, old) else "neither"


def _expected(calls: list, tag: str, reuse: bool) -> str:
    """What ``latest`` must name after a fault that let ``calls`` complete: a re-used tag is new
    once the new folder was renamed into place, a fresh tag once ``latest`` was replaced."""
    done = {tuple(c) for c in calls}
    if reuse:
        return "new" if ("replace", f".{tag}.partial", tag) in done else "old"
    return "new" if ("replace", ".latest.tmp", "latest") in done else "old"


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


class _Setup:
    """The engine that saves (its state is the "new" checkpoint), a probe engine that loads,
    a decoy checkpoint the probe loads before a check (so a load that loads nothing shows).

    With ``one_rank``, the decoy is loaded only where the probe's whole state already is the
    checkpoint the check expects ("old" or "new", from its last complete load): otherwise a load
    that loads nothing, or only part of the state, leaves weights other than the expected ones
    and shows just the same. (On 2 ranks every check loads it: the ranks' decisions could differ,
    and the loads are collective.)"""

    def __init__(self, root: Path, one_rank: bool = False):
        self.one_rank = one_rank
        self.holds = None  # what the probe's whole state is, where known: "old", "new"
        cfg = config(2)
        del cfg["scheduler"]  # a warm-up from lr 0 would leave the first step's weights unchanged
        self.engine = build(cfg)
        self.probe = build(cfg)
        train(self.engine, 1)
        self.decoy = root / "decoy"
        self.probe.save_checkpoint(self.decoy, tag="decoy")  # untrained: other weights
        self.base = root / "base"
        self.engine.save_checkpoint(self.base, tag=OLD_TAG)
        self.old = _weights(self.engine)
        train(self.engine, 1)
        self.new = _weights(self.engine)
        self.decoy_weights = _weights(self.probe)
        assert not _same(self.old, self.new) and not _same(self.decoy_weights, self.old)

    def fresh_copy(self, folder: Path) -> Path:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(self.base, folder)
        return folder

    def probe_load(self, folder: Path, expected: str | None = None) -> str:
        from zerotrain.checkpoint.format import CheckpointError

        if not self.one_rank or expected is None or self.holds in (None, expected):
            self.probe.load_checkpoint(self.decoy)
            assert _same(_weights(self.probe), self.decoy_weights)
        self.holds = None
        try:
            self.probe.load_checkpoint(folder)
        except CheckpointError as error:
            return f"CheckpointError: {error}"
        got = _which(_weights(self.probe), self.old, self.new)
        self.holds = got if got in ("old", "new") else None
        return got

    def consolidated(self, folder: Path) -> str:
        from zerotrain.checkpoint import get_fp32_state_dict_from_zero_checkpoint
        from zerotrain.checkpoint.format import CheckpointError

        try:
            return _which(get_fp32_state_dict_from_zero_checkpoint(folder), self.old, self.new)
        except CheckpointError as error:
            return f"CheckpointError: {error}"

    def save(self, folder: Path, tag: str, async_save: bool) -> None:
        self.engine.save_checkpoint(folder, tag=tag, async_save=async_save)
        self.engine.wait_for_checkpoint()

    def check(self, folder: Path, tag: str, async_save: bool, record: dict) -> dict:
        """After a fault: what loads; then the next save (recovery) and what loads after it."""
        record["loaded"] = self.probe_load(folder, record.get("expected"))
        record["consolidated"] = self.consolidated(folder)
        try:
            self.save(folder, tag, async_save)
        except Exception as error:  # noqa: BLE001 - recorded, the test names it
            record["next_save"] = f"{type(error).__name__}: {error}"
            return record
        record["next_save"] = "ok"
        record["leftovers_after_next_save"] = _leftovers(folder)
        record["latest_after_next_save"] = (folder / "latest").read_text()
        record["loaded_after_next_save"] = self.probe_load(folder, "new")
        return record


def _save_in_child(setup: _Setup, folder: Path, tag: str, async_save: bool, at: int) -> dict:
    """Save in a forked copy of this process that dies (``os._exit``) before its ``at``-th
    filesystem call; returns the calls it made and whether it died."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        code = 0

        def die(call, calls):
            os.write(write_end, json.dumps({"calls": calls, "died_before": call}).encode())
            os._exit(CRASHED)

        try:
            calls = FileSystemCalls(at, die).install()
            setup.save(folder, tag, async_save)
            calls.uninstall()
            os.write(write_end, json.dumps({"calls": calls.calls, "died_before": None}).encode())
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            os.write(write_end, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
            code = 1
        os._exit(code)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 1 << 16):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b"{}")
    out["exit"] = os.waitstatus_to_exitcode(status)
    return out


def crash_points(root: str) -> dict:
    from zerotrain.checkpoint.format import CheckpointError

    root = Path(root)
    setup = _Setup(root, one_rank=True)
    records = []
    for reuse in (False, True):
        tag = OLD_TAG if reuse else "t2"
        for async_save in (False, True):
            variant = {"reuse": reuse, "async": async_save}
            # 1. killed before call number `at`
            at = 1
            while True:
                folder = setup.fresh_copy(root / "work")
                child = _save_in_child(setup, folder, tag, async_save, at)
                record = dict(
                    variant,
                    mode="kill",
                    at=at,
                    exit=child["exit"],
                    error=child.get("error"),
                    call=child.get("died_before"),
                )
                if "calls" in child:
                    record["expected"] = (
                        "new" if child["died_before"] is None else _expected(child["calls"], tag, reuse)
                    )
                    record["leftovers"] = _leftovers(folder)
                records.append(setup.check(folder, tag, async_save, record))
                if child.get("died_before") is None:
                    break
                at += 1
            # 2. ENOSPC at call number `at` (of those that can fail so), in process
            at = 1
            while True:
                folder = setup.fresh_copy(root / "work")
                faults = FileSystemCalls(at, no_space, kinds=CAN_RUN_OUT_OF_SPACE)
                raised = None
                with faults:
                    try:
                        setup.save(folder, tag, async_save)
                    except CheckpointError as error:
                        raised = f"CheckpointError: {error}"
                    except Exception as error:  # noqa: BLE001 - the test names it
                        raised = f"not a CheckpointError: {type(error).__name__}: {error}"
                injected = len(faults.calls) >= at
                record = dict(
                    variant,
                    mode="enospc",
                    at=at,
                    injected=injected,
                    raised=raised,
                    call=list(faults.calls[at - 1]) if injected else None,
                    expected=(_expected(faults.calls[: at - 1], tag, reuse) if injected and raised else "new"),
                    leftovers=_leftovers(folder),
                )
                records.append(setup.check(folder, tag, async_save, record))
                if not injected:
                    break
                at += 1
    return {"records": records}


def two_rank_faults(root: str) -> dict:
    """ENOSPC before each ENOSPC-able call of rank 0, then of rank 1, re-saving a tag."""
    import torch.distributed as dist

    from zerotrain.checkpoint.format import CheckpointError

    root = Path(root)
    setup = _Setup(root)
    rank = dist.get_rank()
    records = []
    for faulty in (0, 1):
        at = 1
        while True:
            folder = root / "work"
            if rank == 0:
                setup.fresh_copy(folder)
            dist.barrier()
            faults = FileSystemCalls(at, no_space, kinds=CAN_RUN_OUT_OF_SPACE)
            raised = None
            if rank == faulty:
                faults.install()
            try:
                setup.save(folder, OLD_TAG, False)
            except CheckpointError as error:
                raised = f"CheckpointError: {error}"
            except Exception as error:  # noqa: BLE001 - the test names it
                raised = f"not a CheckpointError: {type(error).__name__}: {error}"
            finally:
                faults.uninstall()
            flags = [None, None]
            dist.all_gather_object(flags, (len(faults.calls) >= at, faults.calls[: at - 1]))
            injected, done = flags[faulty]
            record = {
                "faulty": faulty,
                "at": at,
                "injected": injected,
                "raised": raised,
                "expected": _expected(done, OLD_TAG, True) if injected and raised else "new",
                "leftovers": _leftovers(folder) if rank == 0 else [],
            }
            dist.barrier()
            records.append(setup.check(folder, OLD_TAG, False, record))
            dist.barrier()
            if not injected:
                break
            at += 1
    return {"records": records}
