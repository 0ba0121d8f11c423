"""The one atomic writer: a reader sees the old file or the whole new one, never half of it, even after a crash.

Every file kvbench stores (row and ops tables, compacted sweeps, exports, capacity frontiers, device ceilings) is
written through `atomic_write`: a hidden temp file beside the target, fsync, os.replace, then an fsync of the folder
so that the rename itself survives a power loss. The loaders skip hidden names, so a crash mid-write leaves nothing
that passes for a result.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMP_MARKER = ".tmp-"  # .<name>.tmp-<pid>-<random>: hidden, and says whose it was


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    """Create path's folder if needed, call `write(f)` on a temp file beside `path`, fsync it, rename it over `path`.

    The rename is atomic on POSIX. Whatever `write` or the rename raises, the temp file is removed and `path` is
    left as it was. Returns `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # pid and a random part: two writers of one path (two processes, or two threads of one) never share a temp file.
    tmp_path = path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with tmp_path.open("xb") as f:  # default permissions (umask), unlike tempfile's 0600
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # makes the rename itself survive a power loss
    return path


def fsync_directory(directory: str | Path) -> None:
    """Flush a folder's entries (renames, removals) to disk."""
    if not hasattr(os, "O_DIRECTORY"):  # Windows cannot open a directory; its rename is durable enough
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
