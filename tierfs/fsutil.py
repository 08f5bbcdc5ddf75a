"""Durable filesystem primitives shared by every component that persists.

A new file or directory survives a power cut only once the directory that
holds its *name* is fsynced; ``mkdir -p`` of several levels needs that for
every level it created. These helpers are the one place that rule lives
(the LazyFS power-loss tests in tests/faults/ catch a missing fsync).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "makedirs_durable"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory entries of ``path`` (creates, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str | os.PathLike[str], mode: int = 0o755) -> Path:
    """``mkdir -p path`` whose result survives a power cut: each level created
    here is fsynced into its parent. Existing levels are left alone. Returns
    the path."""
    p = Path(path).absolute()
    missing: list[Path] = []
    cur = p
    while not cur.is_dir():
        missing.append(cur)
        if cur.parent == cur:
            break
        cur = cur.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # created concurrently by someone else, who syncs it
        fsync_dir(d.parent)
    return p
