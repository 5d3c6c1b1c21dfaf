"""``python -m zerotrain.hf install`` / ``uninstall`` / ``status``: zerotrain as ``deepspeed`` in
this environment, with no prefix and no change to scripts.

``install`` writes, into the running interpreter's environment (``sysconfig`` paths: the active
virtual environment, or the interpreter's own site-packages):

- ``<site-packages>/deepspeed/__init__.py``: the shim package (``import deepspeed`` is zerotrain,
  see :mod:`zerotrain.hf.deepspeed_alias`);
- ``<site-packages>/deepspeed-<version>.dist-info/``: its package metadata (``METADATA``,
  ``INSTALLER`` = ``zerotrain``, ``entry_points.txt``, ``RECORD``), which transformers and
  accelerate read to decide that DeepSpeed is installed (pip lists it as
  ``deepspeed 0.19.6+zerotrain``);
- ``<scripts>/deepspeed``: DeepSpeed's launcher command, running zerotrain's launcher
  (``deepspeed --num_gpus=2 train.py --deepspeed ds_config.json``).

It refuses when a real DeepSpeed (a ``deepspeed`` distribution not installed by zerotrain, a
``deepspeed`` module elsewhere on the path, or a ``deepspeed`` command it did not write) is
present, and writes nothing then. ``uninstall`` removes exactly the files ``RECORD`` lists (and
the bytecode Python wrote for them), then the folders it created if they are empty; it refuses a
``deepspeed`` it did not install. ``pip uninstall deepspeed`` removes the same files.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import os
import sys
import sysconfig
from pathlib import Path

from zerotrain.hf.switch import DEEPSPEED_VERSION, SHIM_DIR

INSTALLER = "zerotrain"
PACKAGE = "deepspeed"
DIST_INFO = f"{PACKAGE}-{DEEPSPEED_VERSION}.dist-info"
MARKER = "# zerotrain's DeepSpeed shim, written by `python -m zerotrain.hf install`"


class InstallError(Exception):
    """A refusal, with a one-line message saying what to do."""


def _paths() -> tuple[Path, Path]:
    paths = sysconfig.get_paths()
    return Path(paths["purelib"]), Path(paths["scripts"])


def _package_text() -> str:
    return (
        f"{MARKER}\n# `python -m zerotrain.hf uninstall` removes it (docs/hf.md).\n"
        "from zerotrain.hf.deepspeed_alias import become_deepspeed\n\n"
        "become_deepspeed(__name__)\n"
    )


def _script_text() -> str:
    return (
        f"#!{sys.executable}\n{MARKER}\n# DeepSpeed's launcher command, running zerotrain's launcher.\n"
        "import sys\n\nfrom zerotrain.launcher.cli import main\n\n"
        'if __name__ == "__main__":\n    sys.exit(main())\n'
    )


def _metadata_text() -> str:
    return (Path(SHIM_DIR) / DIST_INFO / "METADATA").read_text(encoding="utf-8")


def _ours(dist: importlib.metadata.Distribution) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def _deepspeed_distributions(site: Path) -> list[importlib.metadata.Distribution]:
    """Every ``deepspeed`` distribution on the path (and in ``site``), the shim folder excluded."""
    search = [p for p in sys.path if os.path.abspath(p or ".") != os.path.abspath(SHIM_DIR)]
    if str(site) not in search:
        search.insert(0, str(site))
    found, seen = [], set()
    for dist in importlib.metadata.distributions(name=PACKAGE, path=search):
        key = str(getattr(dist, "_path", id(dist)))
        if key not in seen:
            seen.add(key)
            found.append(dist)
    return found


def _dist_location(dist: importlib.metadata.Distribution) -> str:
    return str(getattr(dist, "_path", dist.metadata.get("Name", PACKAGE)))


def installed() -> Path | None:
    """This environment's zerotrain-installed ``deepspeed`` dist-info folder, or None."""
    site, _ = _paths()
    folder = site / DIST_INFO
    if (folder / "INSTALLER").is_file() and (folder / "INSTALLER").read_text().strip() == INSTALLER:
        return folder
    return None


def _refuse_real_deepspeed(site: Path, script: Path) -> None:
    for dist in _deepspeed_distributions(site):
        if not _ours(dist):
            raise InstallError(
                f"a real DeepSpeed is installed (deepspeed {dist.version} at {_dist_location(dist)}); "
                "zerotrain will not shadow it. Run `pip uninstall deepspeed` first, or keep it and "
                "start commands with `python -m zerotrain.hf ...` instead"
            )
    shim = os.path.abspath(SHIM_DIR)
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != shim]
        spec = importlib.util.find_spec(PACKAGE) if PACKAGE not in sys.modules else None
    finally:
        sys.path[:] = saved
    origin = getattr(spec, "origin", None)
    if spec is not None and origin != str(site / PACKAGE / "__init__.py"):
        raise InstallError(
            f"a `deepspeed` module is importable from {origin or spec.submodule_search_locations}; "
            "remove it from the path first (zerotrain will not shadow it)"
        )
    if script.exists() and MARKER not in script.read_text(encoding="utf-8", errors="replace"):
        raise InstallError(
            f"{script} exists and was not written by zerotrain; remove it first "
            "(or use `python -m zerotrain.hf deepspeed ...`)"
        )


def _record_line(site: Path, path: Path, data: bytes | None) -> list[str]:
    try:
        name = os.path.relpath(path, site)
    except ValueError:  # another drive (Windows)
        name = str(path)
    if data is None:
        return [name, "", ""]
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def install() -> list[Path]:
    """Write the shim package, its metadata and the ``deepspeed`` command; return what was written."""
    site, scripts = _paths()
    script = scripts / PACKAGE
    _refuse_real_deepspeed(site, script)
    for folder in (site, scripts):
        if not os.access(folder if folder.exists() else folder.parent, os.W_OK):
            raise InstallError(
                f"{folder} is not writable; activate the virtual environment you train in "
                "(or run with the interpreter that owns it) and run this again"
            )
    if installed() is not None:
        uninstall()  # re-install over our own files: same set, fresh contents
    files = {
        site / PACKAGE / "__init__.py": _package_text().encode(),
        site / DIST_INFO / "METADATA": _metadata_text().encode(),
        site / DIST_INFO / "INSTALLER": f"{INSTALLER}\n".encode(),
        site / DIST_INFO / "entry_points.txt": b"[console_scripts]\ndeepspeed = zerotrain.launcher.cli:main\n",
        script: _script_text().encode(),
    }
    written: list[Path] = []
    try:
        for path, data in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            written.append(path)
        script.chmod(0o755)
        record = site / DIST_INFO / "RECORD"
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for path, data in files.items():
            writer.writerow(_record_line(site, path, data))
        writer.writerow(_record_line(site, record, None))
        record.write_text(out.getvalue(), encoding="utf-8")
        written.append(record)
    except OSError as error:
        for path in written:
            path.unlink(missing_ok=True)
        _remove_empty(site / PACKAGE, site / DIST_INFO)
        raise InstallError(f"could not write {error.filename}: {error.strerror}") from None
    importlib.invalidate_caches()
    return written


def uninstall() -> list[Path]:
    """Remove exactly what :func:`install` wrote; return the removed files."""
    site, _ = _paths()
    folder = site / DIST_INFO
    if installed() is None:
        others = [d for d in _deepspeed_distributions(site) if not _ours(d)]
        if others:
            raise InstallError(
                f"the deepspeed at {_dist_location(others[0])} was not installed by zerotrain; "
                "leaving it (remove it with `pip uninstall deepspeed`)"
            )
        raise InstallError(f"zerotrain's deepspeed is not installed in this environment ({site}); nothing to remove")
    rows = list(csv.reader(io.StringIO((folder / "RECORD").read_text(encoding="utf-8"))))
    removed = []
    for row in rows:
        if not row:
            continue
        path = Path(row[0]) if os.path.isabs(row[0]) else site / row[0]
        path = Path(os.path.normpath(path))
        if path.exists():
            path.unlink()
            removed.append(path)
        if path.suffix == ".py":  # the bytecode Python wrote next to it
            cache = path.parent / "__pycache__"
            for compiled in cache.glob(f"{path.stem}.*.pyc") if cache.is_dir() else ():
                compiled.unlink()
            _remove_empty(cache)
    _remove_empty(site / PACKAGE, folder)
    importlib.invalidate_caches()
    return removed


def _remove_empty(*folders: Path) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            pass  # absent, or holds files zerotrain did not write: left alone


def status() -> str:
    site, scripts = _paths()
    folder = installed()
    if folder is not None:
        return (
            f"installed: `import deepspeed` and the `deepspeed` command ({scripts / PACKAGE}) run zerotrain "
            f"in {sys.prefix}; `python -m zerotrain.hf uninstall` removes them"
        )
    real = [d for d in _deepspeed_distributions(site) if not _ours(d)]
    if real:
        return f"not installed: a real DeepSpeed is present (deepspeed {real[0].version} at {_dist_location(real[0])})"
    return (
        f"not installed in {sys.prefix}: `python -m zerotrain.hf install` makes `deepspeed` and "
        "`import deepspeed` run zerotrain here"
    )
