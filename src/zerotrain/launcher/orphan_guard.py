"""Nothing a launch starts may outlive the launcher, even a SIGKILLed one.

torch's elastic agent starts every rank in a session of its own (``setsid``) and stops it with
``killpg`` when the agent exits normally; a SIGKILLed launcher runs no code, so its ranks were
reparented to init and a rank in a collective waited out the 30-minute timeout. The same held
for the ssh/pdsh/srun/mpirun clients of a multi-node launch (torch's agent has no guard for it;
Slurm's cgroups and torch's agent on a normal exit do the equivalent).

`guard(launcher_pid)` runs first in every process the launcher starts (each rank, in the entry
shim; each multi-node client, through ``python orphan_guard.py --launcher_pid P -- COMMAND``,
which then execs COMMAND):

1. ``PR_SET_PDEATHSIG`` (Linux): the kernel sends this process ``SIGTERM`` when its parent
   (the launcher's thread that started it: torch's agent starts ranks from its main thread)
   exits. It survives ``exec``. A launcher that died before the call is caught by checking
   ``getppid()`` after it.
2. A watchdog (a detached grandchild, in a session of its own, holding no inherited file
   descriptors) waits for either the launcher or this process to end (pidfds; polling where
   there are none). This process ending first: the watchdog exits. The launcher ending first:
   it sends ``SIGTERM`` to this process's process group (which holds the rank's own children
   unless they left it), waits up to ``grace`` seconds for this process to end, then sends
   ``SIGKILL`` to the group. Only a process that leads its own group has the group signalled;
   otherwise only the process is.

Standard library only: the entry shim loads this file by path before the user's code runs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
_POLL_SECONDS = 0.5


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` when this process's parent thread exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _wait_for_first_end(fds: dict[int, int | None], timeout: float | None = None) -> int | None:
    """The first of ``fds``' pids (pid -> its pidfd, or None to poll) to end; None after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    poller = select.poll()
    for fd in fds.values():
        if fd is not None:
            poller.register(fd, select.POLLIN)
    by_fd = {fd: pid for pid, fd in fds.items() if fd is not None}
    polling = len(by_fd) < len(fds)
    while True:
        for pid, fd in fds.items():
            if fd is None and not _alive(pid):
                return pid
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if polling:
            wait = _POLL_SECONDS if wait is None else min(wait, _POLL_SECONDS)
        ready = poller.poll(None if wait is None else int(wait * 1000))
        if ready:
            return by_fd[ready[0][0]]
        if deadline is not None and time.monotonic() >= deadline:
            return None


def _signal_group(pid: int, pgid: int, sig: int) -> None:
    try:
        if pgid == pid:
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except OSError:
        pass


def _watch(
    launcher_pid: int, launcher_fd: int | None, guarded: int, guarded_fd: int | None, pgid: int, grace: float
) -> None:
    _wait_for_first_end({launcher_pid: launcher_fd, guarded: guarded_fd})
    # The parent-death signal may end the guarded process before the launcher's end is seen
    # here: what matters is whether the launcher ends too (the group may still hold the guarded
    # process's children, and nothing may outlive the launcher).
    if _wait_for_first_end({launcher_pid: launcher_fd}, timeout=_POLL_SECONDS * 2) is None:
        return
    _signal_group(guarded, pgid, signal.SIGTERM)
    _wait_for_first_end({guarded: guarded_fd}, timeout=grace)
    _signal_group(guarded, pgid, signal.SIGKILL)


def _detach_fds(keep: set[int]) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        names = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        names = list(range(3, 1024))
    for fd in names:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _start_watchdog(launcher_pid: int, grace: float) -> None:
    guarded = os.getpid()
    pgid = os.getpgid(0)
    launcher_fd, guarded_fd = _pidfd(launcher_pid), _pidfd(guarded)
    child = os.fork()
    if child == 0:  # intermediate: fork the watchdog and leave, so init adopts it
        try:
            if os.fork() == 0:
                os.setsid()
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                _detach_fds({fd for fd in (launcher_fd, guarded_fd) if fd is not None})
                try:
                    _watch(launcher_pid, launcher_fd, guarded, guarded_fd, pgid, grace)
                finally:
                    os._exit(0)
        finally:
            os._exit(0)
    while True:
        try:
            os.waitpid(child, 0)
            break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    for fd in (launcher_fd, guarded_fd):
        if fd is not None:
            os.close(fd)


def guard(launcher_pid: int, grace: float = 5.0) -> None:
    """Make this process (and the process group it leads) end when ``launcher_pid`` ends.

    Exits at once (status 1, with a one-line message) when the launcher has already ended.
    """
    if os.getppid() == launcher_pid:
        set_parent_death_signal(signal.SIGTERM)
        gone = os.getppid() != launcher_pid  # it died before the signal was armed
    else:  # started through a wrapper that did not exec
        gone = not _alive(launcher_pid)
    if gone:
        print(f"zerotrain: the launcher (pid {launcher_pid}) has exited; not starting", file=sys.stderr)
        sys.exit(1)
    try:
        _start_watchdog(launcher_pid, grace)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.ENOMEM):
            raise
        print(
            f"zerotrain: no watchdog for pid {os.getpid()} ({err.strerror}); it stops with the launcher only "
            "by the parent-death signal",
            file=sys.stderr,
        )


def guarded_command(command: list[str], launcher_pid: int, grace: float, python: str = sys.executable) -> list[str]:
    """``command`` run under `guard` of ``launcher_pid`` (then exec'd, same pid)."""
    return [
        python,
        "-u",
        os.path.abspath(__file__),
        f"--launcher_pid={launcher_pid}",
        f"--grace={grace:g}",
        "--",
        *command,
    ]


def main(argv: list[str]) -> None:
    """``orphan_guard.py --launcher_pid=P [--grace=S] -- COMMAND...``: guard, then exec COMMAND."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit("orphan_guard: expected '--launcher_pid=P [--grace=S] -- COMMAND [ARGS...]'")
    split = argv.index("--")
    opts, command = argv[:split], argv[split + 1 :]
    values = dict(o.lstrip("-").split("=", 1) for o in opts if "=" in o)
    guard(int(values["launcher_pid"]), float(values.get("grace", 5)))
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"zerotrain: cannot run {command[0]!r}: {err.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
