"""Directory-tree copies: ``tierfs put -r`` and ``tierfs get -r``.

Destination as cp(1) -r: a destination that is an existing directory
receives the source under its own name; otherwise the destination becomes
the copy (its parents are made). A tree is scanned first (so progress knows
the totals), directories are made top-down, then files are copied several at
once (``jobs``), each streamed block by block through :func:`tierfs.cli.fs.put`
or :func:`tierfs.cli.fs.get` (atomic per file: a temporary name renamed at
the end). Permission bits and modification times are kept (directories get
theirs last, once their contents are written). Symbolic links are copied as
links (their target text unchanged) unless ``follow_symlinks``, which copies
what they point to. A file that fails (permission denied, a directory where
the file should go, ...) is reported in ``errors`` and the rest is still
copied; the command then exits 1. Other kinds of local files (fifos,
sockets, devices) are skipped and listed in ``skipped``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import posixpath
import stat as _stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierfs.cli.fs import LocalFileError, get, put
from tierfs.client import AsyncClient
from tierfs.errors import (
    AlreadyExistsError,
    NotADirectoryError_,
    NotFoundError,
    TierFSError,
    UnavailableError,
)
from tierfs.local import STATE_FILE

__all__ = ["DEFAULT_JOBS", "TreeProgress", "get_tree", "put_tree"]

#: Files copied at once: enough to hide per-file round trips on small files;
#: each one in flight holds one block buffer (tierfs.cli.fs.BLOCK) at most.
DEFAULT_JOBS = 4


@dataclass
class TreeProgress:
    """Counters of one tree copy, handed to the progress callback as they move."""

    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    errors: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started


TreeCallback = Callable[[TreeProgress], None]


@dataclass
class _Entry:
    rel: str  # relative path, "/"-separated; "" is the root of the copy
    kind: str  # "dir" | "file" | "link"
    size: int = 0
    mode: int = 0
    mtime_ns: int = 0
    target: str = ""  # symlinks: the link text


@dataclass
class _Copy:
    entries: list[_Entry] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    bytes_copied: int = 0

    def fail(self, path: str, exc: BaseException | str) -> None:
        self.errors.append({"path": path, "error": str(exc)})


def _join(root: str, rel: str) -> str:
    return posixpath.join(root, rel) if rel else root


def _local_join(root: str, rel: str) -> str:
    return os.path.join(root, *rel.split("/")) if rel else root


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, TierFSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc)


async def _run_files(copy: _Copy, files: list[_Entry], jobs: int, prog: TreeProgress,
                     progress: TreeCallback | None, one: Callable[[_Entry, Callable[[int, int | None], None]], Any],
                     name: Callable[[_Entry], str]) -> None:
    """Copy ``files`` with ``jobs`` workers; per-file progress folds into
    ``prog``. A cluster that stops answering stops the copy (every other file
    would wait out its own deadline); any other failure is one file's."""
    queue = list(reversed(files))
    stop: list[BaseException] = []

    async def worker() -> None:
        while queue and not stop:
            e = queue.pop()
            seen = 0

            def step(done: int, _total: int | None) -> None:
                nonlocal seen
                prog.bytes_done += done - seen
                seen = done
                if progress is not None:
                    progress(prog)

            try:
                await one(e, step)
            except UnavailableError as exc:
                stop.append(exc)
                copy.fail(name(e), exc)
            except (TierFSError, LocalFileError, OSError) as exc:
                copy.fail(name(e), _describe(exc))
            else:
                prog.files_done += 1
                copy.bytes_copied += seen
            prog.bytes_done += e.size - seen  # a failed file counts as handled, for the totals to meet
            prog.errors = len(copy.errors)
            if progress is not None:
                progress(prog)

    # return_exceptions: a cancelled copy (Ctrl-C) waits for every worker to
    # finish its cleanup (a put removing its temporary file) before the
    # client closes under it; without it gather returned at the first worker
    # done and the others' cleanup failed on the closed client, leaving
    # `.NAME.put-XXXXXXXX` files behind.
    results = await asyncio.gather(*(worker() for _ in range(max(1, min(jobs, len(files))))),
                                   return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    if stop:
        left = len(queue)
        raise UnavailableError(f"{stop[0]} (copy stopped; {prog.files_done} files copied, {left} not tried)")


def _summary(src: str, dst: str, copy: _Copy, prog: TreeProgress) -> dict[str, Any]:
    dt = prog.seconds
    kinds = [e.kind for e in copy.entries]
    return {
        "src": src, "dst": dst,
        "files": prog.files_done, "files_total": prog.files_total,
        "dirs": kinds.count("dir"), "symlinks": kinds.count("link"),
        "bytes": copy.bytes_copied, "bytes_total": prog.bytes_total,
        "seconds": dt, "mb_per_s": copy.bytes_copied / max(dt, 1e-9) / 1e6,
        "errors": copy.errors, "skipped": copy.skipped,
    }


# ---- put -r -------------------------------------------------------------------------


def _scan_local(root: str, follow: bool, copy: _Copy) -> None:
    """Every directory, file and link under ``root`` (top-down), as lstat
    (or stat, with ``follow``) sees it; unreadable directories are errors."""
    seen_dirs: set[tuple[int, int]] = set()
    # An explicit stack, not recursion (a tree 1000 levels deep, as get -r
    # makes of one in TierFS, died with a RecursionError): ("visit", path,
    # rel) in the order the recursion took, ("leave", ...) where it returned
    # from a directory.
    todo: list[tuple[str, str, str, tuple[int, int]]] = [("visit", root, "", (0, 0))]

    def visit(path: str, rel: str) -> None:
        try:
            # The root named on the command line is followed (as cp -H does).
            st = os.stat(path) if follow or not rel else os.lstat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link to itself (or a ring of links), followed with -L
                copy.skipped.append({"path": path, "reason": "a symlink loop"})
                return
            copy.fail(path, _describe(exc) if exc.filename else f"{path}: {exc.strerror}")
            return
        m = st.st_mode
        if _stat.S_ISDIR(m):
            if (st.st_dev, st.st_ino) in seen_dirs:
                copy.skipped.append({"path": path, "reason": "a symlink loop back to a directory being copied"})
                return
            seen_dirs.add((st.st_dev, st.st_ino))
            if rel and os.path.isfile(os.path.join(path, STATE_FILE)):
                # `tierfs up --data DIR` inside the tree: its fragment files and
                # logs change while they are copied, into the cluster itself.
                copy.skipped.append({"path": path, "reason": f"a local TierFS cluster's data directory (holds "
                                                             f"{STATE_FILE}): not copied"})
                return
            copy.entries.append(_Entry(rel, "dir", mode=m & 0o7777, mtime_ns=st.st_mtime_ns))
            try:
                names = sorted(os.listdir(path))
            except OSError as exc:
                copy.fail(path, f"cannot list local directory: {exc.strerror}")
                return
            todo.append(("leave", path, rel, (st.st_dev, st.st_ino)))
            todo.extend(("visit", os.path.join(path, n), f"{rel}/{n}" if rel else n, (0, 0))
                        for n in reversed(names))
        elif _stat.S_ISREG(m):
            copy.entries.append(_Entry(rel, "file", size=st.st_size, mode=m & 0o7777, mtime_ns=st.st_mtime_ns))
        elif _stat.S_ISLNK(m):
            copy.entries.append(_Entry(rel, "link", target=os.readlink(path)))
        else:
            copy.skipped.append({"path": path, "reason": "not a regular file, directory or symbolic link"})

    while todo:
        what, path, rel, key = todo.pop()
        if what == "visit":
            visit(path, rel)
        elif follow:
            seen_dirs.discard(key)


async def _remote_kind(client: AsyncClient, path: str) -> str | None:
    """What ``path`` names, a link followed (a destination that is a link
    to a directory is a directory, as for cp -r)."""
    try:
        return (await client.stat(await client.resolve(path))).type
    except NotFoundError:
        return None


async def put_tree(client: AsyncClient, local: str, remote: str, *, jobs: int = DEFAULT_JOBS,
                   progress: TreeCallback | None = None, follow_symlinks: bool = False,
                   preserve: bool = True) -> dict[str, Any]:
    """Copy local directory tree ``local`` into TierFS at ``remote`` (cp -r
    semantics, see the module). Returns the summary: files/dirs/symlinks
    copied, bytes, seconds, ``errors`` (path and reason of each failure) and
    ``skipped``."""
    try:
        lst = os.stat(local)
    except OSError as exc:
        raise LocalFileError(f"cannot read local directory {local}: {exc.strerror}") from None
    remote = posixpath.normpath(remote)
    kind = await _remote_kind(client, remote)
    if kind == "directory":
        remote = posixpath.join(remote, os.path.basename(os.path.normpath(local)))
        kind = await _remote_kind(client, remote)
    if _stat.S_ISDIR(lst.st_mode) and kind not in (None, "directory"):
        raise NotADirectoryError_(f"{remote} exists and is not a directory: cannot copy directory {local} there")
    # Links before the last component followed once here (a destination
    # that is a link to a directory): every call below names real paths.
    remote = await client.resolve(remote, last=False)
    copy = _Copy()
    _scan_local(local, follow_symlinks, copy)
    files = [e for e in copy.entries if e.kind == "file"]
    prog = TreeProgress(files_total=len(files), bytes_total=sum(e.size for e in files))
    if progress is not None:
        progress(prog)
    parent = posixpath.dirname(remote)
    if parent and parent != "/":
        await client.mkdir(parent, parents=True, exist_ok=True)
    bad_dirs: list[str] = []  # remote directories that could not be made: skip what is under them

    def under_bad(rel: str) -> bool:
        return any(rel == b or rel.startswith(b + "/") or b == "" for b in bad_dirs)

    for e in copy.entries:
        if under_bad(e.rel):
            if e.kind == "file":
                copy.fail(_local_join(local, e.rel), "not copied: its remote directory could not be made")
                prog.bytes_done += e.size
            continue
        dst = _join(remote, e.rel)
        try:
            if e.kind == "dir":
                # Owner-writable while files go in; the source's own mode is set at the end.
                await client.mkdir(dst, exist_ok=True, mode=(e.mode | 0o700) if preserve else 0o755)
            elif e.kind == "link":
                await _put_link(client, dst, e.target)
        except UnavailableError:
            raise
        except TierFSError as exc:
            if e.kind == "dir" and not e.rel:
                # The copy's own top directory: nothing can be copied, one
                # error says why (it was one line per file until stop 48).
                raise type(exc)(f"cannot make {dst}: {exc}") from None
            copy.fail(dst, exc)
            if e.kind == "dir":
                bad_dirs.append(e.rel)
    todo = [e for e in files if not under_bad(e.rel)]
    prog.errors = len(copy.errors)

    async def one(e: _Entry, step: Callable[[int, int | None], None]) -> None:
        await put(client, _local_join(local, e.rel), _join(remote, e.rel), progress=step, into_dir=False,
                  preserve=preserve)

    # Raises only when the cluster stopped answering: then directory attributes are not tried either.
    await _run_files(copy, todo, jobs, prog, progress, one, lambda e: _local_join(local, e.rel))
    if preserve:
        # Bottom-up, after the files: writing into a directory changes its mtime.
        for e in reversed(copy.entries):
            if e.kind == "dir" and not under_bad(e.rel):
                try:
                    await client.meta.setattr(_join(remote, e.rel), mode=e.mode, mtime_ns=e.mtime_ns)
                except UnavailableError:
                    raise
                except TierFSError as exc:
                    copy.fail(_join(remote, e.rel), f"cannot set mode and mtime: {exc}")
    return _summary(local, remote, copy, prog)


async def _put_link(client: AsyncClient, dst: str, target: str) -> None:
    try:
        await client.meta.symlink(dst, target)
    except AlreadyExistsError:
        if (await client.stat(dst)).is_dir:
            raise NotADirectoryError_(f"{dst} exists and is a directory: cannot make a symbolic link there") from None
        await client.meta.unlink(dst)
        await client.meta.symlink(dst, target)


# ---- get -r -------------------------------------------------------------------------


async def _scan_remote(client: AsyncClient, root: str, copy: _Copy) -> None:
    # The root named on the command line is followed (as put -r follows
    # its local root): get -r of /ckpt/latest copies the checkpoint, not
    # the link (until stop 46 it copied the link).
    root = await client.resolve(root)
    st = await client.stat(root)
    if not st.is_dir:
        copy.entries.append(_Entry("", "file" if st.is_file else "link", size=st.size, mode=st.mode & 0o7777,
                                   mtime_ns=int(st.mtime * 1e9)))
        if not st.is_file:
            copy.entries[-1].target = await client.meta.readlink(root)
        return
    copy.entries.append(_Entry("", "dir", mode=st.mode & 0o7777, mtime_ns=int(st.mtime * 1e9)))
    pending = [""]
    while pending:
        rel = pending.pop(0)
        try:
            kids = await client.ls(_join(root, rel), detail=True)
        except UnavailableError:
            raise
        except TierFSError as exc:
            copy.fail(_join(root, rel), exc)
            continue
        for k in kids:
            r = f"{rel}/{posixpath.basename(k.path)}" if rel else posixpath.basename(k.path)
            e = _Entry(r, {"directory": "dir", "file": "file", "symlink": "link"}.get(k.type, k.type),
                       size=k.size, mode=k.mode & 0o7777, mtime_ns=int(k.mtime * 1e9))
            if e.kind == "link":
                e.target = await client.meta.readlink(_join(root, r))
            elif e.kind == "dir":
                pending.append(r)
            elif e.kind != "file":
                copy.skipped.append({"path": _join(root, r), "reason": f"unknown inode type {k.type}"})
                continue
            copy.entries.append(e)
    # Top-down order (parents before children), as the local scan gives.
    copy.entries.sort(key=lambda e: (e.rel.count("/") if e.rel else -1, e.rel))


async def get_tree(client: AsyncClient, remote: str, local: str, *, jobs: int = DEFAULT_JOBS,
                   progress: TreeCallback | None = None, preserve: bool = True) -> dict[str, Any]:
    """Copy TierFS tree ``remote`` to local ``local`` (cp -r semantics, see
    the module). Returns the summary as :func:`put_tree` does."""
    remote = posixpath.normpath(remote)
    copy = _Copy()
    await _scan_remote(client, remote, copy)
    if os.path.isdir(local):
        local = os.path.join(local, posixpath.basename(remote) or "root")
    if copy.entries and copy.entries[0].kind == "dir" and os.path.lexists(local) and not os.path.isdir(local):
        raise LocalFileError(f"{local} exists and is not a directory: cannot copy directory {remote} there")
    files = [e for e in copy.entries if e.kind == "file"]
    prog = TreeProgress(files_total=len(files), bytes_total=sum(e.size for e in files))
    if progress is not None:
        progress(prog)
    bad_dirs: list[str] = []

    def under_bad(rel: str) -> bool:
        return any(b == "" or rel == b or rel.startswith(b + "/") for b in bad_dirs)

    for e in copy.entries:
        dst = _local_join(local, e.rel)
        if under_bad(e.rel):
            if e.kind == "file":
                copy.fail(dst, "not copied: its local directory could not be made")
            continue
        try:
            if e.kind == "dir":
                # Owner-writable while the copy runs; the real mode is set at the end.
                os.makedirs(dst, mode=(0o700 | e.mode) if preserve else 0o777, exist_ok=True)
                if not os.path.isdir(dst):
                    raise LocalFileError(f"{dst} exists and is not a directory")
            elif e.kind == "link":
                if os.path.lexists(dst) and not os.path.isdir(dst):
                    os.unlink(dst)
                os.symlink(e.target, dst)
        except (OSError, LocalFileError) as exc:
            if e.kind == "dir" and not e.rel:  # the top directory: one error, not one per file
                raise LocalFileError(f"cannot make {dst}: {_describe(exc)}") from None
            copy.fail(dst, _describe(exc))
            if e.kind == "dir":
                bad_dirs.append(e.rel)
    todo = [e for e in files if not under_bad(e.rel)]
    for e in files:
        if under_bad(e.rel):
            prog.bytes_done += e.size
    prog.errors = len(copy.errors)

    async def one(e: _Entry, step: Callable[[int, int | None], None]) -> None:
        await get(client, _join(remote, e.rel), _local_join(local, e.rel), progress=step, into_dir=False,
                  preserve=preserve)

    try:
        await _run_files(copy, todo, jobs, prog, progress, one, lambda e: _join(remote, e.rel))
    finally:
        # Also when the copy stopped: directories left owner-only (0700) would surprise.
        if preserve:
            for e in reversed(copy.entries):
                if e.kind == "dir" and not under_bad(e.rel):
                    dst = _local_join(local, e.rel)
                    try:
                        os.chmod(dst, e.mode)
                        os.utime(dst, ns=(e.mtime_ns, e.mtime_ns))
                    except OSError as exc:
                        copy.fail(dst, f"cannot set mode and mtime: {exc.strerror}")
    return _summary(remote, local, copy, prog)
