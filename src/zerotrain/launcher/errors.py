"""Launcher errors and the report printed when a rank fails."""

from __future__ import annotations

import os
import signal

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

TAIL_LINES = 20
_TAIL_BYTES = 64 * 1024


class LaunchError(Exception):
    """A launch option is unusable; reported like a CLI error naming ``flag``."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


def flag_or_env(choice: str | None, flag: str, env_var: str, choices, what: str = "value", environ=os.environ) -> str:
    """A launcher flag's value, else its environment variable's, else ``auto``; anything not in
    ``choices`` is one line naming where it came from."""
    name = choice or environ.get(env_var) or "auto"
    if name not in choices:
        raise LaunchError(flag if choice else env_var, f"unknown {what} {name!r}; choose one of {', '.join(choices)}")
    return name


def describe_exit(failure: ProcessFailure) -> str:
    """'exit code 3' or 'signal 9 (SIGKILL)'."""
    if failure.exitcode < 0:
        return f"signal {-failure.exitcode} ({failure.signal_name()})"
    return f"exit code {failure.exitcode}"


def failure_exit_code(err: ChildFailedError) -> int:
    """Exit code for the launcher: the first failed rank's code, 128+N for signal N, else 1."""
    code = _first_failure(err)[1].exitcode
    if code > 0:
        return code
    return 128 - code if code < 0 else 1


def tail(path: str, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a text file ([] if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - _TAIL_BYTES))
            data = f.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]


_AGENT_SIGNALS = (-signal.SIGTERM, -signal.SIGKILL)


def _stopped_by_agent(failure: ProcessFailure) -> bool:
    # The agent records the ranks it terminates after the first failure as
    # failures too (SIGTERM, or SIGKILL after the shutdown timeout).
    return failure.exitcode in _AGENT_SIGNALS


def _first_failure(err: ChildFailedError) -> tuple[int, ProcessFailure]:
    # Timestamps have 1 s resolution, so break ties by preferring a rank the
    # agent did not stop itself; min() keeps the agent's detection order after that.
    rank = min(err.failures, key=lambda r: (err.failures[r].timestamp, _stopped_by_agent(err.failures[r])))
    return rank, err.failures[rank]


def format_failure_report(
    err: ChildFailedError,
    stderrs: dict[int, str],
    nproc: int,
    logs_kept: bool = False,
    node_name: str | None = None,
) -> str:
    """Text naming the failed global rank (and ``node_name``, on a multi-node launch), how it
    died and its stderr tail.

    ``stderrs`` maps local rank to that rank's stderr log file, whose path is
    shown when ``logs_kept`` (the file outlives the launcher).
    """
    rank, failure = _first_failure(err)
    also_failed = {r: f for r, f in err.failures.items() if r != rank and not _stopped_by_agent(f)}
    stopped = nproc - 1 - len(also_failed)
    where = f" on {node_name}" if node_name else ""
    lines = [f"zerotrain: rank {rank} (pid {failure.pid}){where} failed with {describe_exit(failure)}"]
    if stopped > 0:
        lines[0] += f"; stopped the other {stopped} rank(s)" + (" of this node" if node_name else "")
    for other, f in sorted(also_failed.items()):
        lines.append(f"zerotrain: rank {other} (pid {f.pid}) also failed with {describe_exit(f)}")
    stderr_path = stderrs.get(failure.local_rank, "")
    stderr_tail = tail(stderr_path)
    if stderr_tail:
        lines.append(f"zerotrain: last {len(stderr_tail)} line(s) of rank {rank}'s stderr:")
        lines += [f"    {line}" for line in stderr_tail]
    else:
        lines.append(f"zerotrain: rank {rank} wrote nothing to stderr")
    if logs_kept and stderr_path:
        lines.append(f"zerotrain: rank {rank}'s full stderr: {stderr_path}")
    from zerotrain.launcher.deepspeed_shim import failure_hint  # here: it imports LaunchError from this module

    hint = failure_hint(stderr_tail)
    if hint:
        lines.append(hint)
    return "\n".join(lines)
