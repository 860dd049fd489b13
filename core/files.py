"""Writing files and folders so that a reader never sees half of one: write aside, then rename into place.

A process killed at any moment leaves either the old complete file (or folder), the new complete one, or a stray
temporary that the next run removes; never a truncated file under the final name. ``os.replace`` of a file and
``rename`` of a folder within one directory are atomic on POSIX filesystems.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable


def temporary_name(path: Path) -> Path:
    """A sibling of ``path`` for writing it aside: unique per process, recognisable as a temporary (``.tmp-``)."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def atomic_write(path: Path, write: Callable[[Path], None], before_replace: Callable[[], None] | None = None) -> None:
    """Create or replace ``path`` with what ``write(tmp)`` writes to a temporary sibling, flushed to disk first.

    ``before_replace`` runs between the flush and the rename (the resume tests kill the process there).
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(Path(path), lambda tmp: tmp.write_text(text))


def staging_dir(final: Path) -> Path:
    """A new empty hidden sibling folder of ``final`` to build it in (``publish_dir`` moves it into place)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; what is built here is an ordinary shared folder
    return tmp


def publish_dir(built: Path, final: Path, replace: bool = True) -> bool:
    """Rename the complete folder ``built`` to ``final``; True when it was moved there.

    An existing ``final`` is swapped out (renamed aside, then deleted) when ``replace``; otherwise it is kept and
    ``built`` is deleted: another process finished the same work first, and theirs is as good. A reader sees the
    old folder or the new one, never a mixture.
    """
    built, final = Path(built), Path(final)
    if final.exists():
        if not replace:
            shutil.rmtree(built, ignore_errors=True)
            return False
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
        built.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return True
    try:
        built.rename(final)
    except OSError:
        # Lost a race to create the same folder: keep the winner's (rename does not replace a non-empty folder).
        if not final.exists():
            raise
        shutil.rmtree(built, ignore_errors=True)
        return False
    return True


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def renamed_file(folder: str | Path, name: str, old: str) -> Path:
    """The path to read ``name`` in ``folder`` from: ``folder/old`` where only a file of that older name is there (a
    folder an earlier fledge wrote), else ``folder/name``. Writers write ``name`` and remove ``old``
    (``retire_old_name``), so a folder holds one of them."""
    folder = Path(folder)
    return folder / old if not (folder / name).exists() and (folder / old).is_file() else folder / name


def retire_old_name(folder: str | Path, old: str) -> None:
    """Remove the older name of a file once its current name is written (``renamed_file``)."""
    (Path(folder) / old).unlink(missing_ok=True)
