"""Run a pickled training function on one rank (the distributors' script for ``run(fn, ...)``).

``python function_runner.py PAYLOAD OUTPUT [--deepspeed --deepspeed_config PATH]`` under
``zerotrain launch``: every rank loads ``(fn, args, kwargs)`` from PAYLOAD (written moments ago
by the distributor in its own private temporary directory), calls it, and only global rank 0
writes the return value to OUTPUT, so the caller always gets rank 0's value. The config path
reaches the function as the ``ZEROTRAIN_DEEPSPEED_CONFIG`` environment variable.
"""

from __future__ import annotations

import os
import sys

CONFIG_ENV = "ZEROTRAIN_DEEPSPEED_CONFIG"


def _cloudpickle():
    try:
        from pyspark import cloudpickle
    except ImportError:
        import cloudpickle
    return cloudpickle


def main(argv: list[str]) -> None:
    # Run by path, this directory is sys.path[0]; drop it so that `import ray` in the user's
    # function finds Ray, not zerotrain/integrations/ray.py.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    payload, output, *rest = argv
    if "--deepspeed_config" in rest:
        os.environ[CONFIG_ENV] = rest[rest.index("--deepspeed_config") + 1]
    cloudpickle = _cloudpickle()
    with open(payload, "rb") as f:
        fn, args, kwargs = cloudpickle.load(f)  # our own file, written by the distributor
    result = fn(*args, **kwargs)
    # The job's global rank 0 (the launcher's RANK, whatever engines the function built): the
    # distributor returns one value for the whole job, as torch's TorchDistributor does.
    if os.environ.get("RANK", "0") == "0":
        with open(output + ".tmp", "wb") as f:
            cloudpickle.dump(result, f)
        os.replace(output + ".tmp", output)


if __name__ == "__main__":
    main(sys.argv[1:])
