"""The run behind tests/checkpoint/test_metadata_integrity.py (1 rank, module-level for
run_on_ranks): a checkpoint whose metadata.json is edited or has a flipped bit must never load
other weights into the engine."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from tests.checkpoint.workloads import build, config, train

TAG = "good"


def integrity_config(stage: int = 3) -> dict:
    cfg = config(stage)  # stage 3: flat units; fp32 stage 0: whole parameters
    del cfg["scheduler"]  # a warm-up from lr 0 would leave the first step's weights unchanged
    return cfg


def weights(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module_state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flipped_bits(size: int, seed: int) -> list[tuple[int, int]]:
    """One bit of every byte: ``(position, bit)``, the bit drawn with a fixed seed."""
    rng = random.Random(seed)
    return [(i, rng.randrange(8)) for i in range(size)]


def swap_two_same_shape_names(meta: dict) -> tuple[str, str]:
    for unit in meta["units"]:
        by_shape = {}
        for entry in unit["params"]:
            by_shape.setdefault(tuple(entry[3]), []).append(entry)
        for entries in by_shape.values():
            if len(entries) >= 2:
                a, b = entries[:2]
                a[0], b[0] = b[0], a[0]
                return a[0], b[0]
    raise AssertionError("no two parameters of one shape in a unit")


def shift_one_offset(meta: dict) -> str:
    entry = meta["units"][0]["params"][1]
    entry[1] += 1
    return entry[0]


def swap_two_whole(meta: dict) -> tuple[str, str]:
    by_shape = {}
    for name, entry in meta["whole"].items():
        by_shape.setdefault(tuple(entry["shape"]), []).append(name)
    names = next(v for v in by_shape.values() if len(v) >= 2)[:2]
    whole = meta["whole"]
    a, b = names
    meta["whole"] = {(b if k == a else a if k == b else k): v for k, v in whole.items()}
    return a, b


def _frames(tb):
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


EDITS = {"swap_names": swap_two_same_shape_names, "shift_offset": shift_one_offset}
WHOLE_EDITS = {"swap_whole": swap_two_whole}
FOLDERS = {"units": "ckpt", "whole": "whole"}


def save_and_flip(root: str, seed: int) -> dict:
    """Save a checkpoint; then load it with each edit and each single-bit flip of metadata.json
    (one per byte) into an engine that holds other weights; report what each load did."""
    from zerotrain.checkpoint.format import METADATA, CheckpointError

    root = Path(root)
    engine = build(integrity_config())
    decoy_dir = root / "decoy"
    engine.save_checkpoint(decoy_dir, tag="decoy")  # the untrained weights
    decoy = weights(engine)
    train(engine, 2)
    saved_dir = root / "ckpt"
    engine.save_checkpoint(saved_dir, tag=TAG)
    saved = weights(engine)
    assert not same(saved, decoy)
    # the same weights as whole parameters: saved from an fp32 stage-0 engine
    whole_dir = root / "whole"
    stage0 = build(integrity_config(0))
    stage0.load_checkpoint(saved_dir)
    stage0.save_checkpoint(whole_dir, tag=TAG)

    touched = [True]  # whether the engine may hold anything but the decoy's weights

    def load(folder) -> str:
        if touched[0]:
            engine.load_checkpoint(decoy_dir)
            assert same(weights(engine), decoy)
        touched[0] = True
        try:
            engine.load_checkpoint(folder)
        except CheckpointError as error:
            # refused before load_into wrote anything: the engine still holds the decoy
            touched[0] = "load_into" in {c.co_name for c in _frames(error.__traceback__)}
            return f"CheckpointError: {error}"
        except Exception as error:  # noqa: BLE001 - the test names it
            return f"not a CheckpointError: {type(error).__name__}: {error}"
        return "same" if same(weights(engine), saved) else "different"

    out = {"clean": [load(saved_dir), load(whole_dir)], "edits": {}, "flips": {}, "size": {}}
    for folder, edits in ((saved_dir, EDITS), (whole_dir, WHOLE_EDITS)):
        path = folder / TAG / METADATA
        original = path.read_bytes()
        for name, edit in edits.items():
            meta = json.loads(original)
            edit(meta)
            path.write_text(json.dumps(meta, indent=1))  # the recorded digest left as it was
            out["edits"][name] = load(folder)
        outcomes = []
        for position, bit in flipped_bits(len(original), seed):
            data = bytearray(original)
            data[position] ^= 1 << bit
            path.write_bytes(bytes(data))
            outcomes.append(load(folder))
        path.write_bytes(original)
        out["flips"][folder.name] = outcomes
        out["size"][folder.name] = len(original)
    original = (saved_dir / TAG / METADATA).read_bytes()
    # the same file without its digest: an old checkpoint (loaded with a warning)
    meta = json.loads(original)
    meta.pop("metadata_sha256")
    old = root / "old"
    shutil.copytree(saved_dir, old)
    (old / TAG / METADATA).write_text(json.dumps(meta, indent=1))
    engine.load_checkpoint(decoy_dir)
    engine.load_checkpoint(old)
    out["old_format"] = "same" if same(weights(engine), saved) else "different"
    out["saved"] = saved
    return out
