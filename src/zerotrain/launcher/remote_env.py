"""The environment a multi-node launch exports to every node, as DeepSpeed does.

- variables of the launching shell whose names start with ``NCCL``, ``PYTHON``, ``MLFLOW``,
  ``UCX``, ``MV2`` or ``ZEROTRAIN`` (plus the accelerator's own prefixes);
- ``KEY=VALUE`` lines of ``~/.deepspeed_env``, ``./.deepspeed_env`` (``DS_ENV_FILE`` replaces
  that name, or gives a path), ``~/.zerotrain_env`` and ``./.zerotrain_env``, later files
  overriding earlier ones; ``#`` comments and blank lines are allowed, values are literal;
- ``PYTHONPATH`` with the launch directory first, so the script's own modules import.
"""

from __future__ import annotations

import os
import re

from zerotrain.launcher.errors import LaunchError

EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "UCX", "MV2", "ZEROTRAIN")
ENV_FILE_NAMES = (".deepspeed_env", ".zerotrain_env")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _accelerator_prefixes() -> list[str]:
    from zerotrain.accelerator import get_accelerator

    return list(get_accelerator().export_envs())


def env_file_paths(environ: dict[str, str], cwd: str) -> list[str]:
    """Candidate env files, lowest precedence first."""
    home = os.path.expanduser("~")
    names = [environ.get("DS_ENV_FILE", ".deepspeed_env"), ".zerotrain_env"]
    paths = []
    for name in names:
        for base in (home, cwd):
            path = os.path.join(base, name)  # an absolute DS_ENV_FILE stays itself
            if path not in paths:
                paths.append(path)
    return paths


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (``export KEY=VALUE`` too); an unreadable line is an error quoting it."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not _NAME.match(key):
            raise LaunchError("env file", f"{source}:{number}: {raw!r} is not KEY=VALUE (e.g. NCCL_SOCKET_IFNAME=eth0)")
        values[key] = value.strip()
    return values


def exported_env(
    environ: dict[str, str] | None = None, cwd: str | None = None, prefixes: list[str] | None = None
) -> dict[str, str]:
    """Name -> value of everything a node's command exports (ordered, later wins)."""
    environ = dict(os.environ if environ is None else environ)
    cwd = os.getcwd() if cwd is None else cwd
    prefixes = [*EXPORT_PREFIXES, *(_accelerator_prefixes() if prefixes is None else prefixes)]
    exports = {k: v for k, v in sorted(environ.items()) if k.startswith(tuple(prefixes))}
    for path in env_file_paths(environ, cwd):
        if os.path.isfile(path):
            with open(path) as f:
                exports.update(parse_env_file(f.read(), path))
    path_entries = [cwd, *[p for p in exports.get("PYTHONPATH", "").split(os.pathsep) if p and p != cwd]]
    exports["PYTHONPATH"] = os.pathsep.join(path_entries)
    return exports
