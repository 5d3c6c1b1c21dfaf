"""Per-rank entry point: ``python -u .../local_rank_entry.py [opts] -- target args``.

The elastic agent gives every worker the same argv, so this shim adds the
per-rank parts DeepSpeed users expect: ``--local_rank=N`` at the end of the
script's arguments and the CROSS_RANK / CROSS_SIZE / LOCAL_SIZE variables.
It then runs the target in this interpreter as ``__main__`` (``--mode=script``
or ``--mode=module``) or replaces itself with it (``--mode=exec``).

It is run by file path and imports only the standard library, so nothing
(not even the zerotrain package or torch) is imported before the user's code.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from types import TracebackType

_MODES = ("script", "module", "exec")


def _parse(argv: list[str]) -> tuple[str, bool, str, list[str]]:
    if "--" not in argv:
        raise SystemExit("local_rank_entry: expected '[--mode=M] [--no_local_rank] -- target [args...]'")
    split = argv.index("--")
    opts, rest = argv[:split], argv[split + 1 :]
    mode = next((o.split("=", 1)[1] for o in opts if o.startswith("--mode=")), "script")
    if mode not in _MODES or not rest:
        raise SystemExit(f"local_rank_entry: bad mode {mode!r} or missing target")
    return mode, "--no_local_rank" not in opts, rest[0], rest[1:]


def set_deepspeed_env(environ: dict[str, str] = os.environ) -> None:
    """Add DeepSpeed's node-level variables derived from torchelastic's."""
    environ["CROSS_RANK"] = environ.get("GROUP_RANK", "0")
    environ["CROSS_SIZE"] = environ.get("GROUP_WORLD_SIZE", "1")
    environ["LOCAL_SIZE"] = environ.get("LOCAL_WORLD_SIZE", "1")


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    # Drop this shim's and runpy's frames so the traceback starts in user code,
    # as it would under `python script.py`.
    own = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in own:
        tb = tb.tb_next
    return tb


def _run_in_process(mode: str, target: str, args: list[str]) -> None:
    # sys.path[0] is this file's directory; replace it with what `python -m mod`
    # (the cwd) or `python script.py` (the script's directory) would put there.
    sys.argv = [target, *args]
    if mode == "module":
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        path = os.path.abspath(target)  # __file__ of a main script is absolute, argv[0] is not
        sys.path[0] = os.path.dirname(path)
        runpy.run_path(path, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    """Run one rank's target with ``--local_rank=<LOCAL_RANK>`` appended."""
    mode, add_local_rank, target, args = _parse(sys.argv[1:] if argv is None else argv)
    set_deepspeed_env()
    if add_local_rank:
        args = [*args, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
    if mode == "exec":
        os.execvp(target, [target, *args])
    try:
        _run_in_process(mode, target, args)
    except SystemExit:
        raise
    except BaseException as exc:
        _die_like_python(exc)


def _die_like_python(exc: BaseException) -> None:
    # The default hook prints exc.__traceback__, not its third argument.
    exc = exc.with_traceback(_user_frames(exc.__traceback__))
    sys.excepthook(type(exc), exc, exc.__traceback__)
    if isinstance(exc, KeyboardInterrupt):
        # Python exits by SIGINT after an uncaught KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(1)


if __name__ == "__main__":
    main()
