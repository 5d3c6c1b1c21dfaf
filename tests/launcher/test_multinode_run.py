"""Multi-node launch for real on one machine: two "nodes", 127.0.0.1 and 127.0.0.2 (both this
host's loopback), reached through an sshd the test starts on those addresses with a throwaway key.

- ssh launcher: a ZeRO-2 GPT trains on 2 nodes x 1 process and matches the single-node 2-process
  losses; arguments, env files and exported variables arrive unchanged on each node.
- pdsh launcher: SIGKILL of the rank on node 1 fails the whole job, names node 1 and its rank,
  and leaves no process behind on either node.
- ssh launcher: Ctrl-C (SIGINT) to the launcher stops both nodes (exit 130, nothing left).
- openmpi launcher (when mpirun is installed): the same training through mpirun, whose second
  node's daemon is started over the same sshd.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.launcher.reference import run_script_on_ranks

SSHD = "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(
    not (os.path.exists(SSHD) and shutil.which("ssh")),
    reason="needs openssh-server and openssh-client (apt-get install openssh-server)",
)
NODES = ("127.0.0.1", "127.0.0.2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """An sshd on 127.0.0.1/127.0.0.2 accepting one throwaway key; yields the ssh options."""
    root = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / key)], check=True)
    shutil.copy(root / "user_key.pub", root / "authorized_keys")
    port = _free_port()
    (root / "sshd_config").write_text(
        textwrap.dedent(f"""\
        ListenAddress {NODES[0]}
        ListenAddress {NODES[1]}
        Port {port}
        HostKey {root}/host_key
        AuthorizedKeysFile {root}/authorized_keys
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PermitRootLogin prohibit-password
        StrictModes no
        UsePAM no
        PidFile none
        """)
    )
    try:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    except PermissionError:
        pytest.skip("needs root to start a test sshd (it wants /run/sshd)")
    server = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(root / "sshd_config")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    options = f"-i {root}/user_key -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    try:
        for _ in range(50):
            probe = subprocess.run(
                ["ssh", *options.split(), "-p", str(port), "-o", "BatchMode=yes", NODES[1], "true"],
                capture_output=True,
                timeout=20,
            )
            if probe.returncode == 0 or server.poll() is not None:
                break
            time.sleep(0.1)
        if probe.returncode != 0:
            server.kill()
            pytest.skip(f"could not start a loopback sshd: {server.stderr.read().decode()[-500:]}")
        yield {"port": port, "options": options}
    finally:
        server.terminate()
        server.wait(timeout=10)


TRAIN = """
import argparse, json, os, sys
import torch
import zerotrain
from zerotrain.models import GPT, GPTConfig

parser = zerotrain.add_config_arguments(argparse.ArgumentParser())
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
parser.add_argument("rest", nargs="*")
args = parser.parse_args()
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
engine, _, _, _ = zerotrain.initialize(args=args, model=model, model_parameters=model.parameters())
data = torch.Generator().manual_seed(100 + rank)
ids = torch.randint(0, 64, (2, 16), generator=data)
losses = []
for _ in range(3):
    loss = engine(ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
record = {"losses": losses, "rest": args.rest, "local_rank": args.local_rank,
          "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE",
                  "MASTER_ADDR", "ZT_FROM_FILE", "NCCL_ZT_TEST", "OMP_NUM_THREADS")}}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
"""

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}
ARGS = ["two words", "$HOME", "a;touch INJECTED", "`touch INJECTED`", "it's", "100%", "%h", "line\nbreak"]


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    (tmp_path / "hosts").write_text(f"# two nodes on this machine\n{NODES[0]} slots=1\n{NODES[1]} slots=1\n")
    # Reaches the remote nodes only through the env file (OMP_NUM_THREADS is not exported otherwise).
    # (GLOO_SOCKET_IFNAME keeps the ranks' gloo traffic on loopback.)
    (tmp_path / ".zerotrain_env").write_text(
        "ZT_FROM_FILE=value with 'quotes' and $dollar\nOMP_NUM_THREADS=1\nGLOO_SOCKET_IFNAME=lo\n"
    )
    return tmp_path


def launch(*argv: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "zerotrain.launcher.cli", *argv],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(out) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def single_node_losses(job) -> list[list[float]]:
    """The same script on 2 ranks of one process group on this machine (run_on_ranks: the
    reference needs no launcher)."""
    (job / "single").mkdir()
    run_script_on_ranks(
        "train.py", "--deepspeed_config", "ds.json", "--out", "single", cwd=job, env={"GLOO_SOCKET_IFNAME": "lo"}
    )
    return [r["losses"] for r in records(job / "single")]


def launch_two_nodes(job, *launcher_args, env):
    """The hostfile job through ``launcher_args``, its records in ``job/multi``."""
    return launch(
        "--hostfile",
        "hosts",
        *launcher_args,
        "--master_port",
        str(_free_port()),
        "train.py",
        "--deepspeed_config",
        "ds.json",
        "--out",
        "multi",
        *ARGS,
        env=env,
    )


def test_ssh_two_nodes_train_like_one_node(sshd, job):
    (job / "multi").mkdir()
    result = launch_two_nodes(
        job,
        "--launcher",
        "ssh",
        f"--launcher_args={sshd['options']}",
        "--ssh_port",
        str(sshd["port"]),
        env={"NCCL_ZT_TEST": "exported"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    multi = records(job / "multi")
    for rank, record in enumerate(multi):
        assert record["rest"] == ARGS
        assert record["local_rank"] == 0
        assert record["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "CROSS_RANK": str(rank),
            "CROSS_SIZE": "2",
            "MASTER_ADDR": NODES[0],
            "ZT_FROM_FILE": "value with 'quotes' and $dollar",
            "NCCL_ZT_TEST": "exported",
            "OMP_NUM_THREADS": "1",
        }
    assert not (job / "INJECTED").exists()
    expected = single_node_losses(job)
    for got, want in zip([r["losses"] for r in multi], expected):
        assert got == pytest.approx(want, rel=1e-6)
        assert want[-1] < want[0]  # it trains


KILLABLE = """
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
with open(os.path.join(os.environ["ZEROTRAIN_TEST_OUT"], f"pid{dist.get_rank()}"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.2)
"""


def _processes_running(marker: str) -> list[psutil.Process]:
    """Live processes whose command line mentions ``marker`` (a zombie has exited: only its parent's
    bookkeeping is left, so it is not counted)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(marker in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _still_running(processes: list[psutil.Process], grace: float = 10.0) -> list[str]:
    """The command lines of ``processes`` still alive after ``grace`` seconds. A process found while it was
    exiting (its parent reaps it a moment later) is not one that outlived the launch; one that keeps
    running is."""
    deadline = time.monotonic() + grace
    alive = processes
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    left = []
    for proc in alive:
        try:
            left.append(" ".join(proc.cmdline()))
            proc.kill()
        except psutil.Error:
            pass
    return left


def _start_killable(sshd, job, launcher: str) -> subprocess.Popen:
    (job / "killable.py").write_text(KILLABLE)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "ZEROTRAIN_TEST_OUT": str(job),
        "PDSH_SSH_ARGS_APPEND": sshd["options"],
    }
    command = [
        sys.executable,
        "-m",
        "zerotrain.launcher.cli",
        "--hostfile",
        "hosts",
        "--launcher",
        launcher,
        "--ssh_port",
        str(sshd["port"]),
        "--master_port",
        str(_free_port()),
        "--no_local_rank",
        "killable.py",
    ]
    if launcher == "ssh":
        command.insert(-2, f"--launcher_args={sshd['options']}")
    launcher_process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (job / "pid1").exists() or not (job / "pid0").exists():
        if launcher_process.poll() is not None or time.monotonic() > deadline:
            launcher_process.kill()
            pytest.fail(f"ranks did not start: {launcher_process.communicate()}")
        time.sleep(0.2)
    time.sleep(0.2)
    return launcher_process


def _assert_nothing_left(job) -> None:
    leftovers = _still_running(_processes_running(str(job)) + _processes_running("killable.py"))
    assert not leftovers, f"a rank or agent outlived the launch: {leftovers}"


@pytest.mark.skipif(not shutil.which("pdsh"), reason="needs pdsh (apt-get install pdsh)")
def test_pdsh_killing_one_nodes_rank_stops_every_node(sshd, job):
    launcher = _start_killable(sshd, job, "pdsh")
    try:
        victim = int((job / "pid1").read_text())
        os.kill(victim, signal.SIGKILL)
        out, err = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 137, out + err
    final = err.strip().splitlines()[-1]
    assert final.startswith(
        f"zerotrain: node 1 ({NODES[1]}) failed with exit code 137: rank 1 (pid {victim}) "
        f"on node 1 ({NODES[1]}) failed with signal 9 (SIGKILL)"
    ), err
    assert "stopped the other 1 node(s)" in final
    _assert_nothing_left(job)


def test_ssh_ctrl_c_stops_every_node(sshd, job):
    # The ssh launcher stops the nodes by closing their sessions (each agent stops at end of input).
    launcher = _start_killable(sshd, job, "ssh")
    try:
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, out + err
    assert "zerotrain: received SIGINT; stopped every node" in err
    _assert_nothing_left(job)


@pytest.mark.skipif(not shutil.which("mpirun"), reason="needs Open MPI (apt-get install openmpi-bin)")
def test_openmpi_two_nodes_train(sshd, job):
    (job / "multi").mkdir()
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    result = launch_two_nodes(
        job,
        "--launcher",
        "openmpi",
        f"--launcher_args=--mca plm_rsh_agent 'ssh {sshd['options']}'",
        "--ssh_port",
        str(sshd["port"]),
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    multi = records(job / "multi")
    assert [r["env"]["CROSS_RANK"] for r in multi] == ["0", "1"] and all(r["rest"] == ARGS for r in multi)
    assert multi[0]["losses"][-1] < multi[0]["losses"][0]


@pytest.mark.parametrize("launcher_name", ["pdsh", "ssh"])
def test_sigkill_of_the_launcher_leaves_nothing_on_any_node(sshd, job, launcher_name):
    # SIGKILL runs no clean-up in the launcher: its clients must end (orphan guard) and each node's
    # agent must see its session end and stop its ranks.
    if launcher_name == "pdsh" and not shutil.which("pdsh"):
        pytest.skip("needs pdsh (apt-get install pdsh)")
    launcher = _start_killable(sshd, job, launcher_name)
    launcher.kill()
    launcher.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while (_processes_running(str(job)) + _processes_running("killable.py")) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _processes_running(str(job)) + _processes_running("killable.py")
    for proc in left:
        proc.kill()
    assert not left, f"outlived the launcher: {[p.info['cmdline'] for p in left]}"
