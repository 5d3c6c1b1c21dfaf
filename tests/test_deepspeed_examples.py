"""tests/deepspeed_examples.py, the example tests' shared helper: these run without
DeepSpeedExamples (the run tests that need its scripts skip without them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deepspeed_examples import CIFAR10_MOE, PIPELINE, git_blob_id, import_changed, run_as_main


def test_import_change_touches_only_deepspeed_imports():
    text = "\n".join(
        [
            "import argparse",
            "import deepspeed",
            "import deepspeed_extra",
            "from deepspeed.accelerator import get_accelerator",
            "from deepspeed.moe.utils import split_params",
            "    import deepspeed",
            "x = deepspeed.moe.layer.MoE  # import deepspeed",
            "from deepspeedx import y",
            "from deepspeed import comm",
            "from deepspeed.pipe import PipelineModule",
        ]
    )
    changed = import_changed(text).split("\n")
    assert changed == [
        "import argparse",
        "import zerotrain as deepspeed",
        "import deepspeed_extra",
        "from zerotrain.accelerator import get_accelerator",
        "from zerotrain.moe.utils import split_params",
        "    import deepspeed",
        "x = deepspeed.moe.layer.MoE  # import deepspeed",
        "from deepspeedx import y",
        "from zerotrain import comm",
        "from zerotrain.pipe import PipelineModule",
    ]


def test_git_blob_id_is_gits(tmp_path):
    path = tmp_path / "script.py"
    path.write_bytes(b"import deepspeed\r\nprint(1)\r\n")  # line ends count, as in cifar10_deepspeed.py
    expected = "830a8e28a10a1d7c11fb8e4b4e1e93c444fb122b"  # git hash-object script.py
    assert git_blob_id(str(path)) == expected
    try:
        done = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return
    if done.returncode == 0:
        assert done.stdout.strip() == expected


def test_find_order_and_skip_reason(tmp_path, monkeypatch):
    checkout = tmp_path / "DeepSpeedExamples"
    (checkout / "training" / "pipeline_parallelism").mkdir(parents=True)
    in_checkout = checkout / "training" / "pipeline_parallelism" / "train.py"
    named, beside = tmp_path / "named.py", tmp_path / "harness"
    beside.mkdir()
    monkeypatch.delenv(PIPELINE.env_var, raising=False)
    monkeypatch.delenv("DEEPSPEED_EXAMPLES", raising=False)
    assert PIPELINE.find() is None and PIPELINE.find(beside=str(beside)) is None
    (beside / "train.py").write_text("")
    assert PIPELINE.find() is None and PIPELINE.find(beside=str(beside)) == str(beside / "train.py")
    monkeypatch.setenv("DEEPSPEED_EXAMPLES", str(checkout))
    assert PIPELINE.find(beside=str(beside)) == str(beside / "train.py")  # no file in the checkout yet
    in_checkout.write_text("")
    assert PIPELINE.find(beside=str(beside)) == str(in_checkout)
    monkeypatch.setenv(PIPELINE.env_var, str(named))
    assert PIPELINE.find() == str(in_checkout)  # the named file does not exist
    named.write_text("")
    assert PIPELINE.find(beside=str(beside)) == str(named)
    for script in (PIPELINE, CIFAR10_MOE):
        reason = script.missing()
        assert script.path in reason and "DEEPSPEED_EXAMPLES" in reason and script.env_var in reason
        assert "github.com/deepspeedai/DeepSpeedExamples" in reason


def test_run_as_main_runs_the_changed_script_as_main(tmp_path, monkeypatch):
    out = tmp_path / "out.txt"
    script = tmp_path / "example.py"
    script.write_text(
        "import sys\nimport deepspeed\nfrom deepspeed.utils import RepeatingLoader\n"
        "class Thing:\n    pass\n"
        f"open({str(out)!r}, 'w').write(' '.join([__name__, __file__, deepspeed.__name__, "
        "RepeatingLoader.__module__.split('.')[0], Thing.__module__, str(sys.modules['__main__'] is "
        "sys.modules[Thing.__module__]), sys.path[0]]))\n"
    )
    main = sys.modules["__main__"]
    monkeypatch.setattr(sys, "path", list(sys.path))
    run_as_main(str(script))
    assert out.read_text().split(" ") == [
        "__main__",
        str(script),
        "zerotrain",
        "zerotrain",
        "__main__",
        "True",
        str(tmp_path),
    ]
    assert sys.modules["__main__"] is main
    with pytest.raises(SystemExit, match="EXAMPLE_ENGINE='torch': use zerotrain or deepspeed"):
        run_as_main(str(script), "torch")
