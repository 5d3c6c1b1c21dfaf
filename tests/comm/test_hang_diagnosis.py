"""A rank that skips a collective: the others fail within the timeout, naming it."""

from __future__ import annotations

import time

from zerotrain.testing import run_on_ranks

TIMEOUT = 2.0


def _skip_one(debug: bool):
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
    last = dist.get_world_size() - 1
    if dist.get_rank() == last:
        # Stuck elsewhere (say, in the data loader) until every other rank has failed.
        deadline = time.monotonic() + TIMEOUT + 10
        try:
            while time.monotonic() < deadline and not store.check([f"test/done/{r}" for r in range(last)]):
                time.sleep(0.05)
        except dist.DistError:  # rank 0, the store's host, already finished
            pass
        return None
    start = time.monotonic()
    try:
        collectives.all_reduce(t, async_op=True).wait()
        result = {"message": "no error"}
    except comm.CollectiveError as error:
        result = {"message": str(error), "missing": error.missing, "seq": error.seq,
                  "op": error.op, "elapsed": time.monotonic() - start}
    store.set(f"test/done/{dist.get_rank()}", "1")
    return result


def test_skipped_collective_names_the_missing_rank():
    results = run_on_ranks(_skip_one, 3, args=(True,), comm_timeout=TIMEOUT)
    assert results[2] is None
    for rank, r in enumerate(results[:2]):
        assert r["missing"] == [2], r["message"]
        assert (r["op"], r["seq"]) == ("all_reduce", 3)
        # the backend's timeout plus at most the 1 s grace for the other ranks' reports
        assert TIMEOUT - 0.5 < r["elapsed"] < TIMEOUT + 3.0
        message = r["message"]
        assert message.startswith(f"all_reduce #3 (4.0 KB) on the default group of 3 ranks failed on "
                                  f"rank {rank} after {TIMEOUT:.1f} s: rank 2 had not arrived.")
        assert f"rank {1 - rank}: arrived (also blocked in all_reduce #3)" in message
        # debug mode recorded rank 2's progress, so the error quotes it
        assert "rank 2: no report" in message
        assert "its last completed collective is broadcast #2 (4.0 KB)" in message
        assert "Timed out" in message  # the backend's own error is kept


def test_without_debug_the_error_still_names_the_rank():
    r = run_on_ranks(_skip_one, 2, args=(False,), comm_timeout=TIMEOUT)[0]
    assert r["missing"] == [1], r["message"]
    assert "rank 1 had not arrived" in r["message"]
    assert '"debug": true' in r["message"]  # says how to get more
