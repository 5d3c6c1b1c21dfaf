"""metadata.json carries its own sha256: an edited or damaged one never loads other weights,
through load_checkpoint, the zero_to_fp32 functions, `zerotrain consolidate` and the standalone
script. Every byte of the file gets one flipped bit (the bit drawn with a fixed seed)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint import integrity_runs
from tests.checkpoint.integrity_runs import EDITS, FOLDERS, TAG, WHOLE_EDITS, flipped_bits
from zerotrain.checkpoint import convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint
from zerotrain.checkpoint.format import METADATA, METADATA_DIGEST, CheckpointError, read_metadata
from zerotrain.launcher.cli import main as zerotrain_main
from zerotrain.testing import run_on_ranks

SEED = 29


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    out = run_on_ranks(integrity_runs.save_and_flip, 1, args=(str(root), SEED), timeout=900)[0]
    return root, out


def _one_line_naming_metadata(message: str) -> bool:
    return message.startswith("CheckpointError: ") and "\n" not in message and METADATA in message


def test_load_checkpoint_refuses_edited_metadata(run):
    _, out = run
    assert out["clean"] == ["same", "same"]
    assert sorted(out["edits"]) == sorted({**EDITS, **WHOLE_EDITS})
    for name, outcome in out["edits"].items():
        assert _one_line_naming_metadata(outcome), (name, outcome)
        assert METADATA_DIGEST in outcome and "restore it from a copy" in outcome, (name, outcome)


@pytest.mark.parametrize("layout", sorted(FOLDERS))
def test_load_checkpoint_never_loads_other_weights_after_a_bit_flip(run, layout):
    _, out = run
    flips = out["flips"][FOLDERS[layout]]
    assert len(flips) == out["size"][FOLDERS[layout]] > 2000
    different = [i for i, o in enumerate(flips) if o == "different"]
    assert not different, f"bit flips at bytes {different[:20]} loaded other weights"
    errors = [o for o in flips if o != "same"]
    assert len(errors) > 0.99 * len(flips)  # nearly every flip is caught, not just harmless
    for message in errors:
        assert message.startswith("CheckpointError: ") and "\n" not in message, message


def _edited_copy(root: Path, name: str, edit, source: str) -> Path:
    folder = root / f"edited-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(root / source, folder)
    meta = json.loads((folder / TAG / METADATA).read_text())
    edit(meta)
    (folder / TAG / METADATA).write_text(json.dumps(meta, indent=1))
    return folder


@pytest.mark.parametrize("layout", sorted(FOLDERS))
def test_zero_to_fp32_never_returns_other_weights_after_a_bit_flip(run, layout):
    root, out = run
    saved = {k: v.float() for k, v in out["saved"].items()}
    folder = root / FOLDERS[layout]
    assert torch.equal(
        torch.stack([v.sum() for v in saved.values()]),
        torch.stack([v.sum() for v in get_fp32_state_dict_from_zero_checkpoint(folder).values()]),
    )
    path = folder / TAG / METADATA
    original = path.read_bytes()
    outcomes = {"same": 0, "error": 0}
    try:
        for position, bit in flipped_bits(len(original), SEED + 1):
            data = bytearray(original)
            data[position] ^= 1 << bit
            path.write_bytes(bytes(data))
            try:
                state = get_fp32_state_dict_from_zero_checkpoint(folder)
            except CheckpointError as error:
                assert "\n" not in str(error)
                outcomes["error"] += 1
                continue
            assert state.keys() == saved.keys(), position
            assert all(torch.equal(state[k], saved[k]) for k in saved), f"byte {position} bit {bit}"
            outcomes["same"] += 1
    finally:
        path.write_bytes(original)
    assert outcomes["error"] > 0.99 * len(original), outcomes


@pytest.mark.parametrize("name", sorted({**EDITS, **WHOLE_EDITS}))
def test_consolidation_refuses_edited_metadata(run, name, tmp_path, capsys):
    root, _ = run
    edit, source = (EDITS[name], "ckpt") if name in EDITS else (WHOLE_EDITS[name], "whole")
    folder = _edited_copy(root, name, edit, source)
    with pytest.raises(CheckpointError, match=f"{METADATA} does not match its {METADATA_DIGEST}"):
        get_fp32_state_dict_from_zero_checkpoint(folder)
    with pytest.raises(CheckpointError, match=METADATA_DIGEST):
        convert_zero_checkpoint_to_fp32_state_dict(folder, tmp_path / "out1")
    assert zerotrain_main(["consolidate", str(folder), str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and METADATA_DIGEST in err and str(folder / TAG / METADATA) in err, err
    assert not list((tmp_path / "out2").glob("*.bin"))
    # the torch-only copy inside the checkpoint folder
    script = folder / "zero_to_fp32.py"
    done = subprocess.run(
        [sys.executable, str(script), str(folder), str(tmp_path / "out3")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1 and METADATA_DIGEST in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_checkpoint_without_the_digest_loads_with_a_warning(run, caplog):
    """Checkpoints written before metadata.json carried its sha256 still load (documented)."""
    root, out = run
    assert out["old_format"] == "same"
    caplog.set_level(logging.WARNING, logger="zerotrain")
    logging.getLogger("zerotrain").addHandler(caplog.handler)
    try:
        meta = read_metadata(root / "old" / TAG)
    finally:
        logging.getLogger("zerotrain").removeHandler(caplog.handler)
    assert METADATA_DIGEST not in meta
    assert any(METADATA_DIGEST in r.getMessage() and "save a new checkpoint" in r.getMessage() for r in caplog.records)
    saved = {k: v.float() for k, v in out["saved"].items()}
    state = get_fp32_state_dict_from_zero_checkpoint(root / "old")
    assert all(torch.equal(state[k], saved[k]) for k in saved)


def test_converted_deepspeed_checkpoints_carry_the_digest(tmp_path):
    from zerotrain.checkpoint.deepspeed_import import convert_deepspeed_checkpoint

    fixtures = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
    folder = convert_deepspeed_checkpoint(fixtures / "stage2-fp32", tmp_path / "out")
    meta = read_metadata(folder)
    assert len(meta[METADATA_DIGEST]) == 64
    assert get_fp32_state_dict_from_zero_checkpoint(tmp_path / "out")


@pytest.mark.parametrize("layout", sorted(FOLDERS))
def test_a_deleted_listed_file_is_a_checkpoint_error_naming_it(run, layout, tmp_path):
    """Every file metadata.json lists, deleted in turn: a one-line CheckpointError naming that
    file (not FileNotFoundError) from the zero_to_fp32 functions, even for a file they would not
    read (a state file, the buffers-only model file of a sharded checkpoint): it is damaged."""
    root, _ = run
    source = root / FOLDERS[layout]
    listed = sorted(read_metadata(source / TAG)["files"])
    assert "model.safetensors" in listed and any(f.startswith("state.") for f in listed), listed
    for filename in listed:
        folder = tmp_path / f"deleted-{filename}"
        shutil.copytree(source, folder)
        (folder / TAG / filename).unlink()
        with pytest.raises(CheckpointError, match="is missing from checkpoint") as error:
            get_fp32_state_dict_from_zero_checkpoint(folder)
        assert filename in str(error.value) and "\n" not in str(error.value)
