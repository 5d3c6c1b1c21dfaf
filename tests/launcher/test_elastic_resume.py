"""Elastic restart: a rank is SIGKILLed mid-run; with ``--max_restarts 1`` the
agent restarts every rank, the script resumes from its latest checkpoint, and the run ends
exactly as an uninterrupted one, redoing only the steps since that checkpoint. On one node, and
on two nodes (two agents on this machine, each as a node of a multi-node launch runs it).

Restarted ranks used to read the killed attempt's gloo addresses from the agent's store (torch
keeps one store for all attempts and its keys have no attempt prefix): rank 0 of the restart
waits a moment before ``initialize`` so that rank 1 always reads before rank 0 rewrites them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.launcher.test_launcher_run import free_port, write_script

STEPS, SAVE_EVERY, KILL_AFTER = 8, 2, 5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE, EXAMPLE_CONFIG = (
    os.path.join(ROOT, "examples", "train_gpt.py"),
    os.path.join(ROOT, "examples", "ds_config.json"),
)
EXAMPLE_ARGS = [
    "--steps",
    "2",
    "--save_interval",
    "1",
    "--seq_len",
    "32",
    "--n_layer",
    "1",
    "--n_embd",
    "32",
    "--n_head",
    "2",
    "--text_bytes",
    "20000",
    "--sample_bytes",
    "4",
]

RESUMING_SCRIPT = """
import json, os, signal, sys, time
import torch
import zerotrain
from zerotrain.models import GPT, GPTConfig

steps, save_every, kill_after, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
os.environ["ZEROTRAIN_COMM_TIMEOUT"] = "60"  # a broken rendezvous fails in 1 minute, not 30
if attempt > 0 and rank == 0:
    time.sleep(2)  # rank 1 reaches the rendezvous first: stale keys would be read, not waited for
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
engine, *_ = zerotrain.initialize(model=model, config=config)
ckpt = os.path.join(out, "ckpt")
if os.path.exists(os.path.join(ckpt, "latest")):
    engine.load_checkpoint(ckpt)
g = torch.Generator().manual_seed(1)
data = torch.randint(0, 64, (steps, 4, 16), generator=g)
while engine.global_steps < steps:
    step = engine.global_steps
    batch = data[step, 2 * rank:2 * rank + 2]
    loss = engine(batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    with open(os.path.join(out, f"losses{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"attempt": attempt, "step": step, "loss": loss.item()}) + "\\n")
    if engine.global_steps % save_every == 0:
        engine.save_checkpoint(ckpt)
    if kill_after and attempt == 0 and rank == 1 and engine.global_steps == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind: a lost machine
engine.destroy()
"""


def _start(*args: str, cwd) -> subprocess.Popen:
    """``zerotrain launch`` in a session of its own, so that a timeout can stop its ranks too."""
    cmd = [sys.executable, "-m", "zerotrain.launcher.cli", *args]
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(test: killed after {timeout} s)"
    return proc.returncode, out + err


def _losses(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_rank_resumes_from_latest_checkpoint(tmp_path):
    """One node with 2 ranks, and two agents of 1 rank each as two nodes (``--no_ssh``: what every
    node of a hostfile launch runs), against an uninterrupted run; all three at once."""
    script = write_script(tmp_path, RESUMING_SCRIPT)

    def job(kill: int, name: str) -> list[str]:
        return [script, str(STEPS), str(SAVE_EVERY), str(kill), name]

    two_nodes = [
        "--no_ssh",
        "--world",
        "n0:0@n1:0",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "--rdzv_id",
        "two-nodes",
        "--max_restarts",
        "1",
        "--no_local_rank",
    ]
    # examples/train_gpt.py's `--resume` as the one command of an elastic run: a fresh save_dir (with
    # only what a first save killed before its commit leaves) starts from step 0; a save_dir with a
    # checkpoint folder but no `latest` is not taken for fresh (load_checkpoint's error).
    fresh, partial = tmp_path / "example" / "ckpt", tmp_path / "example_partial" / "ckpt"
    (fresh / ".global_step1.partial").mkdir(parents=True)
    (partial / "global_step2").mkdir(parents=True)
    (partial / "global_step2" / "metadata.json").write_text("{}")
    example = [EXAMPLE, "--resume", "--deepspeed_config", EXAMPLE_CONFIG, *EXAMPLE_ARGS]
    runs = {
        "example": [
            (
                "--nproc",
                "2",
                "--max_restarts",
                "1",
                "--master_port",
                str(free_port()),
                *example,
                "--save_dir",
                str(fresh),
            )
        ],
        "example_partial": [("--nproc", "1", "--master_port", str(free_port()), *example, "--save_dir", str(partial))],
        "plain": [("--nproc", "2", "--master_port", str(free_port()), "--no_local_rank", *job(0, "plain"))],
        "killed": [
            (
                "--nproc",
                "2",
                "--max_restarts",
                "1",
                "--master_port",
                str(free_port()),
                "--no_local_rank",
                *job(KILL_AFTER, "killed"),
            )
        ],
        "two_nodes": [
            ("launch", *two_nodes, "--node_rank", str(node), *job(KILL_AFTER, "two_nodes")) for node in (0, 1)
        ],
    }
    procs = {}
    for name, commands in runs.items():
        (tmp_path / name).mkdir(exist_ok=True)
        procs[name] = [_start(*command, cwd=tmp_path) for command in commands]
    finished = {name: [_finish(proc) for proc in group] for name, group in procs.items()}  # all, before asserting
    code, output = finished.pop("example_partial")[0]
    assert code == 1 and f"CheckpointError: {partial / 'latest'} does not exist" in output, output
    for name, results in finished.items():
        for code, output in results:
            assert code == 0, f"{name}: {output}"
    output = finished.pop("example")[0][1]
    assert f"--resume: {str(fresh)!r} holds no checkpoint yet; starting from step 0" in output, output
    assert "done: 2 steps" in output and (fresh / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in fresh.iterdir() if p.is_dir()) == ["global_step1", "global_step2"]
    runs = {name: runs[name] for name in finished}
    outputs = {name: {rank: _losses(tmp_path / name / f"losses{rank}.jsonl") for rank in (0, 1)} for name in runs}
    last_saved = KILL_AFTER // SAVE_EVERY * SAVE_EVERY  # global_step4: step index 4 is redone
    assert KILL_AFTER - last_saved <= SAVE_EVERY  # at most one checkpoint interval lost
    for rank in (0, 1):
        plain = outputs["plain"][rank]
        assert [r["step"] for r in plain] == list(range(STEPS)) and {r["attempt"] for r in plain} == {0}
        reference = {r["step"]: r["loss"] for r in plain}
        for name in ("killed", "two_nodes"):
            # Steps before the kill, then from the checkpoint on. Rank 1 dies right after logging
            # step KILL_AFTER - 1; rank 0 may be stopped before logging it.
            logged = (KILL_AFTER,) if rank else (KILL_AFTER - 1, KILL_AFTER)
            expected = [list(range(done)) + list(range(last_saved, STEPS)) for done in logged]
            assert [r["step"] for r in outputs[name][rank]] in expected, (name, rank, outputs[name][rank])
            for r in outputs[name][rank]:  # every loss, before and after the restart, equals the uninterrupted run's
                assert r["loss"] == reference[r["step"]], (name, rank, r)
        # One agent: TORCHELASTIC_RESTART_COUNT is the attempt.
        assert {r["attempt"] for r in outputs["killed"][rank] if r["step"] > KILL_AFTER} == {1}
    # Across nodes it counts each agent's own restarts: node 0's rank may be restarted for node 1's
    # failure without counting one (or fail itself first and count one).
    assert {r["attempt"] for r in outputs["two_nodes"][1] if r["step"] > KILL_AFTER} == {1}


def test_restarts_use_c10d_and_a_store_per_attempt():
    from zerotrain.launcher.errors import LaunchError
    from zerotrain.launcher.launch import (
        UNSHARED_STORE_VAR,
        LaunchOptions,
        build_launch_config,
        restart_safe_environment,
    )

    opts = LaunchOptions(script="train.py", master_addr="10.0.0.1", max_restarts=2)
    config = build_launch_config(opts, 2, 29501, logs_specs=None)
    assert (config.rdzv_backend, config.rdzv_configs["is_host"], config.local_addr) == ("c10d", True, "10.0.0.1")
    environ = {}
    restart_safe_environment(opts, environ)
    assert environ == {UNSHARED_STORE_VAR: "1"}
    with pytest.raises(LaunchError, match=f"{UNSHARED_STORE_VAR}=0 .* unset it"):
        restart_safe_environment(opts, {UNSHARED_STORE_VAR: "0"})
    opts.max_restarts = 0  # no restarts: the static rendezvous, the given port, nothing exported
    config = build_launch_config(opts, 2, 29501, logs_specs=None)
    assert (config.rdzv_backend, config.rdzv_configs["rank"], config.local_addr) == ("static", 0, None)
    environ = {}
    restart_safe_environment(opts, environ)
    assert environ == {}
