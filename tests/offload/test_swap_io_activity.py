"""Swap I/O time is counted per ``DiskActivity``: two ``AsyncFileIO`` with their own (two
engines' stages) do not see each other's operations; two sharing one (a stage's optimizer and
parameter swappers) count overlaps once. Read on a scripted clock, not the wall clock."""

from __future__ import annotations

import types

import torch

from zerotrain.offload import aio


def test_each_activity_counts_its_own_operations(tmp_path, monkeypatch):
    now = [0.0]

    def tick() -> float:
        now[0] += 1.0  # every reading of the clock is one tick later
        return now[0]

    monkeypatch.setattr(aio, "time", types.SimpleNamespace(perf_counter=tick))
    mine, theirs = aio.DiskActivity(), aio.DiskActivity()
    io_a = aio.AsyncFileIO(direct=False, activity=mine)
    io_b = aio.AsyncFileIO(direct=False, activity=theirs)
    io_own = aio.AsyncFileIO(direct=False)  # no activity given: its own
    try:
        data = aio.aligned_bytes(8192 + aio.ALIGN)
        data.narrow(0, 0, 8192).copy_(torch.arange(8192) % 251)
        io_a.write(str(tmp_path / "a"), data, 8192, 1).result()
        busy_mine, busy_theirs = mine.busy_s, theirs.busy_s
        assert busy_mine == 1.0 and busy_theirs == 0.0  # one operation: enter and exit, a tick apart
        for _ in range(3):
            io_b.write(str(tmp_path / "b"), data, 8192, 1).result()
            io_own.write(str(tmp_path / "c"), data, 8192, 1).result()
        assert mine.busy_s == busy_mine  # others' writes: not counted here
        assert theirs.busy_s == 3.0 and io_own.activity.busy_s == 3.0
        assert io_own.activity is not mine and io_own.activity is not theirs
        back = aio.aligned_bytes(8192 + aio.ALIGN)
        io_a.read(str(tmp_path / "b"), back, 8192, 1).result()
        assert torch.equal(back.narrow(0, 0, 8192), data.narrow(0, 0, 8192))
        assert mine.busy_s == busy_mine + 1.0 and theirs.busy_s == 3.0
    finally:
        for io in (io_a, io_b, io_own):
            io.close()
