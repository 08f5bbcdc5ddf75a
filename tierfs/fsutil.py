"""Durable filesystem primitives shared by every component that persists.

A new file or directory survives a power cut only once the directory that
holds its *name* is fsynced; ``mkdir -p`` of several levels needs that for
every level it created. These helpers are the one place that rule lives
(the LazyFS power-loss tests in tests/faults/ catch a missing fsync).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

#: Overrides the kernel's boot id (tests: a simulated power cut is a reboot).
BOOT_ID_ENV = "TIERFS_BOOT_ID"

__all__ = ["boot_id", "fsync_dir", "lock_dir", "make_private", "makedirs_durable", "syncfs", "write_durable"]


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


def make_private(path: str | os.PathLike[str]) -> None:
    """Take group and other permissions off the directory ``path``: it holds
    file data or meta's journal (fragments, KV objects, raft.log, snapshots),
    which the files inside, made under the usual umask 022, would otherwise
    show to every local account (docs/security.md, "Files on disk")."""
    mode = os.stat(path).st_mode & 0o7777
    if mode & 0o077:
        os.chmod(path, mode & ~0o077)


def write_durable(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (file mode ``mode``) so that after a
    power cut it holds the old or the new contents, never neither: a
    temporary file, fsynced, renamed over it, and the directory fsynced."""
    p = Path(path)
    # Its own temporary name: two threads (or processes) writing the same
    # file must not rename each other's (the last rename wins, whole).
    tmp = p.with_name(f"{p.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)  # whatever the umask
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, p)
    fsync_dir(p.parent)


def boot_id() -> str:
    """This boot of the machine (``/proc/sys/kernel/random/boot_id``): it
    changes at every reboot, so state that a process left behind under an
    older one may have lost whatever was not fsynced. ``TIERFS_BOOT_ID``
    overrides it (a test's simulated power cut and reboot)."""
    forced = os.environ.get(BOOT_ID_ENV)
    if forced:
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def syncfs(path: str | os.PathLike[str]) -> None:
    """Write back everything cached for the file system holding ``path``
    (``syncfs(2)``; ``sync(2)`` where it is missing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)


def lock_dir(path: str | os.PathLike[str], what: str) -> int:
    """Take ``path/LOCK`` (flock, created with ``path`` if missing) for this
    process, or raise ConfigError naming the process that holds it: one
    daemon per data directory (a second storage daemon on a running node's
    data_dir took its identity over, a second meta replica opened its
    journal). Returns the descriptor; closing it (or exiting) releases it."""
    import fcntl

    from tierfs.errors import ConfigError

    d = makedirs_durable(path)
    fd = os.open(d / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(f"{d} is in use by {holder}: another {what} runs with this data_dir "
                          f"(each needs its own)", field="data_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
    return fd
