"""engine.save_checkpoint / load_checkpoint: exact resume at every stage and precision, reload
on other world sizes and stages, atomic saves (injected exception, SIGKILL), integrity,
consolidation equal to the live model. Five process groups in all (tests/checkpoint/runs.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint import runs
from tests.engine.workloads import assert_close_trajectory
from zerotrain.checkpoint.format import CheckpointError, CheckpointReader, shard_file
from zerotrain.testing import RankFailed, run_on_ranks

ROOT_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    saved = run_on_ranks(runs.save_runs, 2, args=(str(root),), timeout=600)
    loaded = run_on_ranks(runs.load_runs, 2, args=(str(root),), timeout=600)
    killed = root / "killed"
    with pytest.raises(RankFailed, match="rank 1 died|by peer"):
        run_on_ranks(runs.killed_save, 2, args=(str(killed),), timeout=120)
    killed_state = {"latest": (killed / "latest").read_text(), "folders": sorted(p.name for p in killed.iterdir())}
    # a neutral folder name: the message must not pass by quoting it
    flipped = root / "flipped_bit"
    shutil.copytree(root / "universal1", flipped)
    data = bytearray((flipped / f"global_step{runs.STEPS}" / shard_file(1)).read_bytes())
    data[-5] ^= 0x40  # one flipped bit in rank 1's optimizer state (same size: only the sha256 tells)
    (flipped / f"global_step{runs.STEPS}" / shard_file(1)).write_bytes(bytes(data))
    single = run_on_ranks(runs.single_rank_loads, 1, args=(str(root), str(killed), str(flipped)), timeout=300)
    four = run_on_ranks(runs.four_rank_loads, 4, args=(str(root),), timeout=300)
    return {"root": root, "saved": saved, "loaded": loaded, "killed": killed_state, "single": single[0], "four": four}


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("stage, precision", runs.EXACT)
def test_resume_is_bit_identical(results, stage, precision):
    """Train STEPS, save, train STEPS -- and in fresh processes load and train STEPS: same losses, weights,
    counters, loss scale, LR and random stream, on every rank."""
    for rank in (0, 1):
        want = results["saved"][rank][(stage, precision)]
        got = results["loaded"][rank][(stage, precision)]
        assert got["after"] == want["after"]
        assert got["client"]["epoch"] == 3 and torch.equal(got["client"]["ids"], torch.arange(4))
        w, g = want["final"], got["final"]
        for key in ("global_steps", "global_samples", "skipped", "micro_steps", "scale", "lr"):
            assert g[key] == w[key], key
        assert torch.equal(g["draw"], w["draw"])  # RNG restored per rank (dropout used it)
        if rank == 0:
            _assert_same_weights(w["weights"], g["weights"])
    if precision == "fp16":  # the scaler's state mattered: it skipped steps and changed scale
        assert results["saved"][0][(stage, precision)]["final"]["skipped"] > 0


def test_resume_continues_from_the_saved_step(results):
    got = results["loaded"][0][(2, "fp32")]
    assert got["final"]["global_steps"] == 2 * runs.STEPS
    assert got["path"].endswith(f"global_step{runs.STEPS}")


def test_reload_on_other_world_sizes_and_stages(results):
    """2 ranks stage 2 -> 1 rank stage 0 and 4 ranks stage 3; 2 ranks stage 1 -> stage 3."""
    reference2 = results["saved"][0]["universal2"]["after"]
    assert_close_trajectory(results["single"]["2->0"]["after"], reference2, rtol=1e-5)
    assert_close_trajectory(results["four"][0]["after"], reference2, rtol=1e-5)
    reference1 = results["saved"][0]["universal1"]["after"]
    assert_close_trajectory(results["loaded"][0]["1->3"]["after"], reference1, rtol=1e-5)
    for final in (results["single"]["2->0"]["final"], results["four"][0]["final"]):
        assert final["global_steps"] == 2 * runs.STEPS
        assert final["lr"] == results["saved"][0]["universal2"]["final"]["lr"]


def test_fp32_checkpoint_into_bf16_keeps_exact_masters(results):
    saved = results["saved"][0]["universal1"]
    # the checkpoint holds the weights at step STEPS; recover them by consolidation
    state = _fp32(results["root"] / "universal1")
    for rank in (0, 1):
        for (name, start), master in results["loaded"][rank]["fp32->bf16"]["masters"].items():
            want = state[name].reshape(-1)[start : start + master.numel()]
            assert torch.equal(master, want), name
    weights = results["loaded"][0]["fp32->bf16"]["weights"]
    for name, value in state.items():
        assert torch.equal(weights[name], value.to(torch.bfloat16)), name
    assert all(torch.isfinite(torch.tensor(results["loaded"][0]["fp32->bf16"]["after"])))
    assert saved["final"]["global_steps"] == 2 * runs.STEPS


def _fp32(folder):
    from zerotrain.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(folder)


def test_failed_save_leaves_latest_on_the_previous_checkpoint(results):
    saved = results["saved"][0]
    assert "rank 1: OSError: No space left on device (injected)" in saved["failure"]
    assert saved["failure_latest"] == "good"
    assert saved["failure_folders"] == ["good", "latest", "zero_to_fp32.py", "zerotrain_checkpoint_format.py"]
    assert saved["failure_reload"][0].endswith("good") and saved["failure_reload"][1] == 1
    assert results["saved"][1]["failure"] == saved["failure"]  # every rank raised


def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(results):
    killed = results["killed"]
    assert killed["latest"] == "first"
    assert "second" not in killed["folders"] and ".second.partial" in killed["folders"]
    single = results["single"]["killed"]
    assert single["path"].endswith("first") and single["steps"] == 2
    _assert_same_weights(single["weights"], _fp32(results["root"] / "killed"))


def test_flipped_byte_is_reported_with_the_file_name(results):
    message = results["single"]["corrupt"]  # runs.single_rank_loads' key; the folder is flipped_bit
    path = results["root"] / "flipped_bit" / f"global_step{runs.STEPS}" / shard_file(1)
    assert message == (f"{path} is corrupt: its sha256 does not match the one recorded in metadata.json"), message


def test_shape_mismatch_names_the_parameter_and_non_strict_loads_the_rest(results):
    message = results["single"]["mismatch"]
    assert "wte.weight has shape (64, 32) in the checkpoint but (80, 32) in the model" in message
    non_strict = results["single"]["non_strict"]
    reference = _fp32(results["root"] / "universal1")
    for name, value in non_strict["after"].items():
        if name in ("wte.weight", "lm_head.weight"):  # tied: one parameter
            assert torch.equal(value, non_strict["before"][name]), name  # left as it was
        else:
            assert torch.equal(value, reference[name]), name


def test_tag_validation_fail_raises_on_disagreeing_tags(results):
    for rank in (0, 1):
        assert "ranks disagree on the checkpoint tag" in results["saved"][rank]["tag_fail"]


def test_layout_and_metadata(results):
    folder = results["root"] / "stage3-bf16"
    tag = (folder / "latest").read_text()
    assert tag == f"global_step{runs.STEPS}"
    meta = json.loads((folder / tag / "metadata.json").read_text())
    assert meta["world_size"] == 2 and meta["stage"] == 3 and meta["param_dtype"] == "bfloat16"
    assert meta["torch_version"] == torch.__version__ and meta["config"]["bf16"]["enabled"]
    assert set(meta["files"]) == {
        "model.safetensors",
        shard_file(0),
        shard_file(1),
        "state.rank00000.pt",
        "state.rank00001.pt",
    }
    unit = meta["units"][0]
    assert {"params", "shard_numel", "world_size", "saved"} <= set(unit)
    assert "master" in unit["saved"] and "state/exp_avg" in unit["saved"]
    from safetensors import safe_open  # the files are ordinary safetensors

    with safe_open(str(folder / tag / shard_file(1)), "pt") as f:
        assert f"u{unit['id']}/master" in f.keys()


@pytest.mark.parametrize("stage, precision", [(3, "bf16"), (1, "fp16"), (0, "fp32")])
def test_consolidation_equals_the_live_model(results, stage, precision, tmp_path):
    from zerotrain.checkpoint.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    folder = runs.exact_dir(results["root"], stage, precision)
    dtype = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[precision]
    files = convert_zero_checkpoint_to_fp32_state_dict(
        folder, tmp_path, max_shard_size="20KB", safe_serialization=True, dtype=dtype
    )
    assert len(files) > 2 and files[-1].name == "model.safetensors.index.json"
    from safetensors.torch import load_file

    got = {}
    for f in files[:-1]:
        got.update(load_file(f))
    want = results["saved"][0][(stage, precision)]["saved_weights"]
    _assert_same_weights({k: got[k] for k in want}, want)
    index = json.loads(files[-1].read_text())
    assert set(index["weight_map"]) == set(want)


def test_consolidate_cli_and_standalone_script(results, tmp_path):
    folder = Path(runs.exact_dir(results["root"], 2, "bf16"))
    want = runs_fp32 = _fp32(folder)
    out = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "zerotrain.launcher.cli", "consolidate", str(folder), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    _assert_same_weights(torch.load(out / "pytorch_model.bin", weights_only=True), want)
    # The copy inside the checkpoint runs with zerotrain made unimportable.
    out2 = tmp_path / "standalone"
    code = (
        "import sys, runpy; sys.modules['zerotrain'] = None; "
        f"sys.argv = ['zero_to_fp32.py', {str(folder)!r}, {str(out2)!r}, '--safe_serialization']; "
        f"runpy.run_path({str(folder / 'zero_to_fp32.py')!r}, run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    _assert_same_weights(load_file(out2 / "model.safetensors"), runs_fp32)


def test_missing_or_damaged_latest_is_an_error(tmp_path, results):
    from zerotrain.checkpoint.format import resolve_tag

    with pytest.raises(CheckpointError, match="latest does not exist"):
        resolve_tag(tmp_path)
    copy = tmp_path / "c"
    shutil.copytree(results["root"] / "universal1", copy)
    (copy / "latest").write_text("")
    with pytest.raises(CheckpointError, match="latest is damaged"):
        resolve_tag(copy)
    (copy / "latest").write_text("global_step99")
    with pytest.raises(CheckpointError, match="global_step99 is missing or incomplete"):
        resolve_tag(copy)


def test_truncated_file_is_reported_with_its_name(tmp_path, results):
    copy = tmp_path / "c"
    shutil.copytree(results["root"] / "universal1", copy)
    path = copy / f"global_step{runs.STEPS}" / shard_file(0)
    path.write_bytes(path.read_bytes()[:-100])
    reader = CheckpointReader(copy / f"global_step{runs.STEPS}")
    with pytest.raises(CheckpointError, match=f"{shard_file(0)} is .* bytes, the checkpoint recorded"):
        reader.read(reader.meta["units"][0]["params"][0][0], "param")
