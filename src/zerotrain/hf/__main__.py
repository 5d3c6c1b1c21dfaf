"""``python -m zerotrain.hf``: run Hugging Face / DeepSpeed commands on zerotrain.

Once per environment, opt-in and reversible (no prefix needed afterwards)::

    python -m zerotrain.hf install      # `deepspeed` command + `import deepspeed` run zerotrain here
    python -m zerotrain.hf uninstall    # removes exactly what install wrote
    python -m zerotrain.hf status

then the usual commands run as they are::

    deepspeed --num_gpus=2 train.py --deepspeed ds_config.json
    accelerate launch --config_file cfg.yaml train.py

Or per command, without installing anything (``PYTHONPATH`` gets the shim folder first, so the
command and every process it starts import zerotrain when they ``import deepspeed``)::

    python -m zerotrain.hf deepspeed --num_gpus=2 train.py --deepspeed ds_config.json
    python -m zerotrain.hf accelerate launch --config_file cfg.yaml train.py
    python -m zerotrain.hf zerotrain launch --nproc 2 train.py --deepspeed ds_config.json
    python -m zerotrain.hf python train.py
    python -m zerotrain.hf --print-path        # the folder to put first in PYTHONPATH yourself

``deepspeed`` here is zerotrain's launcher (``zerotrain``, which takes DeepSpeed's arguments).
``install``, ``uninstall`` and ``status`` are this tool's own; to run a program of one of those
names, give its path.
"""

from __future__ import annotations

import os
import shutil
import sys

from zerotrain.hf.switch import SHIM_DIR, environment


def _manage(action: str) -> int:
    from zerotrain.hf import install as manager

    try:
        if action == "install":
            written = manager.install()
            print(f"zerotrain.hf: installed zerotrain as deepspeed in this environment ({sys.prefix}); wrote:")
            for path in written:
                print(f"  {path}")
            print(
                "`deepspeed ...`, `accelerate launch ...` and `import deepspeed` now run zerotrain; "
                "`python -m zerotrain.hf uninstall` undoes it"
            )
        elif action == "uninstall":
            removed = manager.uninstall()
            print(f"zerotrain.hf: removed zerotrain's deepspeed from {sys.prefix}:")
            for path in removed:
                print(f"  {path}")
        else:
            print(f"zerotrain.hf: {manager.status()}")
    except manager.InstallError as error:
        print(f"zerotrain.hf {action}: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--print-path":
        print(SHIM_DIR)
        return 0
    if argv[0] in ("install", "uninstall", "status"):
        if len(argv) > 1:
            print(f"zerotrain.hf {argv[0]}: takes no arguments (got {' '.join(argv[1:])})", file=sys.stderr)
            return 2
        return _manage(argv[0])
    if argv[0] == "deepspeed":  # DeepSpeed's launcher command: zerotrain's launcher takes its arguments
        command = [sys.executable, "-m", "zerotrain.launcher.cli", *argv[1:]]
        os.execve(sys.executable, command, environment())
    program = shutil.which(argv[0])
    if program is None:
        print(
            f"zerotrain.hf: command not found: {argv[0]} (run `python -m zerotrain.hf COMMAND ...` with a "
            "command on PATH, e.g. `python -m zerotrain.hf accelerate launch train.py` or "
            "`python -m zerotrain.hf deepspeed --num_gpus=2 train.py`; `python -m zerotrain.hf install` "
            "makes the commands work without this prefix)",
            file=sys.stderr,
        )
        return 127
    os.execve(program, argv, environment())
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
