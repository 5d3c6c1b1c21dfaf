"""Two engines in one process keep their own state (issue 30, item 5).

Engine A (stage 2, ``memory_release: "off"``) and engine B (stage 3, ``"eager"``) are built side
by side on 2 ranks: each follows its own policy whichever was built last, A's weights equal A
trained alone, the memory report counts both, an engine left mid-backward and destroyed does not
make the other accept a backward it did not see begin, and each NVMe engine's ``io_busy_s`` counts its
own swap I/O only. Trims are counted through a stand-in for the C library; the I/O clock is a
counter (no wall-clock windows).
"""

from __future__ import annotations

import pytest

from zerotrain.testing import run_on_ranks


class _CountingLibc:
    def __init__(self):
        self.trims = 0
        self.mallopts = 0

    def malloc_trim(self, pad):
        self.trims += 1
        return 1

    def mallopt(self, param, value):
        self.mallopts += 1
        return 1


def _config(stage: int, policy: str, **extra) -> dict:
    from tests.engine.workloads import adamw_config

    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    return adamw_config(2, memory_release=policy, zero_optimization=zero, **extra)


def _trained(engine, steps: int, fake) -> int:
    from tests.engine.workloads import train_steps

    before = fake.trims
    train_steps(engine, steps)
    return fake.trims - before


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _policies_and_reports() -> dict:
    import zerotrain
    from tests.engine.workloads import global_batches, make_model
    from zerotrain import memory_release
    from zerotrain.monitor.memory import live_engines

    fake = _CountingLibc()
    memory_release._libc = lambda: fake
    memory_release._fix_mmap_threshold = memory_release._fix_mmap_threshold.__wrapped__
    zerotrain.init_distributed()
    out = {}
    init_policy = memory_release.memory_release()

    alone = make_model()  # A's reference: the same engine with no other in the process
    engine, *_ = zerotrain.initialize(model=alone, config=_config(2, "off"))
    out["alone_trims"] = _trained(engine, 2, fake)
    out["alone"] = _params(alone)
    engine.destroy()

    model_a, model_b = make_model(), make_model(seed=1)
    engine_a, *_ = zerotrain.initialize(model=model_a, config=_config(2, "off"))
    engine_b, *_ = zerotrain.initialize(model=model_b, config=_config(3, "eager"))
    out["policies"] = (engine_a.zero_stage_object.memory_release.name, engine_b.zero_stage_object.memory_release.name)
    out["a_trims"] = _trained(engine_a, 2, fake)  # built before B: still "off"
    out["b_trims"] = _trained(engine_b, 2, fake)
    out["beside"] = _params(model_a)
    engine_c, *_ = zerotrain.initialize(model=make_model(seed=2), config=_config(2, "off"))
    out["b_trims_after_c"] = _trained(engine_b, 1, fake)  # built before C: still "eager"
    out["init_policy"] = (init_policy, memory_release.memory_release())  # C ("off") built last

    # ds_ids: unique across the process's engines (DeepSpeed's are too)
    ids_b = [p.ds_id for p in model_b.parameters()]
    model_d = make_model(seed=3)
    engine_d, *_ = zerotrain.initialize(model=model_d, config=_config(3, "eager"))
    ids_d = [p.ds_id for p in model_d.parameters()]
    out["ids"] = (len(set(ids_b)), len(set(ids_d)), len(set(ids_b) | set(ids_d)), len(ids_b) + len(ids_d))
    engine_d.destroy()
    engine_c.destroy()

    # memory reports: the named engine's, else every live engine's summed
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as printed:
        only_a = zerotrain.memory_status("a", engine=engine_a)
        both = zerotrain.memory_status("both")
    held_a, held_b = engine_a.memory_breakdown(), engine_b.memory_breakdown()
    out["report"] = {
        "only_a": only_a["engine"],
        "both": both["engine"],
        "each": both["engines"],
        "held_a": held_a,
        "held_b": held_b,
        "sum": {k: held_a.get(k, 0) + held_b.get(k, 0) for k in held_a | held_b},
        "line": printed.getvalue().splitlines()[-1],
    }

    # an engine left in backward, then destroyed: A must still refuse a backward it cannot see
    # begin (a forward through engine_a.module, not through the engine's outputs)
    batch = global_batches(1, 2)[0]
    engine_b.destroy()
    model_e = make_model(seed=4)
    engine_e, *_ = zerotrain.initialize(model=model_e, config=_config(2, "off"))
    engine_e.zero_stage_object.begin_backward(True, False)  # never ended
    engine_e.destroy()
    try:
        engine_a.module(batch, labels=batch).loss.backward()
        out["plain_backward"] = "accepted"
    except RuntimeError as error:
        out["plain_backward"] = str(error)
    engine_a.zero_grad()
    out["after_destroy"] = len(live_engines())
    engine_a.destroy()
    out["after_all"] = len(live_engines())
    return out


def test_two_engines_keep_their_own_policy_report_and_backward_state():
    results = run_on_ranks(_policies_and_reports, world_size=2, timeout=300)
    for r in results:
        assert r["policies"] == ("off", "eager")
        init_before, init_after = r["init_policy"]
        assert init_after == init_before  # building engines leaves zero.Init's setting alone
        assert r["alone_trims"] == 0 and r["a_trims"] == 0, r  # "off": never, beside "eager" too
        assert r["b_trims"] >= 4 and r["b_trims_after_c"] >= 2, r  # "eager", beside "off" too
        for name, want in r["alone"].items():  # A beside B trains exactly as A alone
            assert r["beside"][name].equal(want), name
        per_b, per_d, union, total = r["ids"]
        assert per_b == per_d and union == total  # unique within and across engines
        report = r["report"]
        assert report["only_a"] == report["held_a"]
        assert report["each"] == [report["held_a"], report["held_b"]]
        assert report["both"] == report["sum"] != report["held_b"]  # not just the last built
        assert report["line"].endswith(" engines=2")
        assert "outside engine.backward()" in r["plain_backward"], r["plain_backward"]
        assert r["after_destroy"] == 1 and r["after_all"] == 0


def _nvme_engines(nvme_path: str) -> dict:
    """Two NVMe-offload engines; the swap I/O clock is a counter that moves only when an
    operation starts, ends or is read, so each engine's ``io_busy_s`` is a count of its own
    operations' clock ticks, the same each step."""
    import itertools
    import threading
    import types

    import zerotrain
    from tests.engine.workloads import make_model
    from zerotrain.offload import aio

    ticks, lock = itertools.count(), threading.Lock()

    def tick() -> float:
        with lock:
            return float(next(ticks))

    aio.time = types.SimpleNamespace(perf_counter=tick)
    zerotrain.init_distributed()
    zero = {
        "stage": 2,
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2},
        "sub_group_size": 2000,
    }
    config = _config(2, "off", aio={"thread_count": 1})
    config["zero_optimization"] = zero
    engine_e, *_ = zerotrain.initialize(model=make_model(), config=config)
    engine_f, *_ = zerotrain.initialize(model=make_model(seed=1), config=config)
    busy = {"e": [], "f": []}

    def step(engine, key):
        _trained(engine, 1, _CountingLibc())
        busy[key].append(engine.zero_stage_object.statistics(engine.module, engine.optimizer).offload["io_busy_s"])

    for _ in range(2):
        step(engine_f, "f")
    for _ in range(4):
        step(engine_e, "e")
    step(engine_f, "f")  # E's four steps of swap I/O happened since F's last step
    stage_e, stage_f = engine_e.zero_stage_object, engine_f.zero_stage_object
    distinct = stage_e.disk_activity is not stage_f.disk_activity
    shared = stage_e.offload.io.activity is stage_e.disk_activity
    engine_e.destroy()
    engine_f.destroy()
    return {"busy": busy, "distinct": distinct, "shared": shared}


def test_nvme_io_busy_counts_each_engines_own_swap_io(tmp_path):
    for r in run_on_ranks(_nvme_engines, world_size=2, args=(str(tmp_path),), timeout=300):
        f, e = r["busy"]["f"], r["busy"]["e"]
        assert r["distinct"] and r["shared"]
        assert all(x > 0 for x in f + e), r
        # F's window over E's steps holds F's own step only: what F's previous step took,
        # not that plus E's four steps (each about as large)
        assert sum(e) > 2 * f[1], r
        assert f[2] <= 1.5 * f[1], r


@pytest.mark.parametrize("order", ["eager_first", "off_first"])
def test_release_policy_objects_do_not_share_state(order, monkeypatch):
    """Without processes: two stage policies and their trim counters, built in either order."""
    from zerotrain import memory_release

    fake = _CountingLibc()
    monkeypatch.setattr(memory_release, "_libc", lambda: fake)
    names = ["eager", "off"] if order == "eager_first" else ["off", "eager"]
    policies = {name: memory_release.ReleasePolicy(name) for name in names}
    trims = {name: policy.trim_every(10) for name, policy in policies.items()}
    for name in names:
        trims[name].reduced(10)
        policies[name].between_phases()
        policies[name].before_backward()
    assert fake.trims == 3  # eager: the bucket, between phases, before backward; off: none
