"""LazyFS server: a FUSE filesystem that keeps unsynced state in memory only.

This module owns the power-loss model and the FUSE process that implements it.
It runs as its own process (started and controlled by ``lazyfs.LazyFS``) so
that daemons doing blocking I/O on the mount never block the test process.

Model (see docs/testing.md for the user-facing summary):

* The backing directory *is* the simulated disk: it only ever changes when a
  file or directory is fsynced (or at a clean shutdown), so killing this
  process leaves it holding exactly the durable state.
* Every inode has a *visible* identity (its place in the mounted tree, its
  current size and contents) and, once anything about it is durable, a
  *durable home*: a path in the backing dir.  The home is either its durable
  name (``d_parent``/``d_name``) or, for an inode that was fsynced before any
  directory entry naming it was, an orphan under ``.lazyfs-store/`` (a real
  filesystem would have the inode on disk but unreachable).
* File data is kept in 64 KiB dirty pages over the durable contents; reads
  merge both.  fsync/fdatasync writes the pages (and size, mode, times) to the
  home.  ``floor`` remembers how far the file was truncated since the last
  sync, so durable bytes past it read as zeros.
* A directory's entries become durable when *that* directory is fsynced:
  fsyncdir makes the durable entries equal to the visible ones, moving each
  inode's home into place with one rename (atomic replace), creating empty
  files / empty directories for inodes that have no durable home yet, and
  moving still-referenced inodes that lost their durable name to the store.

Control protocol (lines on stdin, replies on stdout): ``sync`` -> ``ok``
(persist everything), ``stats`` -> one JSON line, ``powerloss`` -> the process
exits at once without touching the backing dir, ``exit`` -> persist everything
and stop serving.  ``ready`` is printed once the mount exists.

Run: ``python lazyfs_server.py BACKING MOUNTPOINT``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import pyfuse3
import trio

log = logging.getLogger("lazyfs")

PAGE = 64 * 1024
STORE = b".lazyfs-store"
# The kernel sees every change (no writeback cache, nothing changes behind its
# back), so caching attributes and entries is coherent.
CACHE_TIMEOUT = 1.0

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _op(fn: F) -> F:
    """Turn backing-dir OSErrors into FUSE errnos; anything else is EIO (logged)."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            log.warning("lazyfs: %s failed: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            # A bug in the simulator, not a fault of the code under test:
            # counted so that LazyFS.unmount() can fail the test loudly.
            log.exception("lazyfs: %s failed", fn.__name__)
            args[0].internal_errors += 1
            raise pyfuse3.FUSEError(errno.EIO) from None

    return cast(F, wrapper)


def _err(code: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(code)


class Node:
    """One inode: visible state plus where (if anywhere) its durable copy lives."""

    __slots__ = (
        "atime_ns",
        "ctime_ns",
        "d_entries",
        "d_name",
        "d_parent",
        "d_size",
        "dirty",
        "durable",
        "entries",
        "floor",
        "gid",
        "ino",
        "meta_dirty",
        "mode",
        "mtime_ns",
        "name",
        "open_count",
        "pages",
        "parent",
        "size",
        "uid",
    )

    def __init__(self, ino: int, mode: int, uid: int, gid: int) -> None:
        now = time.time_ns()
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.atime_ns = self.mtime_ns = self.ctime_ns = now
        # Visible namespace: parent is None once unlinked (or for the root).
        self.parent: Node | None = None
        self.name = b""
        # Directories: visible entries (None until loaded from the backing dir)
        # and durable entries (what the backing dir holds right now).
        self.entries: dict[bytes, Node] | None = None
        self.d_entries: dict[bytes, Node] = {}
        # Durable home: d_parent/d_name, or the store when d_parent is None.
        self.durable = False
        self.d_parent: Node | None = None
        self.d_name = b""
        # Files: visible size, durable size, truncation floor, dirty pages.
        self.size = 0
        self.d_size = 0
        self.floor = 0
        self.pages: dict[int, bytearray] = {}
        self.dirty = False
        self.meta_dirty = False
        self.open_count = 0

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class LazyOps(pyfuse3.Operations):
    """The FUSE operations; all state lives in memory, single-threaded under trio."""

    def __init__(self, backing: bytes) -> None:
        super().__init__()
        self.backing = backing
        self.store = os.path.join(backing, STORE)
        # A previous power loss leaves orphans behind; like fsck, drop them.
        shutil.rmtree(self.store, ignore_errors=True)
        os.mkdir(self.store, 0o700)
        st = os.stat(backing)
        root = Node(pyfuse3.ROOT_INODE, st.st_mode, st.st_uid, st.st_gid)
        root.durable = True
        self.root = root
        self.nodes: dict[int, Node] = {root.ino: root}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.dir_handles: dict[int, tuple[Node, list[tuple[bytes, Node]]]] = {}
        self.file_handles: dict[int, Node] = {}
        self.next_fh = 1
        self.internal_errors = 0

    # ---------------------------------------------------------------- helpers

    def _new_node(self, mode: int, uid: int, gid: int) -> Node:
        node = Node(self.next_ino, mode, uid, gid)
        self.next_ino += 1
        self.nodes[node.ino] = node
        return node

    def home(self, node: Node) -> bytes:
        if node is self.root:
            return self.backing
        if not node.durable:
            raise RuntimeError(f"inode {node.ino} has no durable home")
        if node.d_parent is None:
            return os.path.join(self.store, node.d_name)
        return os.path.join(self.home(node.d_parent), node.d_name)

    def _set_home(self, node: Node, d_parent: Node | None, d_name: bytes) -> None:
        if node.durable and node.d_parent is not None:
            node.d_parent.d_entries.pop(node.d_name, None)
        node.durable = True
        node.d_parent = d_parent
        node.d_name = d_name
        if d_parent is not None:
            d_parent.d_entries[d_name] = node

    def _drop_home(self, node: Node) -> None:
        if node.durable and node.d_parent is not None:
            node.d_parent.d_entries.pop(node.d_name, None)
        node.durable = False
        node.d_parent = None
        node.d_size = node.floor = 0

    def _store_name(self, node: Node) -> bytes:
        return str(node.ino).encode()

    def _load(self, d: Node) -> dict[bytes, Node]:
        if d.entries is not None:
            return d.entries
        path = self.home(d)
        entries: dict[bytes, Node] = {}
        with os.scandir(path) as it:
            for ent in it:
                name = ent.name
                if d is self.root and name == STORE:
                    continue
                st = ent.stat(follow_symlinks=False)
                if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                    log.warning("lazyfs: ignoring %r (only files and dirs are supported)", ent.path)
                    continue
                child = self._new_node(st.st_mode, st.st_uid, st.st_gid)
                child.atime_ns, child.mtime_ns, child.ctime_ns = (
                    st.st_atime_ns,
                    st.st_mtime_ns,
                    st.st_ctime_ns,
                )
                child.size = child.d_size = child.floor = st.st_size
                child.parent, child.name = d, name
                child.durable, child.d_parent, child.d_name = True, d, name
                entries[name] = child
        d.entries = entries
        d.d_entries = dict(entries)
        return entries

    def _node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise _err(errno.ENOENT) from None

    def _dir(self, ino: int) -> tuple[Node, dict[bytes, Node]]:
        d = self._node(ino)
        if not d.is_dir:
            raise _err(errno.ENOTDIR)
        return d, self._load(d)

    def _attrs(self, n: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = n.ino
        a.generation = 0
        a.entry_timeout = CACHE_TIMEOUT
        a.attr_timeout = CACHE_TIMEOUT
        a.st_mode = n.mode
        linked = n is self.root or n.parent is not None
        a.st_nlink = 1 if linked else 0
        a.st_uid = n.uid
        a.st_gid = n.gid
        a.st_rdev = 0
        a.st_size = 4096 if n.is_dir else n.size
        a.st_blksize = 4096
        a.st_blocks = (a.st_size + 511) // 512
        a.st_atime_ns = n.atime_ns
        a.st_mtime_ns = n.mtime_ns
        a.st_ctime_ns = n.ctime_ns
        return a

    def _check_name(self, parent: Node, name: bytes) -> None:
        if parent is self.root and name == STORE:
            raise _err(errno.EPERM)
        if len(name) > 255:
            raise _err(errno.ENAMETOOLONG)

    def _touch_dir(self, d: Node) -> None:
        d.mtime_ns = d.ctime_ns = time.time_ns()

    def _unlinked(self, node: Node) -> None:
        """``node`` lost its last visible name."""
        node.parent = None
        self._maybe_free(node)

    def _maybe_free(self, node: Node) -> None:
        # A dead, closed file never becomes visible again: its dirty pages and
        # any orphan copy in the store are garbage.  A durable *name* stays
        # until its directory is fsynced.
        if node.parent is not None or node.open_count > 0 or node.is_dir:
            return
        node.pages.clear()
        node.dirty = False
        if node.durable and node.d_parent is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.home(node))
            self._drop_home(node)
        if not node.durable:
            self.nodes.pop(node.ino, None)

    # ----------------------------------------------------------- file data

    def _dlim(self, n: Node) -> int:
        return min(n.floor, n.d_size) if n.durable else 0

    def _page(self, n: Node, p: int) -> bytearray:
        page = n.pages.get(p)
        if page is None:
            page = bytearray(PAGE)
            lo = p * PAGE
            want = min(self._dlim(n), lo + PAGE) - lo
            if want > 0:
                fd = os.open(self.home(n), os.O_RDONLY)
                try:
                    data = os.pread(fd, want, lo)
                finally:
                    os.close(fd)
                page[: len(data)] = data
            n.pages[p] = page
        return page

    def _read(self, n: Node, off: int, size: int) -> bytes:
        end = min(off + size, n.size)
        if end <= off:
            return b""
        out = bytearray(end - off)
        dlim = self._dlim(n)
        if off < dlim:
            fd = os.open(self.home(n), os.O_RDONLY)
            try:
                data = os.pread(fd, min(end, dlim) - off, off)
            finally:
                os.close(fd)
            out[: len(data)] = data
        if n.pages:
            for p in range(off // PAGE, (end - 1) // PAGE + 1):
                page = n.pages.get(p)
                if page is None:
                    continue
                lo = max(off, p * PAGE)
                hi = min(end, (p + 1) * PAGE)
                out[lo - off : hi - off] = page[lo - p * PAGE : hi - p * PAGE]
        return bytes(out)

    def _write(self, n: Node, off: int, buf: bytes) -> None:
        end = off + len(buf)
        view = memoryview(buf)
        pos = off
        while pos < end:
            p = pos // PAGE
            page = self._page(n, p)
            start = pos - p * PAGE
            take = min(PAGE - start, end - pos)
            page[start : start + take] = view[pos - off : pos - off + take]
            pos += take
        n.size = max(n.size, end)
        n.mtime_ns = n.ctime_ns = time.time_ns()
        n.dirty = True

    def _truncate(self, n: Node, size: int) -> None:
        if size < n.size:
            for p in [p for p in n.pages if p * PAGE >= size]:
                del n.pages[p]
            tail = n.pages.get(size // PAGE)
            if tail is not None:
                cut = size % PAGE
                tail[cut:] = bytes(PAGE - cut)
            n.floor = min(n.floor, size)
        n.size = size
        n.mtime_ns = n.ctime_ns = time.time_ns()
        n.dirty = True

    def sync_file(self, n: Node) -> None:
        """fsync/fdatasync: make the file's contents and attributes durable."""
        if not n.durable:
            fd = os.open(
                os.path.join(self.store, self._store_name(n)),
                os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                stat.S_IMODE(n.mode),
            )
            os.close(fd)
            self._set_home(n, None, self._store_name(n))
            n.d_size = n.floor = 0
        path = self.home(n)
        fd = os.open(path, os.O_WRONLY)
        try:
            if n.d_size > n.floor:
                os.ftruncate(fd, n.floor)
            for p in sorted(n.pages):
                lo = p * PAGE
                length = min(PAGE, n.size - lo)
                if length > 0:
                    os.pwrite(fd, memoryview(n.pages[p])[:length], lo)
            os.ftruncate(fd, n.size)
            if n.meta_dirty:
                os.fchmod(fd, stat.S_IMODE(n.mode))
                os.fchown(fd, n.uid, n.gid)
            os.utime(fd, ns=(n.atime_ns, n.mtime_ns))
        finally:
            os.close(fd)
        n.pages.clear()
        n.d_size = n.floor = n.size
        n.dirty = n.meta_dirty = False

    # ------------------------------------------------------------ namespace

    def _alive(self, n: Node) -> bool:
        return n.parent is not None or n.open_count > 0

    def _to_store(self, n: Node, keep_name: bool) -> None:
        """Give a durable inode that loses its durable name an orphan home.

        keep_name: the name is about to be replaced by a rename, so hard-link
        the file into the store and let that rename swap the name atomically.
        """
        src = self.home(n)
        dst = os.path.join(self.store, self._store_name(n))
        if keep_name and not n.is_dir:
            os.link(src, dst)
        else:
            os.rename(src, dst)
        self._set_home(n, None, self._store_name(n))

    def _destroy(self, n: Node) -> None:
        """Remove a dead inode's durable name (it is referenced by nothing)."""
        path = self.home(n)
        if not n.is_dir:
            os.unlink(path)
            self._drop_home(n)
        elif not n.d_entries:
            os.rmdir(path)
            self._drop_home(n)
        else:
            # Durable children may still be reachable once their new
            # directories are fsynced: keep them (as orphans) until then.
            self._to_store(n, keep_name=False)

    def _attach(self, d: Node, name: bytes, child: Node) -> None:
        if child.is_dir and child.durable:
            up: Node | None = d
            while up is not None and up is not child:
                up = up.d_parent
            if up is child:
                # child's durable subtree still holds d (d was moved out of it
                # and that move is not durable yet): a real fs commits both
                # renames together; here d is detached first so the tree
                # stays a tree.  Everything involved is unreachable until its
                # new parents are fsynced anyway.
                self._to_store(d, keep_name=False)
        dst = os.path.join(self.home(d), name)
        if not child.durable:
            tmp = os.path.join(self.store, self._store_name(child))
            if child.is_dir:
                os.mkdir(tmp, stat.S_IMODE(child.mode))
                child.d_entries = {}
            else:
                os.close(
                    os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IMODE(child.mode))
                )
                child.d_size = child.floor = 0
            os.chown(tmp, child.uid, child.gid)
            self._set_home(child, None, self._store_name(child))
        os.rename(self.home(child), dst)
        self._set_home(child, d, name)

    def sync_dir(self, d: Node) -> None:
        """fsyncdir: make this directory's visible entries its durable entries."""
        if d.entries is not None:  # else never loaded: its entries did not change
            self._sync_entries(d, d.entries)
        if d.meta_dirty:
            path = self.home(d)
            os.chmod(path, stat.S_IMODE(d.mode))
            os.chown(path, d.uid, d.gid)
            d.meta_dirty = False

    def _sync_entries(self, d: Node, entries: dict[bytes, Node]) -> None:
        if not d.durable:
            self._attach_orphan_dir(d)
        for name, child in list(entries.items()):
            old = d.d_entries.get(name)
            if old is child:
                continue
            if old is not None:
                if old.is_dir or self._alive(old):
                    # Same-type replace keeps the name present throughout.
                    self._to_store(old, keep_name=not old.is_dir and not child.is_dir)
                elif child.is_dir:
                    self._destroy(old)  # a file becomes a dir: unlink + mkdir anyway
                else:
                    self._drop_home(old)  # the rename below replaces it atomically
            self._attach(d, name, child)
        for name, child in list(d.d_entries.items()):
            if entries.get(name) is child:
                continue
            if self._alive(child):
                self._to_store(child, keep_name=False)
            else:
                self._destroy(child)

    def _attach_orphan_dir(self, d: Node) -> None:
        os.mkdir(os.path.join(self.store, self._store_name(d)), stat.S_IMODE(d.mode))
        d.d_entries = {}
        self._set_home(d, None, self._store_name(d))

    def sync_all(self) -> None:
        """Persist everything, as a clean shutdown (sync; umount) would."""
        for n in list(self.nodes.values()):
            if not n.is_dir and (n.dirty or n.meta_dirty) and n.parent is not None:
                self.sync_file(n)
        stack = [self.root]
        while stack:
            d = stack.pop()
            self.sync_dir(d)
            if d.entries is not None:
                stack.extend(c for c in d.entries.values() if c.is_dir)

    def stats(self) -> dict[str, int]:
        files = dirs = nbytes = 0
        for n in self.nodes.values():
            if n is not self.root and n.parent is None:
                continue
            if n.is_dir:
                if n.entries is not None and (
                    not n.durable
                    or n.meta_dirty
                    or n.d_entries.keys() != n.entries.keys()
                    or any(n.d_entries[k] is not v for k, v in n.entries.items())
                ):
                    dirs += 1
            elif n.dirty or n.meta_dirty or not n.durable:
                files += 1
                nbytes += len(n.pages) * PAGE
        return {
            "dirty_files": files,
            "dirty_dirs": dirs,
            "dirty_bytes": nbytes,
            "internal_errors": self.internal_errors,
        }

    # --------------------------------------------------------- FUSE handlers

    @_op
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        d, entries = self._dir(parent_inode)
        if name == b".":
            return self._attrs(d)
        if name == b"..":
            return self._attrs(d.parent or self.root)
        child = entries.get(name)
        if child is None:
            raise _err(errno.ENOENT)
        return self._attrs(child)

    async def forget(self, inode_list: Any) -> None:
        # Inodes stay in memory for the mount's lifetime: they are small, and
        # their durable bookkeeping must outlive the kernel's interest.
        return None

    @_op
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(self._node(inode))

    @_op
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        n = self._node(inode)
        if fields.update_size:
            if n.is_dir:
                raise _err(errno.EISDIR)
            self._truncate(n, attr.st_size)
        if fields.update_mode:
            n.mode = stat.S_IFMT(n.mode) | stat.S_IMODE(attr.st_mode)
            n.meta_dirty = True
        if fields.update_uid:
            n.uid = attr.st_uid
            n.meta_dirty = True
        if fields.update_gid:
            n.gid = attr.st_gid
            n.meta_dirty = True
        if fields.update_atime:
            n.atime_ns = attr.st_atime_ns
            n.dirty = n.dirty or not n.is_dir
        if fields.update_mtime:
            n.mtime_ns = attr.st_mtime_ns
            n.dirty = n.dirty or not n.is_dir
        n.ctime_ns = time.time_ns()
        return self._attrs(n)

    @_op
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        d, entries = self._dir(parent_inode)
        self._check_name(d, name)
        if name in entries:
            raise _err(errno.EEXIST)
        child = self._new_node(stat.S_IFDIR | stat.S_IMODE(mode), ctx.uid, ctx.gid)
        child.entries = {}
        child.parent, child.name = d, name
        entries[name] = child
        self._touch_dir(d)
        return self._attrs(child)

    @_op
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        d, entries = self._dir(parent_inode)
        self._check_name(d, name)
        if name in entries:
            raise _err(errno.EEXIST)
        child = self._new_node(stat.S_IFREG | stat.S_IMODE(mode), ctx.uid, ctx.gid)
        child.parent, child.name = d, name
        entries[name] = child
        self._touch_dir(d)
        return self._open_fh(child), self._attrs(child)

    @_op
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        d, entries = self._dir(parent_inode)
        child = entries.get(name)
        if child is None:
            raise _err(errno.ENOENT)
        if child.is_dir:
            raise _err(errno.EISDIR)
        del entries[name]
        self._touch_dir(d)
        self._unlinked(child)

    @_op
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        d, entries = self._dir(parent_inode)
        child = entries.get(name)
        if child is None:
            raise _err(errno.ENOENT)
        if not child.is_dir:
            raise _err(errno.ENOTDIR)
        if self._load(child):
            raise _err(errno.ENOTEMPTY)
        del entries[name]
        self._touch_dir(d)
        self._unlinked(child)

    @_op
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        src_dir, src_entries = self._dir(parent_inode_old)
        dst_dir, dst_entries = self._dir(parent_inode_new)
        self._check_name(dst_dir, name_new)
        node = src_entries.get(name_old)
        if node is None:
            raise _err(errno.ENOENT)
        target = dst_entries.get(name_new)
        if flags & pyfuse3.RENAME_EXCHANGE:
            if target is None:
                raise _err(errno.ENOENT)
            src_entries[name_old], dst_entries[name_new] = target, node
            target.parent, target.name = src_dir, name_old
            node.parent, node.name = dst_dir, name_new
        else:
            if target is node:
                return
            if target is not None:
                if flags & pyfuse3.RENAME_NOREPLACE:
                    raise _err(errno.EEXIST)
                if node.is_dir and not target.is_dir:
                    raise _err(errno.ENOTDIR)
                if not node.is_dir and target.is_dir:
                    raise _err(errno.EISDIR)
                if target.is_dir and self._load(target):
                    raise _err(errno.ENOTEMPTY)
            del src_entries[name_old]
            dst_entries[name_new] = node
            node.parent, node.name = dst_dir, name_new
            if target is not None:
                self._unlinked(target)
        node.ctime_ns = time.time_ns()
        self._touch_dir(src_dir)
        self._touch_dir(dst_dir)

    async def link(self, *args: Any) -> pyfuse3.EntryAttributes:
        raise _err(errno.EPERM)

    async def symlink(self, *args: Any) -> pyfuse3.EntryAttributes:
        raise _err(errno.EPERM)

    async def mknod(self, *args: Any) -> pyfuse3.EntryAttributes:
        raise _err(errno.EPERM)

    def _open_fh(self, n: Node) -> pyfuse3.FileInfo:
        fh = self.next_fh
        self.next_fh += 1
        self.file_handles[fh] = n
        n.open_count += 1
        # Page-cache mode (not direct_io) so that mmap works; keep_cache is
        # safe because every change to the file goes through this mount.
        return pyfuse3.FileInfo(fh=fh, direct_io=False, keep_cache=True)

    @_op
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        n = self._node(inode)
        if n.is_dir:
            raise _err(errno.EISDIR)
        if flags & os.O_TRUNC:
            self._truncate(n, 0)
        return self._open_fh(n)

    def _fh(self, fh: int) -> Node:
        try:
            return self.file_handles[fh]
        except KeyError:
            raise _err(errno.EBADF) from None

    @_op
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return self._read(self._fh(fh), off, size)

    @_op
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self._write(self._fh(fh), off, buf)
        return len(buf)

    async def flush(self, fh: int) -> None:
        return None  # close() persists nothing: that is the point

    @_op
    async def release(self, fh: int) -> None:
        n = self.file_handles.pop(fh, None)
        if n is not None:
            n.open_count -= 1
            self._maybe_free(n)

    @_op
    async def fsync(self, fh: int, datasync: bool) -> None:
        n = self._fh(fh)
        if n.parent is None and not n.durable:
            return  # unlinked and never durable: nothing after a crash can see it
        self.sync_file(n)

    @_op
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        d, _ = self._dir(inode)
        fh = self.next_fh
        self.next_fh += 1
        self.dir_handles[fh] = (d, [])
        return fh

    @_op
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        d, snap = self.dir_handles[fh]
        if start_id == 0:
            snap = list(self._load(d).items())
            self.dir_handles[fh] = (d, snap)
        for i in range(start_id, len(snap)):
            name, child = snap[i]
            if not pyfuse3.readdir_reply(token, name, self._attrs(child), i + 1):
                break

    async def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    @_op
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        d, _ = self.dir_handles[fh]
        if d is self.root or d.parent is not None:
            self.sync_dir(d)

    @_op
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        sv = os.statvfs(self.backing)
        out = pyfuse3.StatvfsData()
        out.f_bsize = sv.f_bsize
        out.f_frsize = sv.f_frsize
        out.f_blocks = sv.f_blocks
        out.f_bfree = sv.f_bfree
        out.f_bavail = sv.f_bavail
        out.f_files = sv.f_files
        out.f_ffree = sv.f_ffree
        out.f_favail = sv.f_favail
        out.f_namemax = 255
        return out


def _reply(line: str) -> None:
    data = (line + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


async def _control(ops: LazyOps, mountpoint: str, stop: trio.CancelScope) -> None:
    stream = trio.lowlevel.FdStream(os.dup(0))
    buf = b""
    async with stream:
        while True:
            while b"\n" not in buf:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    # The controller is gone: behave like a power loss and
                    # leave no mount behind.
                    subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False)
                    os._exit(1)
                buf += chunk
            line, buf = buf.split(b"\n", 1)
            cmd = line.decode().strip()
            if cmd == "powerloss":
                # Handlers never await mid-operation, so this runs between two
                # FUSE operations: no fsync is ever half-applied.
                os._exit(0)
            try:
                if cmd == "sync":
                    ops.sync_all()
                    _reply("ok")
                elif cmd == "stats":
                    _reply(json.dumps(ops.stats()))
                elif cmd == "exit":
                    ops.sync_all()
                    _reply("ok")
                    stop.cancel()
                    return
                else:
                    _reply(f"err unknown command {cmd!r}")
            except Exception as exc:
                log.exception("lazyfs: control command %r failed", cmd)
                _reply(f"err {exc}")


async def _amain(ops: LazyOps, mountpoint: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_control, ops, mountpoint, nursery.cancel_scope)
        _reply("ready")
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("LAZYFS_DEBUG") else logging.WARNING,
        format="%(asctime)s lazyfs[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    backing, mountpoint = argv
    ops = LazyOps(os.fsencode(os.path.abspath(backing)))
    options = set(pyfuse3.default_options)
    options.update({"fsname=lazyfs", "subtype=lazyfs"})
    pyfuse3.init(ops, mountpoint, options)
    try:
        trio.run(_amain, ops, mountpoint)
    finally:
        # Reached on a clean unmount (umount, or the `exit` command): anything
        # written after the last `sync` is persisted too.
        ops.sync_all()
        shutil.rmtree(ops.store, ignore_errors=True)
        pyfuse3.close(unmount=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
