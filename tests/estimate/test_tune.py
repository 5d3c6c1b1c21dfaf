"""``zerotrain tune``: the micro-batch search, and one real trial sequence on examples/train_gpt.py."""

from __future__ import annotations

import json

from zerotrain.config import load_config
from zerotrain.estimate.tune import Trial, largest_fitting, trial_config
from zerotrain.launcher.cli import main


def test_search_doubles_then_bisects_to_the_boundary():
    for boundary in (1, 5, 8, 13, 64):
        seen = []

        def run(m, boundary=boundary):
            seen.append(m)
            return Trial(2, m, m <= boundary, peak_bytes=m, samples_per_s=float(m))

        best, trials = largest_fitting(run, max_micro=64)
        assert best.micro_batch == boundary, (boundary, seen)
        assert [t.micro_batch for t in trials] == seen and len(seen) == len(set(seen))
    best, _ = largest_fitting(lambda m: Trial(0, m, False, error="out of memory"), 64)
    assert best is None


def test_trial_config_sets_stage_and_micro_batch_and_drops_the_global_batch():
    base = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e5},
    }
    cfg = trial_config(base, 3, 16)
    assert cfg == {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e5},
    }
    assert base["zero_optimization"]["stage"] == 0  # the user's config is not modified


def test_tune_runs_trials_and_writes_the_fastest_config(tmp_path, capsys):
    out = tmp_path / "tuned.json"
    # Tune's flags after the script, as in the issue; the script's own --steps after "--".
    code = main(
        [
            "tune",
            "examples/train_gpt.py",
            "--config",
            "examples/ds_config.json",
            "--memory-limit",
            "100GiB",
            "--nproc",
            "1",
            "--stages",
            "1",
            "--steps",
            "1",
            "--max-micro-batch",
            "2",
            "--write-config",
            str(out),
            "--",
            "--text_bytes",
            "20000",
            "--n_embd",
            "32",
            "--n_layer",
            "1",
            "--seq_len",
            "32",
            "--steps",
            "20",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "stage 1 micro-batch    1: fits" in text and "stage 1 micro-batch    2: fits" in text
    assert "fastest that fits: stage 1, micro-batch 2" in text
    written = json.loads(out.read_text())
    assert load_config(written).zero_optimization.stage == 1
    assert written["train_micro_batch_size_per_gpu"] == 2
