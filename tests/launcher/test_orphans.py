"""Nothing a launch starts outlives the launcher (issue 29, item 10).

SIGKILL of the launcher (or of a node's agent) used to leave every rank running, reparented to
init (each rank is in a session of its own), a rank in a collective then waiting 30 minutes.
Each test starts real ranks that block (rank 0 in a barrier, rank 1 asleep), each with a child
process of its own, kills a launcher process with SIGKILL and polls until no rank, child, agent,
client or watchdog is left (up to 60 s; nothing is timed).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from zerotrain.launcher import orphan_guard

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process checks use /proc")

BLOCKING_SCRIPT = """
import datetime, json, os, subprocess, sys, time
import torch.distributed as dist
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
record = dict(pid=os.getpid(), ppid=os.getppid(), child=child.pid, node=int(os.environ.get("GROUP_RANK", "0")))
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"rank{dist.get_rank()}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.rename(path + ".tmp", path)
if dist.get_rank() == 0:
    dist.barrier()  # rank 1 never joins
time.sleep(900)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes_mentioning(text: str) -> set[int]:
    """Live processes whose command line contains ``text`` (ranks, watchdogs, agents, clients)."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if text.encode() in f.read() and alive(int(name)):
                        found.add(int(name))
            except OSError:
                pass
    return found


def wait_for_records(tmp_path, count: int, launcher: subprocess.Popen, timeout: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(tmp_path.glob("rank*.json"))
        if len(files) == count:
            return [json.loads(f.read_text()) for f in files]
        if launcher.poll() is not None:
            pytest.fail(
                f"launcher exited with {launcher.returncode} before the ranks started:\n{launcher.stderr.read()}"
            )
        time.sleep(0.2)
    pytest.fail("ranks did not start")


def wait_until_gone(pids: set[int], marker: str, timeout: float = 60) -> set[int]:
    """Poll until none of ``pids`` nor any process mentioning ``marker`` is alive; the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = {p for p in pids if alive(p)} | processes_mentioning(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_all(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def start(tmp_path, *argv: str) -> subprocess.Popen:
    (tmp_path / "block.py").write_text(textwrap.dedent(BLOCKING_SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    return subprocess.Popen(
        [sys.executable, "-m", "zerotrain.launcher.cli", *argv],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def check_sigkill_leaves_nothing(tmp_path, launcher: subprocess.Popen, records: list[dict], victim: int) -> None:
    pids = {r["pid"] for r in records} | {r["child"] for r in records} | {r["ppid"] for r in records}
    assert all(alive(p) for p in pids)
    os.kill(victim, signal.SIGKILL)
    left = wait_until_gone(pids - {launcher.pid}, str(tmp_path))
    kill_all(left)
    assert not left, f"still running 60 s after SIGKILL of pid {victim}: {sorted(left)}"


def test_sigkill_of_the_launcher_stops_every_rank_and_its_children(tmp_path):
    launcher = start(tmp_path, "launch", "--nproc", "2", "block.py")
    records = wait_for_records(tmp_path, 2, launcher)
    # The launcher is torch's agent: every rank is its child.
    assert {r["ppid"] for r in records} == {launcher.pid}
    check_sigkill_leaves_nothing(tmp_path, launcher, records, launcher.pid)
    launcher.wait(timeout=60)
    assert launcher.returncode == -signal.SIGKILL


def _fake_tool(tmp_path, name: str, source: str) -> None:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(source))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


# ssh HOST COMMAND, for a "node" that is this machine: run COMMAND here (standard input stays the
# launcher's pipe, as with ssh).
FAKE_SSH = """
import os, sys
os.execvp("sh", ["sh", "-c", sys.argv[-1]])
"""

# pdsh -S -w HOST,HOST COMMAND: run COMMAND once per host here, %h being the host, its standard
# input a pipe this process holds open (as pdsh does for its ssh clients); report a failed node
# as pdsh does.
FAKE_PDSH = """
import re, subprocess, sys
args = sys.argv[1:]
hosts, remote = args[args.index("-w") + 1].split(","), args[-1]
procs = {h: subprocess.Popen(["sh", "-c", re.sub("%(%|h)", lambda m: "%" if m[1] == "%" else h, remote)],
                             stdin=subprocess.PIPE) for h in hosts}
worst = 0
for host, proc in procs.items():
    if proc.wait():
        print(f"pdsh@fake: {host}: ssh exited with exit code {proc.returncode}", file=sys.stderr, flush=True)
        worst = max(worst, proc.returncode % 256)
sys.exit(worst)
"""


def start_two_nodes(tmp_path, launcher_name: str) -> subprocess.Popen:
    _fake_tool(tmp_path, "ssh", FAKE_SSH)
    _fake_tool(tmp_path, "pdsh", FAKE_PDSH)
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return start(
        tmp_path, "launch", "--hostfile", "hosts", "--launcher", launcher_name, "--master_port", str(port), "block.py"
    )


def test_sigkill_of_the_multinode_launcher_stops_every_node(tmp_path):
    # pdsh keeps no standard input open to the nodes: before the guard, pdsh, both agents and
    # their ranks ran on after the launcher was killed.
    launcher = start_two_nodes(tmp_path, "pdsh")
    records = wait_for_records(tmp_path, 2, launcher)
    assert sorted(r["node"] for r in records) == [0, 1]
    check_sigkill_leaves_nothing(tmp_path, launcher, records, launcher.pid)


def test_sigkill_of_a_node_agent_stops_its_ranks_and_the_job(tmp_path):
    # The intermediate layer: node 1's agent (the ranks' parent) is killed; its rank and the
    # rank's child must end, and the launcher must stop node 0 and report node 1.
    launcher = start_two_nodes(tmp_path, "ssh")
    records = wait_for_records(tmp_path, 2, launcher)
    node1 = next(r for r in records if r["node"] == 1)
    check_sigkill_leaves_nothing(tmp_path, launcher, records, node1["ppid"])
    launcher.wait(timeout=60)
    assert launcher.returncode != 0
    assert "node 1 (127.0.0.2) failed" in launcher.stderr.read()


def test_guard_refuses_to_start_after_the_launcher_has_died():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    result = subprocess.run(
        orphan_guard.guarded_command(["echo", "ran"], dead.pid, 1), capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.strip() == f"zerotrain: the launcher (pid {dead.pid}) has exited; not starting"


def test_guarded_command_runs_the_command_with_its_exit_status(tmp_path):
    result = subprocess.run(
        orphan_guard.guarded_command(["sh", "-c", "echo $$; exit 3"], os.getpid(), 1),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3
    assert result.stdout.strip().isdigit()
