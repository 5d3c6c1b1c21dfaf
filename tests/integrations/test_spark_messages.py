"""How DeepspeedTorchDistributor explains failures (no Spark job: the text of Spark's errors)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("pyspark", reason="needs pyspark: pip install 'zerotrain[spark]'")

from zerotrain.integrations.spark import DeepspeedTorchDistributor, launch_command  # noqa: E402


def explain(text: str) -> Exception:
    fake = types.SimpleNamespace(spark=types.SimpleNamespace(sparkContext=types.SimpleNamespace(pythonExec="python3")))
    return DeepspeedTorchDistributor._explain_failure(fake, RuntimeError(text))


def test_executor_python_without_zerotrain_says_what_to_set():
    err = explain("PythonException: ... ModuleNotFoundError: No module named 'zerotrain' ...")
    assert "executors' Python (python3) cannot import zerotrain/torch; set PYSPARK_PYTHON" in str(err)


def test_rank_report_leads_the_message():
    text = (
        "Command [...] failed with return code 1. The task output is included below: [rank1]: boom\n"
        "zerotrain: rank 1 (pid 42) on node 1 (10.0.0.2) failed with exit code 1\n    ValueError: boom\n"
    )
    err = explain(text)
    assert str(err).startswith("DeepspeedTorchDistributor: training failed: zerotrain: rank 1 (pid 42) on node 1")
    other = RuntimeError("something else")
    assert explain("something else").args == other.args


def test_distributed_task_command(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "4000")
    monkeypatch.setenv("PYSPARK_TORCH_DISTRIBUTOR_RDZV_ID", "abc")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    command = launch_command({"local_mode": False, "num_processes": 4}, "train.py", ["--a", "1"], "/tmp/c.json")
    assert command[1:] == [
        "-m",
        "zerotrain.launcher.cli",
        "launch",
        "--no_local_rank",
        "--no_ssh",
        "--num_nodes",
        "2",
        "--node_rank",
        "1",
        "--nproc",
        "2",
        "--master_addr",
        "10.0.0.1",
        "--master_port",
        "4000",
        "--rdzv_id",
        "abc",
        "train.py",
        "--a",
        "1",
        "--deepspeed",
        "--deepspeed_config",
        "/tmp/c.json",
    ]
