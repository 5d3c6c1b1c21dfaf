"""Run the per-node commands of a multi-node launch and stop all nodes when one fails.

The local processes are ssh (one per node), pdsh, srun or mpirun clients; their output is passed
through line by line and the last stderr lines of each are kept for the failure message. When a
node fails (its ssh client exits non-zero; pdsh reports "HOST: ssh exited with exit code N"; srun
and mpirun stop their own job), or on Ctrl-C / SIGTERM, every node is stopped: ssh sessions are
closed (each node's agent stops at end of input), pdsh runs the stop command on every node, and
srun/mpirun get the signal, which they forward to their tasks.

Each client runs under orphan_guard.py: when the launcher itself is killed (SIGKILL included), the
clients get SIGTERM (ssh sessions close, srun/mpirun forward it) and, ``_STOP_GRACE`` seconds later,
their process groups SIGKILL.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from zerotrain.launcher.multinode import MultiNodePlan, launcher_env, node_commands, pdsh_stop_command
from zerotrain.launcher.orphan_guard import guarded_command

_TAIL = 20
# Seconds the nodes get to stop (their agents' SIGTERM->SIGKILL grace is 5 s) before the local
# clients are killed.
_STOP_GRACE = 20
_PDSH_NODE_EXIT = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)")
_RANK_REPORT = re.compile(r"zerotrain: (rank \d+ \(pid \d+\).* failed with [^;\n]+)")


@dataclasses.dataclass
class _Client:
    name: str
    process: subprocess.Popen
    stderr_tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=_TAIL))
    readers: list = dataclasses.field(default_factory=list)


def _pump(stream: IO[bytes], sink: IO[str], tail: collections.deque | None, on_line: Callable[[str], None]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        sink.write(line)
        sink.flush()
        if tail is not None:
            tail.append(line.rstrip("\n"))
        on_line(line)
    stream.close()


class NodeRunner:
    """Start, watch and stop the clients of one multi-node launch."""

    def __init__(self, plan: MultiNodePlan, environ: dict[str, str] | None = None):
        self.plan = plan
        self.env = launcher_env(plan, dict(os.environ if environ is None else environ))
        self.clients: list[_Client] = []
        self.failed: tuple[str, int] | None = None  # (node name, exit code) of the first failure
        self.rank_reports: list[str] = []
        self._event = threading.Event()
        self._lock = threading.Lock()

    def _names(self) -> list[str]:
        if self.plan.launcher == "ssh":
            return [f"node {rank} ({host})" for rank, host in enumerate(self.plan.hosts)]
        return [self.plan.launcher]

    def _on_line(self, line: str) -> None:
        report = _RANK_REPORT.search(line)
        if report:
            self.rank_reports.append(report.group(1))
        pdsh = _PDSH_NODE_EXIT.match(line)
        if pdsh and int(pdsh.group(2)) != 0:
            with self._lock:
                if self.failed is None:
                    rank = self.plan.hosts.index(pdsh.group(1)) if pdsh.group(1) in self.plan.hosts else "?"
                    self.failed = (f"node {rank} ({pdsh.group(1)})", int(pdsh.group(2)))
            self._event.set()

    def start(self) -> None:
        use_stdin = self.plan.launcher == "ssh"
        for name, command in zip(self._names(), node_commands(self.plan)):
            command = guarded_command(command, os.getpid(), _STOP_GRACE)
            process = subprocess.Popen(
                command,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.PIPE if use_stdin else subprocess.DEVNULL,
                start_new_session=True,
            )
            client = _Client(name, process)
            for stream, sink, tail in (
                (process.stdout, sys.stdout, None),
                (process.stderr, sys.stderr, client.stderr_tail),
            ):
                reader = threading.Thread(target=_pump, args=(stream, sink, tail, self._on_line), daemon=True)
                reader.start()
                client.readers.append(reader)
            self.clients.append(client)

    def _first_exit(self) -> None:
        for client in self.clients:
            code = client.process.poll()
            if code is not None and code != 0 and self.failed is None:
                self.failed = (client.name, code)

    def stop(self) -> None:
        """Ask every node to stop, wait up to the grace period, then kill the local clients."""
        if self.plan.launcher == "ssh":
            for client in self.clients:
                if client.process.poll() is None and client.process.stdin:
                    try:
                        client.process.stdin.close()
                    except OSError:
                        pass
        elif self.plan.launcher == "pdsh":
            subprocess.run(
                pdsh_stop_command(self.plan),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=_STOP_GRACE,
                check=False,
            )
        else:
            for client in self.clients:
                if client.process.poll() is None:
                    client.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE
        for client in self.clients:
            try:
                client.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(client.process.pid, signal.SIGKILL)
                client.process.wait()

    def run(self) -> int:
        """Run to completion; the exit code is 0, the failed node's code, or 130/143 on a signal."""
        received: list[int] = []

        def on_signal(signum, _frame):
            received.append(signum)
            self._event.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            while not received and self.failed is None:
                if all(c.process.poll() is not None for c in self.clients):
                    break
                self._first_exit()
                self._event.wait(0.1)
            if received or self.failed is not None:
                self.stop()
            for client in self.clients:
                client.process.wait()
                for reader in client.readers:
                    reader.join(timeout=5)
            self._first_exit()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if received:
            print(f"zerotrain: received {signal.Signals(received[0]).name}; stopped every node", file=sys.stderr)
            return 128 + received[0]
        if self.failed is None:
            return 0
        return self._report_failure()

    def _report_failure(self) -> int:
        name, code = self.failed
        others = len(self.plan.hosts) - 1
        # The failed node's agent named the rank in its report ("... on node R (HOST) failed ...").
        report = next((r for r in self.rank_reports if f"on {name} " in r), None)
        report = report or (self.rank_reports[0] if self.rank_reports else None)
        rank = f": {report}" if report else ""
        lines = [f"zerotrain: {name} failed with exit code {code}{rank}; stopped the other {others} node(s)"]
        client = next((c for c in self.clients if c.name == name), self.clients[0])
        if not report and client.stderr_tail:
            lines.append(f"zerotrain: last {len(client.stderr_tail)} line(s) of {name}'s stderr:")
            lines += [f"    {line}" for line in client.stderr_tail]
        if self.plan.launcher == "ssh" and code == 255:
            lines.append(
                f"zerotrain: ssh exit 255 means the connection to {name} failed: check "
                "passwordless ssh to it (ssh -o BatchMode=yes HOST true) and --ssh_port/--launcher_args"
            )
        print("\n".join(lines), file=sys.stderr, flush=True)
        return code
