"""Per-rank entry point: ``python -u .../local_rank_entry.py [opts] -- target args``.

The elastic agent gives every worker the same argv, so this shim adds the
per-rank parts DeepSpeed users expect: ``--local_rank=N`` at the end of the
script's arguments, the CROSS_RANK / CROSS_SIZE / LOCAL_SIZE variables and,
with ``--bind_cores=LIST``, this rank's CPU affinity (its equal slice of LIST).
With ``--launcher_pid=P`` (always given by the launcher) it first makes sure the
rank and its process group end when the launcher does, even by SIGKILL
(orphan_guard.py, ``--grace=S`` seconds between SIGTERM and SIGKILL).
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


def _option(opts: list[str], name: str, default: str | None = None) -> str | None:
    return next((o.split("=", 1)[1] for o in opts if o.startswith(f"--{name}=")), default)


def _parse(argv: list[str]) -> tuple[dict, str, list[str]]:
    if "--" not in argv:
        raise SystemExit(
            "local_rank_entry: expected '[--mode=M] [--no_local_rank] [--bind_cores=L] "
            "[--launcher_pid=P] [--grace=S] -- target [args...]'"
        )
    split = argv.index("--")
    opts, rest = argv[:split], argv[split + 1 :]
    mode = _option(opts, "mode", "script")
    if mode not in _MODES or not rest:
        raise SystemExit(f"local_rank_entry: bad mode {mode!r} or missing target")
    pid = _option(opts, "launcher_pid")
    parsed = dict(
        mode=mode,
        add_local_rank="--no_local_rank" not in opts,
        bind=_option(opts, "bind_cores"),
        launcher_pid=int(pid) if pid else None,
        grace=float(_option(opts, "grace", "5")),
    )
    return parsed, rest[0], rest[1:]


def guard_against_orphaning(launcher_pid: int, grace: float) -> None:
    """End this rank (and its process group) when the launcher ends (see orphan_guard.py, loaded
    by path under a private name so that nothing of zerotrain or torch is imported)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "orphan_guard.py")
    spec = importlib.util.spec_from_file_location("_zerotrain_orphan_guard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.guard(launcher_pid, grace)


def _expand(core_list: str) -> list[int]:
    cores: list[int] = []
    for item in core_list.split(","):
        first, _, last = item.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def bind_to_cores(core_list: str, environ: dict[str, str] = os.environ) -> set[int]:
    """Pin this process to its slice of ``core_list``: equal consecutive slices, one per local
    rank, as DeepSpeed's ``--bind_cores_to_rank`` gives them (the launcher checked the list)."""
    cores = _expand(core_list)
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    per_rank = len(cores) // int(environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = set(cores[per_rank * local_rank : per_rank * (local_rank + 1)])
    os.sched_setaffinity(0, mine)
    return mine


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
    opts, target, args = _parse(sys.argv[1:] if argv is None else argv)
    mode = opts["mode"]
    if opts["launcher_pid"] is not None:
        guard_against_orphaning(opts["launcher_pid"], opts["grace"])
    set_deepspeed_env()
    if opts["bind"]:
        bind_to_cores(opts["bind"])
    if opts["add_local_rank"]:
        args = [*args, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
    if mode == "exec":
        os.execvp(target, [target, *args])
    try:
        _run_in_process(mode, target, args)
    except SystemExit:
        raise
    except BaseException as exc:
        _die_like_python(exc)


def _without_rank_prefix(hook):
    # torch.distributed.init_process_group wraps sys.excepthook to start every line with
    # "[rankN]: ", and the launcher prefixes each line of a rank's output already, which doubled
    # it. Call the hook torch wrapped (found in the wrapper's closure) instead.
    while getattr(hook, "__module__", None) == "torch.distributed.distributed_c10d":
        inner = [c.cell_contents for c in (hook.__closure__ or ()) if callable(c.cell_contents)]
        if len(inner) != 1:
            return sys.__excepthook__
        hook = inner[0]
    return hook


def _die_like_python(exc: BaseException) -> None:
    # The default hook prints exc.__traceback__, not its third argument.
    exc = exc.with_traceback(_user_frames(exc.__traceback__))
    _without_rank_prefix(sys.excepthook)(type(exc), exc, exc.__traceback__)
    if isinstance(exc, KeyboardInterrupt):
        # Python exits by SIGINT after an uncaught KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(1)


if __name__ == "__main__":
    main()
