"""Putting a written checkpoint folder in place, and recovering from an interrupted one.

Rank 0 commits, after every rank has written its files into ``save_dir/.<tag>.partial``:

1. ``metadata.json`` (carrying its own sha256) and the recovery scripts are written into the
   partial folder, which is then fsynced;
2. re-saving an existing tag: ``save_dir/<tag>`` is renamed to ``save_dir/.<tag>.old``;
3. the partial folder is renamed to ``save_dir/<tag>`` and ``save_dir`` is fsynced;
4. ``.<tag>.old`` is removed;
5. ``save_dir``'s copies of the scripts, then ``latest``, are replaced (each written to a
   temporary file, fsynced, renamed over the old one).

A crash (SIGKILL: nothing is cleaned up) at any point leaves ``latest`` naming a complete
checkpoint: before step 3 the previous one (between steps 2 and 3 ``<tag>`` is missing and the
loader takes ``.<tag>.old``, see ``format.resolve_tag``), after it the new one where ``latest``
already named ``<tag>``. The next save's ``recover`` puts a set-aside folder back (or drops it
once ``<tag>`` is complete) and removes partial folders and temporary files of interrupted saves.
An exception at any point undoes what it can first: the set-aside folder goes back, the partial
folder and temporary files are removed.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from zerotrain.checkpoint.format import LATEST, METADATA, CheckpointError, aside_name

logger = logging.getLogger("zerotrain")

SCRIPTS = ("zero_to_fp32.py", "format.py")
SCRIPT_NAMES = {"zero_to_fp32.py": "zero_to_fp32.py", "format.py": "zerotrain_checkpoint_format.py"}
_HERE = Path(__file__).resolve().parent


def partial_name(tag: str) -> str:
    return f".{tag}.partial"


def recover(save_dir: Path) -> None:
    """Undo what interrupted saves left in ``save_dir`` (rank 0, before a new save)."""
    if not save_dir.is_dir():
        return
    changed = False
    for entry in sorted(save_dir.iterdir()):
        name = entry.name
        if not name.startswith("."):
            continue
        if name.endswith(".partial") and entry.is_dir():  # never committed
            shutil.rmtree(entry)
            changed = True
        elif name.endswith(".old") and entry.is_dir() and len(name) > 5:
            final = save_dir / name[1:-4]
            if (final / METADATA).is_file():  # the re-save completed: drop the old copy
                shutil.rmtree(entry)
                changed = True
            elif not final.exists() and (entry / METADATA).is_file():  # it did not: put it back
                logger.warning(
                    "checkpoint %s: restoring it from %s (a re-save of this tag was interrupted)", final, entry
                )
                os.replace(entry, final)
                changed = True
        elif (
            name.endswith(".tmp") and entry.is_file() and (name[1:-4] == LATEST or name[1:-4] in SCRIPT_NAMES.values())
        ):
            entry.unlink()
    if changed:
        fsync_dir(save_dir)


def commit(partial: Path, save_dir: Path, tag: str, metadata: bytes, save_latest: bool) -> None:
    """Steps 1-5 above. Raises CheckpointError saying what state ``save_dir`` is left in."""
    final, old = save_dir / tag, save_dir / aside_name(tag)
    moved_aside = False
    try:
        write_durably(partial / METADATA, metadata)
        for source in SCRIPTS:  # the recovery script travels with the checkpoint
            shutil.copyfile(_HERE / source, partial / SCRIPT_NAMES[source])
        fsync_dir(partial)
        if final.exists():  # re-saving a tag: move the old one aside, drop it after the rename
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            moved_aside = True
        os.replace(partial, final)
    except Exception as error:
        if moved_aside:
            _quietly(os.replace, old, final)
        _quietly(shutil.rmtree, partial)
        raise CheckpointError(
            f"{type(error).__name__}: {error} (nothing was changed: "
            f"{save_dir / LATEST} still names the previous checkpoint)"
        ) from error
    try:
        try:
            fsync_dir(save_dir)
        finally:
            shutil.rmtree(old, ignore_errors=True)
        for source in SCRIPTS:  # DeepSpeed users run save_dir/zero_to_fp32.py
            replace_file(save_dir / SCRIPT_NAMES[source], (_HERE / source).read_bytes())
        os.chmod(save_dir / "zero_to_fp32.py", 0o755)
        if save_latest:
            replace_file(save_dir / LATEST, tag.encode())
    except Exception as error:
        raise CheckpointError(
            f"{type(error).__name__}: {error} ({final} is in place, but {save_dir / LATEST} was not "
            f"updated: load it with tag={tag!r}, or save again)"
        ) from error


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except OSError as error:
        logger.warning("checkpoint clean-up: %s(%s) failed: %s", fn.__name__, ", ".join(map(str, args)), error)


def write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically (a temporary file, fsynced, renamed); the temporary file is
    removed on failure."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write_durably(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        _quietly(_unlink_missing_ok, tmp)
        raise
    fsync_dir(path.parent)


def _unlink_missing_ok(path: Path) -> None:
    path.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
