"""How a node's agent learns that the multi-node launch is being stopped.

- ``stop_on_stdin_eof`` (ssh launcher): the launching machine holds this node's ssh session;
  when it closes the session (a node failed, Ctrl-C, or the launcher itself died), standard
  input reaches end-of-file and the agent gets SIGTERM, which makes torch's agent stop every
  rank before exiting.
- ``pid_file`` (pdsh launcher, whose sessions keep standard input open while pdsh runs): the
  agent's pid is written there; the launcher's stop command (``kill -TERM $(cat FILE)`` through
  pdsh) reads it. The pdsh agents also stop at end of input: when pdsh itself dies (the
  launcher was killed, see orphan_guard.py), its ssh clients' input ends.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerotrain.launcher.launch import LaunchOptions


def pid_file_path(run_id: str, node_rank: int | str) -> str:
    """Where node ``node_rank``'s agent of run ``run_id`` writes its pid (``*`` for a glob)."""
    return os.path.join(tempfile.gettempdir(), f"zerotrain-{run_id}-node{node_rank}.pid")


def _terminate_at_stdin_eof() -> None:
    try:
        while os.read(sys.stdin.fileno(), 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def node_lifetime(opts: LaunchOptions) -> Iterator[None]:
    """Install the stop mechanisms ``opts`` asks for while the agent runs."""
    if opts.stop_on_stdin_eof:
        threading.Thread(target=_terminate_at_stdin_eof, name="zerotrain-stdin-watch", daemon=True).start()
    if opts.pid_file is None:
        yield
        return
    with open(opts.pid_file, "w") as f:
        f.write(str(os.getpid()))
    try:
        yield
    finally:
        try:
            os.unlink(opts.pid_file)
        except OSError:
            pass
