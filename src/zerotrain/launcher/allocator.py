"""``--allocator``: which C allocator the ranks' host memory comes from.

glibc's malloc hands freed memory of 128 KiB to 32 MiB back to its heap, where the next
differently-sized allocations cut it into holes: a training step's pattern (gathered parameters,
full-size gradients, activations of several sizes) grows the resident size well past what is
live, or, handed back to the OS, is zero-filled again by the kernel page by page on the next step.
tcmalloc keeps freed memory in size classes it reuses as they are, so neither happens (GPT-2,
2 gloo ranks on CPU, docs/benchmarks.md, "the ranks' allocator": DDP's step 0.73-0.94x of glibc's, ZeRO-3's
0.60-0.73x, each at a lower peak). torch's own CPU launcher (``python -m torch.backends.xeon.run_cpu``) preloads it
the same way, by default.

- ``auto`` (the default; ``ZEROTRAIN_ALLOCATOR`` overrides it): tcmalloc when the ranks compute on
  the CPU (their accelerator, ``zerotrain.accelerator.get_accelerator()``, is the CPU: no CUDA
  device, or ``ZEROTRAIN_ACCELERATOR=cpu``) and the library is installed, else the system's;
- ``tcmalloc``: tcmalloc, or a one-line error saying how to install it;
- ``system``: nothing preloaded.

The library is preloaded into the ranks (``LD_PRELOAD``, before anything the user preloads
already); a user who preloads tcmalloc or jemalloc themselves is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import glob
import os
from collections.abc import Callable, Iterator

from zerotrain.launcher.errors import LaunchError, flag_or_env

ALLOCATORS = ("auto", "tcmalloc", "system")
ENV_VAR = "ZEROTRAIN_ALLOCATOR"
INSTALL_HINT = (
    "install it (Debian/Ubuntu: apt-get install libtcmalloc-minimal4; conda: conda install "
    "-c conda-forge gperftools) or pass --allocator system"
)
# tcmalloc reports every allocation above 1 GiB on stderr ("tcmalloc: large alloc ..."): a
# model's flat buffers would fill the logs. Raised unless the user set it.
_REPORT_VAR = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
_NO_REPORT = str(2**62)
_ALTERNATIVES = ("tcmalloc", "jemalloc", "mimalloc")


def resolve(choice: str | None, environ=os.environ) -> str:
    """The flag's value, else ``ZEROTRAIN_ALLOCATOR``, else ``auto``; one line for anything else."""
    return flag_or_env(choice, "--allocator", ENV_VAR, ALLOCATORS, "allocator", environ)


def find_tcmalloc(environ=os.environ) -> str | None:
    """Path (or soname the dynamic linker finds) of tcmalloc: the active conda environment's or
    virtualenv's ``lib`` first, then the system's library paths."""
    prefixes = [environ[v] for v in ("CONDA_PREFIX", "VIRTUAL_ENV") if environ.get(v)]
    for prefix in prefixes:
        for pattern in ("libtcmalloc_minimal.so*", "libtcmalloc.so*"):
            found = sorted(glob.glob(os.path.join(prefix, "lib", pattern)))
            if found:
                return found[0]
    for name in ("tcmalloc_minimal", "tcmalloc"):
        soname = ctypes.util.find_library(name)
        if soname:
            return soname
    return None


def configure(choice: str | None, on_cpu: bool, environ=os.environ) -> str | None:
    """Set up ``environ`` (the ranks' environment) for the chosen allocator; return a line for
    the launcher to print, or None when there is nothing to say."""
    name = resolve(choice, environ)
    if name == "system":
        return None
    preloaded = [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if any(alt in os.path.basename(p) for p in preloaded for alt in _ALTERNATIVES):
        return None  # the user preloads an allocator of their own
    if name == "auto" and not on_cpu:
        return None  # measured on the CPU only; device memory has its own allocator
    library = find_tcmalloc(environ)
    if library is None:
        if name == "tcmalloc":
            raise LaunchError("--allocator", f"tcmalloc is not installed here; {INSTALL_HINT}")
        return None
    environ["LD_PRELOAD"] = ":".join([library, *preloaded])
    environ.setdefault(_REPORT_VAR, _NO_REPORT)
    return f"ranks allocate host memory with tcmalloc ({library}); --allocator system keeps the system's malloc"


@contextlib.contextmanager
def for_ranks(choice: str | None, on_cpu: bool, say: Callable[[str], None]) -> Iterator[None]:
    """Within the block, this process's environment (which the elastic agent hands its ranks)
    selects the allocator; afterwards it is what it was (an in-process launch, a test, leaves
    no preload behind for later subprocesses)."""
    saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", _REPORT_VAR)}
    said = configure(choice, on_cpu)
    if said:
        say(said)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
