"""Fast, in-process tests of the `zerotrain` command line and launcher helpers."""

from __future__ import annotations

import socket

import pytest

from zerotrain.launcher import cli


def cli_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["launch"], "user_script"),
        (["launch", "missing.py"], "user_script"),
        (["--nproc", "0", "train.py"], "--nproc"),
        (["--num_gpus=-1", "train.py"], "--num_gpus"),
        (["--master_port", "70000", "train.py"], "--master_port"),
        (["--master_port", "http", "train.py"], "--master_port"),
        (["--module", "--no_python", "train.py"], "--no_python"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(capsys, script, argv, flag):
    err = cli_error(capsys, *argv)
    assert flag in err.splitlines()[-1]


def test_master_addr_must_be_local(capsys, script):
    err = cli_error(capsys, "--master_addr", "192.0.2.1", "train.py")
    assert "--master_addr" in err.splitlines()[-1]


@pytest.mark.parametrize("flag, expected", [("--help", "launch"), ("--version", "zerotrain ")])
def test_help_lists_subcommands_and_version(capsys, flag, expected):
    with pytest.raises(SystemExit) as exc:
        cli.main([flag])
    assert exc.value.code == 0
    assert expected in capsys.readouterr().out


def test_script_args_are_not_parsed_as_launcher_flags(script):
    args = cli.build_parser().parse_args(["launch", "--nproc", "2", script, "--nproc", "5", "-h"])
    assert (args.nproc, args.user_script, args.user_args) == (2, script, ["--nproc", "5", "-h"])


def test_busy_master_port_is_replaced(capsys):
    from zerotrain.launcher.launch import LaunchOptions, _resolve_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        chosen = _resolve_port(LaunchOptions(script="x.py", master_port=port))
    assert chosen != port
    assert f"master port {port} is busy" in capsys.readouterr().err


def test_port_taken_after_the_check_is_retried(tmp_path, monkeypatch, capsys):
    from zerotrain.launcher import launch, ports

    (tmp_path / "ok.py").write_text("pass\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(ports, "is_port_free", lambda addr, port: True)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        opts = launch.LaunchOptions(script=str(tmp_path / "ok.py"), nproc=1, master_port=port)
        assert launch.launch_local(opts) == 0
    assert f"master port {port} was taken before the launch; retrying" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag, says",
    [
        (["--bind_core_list", "3-1", "train.py"], "--bind_core_list", "low <= high"),
        (["--bind_core_list", "0,a", "train.py"], "--bind_core_list", "not a core number"),
        (["--bind_core_list", "0-2,1", "train.py"], "--bind_core_list", "ascending"),
        (["--bind_core_list", "100000", "train.py"], "--bind_core_list", "not available to this process"),
        (["--nproc", "100000", "--bind_cores_to_rank", "train.py"], "--bind_cores_to_rank", "cannot give each"),
    ],
)
def test_bad_core_binding_exits_2_naming_the_flag(capsys, script, argv, flag, says):
    err = cli_error(capsys, *argv).splitlines()[-1]
    assert flag in err and says in err


def test_core_lists_parse_and_format_like_deepspeed():
    from zerotrain.launcher.affinity import format_core_list, parse_core_list

    assert parse_core_list("0,2-4,6") == [0, 2, 3, 4, 6]
    assert parse_core_list("5") == [5]
    assert format_core_list([0, 2, 3, 4, 6]) == "0,2-4,6"
    assert format_core_list(parse_core_list("1-3,7-8")) == "1-3,7-8"


def test_each_local_rank_gets_its_own_equal_slice(monkeypatch):
    import os

    from zerotrain.launcher import local_rank_entry

    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append(set(cpus)))
    for rank in range(3):  # 7 cores over 3 ranks: 2 each, the last core unused (as DeepSpeed)
        local_rank_entry.bind_to_cores("0-4,8,9", {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3"})
    assert calls == [{0, 1}, {2, 3}, {4, 8}]


def test_bind_core_list_implies_binding_and_reaches_the_rank_command(script):
    from zerotrain.launcher.launch import worker_command

    args = cli.build_parser().parse_args(["launch", "--bind_core_list", "0-1", script])
    opts = cli.options_from_args(args)
    assert opts.bind_cores_to_rank and opts.bind_core_list == "0-1"
    _, command = worker_command(opts, [0, 1])
    assert "--bind_cores=0-1" in command[: command.index("--")]


def test_launch_config_without_a_shutdown_timeout_field(monkeypatch):
    """torch 2.11's LaunchConfig has no ``shutdown_timeout``: the launch goes on without it (the
    agent's own 30 s), unless a non-default timeout was asked for, which is refused by name."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    from zerotrain.launcher import launch
    from zerotrain.launcher.errors import LaunchError

    fields = [(f.name, f.type, f) for f in dataclasses.fields(LaunchConfig) if f.name != "shutdown_timeout"]
    older = dataclasses.make_dataclass("LaunchConfig", fields)
    opts = launch.LaunchOptions(script="train.py", nproc=2)
    assert launch.build_launch_config(opts, 2, 29501, logs_specs=None).shutdown_timeout == opts.shutdown_timeout
    monkeypatch.setattr(launch, "LaunchConfig", older)
    config = launch.build_launch_config(opts, 2, 29501, logs_specs=None)
    assert isinstance(config, older) and config.nproc_per_node == 2
    opts.shutdown_timeout = 60
    with pytest.raises(LaunchError, match="shutdown_timeout.*upgrade torch"):
        launch.build_launch_config(opts, 2, 29501, logs_specs=None)
