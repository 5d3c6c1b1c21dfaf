"""``zerotrain estimate`` end to end in this process: tables, --json against its schema, --plot,
--write-config, and errors that name the flag."""

from __future__ import annotations

import json

import pytest

from zerotrain.config import load_config
from zerotrain.estimate import EstimateReport
from zerotrain.launcher.cli import main

BLOOM = {"model_type": "bloom", "vocab_size": 250880, "hidden_size": 1024, "n_layer": 24, "n_head": 16}


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["estimate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_seed_002_command_line(capsys):
    code, out, _ = run(capsys, "--params", "7e9", "--num-gpus", "4", "--gpu-memory", "80GiB", "--precision", "bf16")
    assert code == 0
    assert "7,000,000,000 parameters" in out
    assert "refined   112.00 GB" in out  # 16 bytes/param of model states, beside the seed's 12
    assert "stage 0 does not fit" in out and "follow DeepSpeed's ZeRO-Offload/Infinity placement" in out
    assert "=> ZeRO stage 1" in out


def test_json_matches_the_schema_and_the_tables(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(BLOOM))
    code, out, _ = run(
        capsys,
        "--hf-config",
        str(config),
        "--num-gpus",
        "8",
        "--gpu-memory",
        "16GiB",
        "--precision",
        "fp32",
        "--optimizer",
        "adam",
        "--json",
    )
    assert code == 0
    report = EstimateReport.model_validate_json(out)  # extra keys or wrong types fail here
    assert report.model.params == 559_214_592 and len(report.rows) == 9
    assert [(r.stage, r.offload) for r in report.rows if r.recommendable] == [
        (0, "none"),
        (1, "none"),
        (2, "none"),
        (3, "none"),
    ]
    stage1 = report.rows[1]
    assert (
        stage1.per_gpu.model_states
        == stage1.per_gpu.parameters + stage1.per_gpu.gradients + stage1.per_gpu.optimizer_state
    )
    assert report.recommendation.fits and report.recommendation.config["zero_optimization"]["stage"] == 0
    schema = EstimateReport.model_json_schema()
    assert set(schema["required"]) >= {"model", "setup", "rows", "recommendation"}
    bad = json.loads(out)
    bad["rows"][0]["stage"] = 7
    with pytest.raises(ValueError):
        EstimateReport.model_validate(bad)


def test_plot_writes_a_png(capsys, tmp_path):
    png = tmp_path / "memory.png"
    code, _, err = run(
        capsys,
        "--params",
        "1.3e9",
        "--layers",
        "24",
        "--hidden",
        "2048",
        "--heads",
        "16",
        "--vocab",
        "50257",
        "--num-gpus",
        "4",
        "--gpu-memory",
        "24GiB",
        "--plot",
        str(png),
    )
    assert code == 0 and f"wrote {png}" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_write_config_passes_validation_and_carries_bucket_keys(capsys, tmp_path):
    out_path = tmp_path / "ds.json"
    code, _, _ = run(
        capsys,
        "--model",
        "tests.estimate.measure:build_gpt",
        "--num-gpus",
        "2",
        "--seq-len",
        "128",
        "--config",
        "examples/ds_config.json",
        "--gpu-memory",
        "200MiB",
        "--gpu-reserve",
        "0",
        "--write-config",
        str(out_path),
    )
    assert code == 0
    written = json.loads(out_path.read_text())
    cfg = load_config(written, world_size=2)  # raises on anything invalid
    assert cfg.zero_optimization.stage == 1  # stage 0 needs ~225 MiB, stage 1 ~197 MiB
    assert written["zero_optimization"]["reduce_bucket_size"] == 500000  # from examples/ds_config.json
    assert written["train_micro_batch_size_per_gpu"] == 8 and written["optimizer"]["type"] == "AdamW"
    assert "bf16" not in written and "fp16" not in written  # the example config trains in fp32


def test_nothing_fits_writes_no_config(capsys, tmp_path):
    out_path = tmp_path / "ds.json"
    code, out, err = run(
        capsys, "--params", "70e9", "--num-gpus", "2", "--gpu-memory", "24GiB", "--write-config", str(out_path)
    )
    assert code == 1 and not out_path.exists() and "no config was written" in err
    assert "does not fit without offload" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--params", "lots"], "--params: cannot read 'lots'"),
        (["--params", "7e9", "--gpu-memory", "80 gigs"], "--gpu-memory: cannot read"),
        (["--model", "no_such_module_xyz:build"], "--model: cannot import 'no_such_module_xyz'"),
        (["--hf-config", "/nonexistent/config.json"], "--hf-config: file '/nonexistent/config.json' not found"),
        (["--params", "7e9", "--num-gpus", "0"], "--num-gpus: must be at least 1"),
    ],
)
def test_bad_input_names_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# `python -c` with an optional dependency made unimportable, then the real CLI entry point.
WITHOUT = "import sys; sys.modules[{module!r}] = None; from zerotrain.launcher.cli import main; sys.exit(main())"


def run_without(module: str, tmp_path, *argv: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", WITHOUT.format(module=module), *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plot_without_matplotlib_is_one_line(tmp_path):
    png = tmp_path / "memory.png"
    result = run_without(
        "matplotlib",
        tmp_path,
        "estimate",
        "--params",
        "1e9",
        "--num-gpus",
        "1",
        "--gpu-memory",
        "24GiB",
        "--plot",
        str(png),
    )
    assert result.returncode == 1
    assert result.stderr == "zerotrain estimate --plot needs matplotlib: pip install 'zerotrain[plot]'\n"
    assert result.stdout == "" and not png.exists()  # refused before any work


def test_plot_to_an_unwritable_path_is_one_line(capsys, tmp_path):
    target = tmp_path / "missing-dir" / "memory.png"
    code, _, err = run(capsys, "--params", "1e9", "--num-gpus", "1", "--gpu-memory", "24GiB", "--plot", str(target))
    assert code == 1 and err.splitlines()[-1].startswith(f"--plot: cannot write {str(target)!r} (")


def test_any_missing_extra_reached_from_the_cli_names_the_extra(capsys, monkeypatch):
    import zerotrain.estimate.cli as estimate_cli

    def needs(name):
        def run_estimate(args, parser):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        return run_estimate

    for module, extra in [
        ("mlflow", "mlflow"),
        ("tensorboard", "tensorboard"),
        ("ray.train", "ray"),
        ("pyspark", "spark"),
        ("transformers", "hf"),
    ]:
        monkeypatch.setattr(estimate_cli, "run_estimate", needs(module))
        assert main(["estimate", "--params", "1e9"]) == 1
        top = module.partition(".")[0]
        assert capsys.readouterr().err == f"zerotrain estimate needs {top}: pip install 'zerotrain[{extra}]'\n"
    monkeypatch.setattr(estimate_cli, "run_estimate", needs("not_an_extra"))
    with pytest.raises(ModuleNotFoundError):  # a real bug stays a traceback
        main(["estimate", "--params", "1e9"])
