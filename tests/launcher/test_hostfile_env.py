"""Hostfile and --include/--exclude grammar, the exported environment, --node_rank forms."""

from __future__ import annotations

import pytest

from zerotrain.launcher import hostfile
from zerotrain.launcher.errors import LaunchError
from zerotrain.launcher.multinode_cli import resolve_node_rank
from zerotrain.launcher.remote_env import exported_env

HOSTFILE = """
# two nodes
worker-0 slots=4
worker-1   slots=2   # trailing comment

worker-2 slots=1
"""


def test_hostfile_parses_in_order_with_comments_and_blank_lines():
    world = hostfile.parse_hostfile_text(HOSTFILE)
    assert world == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1], "worker-2": [0]}
    assert list(world) == ["worker-0", "worker-1", "worker-2"]


@pytest.mark.parametrize(
    "text, says",
    [
        ("worker-0 slots=4\nworker-1 4\n", "hosts:2: 'worker-1 4' is not 'HOST slots=N'"),
        ("worker-0 slots=four\n", "hosts:1: 'worker-0 slots=four' is not"),
        ("worker-0 slots=2 extra\n", "hosts:1: 'worker-0 slots=2 extra' is not"),
        ("worker-0 slots=2\nworker-0 slots=2\n", "hosts:2: 'worker-0 slots=2' repeats host 'worker-0'"),
        ("worker-0 slots=0\n", "gives worker-0 no slots"),
        ("# nothing\n\n", "hosts lists no hosts"),
    ],
)
def test_bad_hostfiles_quote_the_line(text, says):
    with pytest.raises(LaunchError) as err:
        hostfile.parse_hostfile_text(text, source="hosts")
    assert err.value.flag == "--hostfile" and says in str(err.value)


def test_named_missing_hostfile_is_an_error(tmp_path):
    with pytest.raises(LaunchError, match="--hostfile: cannot read .*nope.*No such file"):
        hostfile.read_hostfile(str(tmp_path / "nope"))


WORLD = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}


@pytest.mark.parametrize(
    "include, exclude, expected",
    [
        ("worker-0@worker-1:0,2", None, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
        ("worker-1:3,1", None, {"worker-1": [1, 3]}),
        ("worker-1@worker-0", None, WORLD),  # hostfile order, not the spec's
        (None, "worker-1:0", {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3]}),
        (None, "worker-0", {"worker-1": [0, 1, 2, 3]}),
        (None, "worker-0:0,1,2,3", {"worker-1": [0, 1, 2, 3]}),
    ],
)
def test_include_exclude_like_deepspeed(include, exclude, expected):
    assert hostfile.filter_world(WORLD, include, exclude) == expected


@pytest.mark.parametrize(
    "include, exclude, flag, says",
    [
        ("worker-9", None, "--include", "'worker-9' names host 'worker-9', which is not in the hostfile"),
        ("worker-1:7", None, "--include", "names slot(s) [7] of 'worker-1'"),
        (None, "worker-1:x", "--exclude", "slots 'x' of 'worker-1'"),
        ("worker-0:", None, "--include", "'worker-0:' in 'worker-0:' is not HOST"),
        ("worker-0@worker-0:1", None, "--include", "appears twice"),
        (None, "worker-0@worker-1", "--exclude", "leaves no host"),
        ("worker-0", "worker-1", "--include", "cannot be combined"),
    ],
)
def test_bad_filters_quote_the_spec(include, exclude, flag, says):
    with pytest.raises(LaunchError) as err:
        hostfile.filter_world(WORLD, include, exclude)
    assert err.value.flag == flag and says in str(err.value)


def test_num_nodes_and_num_gpus_take_the_first_ones():
    assert hostfile.limit_world(WORLD, 1, 2) == {"worker-0": [0, 1]}
    with pytest.raises(LaunchError, match="--num_nodes: 3 node"):
        hostfile.limit_world(WORLD, 3, None)
    with pytest.raises(LaunchError, match="--num_gpus: 5 process"):
        hostfile.limit_world(WORLD, None, 5)
    spec = hostfile.format_world({"a": [0, 2], "b": [1]})
    assert spec == "a:0,2@b:1" and hostfile.parse_node_specs(spec, "--world") == {"a": [0, 2], "b": [1]}


def test_exported_env_prefixes_files_and_pythonpath(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".deepspeed_env").write_text("A=home-ds\nB=home-ds\nC=home-ds\n")
    (work / ".deepspeed_env").write_text("# comment\n\nB=cwd-ds\nexport D = spaced value \n")
    (home / ".zerotrain_env").write_text("C=home-zt\n")
    (work / ".zerotrain_env").write_text("E=$HOME;`x`\n")
    environ = {
        "HOME": str(home),
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/lib",
        "MLFLOW_TRACKING_URI": "u",
        "UCX_TLS": "tcp",
        "SECRET": "no",
        "OMP_NUM_THREADS": "3",
    }
    exports = exported_env(environ, cwd=str(work), prefixes=["NCCL"])
    assert exports == {
        "MLFLOW_TRACKING_URI": "u",
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": f"{work}:/lib",
        "UCX_TLS": "tcp",
        "A": "home-ds",
        "B": "cwd-ds",
        "C": "home-zt",
        "D": "spaced value",
        "E": "$HOME;`x`",
    }
    # DS_ENV_FILE renames DeepSpeed's file (a path works too).
    (tmp_path / "my.env").write_text("F=6\n")
    assert exported_env({**environ, "DS_ENV_FILE": str(tmp_path / "my.env")}, cwd=str(work), prefixes=[])["F"] == "6"
    (work / ".zerotrain_env").write_text("OK=1\nnot a line\n")
    with pytest.raises(LaunchError, match=r"\.zerotrain_env:2: 'not a line' is not KEY=VALUE"):
        exported_env(environ, cwd=str(work), prefixes=[])


def test_node_rank_forms():
    world = {"a": [0], "b.cluster": [0], "c": [0]}
    assert resolve_node_rank("2", world, 3, {}) == 2
    assert resolve_node_rank("host=b.cluster", world, 3, {}) == 1
    assert resolve_node_rank("slurm", world, 3, {"SLURMD_NODENAME": "b"}) == 1  # short name
    assert resolve_node_rank("slurm", None, 3, {"SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "3"}) == 2
    assert resolve_node_rank("openmpi", None, 2, {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}) == 1
    for spec, env, says in [
        (None, {}, "required with --no_ssh"),
        ("3", {}, "outside 0..2"),
        ("x", {}, "'x' is not a number"),
        ("host=z", {}, "'z' is not one of the nodes"),
        ("slurm", {"SLURMD_NODENAME": "q"}, "SLURMD_NODENAME='q' is not one of"),
        ("openmpi", {}, "OMPI_COMM_WORLD_RANK is not set"),
        ("openmpi", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, "start one task per node"),
    ]:
        with pytest.raises(LaunchError, match="--node_rank") as err:
            resolve_node_rank(spec, world, 3, env)
        assert says in str(err.value)
