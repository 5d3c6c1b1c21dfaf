"""The ``memory_release`` policy: "eager" trims the heap several times a step and fixes the mmap
threshold, "per_step" trims once a step (before backward), "off" never does; the default is
"eager" at stage 3 and "per_step" at stages 0-2.

Trims are counted through a stand-in for the C library, so the checks do not depend on what
glibc does with the pages."""

from __future__ import annotations

import pytest

from zerotrain import memory_release
from zerotrain.testing import run_on_ranks


class _CountingLibc:
    def __init__(self):
        self.trims = 0
        self.mallopts = []

    def malloc_trim(self, pad):
        self.trims += 1
        return 1

    def mallopt(self, param, value):
        self.mallopts.append((param, value))
        return 1


@pytest.fixture
def libc(monkeypatch):
    fake = _CountingLibc()
    monkeypatch.setattr(memory_release, "_libc", lambda: fake)
    monkeypatch.setattr(memory_release, "_fix_mmap_threshold", memory_release._fix_mmap_threshold.__wrapped__)
    yield fake
    memory_release.set_memory_release("eager")


def test_policy_follows_config_then_environment_then_stage(monkeypatch, libc):
    monkeypatch.delenv("ZEROTRAIN_MEMORY_RELEASE", raising=False)
    for stage, default in ((0, "per_step"), (1, "per_step"), (2, "per_step"), (3, "eager")):
        assert memory_release.ReleasePolicy(None, stage).name == default
    monkeypatch.setenv("ZEROTRAIN_MEMORY_RELEASE", "off")
    assert memory_release.ReleasePolicy(None).name == "off"
    assert memory_release.ReleasePolicy("eager").name == "eager"  # the config's value wins
    with pytest.raises(ValueError, match="memory_release.*ZEROTRAIN_MEMORY_RELEASE"):
        memory_release.ReleasePolicy("lazy")
    # zero.Init's process-wide setting resolves the same way
    memory_release.set_memory_release(None)
    assert memory_release.memory_release() == "off"
    with pytest.raises(ValueError, match="memory_release.*ZEROTRAIN_MEMORY_RELEASE"):
        memory_release.set_memory_release("lazy")


def test_eager_trims_per_bucket_and_between_phases_off_never(libc):
    policy = memory_release.ReleasePolicy("eager")
    trim = policy.trim_every(100)
    for _ in range(4):
        trim.reduced(50)  # 200 elements: a trim per 100
    policy.between_phases()
    assert libc.trims == 3
    assert policy.configure_allocator() and libc.mallopts == [
        (memory_release.M_MMAP_THRESHOLD, memory_release.MMAP_THRESHOLD_BYTES)
    ]

    policy = memory_release.ReleasePolicy("per_step")
    trim = policy.trim_every(100)
    libc.trims, libc.mallopts = 0, []
    for _ in range(4):
        trim.reduced(50)
    policy.between_phases()
    assert libc.trims == 0
    policy.before_backward()
    assert libc.trims == 1
    assert not policy.configure_allocator() and libc.mallopts == []

    policy = memory_release.ReleasePolicy("off")
    trim = policy.trim_every(100)
    libc.trims, libc.mallopts = 0, []
    for _ in range(4):
        trim.reduced(50)
    policy.between_phases()
    policy.before_backward()
    assert libc.trims == 0
    assert not policy.configure_allocator() and libc.mallopts == []
    memory_release.release_freed_memory()  # one-time releases happen under either policy
    assert libc.trims == 1


def test_policies_side_by_side_do_not_change_each_other(libc):
    """Two policies alive at once (two engines' stage objects): each trims by its own; zero.Init's
    process-wide setting is neither's."""
    eager, off = memory_release.ReleasePolicy("eager"), memory_release.ReleasePolicy("off")
    memory_release.set_memory_release("per_step")  # zero.Init's: changes neither
    eager_trim, off_trim = eager.trim_every(10), off.trim_every(10)
    for _ in range(3):
        eager_trim.reduced(10)
        off_trim.reduced(10)
    eager.between_phases()
    off.between_phases()
    off.before_backward()
    assert libc.trims == 4 and (eager.name, off.name) == ("eager", "off")
    assert not memory_release.configure_allocator() and libc.mallopts == []  # Init's: per_step
    assert memory_release.configure_allocator("eager") and len(libc.mallopts) == 1


def _trims_per_step(policies):
    """Train 2 steps at each stage under each config ``memory_release``; trims and mmap
    threshold settings counted (the stand-in libc makes the policy switchable in one process)."""
    import zerotrain
    from tests.engine.workloads import adamw_config, make_model, train_steps

    fake = _CountingLibc()
    memory_release._libc = lambda: fake
    memory_release._fix_mmap_threshold = memory_release._fix_mmap_threshold.__wrapped__
    zerotrain.init_distributed()
    out = {}
    for policy in policies:
        out[policy] = {}
        for stage in (1, 2, 3):
            model = make_model()
            mallopts = len(fake.mallopts)
            extra = {} if policy is None else {"memory_release": policy}
            engine, *_ = zerotrain.initialize(
                model=model, config=adamw_config(2, zero_optimization={"stage": stage}, **extra)
            )
            before = fake.trims
            train_steps(engine, 2)
            out[policy][stage] = {
                "trims": fake.trims - before,
                "policy": engine.zero_stage_object.memory_release.name,
                "threshold_set": len(fake.mallopts) > mallopts,
            }
            engine.destroy()
    return out


def test_config_key_reaches_the_engine():
    result = run_on_ranks(_trims_per_step, world_size=2, args=(("eager", "per_step", "off", None),))[0]
    eager, per_step, off, default = result["eager"], result["per_step"], result["off"], result[None]
    for stage in (1, 2, 3):
        assert eager[stage]["policy"] == "eager" and eager[stage]["trims"] >= 4, eager
        assert eager[stage]["threshold_set"], eager
        assert off[stage] == {"trims": 0, "policy": "off", "threshold_set": False}, off
    for stage in (1, 2, 3):
        # once per step before backward (stage 3 also before backward's first gather, when
        # it has partitioned units to gather)
        assert per_step[stage]["policy"] == "per_step" and not per_step[stage]["threshold_set"]
        assert 2 <= per_step[stage]["trims"] <= (4 if stage == 3 else 2), per_step
        assert default[stage] == (eager[stage] if stage == 3 else per_step[stage]), default
