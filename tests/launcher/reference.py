"""A launch test's script run on run_on_ranks' ranks: the uninterrupted or single-node reference a
launched run is compared with, without starting a launcher and fresh interpreters for it."""

from __future__ import annotations

import os
import sys

from zerotrain.testing import run_on_ranks


def _run_script(path: str, argv: tuple[str, ...], cwd: str) -> None:
    import runpy

    os.chdir(cwd)  # ranks fork from run_on_ranks' server, which has its own working directory
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


def run_script_on_ranks(
    path, *argv, cwd, world_size: int = 2, env: dict[str, str] | None = None, timeout: float = 240
) -> None:
    """Run the script at ``path`` as ``__main__`` with ``argv`` in ``cwd`` on ``world_size`` gloo
    ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set as a launcher sets them)."""
    run_on_ranks(
        _run_script,
        world_size,
        args=(os.path.abspath(os.path.join(cwd, path)), tuple(map(str, argv)), str(cwd)),
        env=env,
        timeout=timeout,
    )
