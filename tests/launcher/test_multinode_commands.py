"""The commands a multi-node launch runs, checked exactly; quoting through a real shell;
master address resolution; command-line errors."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

from zerotrain.launcher import cli
from zerotrain.launcher.errors import LaunchError
from zerotrain.launcher.multinode import (
    MultiNodePlan,
    node_commands,
    pdsh_stop_command,
    remote_shell_command,
    resolve_master_addr,
)

WORLD = {"w0": [0, 1], "w1": [0, 2]}


def make_plan(launcher: str, **overrides) -> MultiNodePlan:
    fields = dict(
        launcher=launcher,
        hosts=list(WORLD),
        world=WORLD,
        master_addr="10.0.0.1",
        master_port=29500,
        target=["train.py", "--lr", "1"],
        agent_flags=["--no_local_rank", "--max_restarts", "2"],
        exports={"NCCL_DEBUG": "INFO", "PYTHONPATH": "/work"},
        cwd="/work",
        python="/venv/bin/python",
        launcher_args=["-o", "ConnectTimeout=5"],
        ssh_port=2222,
        run_id="zerotrain-abc",
    )
    fields.update(overrides)
    return MultiNodePlan(**fields)


AGENT = ["/venv/bin/python", "-u", "-m", "zerotrain.launcher.cli", "launch", "--no_ssh", "--num_nodes", "2"]
# The world reaches the agents as JSON: any node name (user@host) is unambiguous there.
WORLD_ARG = '[["w0",[0,1]],["w1",[0,2]]]'
RDZV = ["--master_addr", "10.0.0.1", "--master_port", "29500", "--rdzv_id", "zerotrain-abc", "--world", WORLD_ARG]
TAIL = ["--no_local_rank", "--max_restarts", "2", "train.py", "--lr", "1"]


def test_ssh_commands_exactly():
    commands = node_commands(make_plan("ssh"))
    remote = [
        f"cd /work && export NCCL_DEBUG=INFO PYTHONPATH=/work && exec {' '.join(AGENT)} --node_rank {r} "
        f"{shlex.join(RDZV)} --stop_on_stdin_eof {' '.join(TAIL)}"
        for r in (0, 1)
    ]
    assert commands == [
        ["ssh", "-o", "ConnectTimeout=5", "-p", "2222", "-o", "BatchMode=yes", "--", "w0", remote[0]],
        ["ssh", "-o", "ConnectTimeout=5", "-p", "2222", "-o", "BatchMode=yes", "--", "w1", remote[1]],
    ]


def test_pdsh_command_exactly_with_percent_escaped():
    plan = make_plan("pdsh", launcher_args=[], target=["train.py", "--note", "100%"])
    [command] = node_commands(plan)
    remote = (
        f"cd /work && export NCCL_DEBUG=INFO PYTHONPATH=/work && exec {' '.join(AGENT)} --node_rank host=%h "
        f"{shlex.join(RDZV)} --write_pid_file --stop_on_stdin_eof --no_local_rank --max_restarts 2 "
        "train.py --note 100%%"
    )
    assert command == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1", remote]
    assert pdsh_stop_command(plan)[:6] == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1"]
    assert "zerotrain-zerotrain-abc-node*.pid" in pdsh_stop_command(plan)[-1]


def test_slurm_command_exactly():
    [command] = node_commands(make_plan("slurm", launcher_args=["--partition", "gpu"]))
    assert command == [
        "srun",
        "--nodes",
        "2",
        "--ntasks",
        "2",
        "--ntasks-per-node",
        "1",
        "--nodelist",
        "w0,w1",
        "--kill-on-bad-exit=1",
        "--partition",
        "gpu",
        *AGENT,
        "--node_rank",
        "slurm",
        *RDZV,
        *TAIL,
    ]
    # In an allocation without a hostfile: Slurm's nodes, no --world, no --nodelist.
    [command] = node_commands(make_plan("slurm", world=None, launcher_args=[]))
    assert "--nodelist" not in command and "--world" not in command


def test_openmpi_command_exactly():
    [command] = node_commands(make_plan("openmpi", launcher_args=["--mca", "btl", "tcp,self"]))
    assert command == [
        "mpirun",
        "-np",
        "2",
        "--host",
        "w0:1,w1:1",
        "--map-by",
        "ppr:1:node",
        "--bind-to",
        "none",
        "--wdir",
        "/work",
        "--mca",
        "plm_rsh_args",
        "-p 2222",
        "-x",
        "NCCL_DEBUG",
        "-x",
        "PYTHONPATH",
        "--mca",
        "btl",
        "tcp,self",
        *AGENT,
        "--node_rank",
        "openmpi",
        *RDZV,
        *TAIL,
    ]


NASTY_ARGS = [
    "two words",
    "it's",
    '"double"',
    "$HOME",
    "${PATH}",
    "a;touch INJECTED",
    "`touch INJECTED`",
    "$(touch INJECTED)",
    "line1\nline2",
    "tab\there",
    "back\\slash",
    "*",
    "~",
    "",
    "-",
    "--flag=x y",
    "&& touch INJECTED",
    "| cat",
    "> INJECTED",
    "100%",
    "%h %n %u",
    "é ünïcode",
    "'",
    "!event",
]


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_remote_command_delivers_arguments_unchanged(tmp_path, shell):
    record = (
        "import json, os, sys; json.dump({'argv': sys.argv[1:], 'cwd': os.getcwd(), "
        "'env': os.environ.get('ZT_VALUE')}, sys.stdout)"
    )
    plan = make_plan("ssh", cwd=str(tmp_path / "dir with space"), exports={"ZT_VALUE": "$HOME;`id` 'q'"})
    os.mkdir(plan.cwd)
    remote = remote_shell_command(plan, [sys.executable, "-c", record, *NASTY_ARGS])
    # The remote side runs the string with the login shell, as `ssh host STRING` does.
    result = subprocess.run([shell, "-c", remote], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"argv": NASTY_ARGS, "cwd": plan.cwd, "env": "$HOME;`id` 'q'"}
    assert not any(p.name == "INJECTED" for p in tmp_path.rglob("*"))


def test_pdsh_substitutions_apply_only_to_the_host_placeholder():
    plan = make_plan("pdsh", target=["train.py", *NASTY_ARGS])
    [command] = node_commands(plan)
    # pdsh replaces %h/%n/%u and turns %% into % (scanning left to right, as checked with real
    # pdsh in test_multinode_run.py); emulate that, then the shell must see the args.
    subs = {"h": "w1", "n": "1", "u": "root", "%": "%"}
    remote = re.sub(r"%(.)", lambda m: subs.get(m[1], m[0]), command[-1], flags=re.S)
    words = shlex.split(remote[remote.index("exec ") + 5 :])
    assert words[words.index("--node_rank") + 1] == "host=w1"
    assert words[-len(NASTY_ARGS) :] == NASTY_ARGS


def _fake_ssh(tmp_path, monkeypatch, output: str) -> None:
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")


def test_master_addr_resolution(tmp_path, monkeypatch):
    assert resolve_master_addr(make_plan("ssh", hosts=["192.0.2.7", "w1"])) == "192.0.2.7"
    assert resolve_master_addr(make_plan("ssh", hosts=["localhost", "127.0.0.2"])) in ("127.0.0.1", "::1")
    with pytest.raises(
        LaunchError, match="--master_addr: .*'no-such-host.invalid'.*does not resolve.*pass --master_addr"
    ):
        resolve_master_addr(make_plan("slurm", hosts=["no-such-host.invalid", "w1"]))
    # Not resolvable here: ask the host for `hostname -I` over ssh (a fake ssh; nothing is contacted).
    _fake_ssh(tmp_path, monkeypatch, "10.1.2.3 fe80::1 \\n")
    assert resolve_master_addr(make_plan("ssh", hosts=["no-such-host.invalid", "w1"])) == "10.1.2.3"


def test_master_addr_is_never_empty(tmp_path, monkeypatch):
    _fake_ssh(tmp_path, monkeypatch, " \\n")  # DeepSpeed's bug: an empty `hostname -I`
    with pytest.raises(LaunchError, match="hostname -I' over ssh printed none; pass --master_addr"):
        resolve_master_addr(make_plan("pdsh", hosts=["no-such-host.invalid", "w1"]))


def cli_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    return tmp_path


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--hostfile", "missing", "train.py"], "--hostfile: cannot read 'missing'"),
        (["-H", "hosts", "-i", "w7", "train.py"], "--include: 'w7' names host 'w7'"),
        (["-H", "hosts", "-e", "w1:5", "train.py"], "--exclude: 'w1:5' names slot(s) [5]"),
        (["-H", "hosts", "-i", "w0", "--num_gpus", "1", "train.py"], "--include: cannot be combined with --num_nodes"),
        (["--launcher", "ssh", "train.py"], "--launcher: multi-node launch needs --hostfile"),
        (["--num_nodes", "2", "train.py"], "--num_nodes: multi-node launch needs --hostfile"),
        (["--no_ssh", "train.py"], "--num_nodes: with --no_ssh give --num_nodes"),
        (["--no_ssh", "--num_nodes", "2", "train.py"], "--node_rank: required with --no_ssh"),
        (["--no_ssh", "--num_nodes", "2", "--node_rank", "1", "train.py"], "--master_addr: with --no_ssh give node 0"),
        (["--launcher", "slurm", "train.py"], "--launcher: slurm: not inside a Slurm allocation"),
        (["--max_restarts", "-1", "train.py"], "--max_restarts"),
    ],
)
def test_multinode_usage_errors_exit_2_naming_the_flag(capsys, workdir, monkeypatch, argv, says):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert says in cli_error(capsys, *argv)


def test_single_host_hostfile_runs_locally_with_its_slots(workdir):
    from zerotrain.launcher.multinode_cli import plan_launch

    (workdir / "one").write_text("localhost slots=3\n")
    args = cli.build_parser().parse_args(["launch", "-H", "one", "-i", "localhost:0,2", "train.py"])
    opts = plan_launch(args)
    assert (opts.nproc, opts.devices, opts.nnodes) == (2, [0, 2], 1)


def test_node_agent_gets_its_slots_rank_and_rendezvous(workdir, monkeypatch):
    from zerotrain.launcher.multinode_cli import plan_launch

    argv = [
        "launch",
        "--no_ssh",
        "--world",
        "w0:0,1@w1:0,2",
        "--node_rank",
        "host=w1",
        "--master_addr",
        "10.0.0.1",
        "--master_port",
        "29501",
        "--rdzv_id",
        "zerotrain-abc",
        "--max_restarts",
        "2",
        "train.py",
        "--x",
    ]
    opts = plan_launch(cli.build_parser().parse_args(argv))
    assert (opts.nnodes, opts.node_rank, opts.nproc, opts.devices) == (2, 1, 2, [0, 2])
    assert (opts.master_addr, opts.master_port, opts.run_id, opts.max_restarts) == (
        "10.0.0.1",
        29501,
        "zerotrain-abc",
        2,
    )
    assert (opts.node_name, opts.script_args) == ("node 1 (w1)", ["--x"])
    from zerotrain.launcher.launch import build_launch_config

    config = build_launch_config(opts, 2, 29501, logs_specs=None)
    # Restarts across nodes need every agent to re-join: the c10d rendezvous, node 1 not hosting it.
    assert (config.min_nodes, config.max_nodes, config.rdzv_backend, config.rdzv_configs["is_host"]) == (
        2,
        2,
        "c10d",
        False,
    )
    opts.max_restarts = 0
    config = build_launch_config(opts, 2, 29501, logs_specs=None)
    assert (config.rdzv_backend, config.rdzv_configs["rank"], config.rdzv_endpoint) == ("static", 1, "10.0.0.1:29501")
