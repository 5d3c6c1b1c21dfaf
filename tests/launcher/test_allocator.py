"""``--allocator``: the ranks' host allocator (src/zerotrain/launcher/allocator.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from zerotrain.launcher import allocator, cli
from zerotrain.launcher.errors import LaunchError


@pytest.fixture
def fake_venv(tmp_path):
    lib = tmp_path / "venv" / "lib"
    lib.mkdir(parents=True)
    library = lib / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")
    return {"VIRTUAL_ENV": str(tmp_path / "venv")}, str(library)


def test_choice_comes_from_the_flag_then_the_environment_then_auto():
    assert allocator.resolve(None, {}) == "auto"
    assert allocator.resolve(None, {"ZEROTRAIN_ALLOCATOR": "system"}) == "system"
    assert allocator.resolve("tcmalloc", {"ZEROTRAIN_ALLOCATOR": "system"}) == "tcmalloc"
    with pytest.raises(LaunchError, match="ZEROTRAIN_ALLOCATOR.*unknown allocator 'jemalloc'"):
        allocator.resolve(None, {"ZEROTRAIN_ALLOCATOR": "jemalloc"})


def test_tcmalloc_is_preloaded_before_the_users_own_preloads(fake_venv):
    venv, library = fake_venv
    env = {**venv, "LD_PRELOAD": "/opt/libmine.so"}
    said = allocator.configure("tcmalloc", on_cpu=True, environ=env)
    assert env["LD_PRELOAD"] == f"{library}:/opt/libmine.so"
    assert "tcmalloc" in said and "--allocator system" in said
    # tcmalloc's "large alloc" reports are silenced, unless the user set a threshold
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) > 2**40
    env2 = {**venv, "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "1000"}
    allocator.configure("auto", on_cpu=True, environ=env2)
    assert env2["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "1000"
    assert env2["LD_PRELOAD"] == library


@pytest.mark.parametrize(
    "choice, on_cpu, preload",
    [
        ("system", True, None),  # asked for the system's
        ("auto", False, None),  # ranks on accelerators: auto leaves them alone
        ("auto", True, "libjemalloc.so.2"),  # the user preloads an allocator of their own
        ("tcmalloc", True, "/usr/lib/libtcmalloc.so.4"),
    ],
)
def test_nothing_is_preloaded(fake_venv, choice, on_cpu, preload):
    env = dict(fake_venv[0])
    if preload:
        env["LD_PRELOAD"] = preload
    before = dict(env)
    assert allocator.configure(choice, on_cpu=on_cpu, environ=env) is None
    assert env == before


def test_missing_tcmalloc(monkeypatch):
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    env = {}
    assert allocator.configure("auto", on_cpu=True, environ=env) is None and env == {}
    with pytest.raises(LaunchError, match="--allocator.*apt-get install libtcmalloc-minimal4"):
        allocator.configure("tcmalloc", on_cpu=True, environ=env)


def test_bad_choice_exits_2_naming_the_flag(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--allocator", "jemalloc", "train.py"])
    assert exc.value.code == 2
    assert "--allocator" in capsys.readouterr().err.splitlines()[-1]


def test_the_flag_reaches_every_node_agent():
    from zerotrain.launcher import multinode_cli

    args = cli.build_parser().parse_args(["launch", "--allocator", "system", "train.py"])
    assert multinode_cli.local_options(args).allocator == "system"
    assert multinode_cli.local_options(cli.build_parser().parse_args(["launch", "t.py"])).allocator is None


MAPS_SCRIPT = """
import json, os
maps = open("/proc/self/maps").read()
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"alloc{os.environ['RANK']}.json"), "w") as f:
    json.dump({"tcmalloc": "libtcmalloc" in maps}, f)
"""


@pytest.mark.skipif(
    allocator.find_tcmalloc() is None, reason="tcmalloc is not installed (apt-get install libtcmalloc-minimal4)"
)
@pytest.mark.parametrize("flag, loaded", [([], True), (["--allocator", "system"], False)], ids=["auto", "system"])
def test_ranks_run_on_the_chosen_allocator(tmp_path, flag, loaded):
    """Through the real entry point: the ranks' own memory maps say which allocator they run on."""
    (tmp_path / "script.py").write_text(textwrap.dedent(MAPS_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROTRAIN_ALLOCATOR", "LD_PRELOAD")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "zerotrain.launcher.cli", "--nproc", "2", *flag, "script.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    if not flag:  # auto: tcmalloc only where the ranks compute on the CPU
        from zerotrain.launcher.launch import _ranks_on_cpu

        loaded = _ranks_on_cpu()
    records = [json.loads((tmp_path / f"alloc{r}.json").read_text()) for r in (0, 1)]
    assert records == [{"tcmalloc": loaded}] * 2
    assert ("ranks allocate host memory with tcmalloc" in result.stderr) == loaded


def test_an_in_process_launch_leaves_the_environment_as_it_was(fake_venv, monkeypatch):
    for key, value in fake_venv[0].items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", "5")
    said = []
    with allocator.for_ranks("tcmalloc", True, said.append):
        assert os.environ["LD_PRELOAD"] == fake_venv[1]
    assert "LD_PRELOAD" not in os.environ and os.environ["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"
    assert len(said) == 1


def test_every_node_agent_is_given_the_choice(monkeypatch, tmp_path):
    from zerotrain.launcher import multinode_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(multinode_cli.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    args = cli.build_parser().parse_args(["launch", "--allocator", "system", "--master_addr", "10.0.0.1", "train.py"])
    plan = multinode_cli._plan(args, "ssh", ["node-a", "node-b"], None)
    flags = plan.agent_flags
    assert flags[flags.index("--allocator") + 1] == "system"
    plain = multinode_cli._plan(
        cli.build_parser().parse_args(["launch", "--master_addr", "10.0.0.1", "train.py"]),
        "ssh",
        ["node-a", "node-b"],
        None,
    )
    assert "--allocator" not in plain.agent_flags


def test_auto_follows_the_ranks_accelerator(monkeypatch):
    """``auto`` asks the accelerator the ranks will pick; a bad choice is one line naming it."""
    from zerotrain.launcher.launch import _ranks_on_cpu

    monkeypatch.setenv("ZEROTRAIN_ACCELERATOR", "cpu")
    assert _ranks_on_cpu()
    monkeypatch.setenv("ZEROTRAIN_ACCELERATOR", "cuda")
    assert not _ranks_on_cpu()
    monkeypatch.setenv("ZEROTRAIN_ACCELERATOR", "tpu")
    with pytest.raises(LaunchError, match="ZEROTRAIN_ACCELERATOR"):
        _ranks_on_cpu()
