"""Hostfiles through the real ``zerotrain`` command line (issue 29, item 11).

- every bad hostfile gives exit 2 and one line naming the hostfile (its line) and the fix, never
  a traceback, before anything is started;
- ``user@127.0.0.1 slots=3`` + ``127.0.0.2 slots=1`` runs 3 ranks on node 0 and 1 on node 1 (it ran
  [1, 3]: ``@`` and ``:`` were separators of the world spec the nodes' agents got), checked on a
  real launch through a fake ssh that runs each node's command on this machine.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from zerotrain.launcher import hostfile
from zerotrain.launcher.errors import LaunchError


def run_cli(tmp_path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    return subprocess.run(
        [sys.executable, "-m", "zerotrain.launcher.cli", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


BAD_HOSTFILES = [
    ("ipv6", b"w0 slots=1\n::1 slots=1\n", "hosts:2: '::1 slots=1': IPv6 address '::1' is not supported"),
    ("ipv6-brackets", b"[::1] slots=1\nw1 slots=1\n", "hosts:1: '[::1] slots=1': IPv6 address"),
    (
        "host-port",
        b"w0:2222 slots=1\nw1 slots=1\n",
        "'w0:2222' is not a host name: for HOST:PORT write the host alone and pass --ssh_port PORT",
    ),
    (
        "dash-host",
        b"w0 slots=1\n-oProxyCommand=touch_x slots=1\n",
        "hosts:2: '-oProxyCommand=touch_x slots=1': host '-oProxyCommand=touch_x' starts with '-'",
    ),
    ("dash-host-with-user", b"u@-w0 slots=1\nw1 slots=1\n", "host '-w0' starts with '-'"),
    ("not-utf8", b"w0 slots=1\n\xff\xfe slots=1\n", "hosts:2: byte 0xff is not UTF-8 text"),
    (
        "huge-slots",
        b"w0 slots=1000000000000\nw1 slots=1\n",
        "hosts:1: 'w0 slots=1000000000000': slots=1000000000000 is more than 1024 devices per node",
    ),
    ("huge-slots-digits", b"w0 slots=" + b"9" * 5000 + b"\n", "is more than 1024 devices per node"),
    ("same-host-two-users", b"a@w0 slots=1\nb@w0 slots=1\n", "hosts:2: 'b@w0 slots=1' repeats host 'w0'"),
    ("bad-user", b"us$er@w0 slots=1\nw1 slots=1\n", "'us$er@w0' is not USER@HOST"),
    ("bad-char", b"w0 slots=1\nw/1 slots=1\n", "host 'w/1' may hold only letters, digits"),
]


@pytest.mark.parametrize("content, says", [c[1:] for c in BAD_HOSTFILES], ids=[c[0] for c in BAD_HOSTFILES])
def test_bad_hostfile_is_one_line_naming_the_line_and_the_fix(tmp_path, content, says):
    (tmp_path / "hosts").write_bytes(content)
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    result = run_cli(tmp_path, "--hostfile", "hosts", "--launcher", "ssh", "train.py", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == result.stderr.splitlines()[-1], result.stderr
    assert errors[0].startswith("zerotrain launch: error: --hostfile: ") and says in errors[0], errors[0]


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
def test_user_at_host_needs_ssh_or_pdsh(tmp_path, launcher):
    (tmp_path / "hosts").write_text("me@w0 slots=1\nw1 slots=1\n")
    (tmp_path / "train.py").write_text("")
    result = run_cli(tmp_path, "--hostfile", "hosts", "--launcher", launcher, "train.py", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"zerotrain launch: error: --hostfile: 'me@w0': a user@host node needs --launcher ssh or pdsh "
        f"({launcher} starts the nodes' tasks itself); write the host alone"
    )


def test_world_spec_holds_user_at_host_and_filters_name_hosts():
    world = hostfile.parse_hostfile_text("user@127.0.0.1 slots=3\n127.0.0.2 slots=1\n")
    assert world == {"user@127.0.0.1": [0, 1, 2], "127.0.0.2": [0]}
    assert hostfile.decode_world(hostfile.encode_world(world)) == world
    # --include/--exclude name a user@host node by its host (DeepSpeed's worker-0@worker-1:0,2 syntax).
    assert hostfile.filter_world(world, "127.0.0.2@127.0.0.1:0,2") == {"user@127.0.0.1": [0, 2], "127.0.0.2": [0]}
    assert hostfile.filter_world(world, exclude="127.0.0.1:1") == {"user@127.0.0.1": [0, 2], "127.0.0.2": [0]}
    # The hand-written form of --world keeps working.
    assert hostfile.decode_world("n0:0@n1:0,2") == {"n0": [0], "n1": [0, 2]}
    for bad in ('[["w0",[0]],["w0",[1]]]', '[["w0",[]]]', '[["w0","0"]]', "[1,2]", "[", '[["-w0",[0]]]'):
        with pytest.raises(LaunchError, match="^--world: "):
            hostfile.decode_world(bad)


# ssh [options] -- HOST COMMAND for a "node" that is this machine: note the host, run COMMAND here.
FAKE_SSH = """
import os, sys
assert sys.argv[-3] == "--", sys.argv
with open(os.path.join(os.environ["FAKE_SSH_LOG"]), "a") as f:
    f.write(sys.argv[-2] + "\\n")
os.execvp("sh", ["sh", "-c", sys.argv[-1]])
"""

RECORD = """
import json, os
keys = ["RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"]
with open(f"rank{os.environ['RANK']}.json", "w") as f:
    json.dump({k: int(os.environ[k]) for k in keys}, f)
"""


def test_user_at_host_node_gets_its_own_slot_count(tmp_path):
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SSH))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "hosts").write_text("user@127.0.0.1 slots=3\n127.0.0.2 slots=1\n")
    (tmp_path / "record.py").write_text(textwrap.dedent(RECORD))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["FAKE_SSH_LOG"] = str(tmp_path / "ssh.log")
    try:
        result = run_cli(tmp_path, "--hostfile", "hosts", "--launcher", "ssh", "--master_port", str(port), "record.py")
    finally:
        del os.environ["FAKE_SSH_LOG"]
    assert result.returncode == 0, result.stderr
    assert sorted((tmp_path / "ssh.log").read_text().split()) == ["127.0.0.2", "user@127.0.0.1"]
    records = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    assert sorted(tmp_path.glob("rank*.json")) == [tmp_path / f"rank{r}.json" for r in range(4)]
    per_node = [sum(1 for r in records.values() if r["GROUP_RANK"] == node) for node in (0, 1)]
    assert per_node == [3, 1]
    assert [(r["GROUP_RANK"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"], r["WORLD_SIZE"]) for r in records.values()] == [
        (0, 0, 3, 4),
        (0, 1, 3, 4),
        (0, 2, 3, 4),
        (1, 0, 1, 4),
    ]
