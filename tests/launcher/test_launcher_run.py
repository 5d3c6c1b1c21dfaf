"""End-to-end tests of `zerotrain launch`: each one starts real rank processes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

RECORD_SCRIPT = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS"]
record = {k: os.environ.get(k) for k in keys}
record["argv"] = sys.argv[1:]
with open(os.path.join(os.path.dirname(__file__), f"rank{record['RANK']}.json"), "w") as f:
    json.dump(record, f)
print(f"hello from rank {record['RANK']}")
"""

# Rank 0 would sleep far past the test's own timeout: the launcher must stop it, not wait for it
# (checked by the marker it would write, not by a clock).
FAILING_SCRIPT = """
import os, time
if os.environ["RANK"] == "1":
    raise RuntimeError("boom from rank 1")
time.sleep(600)
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0_finished"), "w").close()
"""

ALL_REDUCE_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(os.path.dirname(__file__), f"sum{dist.get_rank()}.txt"), "w") as f:
    f.write(str(t.item()))
dist.destroy_process_group()
"""


def run_cli(*args: str, cwd, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "zerotrain.launcher.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def write_script(tmp_path, source: str, name: str = "script.py") -> str:
    (tmp_path / name).write_text(textwrap.dedent(source))
    return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_records(tmp_path) -> dict[int, dict]:
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.parametrize("form", [["launch", "--nproc", "2"], ["--num_gpus=2"]], ids=["launch", "deepspeed-style"])
def test_ranks_get_env_and_local_rank(tmp_path, form):
    script = write_script(tmp_path, RECORD_SCRIPT)
    port = free_port()
    result = run_cli(*form, "--master_port", str(port), script, "--foo", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # Another process on a busy machine may grab the port first; the launcher then says so.
    switched = re.search(r"free port (\d+)", result.stderr)
    port = int(switched.group(1)) if switched else port
    for rank, record in read_records(tmp_path).items():
        assert record["LOCAL_RANK"] == str(rank)
        assert record["WORLD_SIZE"] == record["LOCAL_WORLD_SIZE"] == record["LOCAL_SIZE"] == "2"
        assert (record["MASTER_ADDR"], record["MASTER_PORT"]) == ("127.0.0.1", str(port)), result.stderr
        assert (record["CROSS_RANK"], record["CROSS_SIZE"]) == ("0", "1")
        assert record["argv"] == ["--foo", "1", f"--local_rank={rank}"]
    assert "[rank0]: hello from rank 0" in result.stdout, result.stdout
    assert "[rank1]: hello from rank 1" in result.stdout, result.stdout


def test_no_local_rank_and_rank0_only(tmp_path):
    script = write_script(tmp_path, RECORD_SCRIPT)
    result = run_cli("--nproc", "2", "--no_local_rank", "--rank0_only", script, "--foo", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(record["argv"] == ["--foo", "1"] for record in read_records(tmp_path).values())
    assert "[rank0]: hello from rank 0" in result.stdout
    assert "[rank1]" not in result.stdout + result.stderr


def test_failing_rank_stops_the_others_and_is_reported(tmp_path):
    script = write_script(tmp_path, FAILING_SCRIPT)
    result = run_cli("--nproc", "2", script, cwd=tmp_path, timeout=240)  # waiting for rank 0 would pass it
    assert not (tmp_path / "rank0_finished").exists()
    assert result.returncode == 1
    assert "zerotrain: rank 1 (pid" in result.stderr
    assert "failed with exit code 1" in result.stderr
    report = result.stderr[result.stderr.index("zerotrain: rank 1") :]
    assert "RuntimeError: boom from rank 1" in report
    # The traceback starts in the user's script, not in the launcher's shim.
    assert "local_rank_entry" not in result.stderr


def test_torch_distributed_all_reduce(tmp_path):
    script = write_script(tmp_path, ALL_REDUCE_SCRIPT)
    result = run_cli("launch", "--nproc", "2", "--no_local_rank", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [(tmp_path / f"sum{r}.txt").read_text() for r in (0, 1)] == ["3.0", "3.0"]


ZEROTRAIN_SCRIPT = """
import argparse, os
import torch
import zerotrain
from zerotrain.models import GPT, GPTConfig

parser = zerotrain.add_config_arguments(argparse.ArgumentParser())
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
engine, _, _, _ = zerotrain.initialize(args=args, model=model)
ids = torch.randint(0, 64, (2, 16))
for _ in range(2):
    engine.backward(engine(ids, labels=ids).loss)
    engine.step()
print(f"rank {engine.global_rank} trained {engine.global_steps} steps")
# No destroy_process_group(): zerotrain tears down what it set up.
"""


def test_zerotrain_script_without_teardown_exits_0_on_every_rank(tmp_path):
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
                "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb")},
            }
        )
    )
    script = write_script(tmp_path, ZEROTRAIN_SCRIPT)
    result = run_cli("--num_gpus=2", script, "--deepspeed", "--deepspeed_config", "ds.json", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"rank {rank} trained 2 steps" in result.stdout


AFFINITY_SCRIPT = """
import json, os
with open("/proc/self/status") as f:
    allowed = next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
record = {"affinity": sorted(os.sched_getaffinity(0)), "status": allowed,
          "omp": os.environ.get("OMP_NUM_THREADS")}
with open(os.path.join(os.path.dirname(__file__), f"cpus{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to give each rank its own")
def test_bind_core_list_pins_each_rank_to_its_own_cores(tmp_path):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    script = write_script(tmp_path, AFFINITY_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [
        sys.executable,
        "-m",
        "zerotrain.launcher.cli",
        "--nproc",
        "2",
        "--bind_cores_to_rank",
        "--bind_core_list",
        f"{first},{second}",
        script,
    ]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    records = [json.loads((tmp_path / f"cpus{r}.json").read_text()) for r in (0, 1)]
    # Set in the rank itself (the kernel's view, /proc/self/status, agrees), before the script ran.
    assert [r["affinity"] for r in records] == [[first], [second]]
    assert [r["status"] for r in records] == [str(first), str(second)]
    assert [r["omp"] for r in records] == ["1", "1"]  # one core each -> one thread each


TRACEBACK_AFTER_INIT_SCRIPT = """
import torch.distributed as dist
dist.init_process_group("gloo")
raise ValueError("boom after init_process_group")
"""


def test_rank_traceback_has_one_rank_prefix(tmp_path):
    # torch's init_process_group prefixes traceback lines with "[rank0]: " itself; the launcher
    # already prefixes every line of rank 0's output, which doubled it.
    script = write_script(tmp_path, TRACEBACK_AFTER_INIT_SCRIPT)
    result = run_cli("--nproc", "1", "--no_local_rank", script, cwd=tmp_path)
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "[rank0]: ValueError: boom after init_process_group" in output, output
    assert "[rank0]: [rank0]:" not in output, output
    report = result.stderr[result.stderr.index("zerotrain: rank 0") :]
    assert "    ValueError: boom after init_process_group" in report  # the report's tail is clean too


RESTARTED_SCRIPT = """
import os
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt} rank {os.environ['RANK']}")
if attempt == 0 and os.environ["RANK"] == "1":
    raise SystemExit(3)
"""


def test_max_restarts_passes_to_the_agent(tmp_path):
    # Rank 1 fails on the first attempt; the agent restarts every rank once and the job succeeds.
    script = write_script(tmp_path, RESTARTED_SCRIPT)
    result = run_cli("--nproc", "2", "--max_restarts", "1", "--no_local_rank", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[rank1]: attempt 0 rank 1" in result.stdout and "[rank1]: attempt 1 rank 1" in result.stdout
    without = run_cli("--nproc", "2", "--no_local_rank", script, cwd=tmp_path)
    assert without.returncode == 3 and "attempt 1" not in without.stdout
