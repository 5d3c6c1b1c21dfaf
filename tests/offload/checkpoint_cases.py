"""Checkpoints of NVMe-offloaded state: save, resume and reshard like the in-memory case
(run by tests/offload/test_offload.py, in its process group).

One 2-rank group saves at stage 3 in bf16 with optimizer state (fp32 masters included) and
parameters on NVMe, and resumes with NVMe offload and without offload (and the other way round):
every resumed run continues bit-identically. A 1-rank group then loads that checkpoint at stage 3
with and without NVMe offload (identical training from there) and at stage 2 in fp32 with the
optimizer on NVMe (the shard is the master): the same optimizer state by name as saved.
"""

from __future__ import annotations

import os

import torch

from tests.checkpoint.workloads import config, train
from tests.engine.workloads import make_model

STEPS = 3
CASES = {"s3bf16": (3, "bf16")}


def _config(stage: int, precision: str, nvme: str | None) -> dict:
    cfg = config(stage, precision)
    if nvme is not None:
        cfg["zero_optimization"].update(
            offload_optimizer={"device": "nvme", "nvme_path": nvme, "buffer_count": 2}, sub_group_size=700
        )  # several chunks per unit, chunk edges inside parameters
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 3000}
    return cfg


def _engine(stage, precision, nvme):
    import zerotrain

    model = make_model()
    engine, optimizer, _, _ = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, precision, nvme)
    )
    return engine, optimizer, model


def _named_state(engine, optimizer) -> dict:
    return {
        name: [(start, {k: v.clone() if torch.is_tensor(v) else v for k, v in d.items()}) for start, d in pieces]
        for name, pieces in engine._zero.named_optimizer_state(optimizer).items()
    }


def _params(engine) -> dict:
    state = engine.module_state_dict()
    return {k: v.detach().float().clone() for k, v in state.items()}


def save_and_resume(folder: str, nvme: str) -> dict:
    """On every rank of a 2-rank group."""
    out = {}
    for case, (stage, precision) in CASES.items():

        def resume(tag, offload):
            engine, _, _ = _engine(stage, precision, nvme if offload else None)
            engine.load_checkpoint(f"{folder}/{case}", tag)
            losses = train(engine, STEPS)
            params = _params(engine)
            engine.destroy()
            return losses, params

        engine, _, _ = _engine(stage, precision, None)  # the uninterrupted in-memory run
        train(engine, STEPS)
        engine.save_checkpoint(f"{folder}/{case}", "plain")
        reference = (train(engine, STEPS), _params(engine))
        engine.destroy()
        engine, optimizer, _ = _engine(stage, precision, nvme)
        train(engine, STEPS)
        engine.save_checkpoint(f"{folder}/{case}", "nvme")
        saved_state = _named_state(engine, optimizer)
        swap_folder = engine._zero.offload.folder
        engine.destroy()
        out[case] = {
            "reference": reference,
            "saved_state": saved_state,
            "swap_gone": not os.path.exists(swap_folder),
            "nvme->nvme": resume("nvme", True),
            "nvme->plain": resume("nvme", False),
            "plain->nvme": resume("plain", True),
        }
    return out


def load_on_one_rank(folder: str, nvme: str) -> dict:
    """In a 1-rank group."""
    out = {}
    for case in CASES:
        for stage, precision, offload in ((3, "bf16", True), (3, "bf16", False), (2, "fp32", True)):
            engine, optimizer, _ = _engine(stage, precision, nvme if offload else None)
            engine.load_checkpoint(f"{folder}/{case}", "nvme")
            state = _named_state(engine, optimizer)
            losses = train(engine, 2)
            out[case, stage, offload] = {"state": state, "losses": losses, "params": _params(engine)}
            engine.destroy()
    return out


def _merged(per_rank: list[dict]) -> dict:
    """``{name: {key: whole flat tensor}}`` from every rank's named optimizer state."""
    pieces: dict[str, list] = {}
    for named in per_rank:
        for name, entries in named.items():
            pieces.setdefault(name, []).extend(entries)
    out = {}
    for name, entries in pieces.items():
        entries.sort(key=lambda e: e[0])
        out[name] = {
            k: torch.cat([d[k] for _, d in entries])
            for k, v in entries[0][1].items()
            if torch.is_tensor(v) and v.dim() == 1
        }
        out[name]["step"] = [float(d["step"]) for _, d in entries]
    return out


def _assert_same(got, want, what):
    assert got[0] == want[0], (what, got[0], want[0])
    for name, value in want[1].items():
        assert torch.equal(got[1][name], value), (what, name)


def check(results: list[dict], single: dict, nvme) -> None:
    """``results``: every rank's ``save_and_resume``; ``single``: ``load_on_one_rank``'s."""
    for rank in results:
        for case, r in rank.items():
            assert r["swap_gone"]
            for resumed in ("nvme->nvme", "nvme->plain", "plain->nvme"):
                _assert_same(r[resumed], r["reference"], (case, resumed))
    assert not any(files for _, _, files in os.walk(nvme))  # every swap folder removed

    # Another world size: the 2-rank checkpoint's optimizer state, resharded onto 1 rank, by name.
    for case in CASES:
        saved = _merged([rank[case]["saved_state"] for rank in results])
        for key in ((case, 3, True), (case, 3, False), (case, 2, True)):
            loaded = _merged([single[key]["state"]])
            assert sorted(loaded) == sorted(saved)
            for name, keys in saved.items():
                assert sorted(loaded[name]) == sorted(keys), name
                for k, value in keys.items():
                    if k == "step":
                        assert set(loaded[name][k]) == set(value) == {float(STEPS)}, name
                    else:
                        assert torch.equal(loaded[name][k], value), (key, name, k)
        with_nvme, without = single[case, 3, True], single[case, 3, False]
        _assert_same(
            (with_nvme["losses"], with_nvme["params"]), (without["losses"], without["params"]), (case, "1 rank")
        )
