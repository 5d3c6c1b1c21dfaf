"""A rank that skips a collective: the others fail within the timeout, naming it."""

from __future__ import annotations

import re
import time

from zerotrain.testing import run_on_ranks

TIMEOUT = 2.0


def _wait_for(store, keys) -> None:
    """Until every key is in the store (no deadline: the test's own timeout bounds it)."""
    while not store.check(keys):
        time.sleep(0.05)


def _skip_one(debug: bool, op: str = "all_reduce"):
    import torch
    import torch.distributed as dist

    import zerotrain.comm as comm
    from zerotrain.comm import collectives

    comm.init_distributed()
    if debug:
        comm.configure(enabled=True, debug=True)
    t = torch.ones(1024)
    collectives.all_reduce(t)
    collectives.broadcast(t, src=0)
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    last = world - 1
    result = None
    if rank == last:
        # Stuck elsewhere (say, in the data loader) until every other rank has failed.
        _wait_for(store, [f"test/failed/{r}" for r in range(last)])
    else:
        start = time.monotonic()
        try:
            if op == "all_reduce":
                collectives.all_reduce(t, async_op=True).wait()
            else:  # gloo: isend/irecv with each peer
                full = torch.zeros(t.numel() * world)
                collectives.all_gather_into(full, t, async_op=True).wait()
            result = {"message": "no error"}
        except comm.CollectiveError as error:
            result = {
                "message": str(error),
                "missing": error.missing,
                "seq": error.seq,
                "op": error.op,
                "elapsed": time.monotonic() - start,
            }
        store.set(f"test/failed/{rank}", "1")
    # Rank 0's process hosts the store: it must stay until no other rank needs the store (a
    # loaded machine may still have a rank diagnosing, which reads the store, after rank 0 has).
    store.set(f"test/done/{rank}", "1")
    if rank == 0:
        _wait_for(store, [f"test/done/{r}" for r in range(1, world)])
    return result


def _reported_wait(message: str) -> float:
    """The seconds the message says the collective waited (``... after 2.0 s: ...``)."""
    found = re.search(r" failed on rank \d+ after (\d+\.\d) s: ", message)
    assert found, message
    return float(found.group(1))


def test_skipped_collective_names_the_missing_rank():
    results = run_on_ranks(_skip_one, 3, args=(True,), comm_timeout=TIMEOUT)
    assert results[2] is None
    for rank, r in enumerate(results[:2]):
        assert r["missing"] == [2], r["message"]
        assert (r["op"], r["seq"]) == ("all_reduce", 3)
        # it waited the backend's timeout (no upper bound: a loaded machine is slow)
        assert r["elapsed"] > TIMEOUT - 0.5 and _reported_wait(r["message"]) > TIMEOUT - 0.5
        message = r["message"]
        assert re.match(
            rf"all_reduce #3 \(4.0 KB\) on the default group of 3 ranks failed on "
            rf"rank {rank} after \d+\.\d s: rank 2 had not arrived\.\n",
            message,
        ), message
        assert f"rank {1 - rank}: arrived (also blocked in all_reduce #3)" in message
        # debug mode recorded rank 2's progress, so the error quotes it
        assert "rank 2: no report" in message
        assert "its last completed collective is broadcast #2 (4.0 KB)" in message
        assert "Timed out" in message  # the backend's own error is kept


def test_send_recv_gather_names_the_missing_rank():
    """gloo's all-gather is built from sends and receives: a skipped one fails the same way."""
    results = run_on_ranks(_skip_one, 3, args=(False, "all_gather_into"), comm_timeout=TIMEOUT)
    assert results[2] is None
    for rank, r in enumerate(results[:2]):
        assert r["missing"] == [2], r["message"]
        assert (r["op"], r["seq"]) == ("all_gather_into_tensor", 3)
        assert r["elapsed"] > TIMEOUT - 0.5 and _reported_wait(r["message"]) > TIMEOUT - 0.5
        assert re.match(
            rf"all_gather_into_tensor #3 \(12.0 KB\) on the default group of 3 ranks "
            rf"failed on rank {rank} after \d+\.\d s: rank 2 had not arrived\.",
            r["message"],
        ), r["message"]


def _diagnose_with_reports(monkeypatch, reports: dict, progress: dict | None = None, wrap=None, **kw):
    """``diagnose`` on rank 0 of 4 against an in-memory store holding the other ranks' reports."""
    import json

    import torch.distributed as dist

    from zerotrain.comm import hang

    store = dist.HashStore()
    for r, report in reports.items():
        store.set(f"zerotrain/failed/world/{r}", json.dumps(report))
    for r, report in (progress or {}).items():
        store.set(f"zerotrain/progress/world/{r}", json.dumps(report))
    if wrap is not None:
        store = wrap(store)
    monkeypatch.setattr(hang, "_store", lambda: store)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1, 2, 3])
    exc = RuntimeError("Timed out waiting 2000ms for recv operation to complete")
    return hang.diagnose(exc, "reduce_scatter_tensor", 2**20, 7, None, time.monotonic() - 2.0, grace=0.1, **kw)


def test_each_rank_is_classified_from_its_report(monkeypatch):
    error = _diagnose_with_reports(
        monkeypatch,
        {
            1: {"seq": 7, "op": "reduce_scatter_tensor", "bytes": 2**20},  # arrived
            2: {"seq": 5, "op": "all_gather_into_tensor", "bytes": 64},  # stuck earlier
            3: {"seq": 7, "op": "all_reduce", "bytes": 4},
        },
    )  # issued something else
    message = str(error)
    assert error.missing == [2, 3] and error.seq == 7
    assert message.startswith(
        "reduce_scatter_tensor #7 (1.0 MB) on the default group of 4 ranks "
        "failed on rank 0 after 2.0 s: ranks 2, 3 had not arrived."
    )
    assert "rank 1: arrived" in message
    assert "rank 2: still blocked in an earlier collective, all_gather_into_tensor #5" in message
    assert "rank 3: blocked in all_reduce #7 (4.0 B) instead: ranks issued different collectives" in message
    assert "backend error: Timed out" in message and "debug" not in message


def test_without_reports_or_debug_the_error_says_how_to_learn_more(monkeypatch):
    error = _diagnose_with_reports(monkeypatch, {}, progress={3: {"seq": 6, "op": "all_reduce", "bytes": 8}})
    message = str(error)
    assert error.missing == [1, 2, 3]
    assert "rank 1: no report within 0.1 s" in message
    assert "rank 3: no report" in message and "its last completed collective is all_reduce #6" in message
    assert '"debug": true' in message  # ranks 1 and 2 left no progress


def test_argument_errors_are_not_diagnosed(monkeypatch):
    from zerotrain.comm import hang

    exc = RuntimeError("Tensors must be contiguous")
    assert hang.diagnose(exc, "all_reduce", 4, 1, None, time.monotonic()) is exc


class _StoreGoneAfter:
    """A store that answers ``reads`` checks, then fails as a TCPStore whose host exited."""

    def __init__(self, inner, reads: int):
        self.inner, self.reads = inner, reads

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def check(self, keys):
        if self.reads == 0:
            raise RuntimeError("Broken pipe")
        self.reads -= 1
        return self.inner.check(keys)


def test_ranks_unheard_because_the_store_is_gone_are_unknown_not_absent(monkeypatch):
    """Rank 0 hosts the store and leaves once it has its own error; a rank still diagnosing then
    cannot read the others' reports, and must not name them as the ranks that never came."""
    error = _diagnose_with_reports(
        monkeypatch,
        {
            1: {"seq": 7, "op": "reduce_scatter_tensor", "bytes": 2**20},
            2: {"seq": 7, "op": "reduce_scatter_tensor", "bytes": 2**20},
        },
        wrap=lambda store: _StoreGoneAfter(store, reads=1),
    )
    message = str(error)
    assert error.missing == [], message
    assert (
        "failed on rank 0 after 2.0 s: which ranks had not arrived is unknown: the rendezvous "
        "store is unreachable" in message
    )
    assert "rank 1: arrived" in message
    assert "rank 2: unknown" in message and "rank 3: unknown" in message
    assert "could not consult the rendezvous store: Broken pipe" in message
    # a rank that did report a different collective is still named
    error = _diagnose_with_reports(
        monkeypatch, {1: {"seq": 5, "op": "all_reduce", "bytes": 4}}, wrap=lambda store: _StoreGoneAfter(store, reads=1)
    )
    assert error.missing == [1] and "rank 2: unknown" in str(error)
