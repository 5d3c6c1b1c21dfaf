"""``--deepspeed_shim``: when the launcher makes ``import deepspeed`` zerotrain in its ranks.

In-process checks of the decision on real files (scripts, a stand-in real DeepSpeed, the file
``python -m zerotrain.hf install`` writes). The spawned runs are in tests/hf/test_switch.py: seed
002's Trainer through ``zerotrain --num_gpus=2`` trains as the prefixed run does, and with the
switch off fails with a line naming zerotrain's fix.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from zerotrain.launcher import cli, deepspeed_shim
from zerotrain.launcher.deepspeed_shim import ENV_VAR, configure, failure_hint, imported_packages, shim_dir
from zerotrain.launcher.errors import LaunchError
from zerotrain.launcher.multinode_cli import local_options

HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate"))


def test_imports_are_read_from_the_source_not_run():
    source = (
        "import os, transformers.trainer as t\nfrom accelerate.utils import x\nfrom . import deepspeed\n"
        "def main():\n    import deepspeed.comm\n    from zerotrain import hf\n"
        "s = 'import torch'\n"
    )
    assert imported_packages(source) == {"os", "transformers", "accelerate", "deepspeed", "zerotrain"}
    assert imported_packages("def broken(:\n") == set()


@pytest.fixture
def no_deepspeed(monkeypatch):
    """As in an environment without any ``deepspeed`` (whatever this one has)."""
    monkeypatch.setattr(deepspeed_shim, "installed_deepspeed", lambda shim: None)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.mark.skipif(not HAS_HF, reason="the shim needs the hf extra")
def test_auto_applies_to_scripts_that_import_hf_or_deepspeed(tmp_path, no_deepspeed):
    shim = shim_dir()
    assert os.path.isfile(os.path.join(shim, "deepspeed", "__init__.py"))
    trainer = _write(tmp_path, "train.py", "def main():\n    from transformers import Trainer\n")
    plain = _write(tmp_path, "plain.py", "import torch\nimport zerotrain as deepspeed\n")
    env = {"PYTHONPATH": f"/a{os.pathsep}{shim}{os.pathsep}/b"}
    said = configure(None, trainer, False, False, env)
    assert env["PYTHONPATH"] == os.pathsep.join([shim, "/a", "/b"])  # first, once
    assert said.startswith("train.py imports transformers and DeepSpeed is not installed")
    assert "--deepspeed_shim off" in said and f"{ENV_VAR}=off" in said
    assert configure(None, trainer, False, False, env) is None  # already first: nothing to say
    for choice, script, environ in [
        ("auto", plain, {}),
        ("off", trainer, {}),
        (None, trainer, {ENV_VAR: "off"}),
        (None, plain, {ENV_VAR: "auto"}),
    ]:
        assert configure(choice, script, False, False, environ) is None and "PYTHONPATH" not in environ
    env = {}
    assert configure("on", plain, False, False, env).startswith("--deepspeed_shim on (plain.py)")
    assert env["PYTHONPATH"] == shim
    # A --module target is read where Python would find it, without importing its package.
    package = tmp_path / "pkg"
    _write(tmp_path, "pkg/__init__.py", "raise RuntimeError('imported')\n")
    _write(tmp_path, "pkg/run.py", "import accelerate\n")
    _write(tmp_path, "pkg/__main__.py", "import deepspeed\n")
    sys.path.insert(0, str(tmp_path))
    try:
        for target, wanted in [("pkg.run", "accelerate"), ("pkg", "deepspeed")]:
            env = {}
            assert configure(None, target, True, False, env).startswith(f"{target} imports {wanted}")
        assert configure(None, "pkg.missing", True, False, {}) is None
    finally:
        sys.path.remove(str(tmp_path))
    assert "pkg" not in sys.modules and package.is_dir()
    assert configure(None, trainer, False, True, {}) is None  # --no_python: a program, not read


def test_a_real_deepspeed_is_left_alone_and_zerotrains_install_is_enough(tmp_path, monkeypatch):
    trainer = _write(tmp_path, "train.py", "import transformers\n")
    real = _write(tmp_path, "site/deepspeed/__init__.py", "__version__ = '0.14.0'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    env = {}
    said = configure(None, trainer, False, False, env)
    assert (
        said == f"train.py imports transformers; its ranks use the DeepSpeed installed at {real} "
        "(zerotrain leaves it alone)"
    )
    assert env == {}
    assert configure("on", trainer, False, False, env).startswith("--deepspeed_shim on (train.py); its ranks use")
    if not HAS_HF:
        return
    from zerotrain.hf.install import _package_text

    (tmp_path / "site/deepspeed/__init__.py").write_text(_package_text())  # what `install` writes
    assert configure(None, trainer, False, False, env) is None and env == {}


def test_without_the_hf_extra_it_says_what_to_install(tmp_path, no_deepspeed, monkeypatch):
    script = _write(tmp_path, "train.py", "import deepspeed\n")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real_find_spec(name, *a)
    )
    env = {}
    said = configure(None, script, False, False, env)
    assert "zerotrain's stand-in needs accelerate: pip install 'zerotrain[hf]'" in said and env == {}
    assert "pip install 'zerotrain[hf]'" in failure_hint(["ModuleNotFoundError: No module named 'deepspeed'"])


def test_bad_values_and_the_flag(tmp_path, capsys, monkeypatch):
    with pytest.raises(LaunchError, match=f"{ENV_VAR}: unknown value 'yes'; choose one of auto, on, off"):
        deepspeed_shim.resolve(None, {ENV_VAR: "yes"})
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "train.py", "")
    with pytest.raises(SystemExit):
        cli.main(["--deepspeed_shim", "maybe", "train.py"])
    assert "--deepspeed_shim" in capsys.readouterr().err.splitlines()[-1]
    args = cli.build_parser().parse_args(["launch", "--deepspeed_shim", "off", "train.py"])
    assert local_options(args).deepspeed_shim == "off"
    assert local_options(cli.build_parser().parse_args(["launch", "train.py"])).deepspeed_shim is None
    # Every node's agent gets the flag (and decides for its own environment).
    from zerotrain.launcher.multinode_cli import plan_launch

    _write(tmp_path, "hosts", "127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    ssh = tmp_path / "bin" / "ssh"
    _write(tmp_path, "bin/ssh", "#!/bin/sh\nexit 1\n")
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{ssh.parent}{os.pathsep}{os.environ['PATH']}")
    plan = plan_launch(
        cli.build_parser().parse_args(
            ["launch", "-H", "hosts", "--launcher", "ssh", "--deepspeed_shim", "off", "train.py"]
        )
    )
    assert plan.agent_flags[plan.agent_flags.index("--deepspeed_shim") + 1] == "off"


def test_failure_hint_only_for_a_missing_deepspeed():
    assert failure_hint(["ValueError: boom"]) is None
    line = "ImportError: DeepSpeed is not available => install it using `pip3 install deepspeed`"
    if HAS_HF:
        hint = failure_hint(["Traceback (most recent call last):", line])
        assert hint.startswith(
            "zerotrain: the rank found no `deepspeed`; zerotrain stands in for it: `python -m zerotrain.hf install`"
        )
        assert "--deepspeed_shim on" in hint
