"""The switch itself: what `import deepspeed` gives under zerotrain.hf, and its errors.

Each check runs in a fresh interpreter (the switch must come before transformers/accelerate are
imported, and must not leak into this test process).

`python -m zerotrain.hf install` / `uninstall` run in a throwaway virtual environment layered
on this one (never in the environment the tests run in): after install, seed 002's exact
`deepspeed --num_gpus=2 train.py --deepspeed ds_config.json` and seed 003's `accelerate launch`
run on zerotrain with no prefix and match plain PyTorch; uninstall leaves the environment's
files exactly as before; a real DeepSpeed is refused. Before the install, the same seed 002
command with `zerotrain` for `deepspeed` runs on zerotrain through the launcher's shim (and
`TrainingArguments(use_cpu=True)` keeps the DeepSpeed path), and fails naming the fix when the
shim is turned off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _python(code: str, *prefix: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *prefix, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


ALIAS_CHECKS = """
    import zerotrain.hf
    zerotrain.hf.use_zerotrain_as_deepspeed()
    zerotrain.hf.use_zerotrain_as_deepspeed()  # idempotent
    import importlib.metadata, importlib.util, os
    import deepspeed, zerotrain
    from zerotrain.hf import SHIM_DIR, deepspeed_extras
    assert zerotrain.hf.is_active()
    # transformers' and accelerate's own "is DeepSpeed installed" checks say yes.
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_available
    from accelerate.utils import is_deepspeed_available as accelerate_sees_it
    from accelerate.utils.versions import compare_versions
    assert is_deepspeed_available() and accelerate_sees_it() and compare_versions("deepspeed", ">=", "0.16.4")
    assert importlib.metadata.version("deepspeed") == deepspeed.__version__ == zerotrain.hf.DEEPSPEED_VERSION
    # deepspeed.* are zerotrain's objects, also through attribute chains after `import deepspeed`.
    assert deepspeed.initialize is zerotrain.initialize
    assert deepspeed.DeepSpeedEngine is zerotrain.ZeroTrainEngine
    assert deepspeed.zero.Init is zerotrain.zero.Init
    from deepspeed.accelerator import get_accelerator
    assert get_accelerator() is zerotrain.get_accelerator()
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from zerotrain.ops.adam import DeepSpeedCPUAdam as ours
    assert DeepSpeedCPUAdam is ours
    # ... and every extra is reachable where DeepSpeed has it.
    for module, names in deepspeed_extras.provided().items():
        for name in names:
            assert getattr(importlib.import_module(module), name) is not None, (module, name)
    assert deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES == [
        "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    for name in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES:
        assert getattr(zerotrain.runtime.lr_schedules, name).__name__ == name
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    import torch
    t = torch.ones(2)
    copy = clone_tensors_for_torch_save({"a": [t, (t,)]})
    assert copy["a"][0] is not t and torch.equal(copy["a"][1][0], t)
    # Names zerotrain does not have fail naming the DeepSpeed name.
    try:
        deepspeed.tp_model_init
    except AttributeError as error:
        assert "'deepspeed.tp_model_init' is not provided by zerotrain" in str(error), error
    else:
        raise AssertionError("tp_model_init should not exist")
    try:
        import deepspeed.inference
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("deepspeed.inference should not exist")
    # Child processes inherit the switch.
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == SHIM_DIR
    print("OK")
"""


def test_deepspeed_names_resolve_to_zerotrain():
    done = _python(ALIAS_CHECKS)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-4000:]


def test_switch_after_accelerate_import_is_a_clear_error():
    done = _python("""
        import accelerate.accelerator
        import zerotrain.hf
        zerotrain.hf.use_zerotrain_as_deepspeed()
    """)
    assert done.returncode != 0
    assert "called after accelerate.accelerator was imported" in done.stderr
    assert "python -m zerotrain.hf" in done.stderr


def test_module_runner_switches_the_command_and_its_children():
    # The command is a Python that starts another: both see zerotrain as deepspeed.
    child = "import deepspeed, zerotrain.hf; print(zerotrain.hf.is_active(), deepspeed.__version__)"
    code = f"import subprocess, sys; {child}; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    done = subprocess.run(
        [sys.executable, "-m", "zerotrain.hf", "python", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.split("\n")[:2] == ["True 0.19.6+zerotrain"] * 2, done.stderr[-3000:]


def test_zerotrain_hf_without_the_extra_names_it():
    done = _python("""
        import sys
        sys.modules["accelerate"] = None  # as if not installed
        import zerotrain  # the core never needs it
        try:
            import zerotrain.hf
        except ImportError as error:
            print(error)
    """)
    assert done.returncode == 0, done.stderr
    assert "pip install 'zerotrain[hf]'" in done.stdout


ROOT = Path(__file__).resolve().parents[2]


def test_module_runner_deepspeed_command_is_zerotrains_launcher_and_missing_commands_name_the_fix(tmp_path):
    from zerotrain.comm.distributed import free_port

    script = tmp_path / "probe.py"
    script.write_text(
        "import os, sys, deepspeed, zerotrain.hf\n"
        "print('PROBE', os.environ['RANK'], zerotrain.hf.is_active(), sys.argv[1:])\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotrain.hf",
            "deepspeed",
            "--num_gpus=2",
            "--master_port",
            str(free_port()),
            str(script),
            "--deepspeed",
            "ds_config.json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    probes = sorted(line.split("PROBE ", 1)[1] for line in done.stdout.splitlines() if "PROBE " in line)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert probes == [f"{r} True ['--deepspeed', 'ds_config.json', '--local_rank={r}']" for r in (0, 1)]
    done = subprocess.run(
        [sys.executable, "-m", "zerotrain.hf", "no-such-command-xyz"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 127
    assert "command not found: no-such-command-xyz" in done.stderr
    assert "python -m zerotrain.hf install" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def _scratch_env(root: Path) -> tuple[Path, Path]:
    """A virtual environment at ``root`` that sees this one's packages (and zerotrain) through a
    .pth file, so that installing into it leaves the environment under test alone."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    )
    import zerotrain

    parent_site, src = sysconfig.get_paths()["purelib"], str(Path(zerotrain.__file__).resolve().parents[1])
    (site / "_zerotrain_test_parent.pth").write_text(f"import site; site.addsitedir({parent_site!r})\n{src}\n")
    return python, site


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


# tests/hf/test_accelerate.py's SEED003_PLUGIN_YAML as `accelerate launch` flags.
SEED003_PLUGIN_FLAGS = [
    "--use_deepspeed",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--zero_stage",
    "2",
    "--gradient_accumulation_steps",
    "1",
    "--gradient_clipping",
    "1.0",
    "--offload_optimizer_device",
    "none",
    "--offload_param_device",
    "none",
    "--zero3_init_flag",
    "false",
    "--mixed_precision",
    "fp16",
]


def test_install_runs_the_seeds_commands_without_prefix_and_uninstall_restores(tmp_path):
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("a deepspeed package is importable here; install would (rightly) refuse")
    from tests.hf.accelerate_script import plain_reference as accelerate_reference
    from tests.hf.hf_workloads import plain_reference as trainer_reference
    from tests.hf.hf_workloads import seed002_config
    from zerotrain.comm.distributed import free_port
    from zerotrain.testing import run_on_ranks

    env_root = tmp_path / "env"
    python, site = _scratch_env(env_root)
    bin_dir = env_root / "bin"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "ZEROTRAIN_REPO": str(ROOT),
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "zerotrain/hf/shim" not in p
    )  # no switch from outside
    env.pop("ZEROTRAIN_DEEPSPEED_SHIM", None)

    def run(*command, timeout=120, **extra_env):
        return subprocess.run(
            [str(c) for c in command],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
            env={**env, **extra_env},
        )

    def result_of(done) -> dict:
        lines = [line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if "RESULT " in line]
        assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
        return json.loads(lines[0])

    (tmp_path / "ds_config.json").write_text(json.dumps(seed002_config(3)))
    (tmp_path / "train.py").write_text((ROOT / "tests/hf/seed002_train.py").read_text())
    seed002_args = [
        "train.py",
        "--deepspeed",
        "ds_config.json",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "4",
        "--output_dir",
        tmp_path / "out",
    ]
    plain_losses = run_on_ranks(trainer_reference, world_size=1, args=(str(tmp_path / "plain"),), timeout=240)[0][0]

    # Before any install: seed 002's command with zerotrain's launcher name for `deepspeed` (its
    # console entry point's main). The launcher sees train.py import transformers and gives the ranks
    # zerotrain as `deepspeed`. TrainingArguments(use_cpu=True) keeps the DeepSpeed path (as with
    # DeepSpeed itself: accelerate's DEEPSPEED type, the engine).
    done = run(
        python,
        "-m",
        "zerotrain.launcher.cli",
        "--num_gpus=2",
        "--master_port",
        free_port(),
        *seed002_args,
        "--use_cpu",
        timeout=300,
    )
    result = result_of(done)
    assert "train.py imports transformers and DeepSpeed is not installed" in done.stderr
    assert (result["engine"], result["stage"], result["world"], result["distributed_type"]) == (
        "zerotrain.engine.engine.ZeroTrainEngine",
        3,
        2,
        "DistributedType.DEEPSPEED",
    )
    assert result["losses"] == pytest.approx(plain_losses, rel=1e-5)
    # The off switch: transformers' own "DeepSpeed is not available", and the launcher's line naming
    # zerotrain's fix (one rank is enough to fail).
    done = run(
        python,
        "-m",
        "zerotrain.launcher.cli",
        "--num_gpus=1",
        "--master_port",
        free_port(),
        *seed002_args,
        ZEROTRAIN_DEEPSPEED_SHIM="off",
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "DeepSpeed is not available" in done.stderr
    assert (
        "zerotrain: the rank found no `deepspeed`; zerotrain stands in for it: `python -m zerotrain.hf "
        "install`" in done.stderr
    )

    before = _files(env_root)
    assert "not installed" in run(python, "-m", "zerotrain.hf", "status").stdout
    done = run(python, "-m", "zerotrain.hf", "install")
    assert done.returncode == 0, done.stderr
    assert (bin_dir / "deepspeed").is_file() and (site / "deepspeed" / "__init__.py").is_file()
    assert "installed:" in run(python, "-m", "zerotrain.hf", "status").stdout

    # Seed 002's command as written (plus a free port: other tests may hold the default one). The
    # installed deepspeed is zerotrain's, so the launcher adds nothing and says nothing about it.
    done = run("deepspeed", "--num_gpus=2", "--master_port", free_port(), *seed002_args, timeout=300)
    result = result_of(done)
    assert "DeepSpeed is not installed" not in done.stderr
    assert (result["engine"], result["stage"], result["world"]) == ("zerotrain.engine.engine.ZeroTrainEngine", 3, 2)
    assert result["losses"] == pytest.approx(plain_losses, rel=1e-5)

    # Seed 003's `accelerate launch` (its CLI module is the `accelerate` command's entry point;
    # this environment has no copy of the command itself).
    # Its YAML given as accelerate's command-line flags instead (--use_deepspeed --num_processes 2: the
    # form that starts several processes on a machine without GPUs; the YAML form runs in
    # tests/hf/test_accelerate.py).
    done = run(
        python,
        "-m",
        "accelerate.commands.accelerate_cli",
        "launch",
        *SEED003_PLUGIN_FLAGS,
        "--main_process_port",
        free_port(),
        ROOT / "tests/hf/accelerate_script.py",
        ROOT,
        timeout=300,
        HF_HOME=tmp_path / "hf_home",
    )  # no accelerate default_config.yaml of this machine
    result = result_of(done)
    assert (result["engine"], result["world"]) == ("zerotrain.engine.engine", 2)
    assert result["losses"] == pytest.approx(accelerate_reference("linear"), rel=1e-3)

    done = run(python, "-m", "zerotrain.hf", "uninstall")
    assert done.returncode == 0, done.stderr
    assert _files(env_root) == before  # exactly what install added is gone, nothing else
    assert run(python, "-c", "import deepspeed").returncode != 0
    done = run(python, "-m", "zerotrain.hf", "uninstall")
    assert done.returncode == 1 and "not installed" in done.stderr

    # A real DeepSpeed is never shadowed: refused, one line, nothing written.
    real = site / "deepspeed-0.14.0.dist-info"
    real.mkdir()
    (real / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.14.0\n")
    (real / "INSTALLER").write_text("pip\n")
    with_real = _files(env_root)
    done = run(python, "-m", "zerotrain.hf", "install")
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "a real DeepSpeed is installed (deepspeed 0.14.0" in done.stderr
    assert "pip uninstall deepspeed" in done.stderr
    assert _files(env_root) == with_real
    done = run(python, "-m", "zerotrain.hf", "uninstall")
    assert done.returncode == 1 and "was not installed by zerotrain" in done.stderr
    assert _files(env_root) == with_real
