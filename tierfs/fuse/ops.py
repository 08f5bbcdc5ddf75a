"""The FUSE operations (pyfuse3, asyncio mode) over one ``AsyncClient``.

Inodes are TierFS inode numbers as they are (meta's root is inode 1, as is
FUSE's), so lookup counts need no table: ``forget`` has nothing to free and
an inode stays valid across renames.

Data goes through the client's file objects. A handle opened for reading
gets its own read-only ``AsyncFile`` (striped reads, one-chunk cache and
read-ahead). Writes to an inode, from any of its handles, go to one shared
write session (an ``AsyncFile`` in ``r+`` mode, opened at the first write):
TierFS allows one writer per file, and one session keeps this mount's
handles coherent with each other. While it is open, reads and sizes of the
inode come from it. ``flush`` (every ``close(2)``), ``fsync`` and any
``setattr`` commit it (the client's close: durable and published), and the
next write opens a new one; so what an application has closed or synced is
durable and visible to every client.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import stat as _stat
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import wraps
from typing import Any, ParamSpec, TypeVar, cast

import pyfuse3

from tierfs.client import AsyncClient, AsyncFile
from tierfs.client.client import FileView
from tierfs.errors import (
    AlreadyExistsError,
    InsufficientTargetsError,
    NotFoundError,
    TierFSError,
    TimeoutError_,
    UnauthenticatedError,
    UnavailableError,
)
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["MountOptions", "TierFSOperations"]

log = logging.getLogger("tierfs.fuse")

P = ParamSpec("P")
R = TypeVar("R")

_TYPE_BITS = {pb.INODE_TYPE_FILE: _stat.S_IFREG, pb.INODE_TYPE_DIRECTORY: _stat.S_IFDIR,
              pb.INODE_TYPE_SYMLINK: _stat.S_IFLNK}
_RENAME_NOREPLACE = 1
_BLKSIZE = 1 << 20  # st_blksize: cp and friends size their buffers from it
#: The hidden name a file unlinked while open here takes until its last close.
SILLY_PREFIX = ".tierfs-unlinked-"
#: A read of a chunk that a read of the same handle just failed to get from
#: the storage nodes (every copy or too many fragments timed out or refused)
#: fails the same way at once when it was asked before that failure ended or
#: within this many seconds after it. The kernel sends one read(2) as several
#: requests (its read-ahead, then the page again after the read-ahead
#: failed); each waited out the client's retries on the stalled nodes in
#: turn, so a read during a whole-cluster stall took about three times that
#: (91 s against 30 s for a replica:3 file).
_READ_FAILURE_SHARED_S = 1.0
_UNREACHABLE = (InsufficientTargetsError, UnavailableError, TimeoutError_)


@dataclass(frozen=True, slots=True)
class MountOptions:
    """Kernel cache timeouts (seconds) and the read-ahead the mount asks for."""

    attr_timeout: float = 1.0
    entry_timeout: float = 1.0
    read_ahead_kib: int = 4096


#: Seconds between two log lines saying that meta refuses the mount's token.
CREDENTIAL_LOG_INTERVAL = 60.0
_credential_logged = [-CREDENTIAL_LOG_INTERVAL]


def _log_refusal(name: str, exc: TierFSError) -> None:
    """What the log says of an error the application gets as an errno. A
    refused credential (expired, revoked, user removed) answers every request
    EACCES, which reads as an ordinary permission denial: the log says why
    (once a minute). A failed commit (flush, fsync) loses what was written
    since the last one: the log says so. Until stop 48 both went to the
    debug log only, and a mount whose token had expired logged nothing."""
    if isinstance(exc, UnauthenticatedError):
        now = time.monotonic()
        if now - _credential_logged[0] >= CREDENTIAL_LOG_INTERVAL:
            _credential_logged[0] = now
            log.warning("meta refuses this mount's credential: %s; every request fails with EACCES until "
                        "the file system is mounted again with a valid token", exc)
    if name in ("flush", "fsync"):
        log.warning("%s: the commit failed (%s): what was written since the last commit is not published; "
                    "the application got %s", name, exc, errno.errorcode.get(exc.errno_value, exc.errno_value))
    else:
        log.debug("%s: %r", name, exc)


def _fuse_errors(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """TierFS errors become their errno (``TierFSError.errno_value``); anything
    else is logged and answered EIO (never a dead mount)."""

    @wraps(fn)
    async def wrapper(*args: P.args, **kw: P.kwargs) -> R:
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kw)
        except pyfuse3.FUSEError:
            raise
        except TierFSError as exc:
            _log_refusal(fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno_value) from None
        except OSError as exc:
            log.debug("%s: %r", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            if log.isEnabledFor(logging.DEBUG):
                shown = tuple(f"<{len(a)} bytes>" if isinstance(a, bytes) and len(a) > 64 else a for a in args[1:])
                log.debug("%s%r: %.1f ms", fn.__name__, shown, (time.perf_counter() - t0) * 1e3)

    return wrapper


def _stale() -> pyfuse3.FUSEError:
    """An inode meta no longer has (unlinked or replaced by another client):
    ESTALE, on which the kernel walks the path again (LOOKUP_REVAL) and finds
    what the name is now. ENOENT failed an open or stat of a path that had
    just been replaced by a rename (until stop 47)."""
    return pyfuse3.FUSEError(errno.ESTALE)


def _name(raw: bytes) -> str:
    """A file name as TierFS keeps it: UTF-8 (meta's names are protobuf
    strings). Other bytes are EILSEQ, not the EIO and logged traceback of a
    surrogate escape meta cannot carry."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise pyfuse3.FUSEError(errno.EILSEQ) from None


@dataclass(eq=False)
class _Node:
    """An inode some handle has open."""

    inode: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    writer: AsyncFile | None = None
    opens: int = 0
    #: Bumped at every commit and truncate: readers opened before re-open.
    version: int = 0
    #: Its attributes as last seen, answered to getattr while it is open and
    #: meta no longer has it (unlinked or replaced since it was opened).
    attr: pb.Attr | None = None
    #: When this mount last wrote to it (ns): its mtime while the write
    #: session is open (meta sets the mtime at the commit).
    wrote_ns: int = 0
    #: Unlinked here while open: the (directory inode, hidden name) it was
    #: renamed to instead, removed at the last release (see ``unlink``).
    silly: tuple[int, str] | None = None


@dataclass(eq=False)
class _Handle:
    node: _Node
    writable: bool
    reader: AsyncFile | None = None
    reader_version: int = -1
    #: What open() looked up, for the first reader (saves a stat per open).
    info: pb.FileInfo | None = None
    #: The kernel's read-ahead sends several reads of one handle at once; a
    #: client file (its chunk cache and read-ahead) serves one at a time.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Opened with O_APPEND: writes go to the end of the file as this mount
    #: knows it (the write session's size), not to the kernel's offset.
    append: bool = False
    #: The last read of this handle that the storage nodes failed: (first
    #: chunk, last chunk, the error, when it ended; time.monotonic()). See
    #: ``_READ_FAILURE_SHARED_S``.
    failed: tuple[int, int, TierFSError, float] | None = None
    #: The chunk size of the file its reader reads (0: no reader yet).
    chunk_size: int = 0


class TierFSOperations(pyfuse3.Operations):
    """See the module docstring. Runs on the loop that runs ``pyfuse3.main``."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, client: AsyncClient, options: MountOptions | None = None) -> None:
        super().__init__()
        self.client = client
        self.options = options or MountOptions()
        self._nodes: dict[int, _Node] = {}
        self._handles: dict[int, _Handle] = {}
        self._dirs: dict[int, list[tuple[str, pb.Attr]]] = {}
        #: inode -> the size this mount last told the kernel (bounded: a
        #: cleared entry costs one attribute invalidation at the next open)
        self._told: dict[int, int] = {}
        self._next_fh = 1
        self._owner = f"tierfs-fuse pid {os.getpid()}"

    # ---- attributes -------------------------------------------------------------

    def _entry(self, attr: pb.Attr) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = attr.inode
        e.generation = 0
        e.entry_timeout = self.options.entry_timeout
        e.attr_timeout = self.options.attr_timeout
        e.st_mode = _TYPE_BITS.get(attr.type, 0) | (attr.mode & 0o7777)
        node = self._nodes.get(attr.inode)
        e.st_nlink = 0 if node is not None and node.silly is not None else max(1, attr.nlink)
        e.st_uid = attr.uid
        e.st_gid = attr.gid
        size = attr.size
        mtime = attr.mtime_ns
        if node is not None and node.writer is not None:
            size = node.writer.size  # written through this mount, not committed yet
            mtime = max(mtime, node.wrote_ns)  # as a local file's (it stayed put until close, until stop 47)
        e.st_size = size
        if len(self._told) > 100_000:
            self._told.clear()
        self._told[attr.inode] = size
        e.st_blksize = _BLKSIZE
        e.st_blocks = -(-size // 512)
        # No atime in TierFS: reads do not update metadata.
        e.st_atime_ns = mtime
        e.st_mtime_ns = mtime
        e.st_ctime_ns = attr.ctime_ns
        return e

    @_fuse_errors
    async def lookup(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            n = _name(name)
        except pyfuse3.FUSEError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None  # no such name can exist
        meta = self.client.meta
        if n == ".":
            info = await meta.stat(int(parent_inode))
        elif n == "..":
            info = await meta.stat((await meta.stat(int(parent_inode))).attr.parent or 1)
        else:
            try:
                info = await meta.lookup(int(parent_inode), n)
            except NotFoundError:
                # A negative entry (inode 0) the kernel may cache for
                # entry_timeout: git and compilers probe many absent names.
                e = pyfuse3.EntryAttributes()
                e.st_ino = 0
                e.entry_timeout = self.options.entry_timeout
                return e
        return self._entry(info.attr)

    async def forget(self, inode_list: Any) -> None:
        return None  # inodes are meta's own numbers: nothing to free

    @_fuse_errors
    async def getattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        ino = int(inode)
        node = self._nodes.get(ino)
        try:
            attr = (await self.client.meta.stat(ino)).attr
        except NotFoundError:
            if node is None or node.attr is None:
                raise _stale() from None
            # Open here, gone from meta: the kernel asks before a read once
            # attr_timeout passed, and an ENOENT would fail that read (and
            # fstat) of a descriptor still reading its snapshot. Answered
            # as a local file system does: its last attributes, no links.
            e = self._entry(node.attr)
            e.st_nlink = 0
            return e
        if node is not None:
            node.attr = attr
        return self._entry(attr)

    @_fuse_errors
    async def setattr(self, inode: pyfuse3.InodeT, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: pyfuse3.FileHandleT | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        ino = int(inode)
        node = self._nodes.get(ino)
        if node is None:
            return await self._setattr(ino, attr, fields, None)
        async with node.lock:
            # Meta refuses a truncate while a session is open, and a commit
            # would overwrite an mtime set now (cp -p sets it before close).
            await self._commit(node)
            return await self._setattr(ino, attr, fields, node)

    async def _setattr(self, ino: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                       node: _Node | None) -> pyfuse3.EntryAttributes:
        meta = self.client.meta
        info: pb.FileInfo | None = None
        if fields.update_size:
            info = await meta.truncate(ino, attr.st_size)
            if node is not None:
                node.version += 1
        mode = attr.st_mode & 0o7777 if fields.update_mode else None
        uid = attr.st_uid if fields.update_uid else None
        gid = attr.st_gid if fields.update_gid else None
        mtime = attr.st_mtime_ns if fields.update_mtime else None
        if mode is not None or uid is not None or gid is not None or mtime is not None:
            info = await meta.setattr(ino, mode=mode, uid=uid, gid=gid, mtime_ns=mtime)
        if info is None:  # atime/ctime only: TierFS keeps neither apart
            info = await meta.stat(ino)
        return self._entry(info.attr)

    @_fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        cmap = await self.client.meta.get_cluster_map()
        cap = sum(t.capacity for t in cmap.targets)
        # Free as `tierfs df` counts it: each target's free space on its file
        # system (what it may still take), capped by capacity minus use. It
        # was capacity minus use alone, 3.7x too much on a shared disk
        # (stop 47).
        free = sum(min(t.free, max(0, t.capacity - t.used)) if t.free else max(0, t.capacity - t.used)
                   for t in cmap.targets)
        s = pyfuse3.StatvfsData()
        s.f_bsize = _BLKSIZE
        s.f_frsize = 4096
        s.f_blocks = cap // 4096
        s.f_bfree = s.f_bavail = free // 4096
        # Meta puts no limit on inodes: all of a large constant free, so
        # that tools that check for free inodes go ahead (half of it free
        # read as "50% of inodes used" in df -i).
        s.f_files = s.f_ffree = s.f_favail = 1 << 32
        s.f_namemax = 255
        return s

    # ---- namespace ----------------------------------------------------------------

    @_fuse_errors
    async def mkdir(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        info = await self.client.meta.mkdir((int(parent_inode), _name(name)), mode=mode & 0o7777,
                                            uid=ctx.uid, gid=ctx.gid)
        return self._entry(info.attr)

    @_fuse_errors
    async def mknod(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if not _stat.S_ISREG(mode):
            raise pyfuse3.FUSEError(errno.EPERM)  # no FIFOs, sockets or device nodes in TierFS
        info = await self.client.meta.create((int(parent_inode), _name(name)), mode=mode & 0o7777,
                                             uid=ctx.uid, gid=ctx.gid)
        return self._entry(info.attr)

    @_fuse_errors
    async def unlink(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                     ctx: pyfuse3.RequestContext) -> None:
        """Unlink; a file open through this mount is renamed to a hidden name
        in its directory instead, and removed when its last descriptor here
        closes (NFS's "silly rename"), so that it stays readable and
        writable meanwhile: the temporary-file pattern (open, unlink, use)
        of Python's ``tempfile.TemporaryFile`` and others. Until stop 48
        its first write failed with ENOENT."""
        meta = self.client.meta
        parent, n = int(parent_inode), _name(name)
        if self._nodes:
            try:
                ino = (await meta.lookup(parent, n)).attr.inode
            except NotFoundError:
                ino = 0
            node = self._nodes.get(ino)
            if node is not None and node.opens > 0 and node.silly == (parent, n):
                # Its hidden name, while still open here: busy, as NFS
                # answers (renamed to yet another hidden name before, so
                # `rm -r` of its directory ended in a puzzling ENOTEMPTY).
                raise pyfuse3.FUSEError(errno.EBUSY)
            if node is not None and node.opens > 0:
                hidden = f"{SILLY_PREFIX}{ino:x}-{secrets.token_hex(4)}"
                await meta.rename((parent, n), (parent, hidden))
                node.silly = (parent, hidden)
                return
        await meta.unlink((parent, n))

    async def _drop_silly(self, node: _Node) -> None:
        """Remove the hidden name of a file unlinked while open (lock held)."""
        if node.silly is not None:
            where, node.silly = node.silly, None
            with contextlib.suppress(NotFoundError):  # removed by hand meanwhile
                await self.client.meta.unlink(where)

    @_fuse_errors
    async def rmdir(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                    ctx: pyfuse3.RequestContext) -> None:
        await self.client.meta.rmdir((int(parent_inode), _name(name)))

    @_fuse_errors
    async def rename(self, parent_inode_old: pyfuse3.InodeT, name_old: pyfuse3.FileNameT,
                     parent_inode_new: pyfuse3.InodeT, name_new: pyfuse3.FileNameT, flags: int,
                     ctx: pyfuse3.RequestContext) -> None:
        meta = self.client.meta
        dst = (int(parent_inode_new), _name(name_new))
        if flags & ~_RENAME_NOREPLACE:
            raise pyfuse3.FUSEError(errno.EINVAL)  # RENAME_EXCHANGE, RENAME_WHITEOUT
        if flags & _RENAME_NOREPLACE:
            # Not atomic against another client creating dst meanwhile.
            try:
                await meta.lookup(*dst)
            except NotFoundError:
                pass
            else:
                raise pyfuse3.FUSEError(errno.EEXIST)
        await meta.rename((int(parent_inode_old), _name(name_old)), dst)

    @_fuse_errors
    async def symlink(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, target: pyfuse3.FileNameT,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        info = await self.client.meta.symlink((int(parent_inode), _name(name)), _name(target),
                                              uid=ctx.uid, gid=ctx.gid)
        return self._entry(info.attr)

    @_fuse_errors
    async def readlink(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileNameT:
        return os.fsencode(await self.client.meta.readlink(int(inode)))

    async def link(self, inode: pyfuse3.InodeT, new_parent_inode: pyfuse3.InodeT, new_name: pyfuse3.FileNameT,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EPERM)  # link(2): "does not support the creation of hard links"

    # ---- directories ------------------------------------------------------------------

    @_fuse_errors
    async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        # A snapshot at opendir: readdir offsets are indexes into it, stable
        # while entries are added or removed meanwhile.
        # "." and ".." first, as POSIX readdir and `ls -a` expect (the
        # kernel does not add them for a FUSE filesystem, and links no
        # dentry for them from readdirplus: no lookup to count).
        me = (await self.client.meta.stat(int(inode))).attr
        up = me
        if me.parent not in (0, me.inode):
            with contextlib.suppress(TierFSError):  # gone meanwhile, or not ours to see: "." stands in
                up = (await self.client.meta.stat(int(me.parent))).attr
        entries: list[tuple[str, pb.Attr]] = [(".", me), ("..", up)]
        entries += [(e.name, e.attr) async for e in self.client.meta.iterdir(int(inode))]
        fh = self._new_fh()
        self._dirs[fh] = entries
        return fh

    @_fuse_errors
    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self._dirs[int(fh)]
        for i in range(start_id, len(entries)):
            name, attr = entries[i]
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(attr), i + 1):
                return

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        self._dirs.pop(int(fh), None)

    # ---- files ----------------------------------------------------------------------

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _open_handle(self, inode: int, flags: int, info: pb.FileInfo | None) -> pyfuse3.FileInfo:
        node = self._nodes.get(inode)
        if node is None:
            node = self._nodes[inode] = _Node(inode)
        node.opens += 1
        if info is not None:
            node.attr = info.attr
        fh = self._new_fh()
        self._handles[fh] = _Handle(node, writable=(flags & os.O_ACCMODE) != os.O_RDONLY,
                                    reader_version=node.version, info=info, append=bool(flags & os.O_APPEND))
        # keep_cache=False: the kernel drops cached pages at open
        # (close-to-open consistency with other clients).
        return pyfuse3.FileInfo(fh=fh, keep_cache=False)

    @_fuse_errors
    async def open(self, inode: pyfuse3.InodeT, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        ino = int(inode)
        try:
            info = await self.client.meta.stat(ino)
        except NotFoundError:
            raise _stale() from None
        FileView.of(f"inode {ino}", info)  # EISDIR / EINVAL for what is not a regular file
        if self._told.get(ino) != info.attr.size and (ino not in self._nodes or self._nodes[ino].writer is None):
            # Close-to-open: the kernel would read up to the size it last
            # heard of (another client's close since grew or shrank the file:
            # a new open read a short file without an error until stop 47).
            with contextlib.suppress(OSError):
                pyfuse3.invalidate_inode(inode, attr_only=True)  # no writeback cache: it cannot block
        node = self._nodes.get(ino)
        dirty = node is not None and node.writer is not None
        if (flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY
                and (info.attr.size or len(info.chunks) or dirty)):
            # libfuse asks for atomic O_TRUNC: the kernel sends no setattr
            # for it, the open must truncate.
            if node is not None:
                async with node.lock:
                    await self._commit(node)
                    info = await self.client.meta.truncate(ino, 0)
                    node.version += 1
            else:
                info = await self.client.meta.truncate(ino, 0)
        return self._open_handle(ino, flags, info)

    @_fuse_errors
    async def create(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        try:
            info = await self.client.meta.create((int(parent_inode), _name(name)), mode=mode & 0o7777,
                                                 uid=ctx.uid, gid=ctx.gid)
        except AlreadyExistsError:
            if flags & os.O_EXCL:
                raise
            # Created by another client since the kernel's lookup.
            info = await self.client.meta.lookup(int(parent_inode), _name(name))
            return await self.open(info.attr.inode, flags, ctx), self._entry(info.attr)
        fi = self._open_handle(info.attr.inode, flags, None)
        self._nodes[info.attr.inode].attr = info.attr
        return fi, self._entry(info.attr)

    async def _writer(self, node: _Node) -> AsyncFile:
        """The inode's write session, opened now if there is none (lock held)."""
        if node.writer is None:
            c = self.client
            reply = await c.meta.open_write(node.inode, owner=self._owner, lease_ms=c.config.lease_ms)
            node.writer = AsyncFile(c, f"inode {node.inode}", "r+b", reply.file, readable=True, writable=True,
                                    append=False, session=reply)
        return node.writer

    async def _commit(self, node: _Node) -> None:
        """Publish the inode's write session, if any (lock held). The writer
        stays the node's until its commit is done: getattr meanwhile answers
        its size, not the committed size from before it (the kernel took
        that for the file's size, and another process's O_APPEND write went
        over what had just been written, until stop 47)."""
        w = node.writer
        if w is not None:
            node.version += 1
            try:
                await w.close()  # on failure it aborts: nothing of the session becomes visible
            finally:
                node.writer = None

    @_fuse_errors
    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        h = self._handles[int(fh)]
        node = h.node
        if node.writer is not None:
            async with node.lock:
                if node.writer is not None:
                    node.writer.seek(off)
                    return await node.writer.read(size)
        asked = time.monotonic()
        async with h.lock:
            cs = h.chunk_size
            first, last = (off // cs, (off + max(size, 1) - 1) // cs) if cs else (0, -1)
            if h.failed is not None and cs and h.reader_version == node.version:
                f_first, f_last, exc, ended = h.failed
                if first <= f_last and f_first <= last and ended >= asked - _READ_FAILURE_SHARED_S:
                    # Asked while a read of the same chunk was failing, or
                    # right after: that read's retries ran just now.
                    log.debug("read of inode %d at %d (%d bytes): fails as the read of chunks %d-%d did %.3f s "
                              "ago", node.inode, off, size, f_first, f_last, time.monotonic() - ended)
                    raise exc
            try:
                return await self._read_handle(h, off, size)
            except _UNREACHABLE as exc:
                if h.chunk_size:
                    cs = h.chunk_size
                    h.failed = (off // cs, (off + max(size, 1) - 1) // cs, exc, time.monotonic())
                log.warning("read of inode %d at %d (%d bytes) failed after %.1f s, the application gets %s: %s",
                            node.inode, off, size, time.monotonic() - asked,
                            errno.errorcode.get(exc.errno_value, exc.errno_value), exc)
                raise

    async def _read_handle(self, h: _Handle, off: int, size: int) -> bytes:
        node = h.node
        if h.reader is None or h.reader_version != node.version:
            if h.reader is not None:
                await h.reader.close()
                h.reader = None
            version = node.version
            info = h.info if h.info is not None and version == h.reader_version else None
            h.info = None
            if info is None:
                info = await self.client.meta.stat(node.inode)
            node.attr = info.attr
            h.reader = AsyncFile(self.client, f"inode {node.inode}", "rb", info, readable=True, writable=False,
                                 append=False, session=None)
            h.reader_version = version
            h.chunk_size = info.layout.chunk_size
        r = h.reader
        size = max(0, min(size, r.size - off))
        buf = bytearray(size)
        r.seek(off)
        n = await r.readinto(buf)
        # pyfuse3 takes any buffer: a view saves copying the bytes once more.
        return cast(bytes, memoryview(buf)[:n])

    @_fuse_errors
    async def write(self, fh: pyfuse3.FileHandleT, off: int, buf: bytes) -> int:
        h = self._handles[int(fh)]
        node = h.node
        async with node.lock:
            w = await self._writer(node)
            # O_APPEND: at the end this mount knows (the session's size, which
            # other processes' appends here moved), not the kernel's offset,
            # which comes from a size it may have had from before them.
            w.seek(w.size if h.append else off)
            n = await w.write(buf)
            node.wrote_ns = time.time_ns()
            return n

    @_fuse_errors
    async def flush(self, fh: pyfuse3.FileHandleT) -> None:
        h = self._handles[int(fh)]
        if h.writable and h.node.writer is not None:
            async with h.node.lock:
                await self._commit(h.node)

    @_fuse_errors
    async def fsync(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        node = self._handles[int(fh)].node
        if node.writer is not None:
            async with node.lock:
                await self._commit(node)

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        h = self._handles.pop(int(fh))
        node = h.node
        node.opens -= 1
        try:
            if h.reader is not None:
                await h.reader.close()
            if node.opens == 0:
                async with node.lock:
                    # Normally committed at flush already; a failure here
                    # cannot reach the application (release has no caller).
                    try:
                        await self._commit(node)
                    finally:
                        await self._drop_silly(node)
        except Exception:
            log.exception("release of inode %d", node.inode)
        finally:
            if node.opens == 0 and node.writer is None and self._nodes.get(node.inode) is node:
                del self._nodes[node.inode]

    async def commit_all(self) -> None:
        """Publish every open write session (at unmount)."""
        for node in list(self._nodes.values()):
            async with node.lock:
                try:
                    await self._commit(node)
                except Exception:
                    log.exception("commit of inode %d at unmount", node.inode)
                try:
                    await self._drop_silly(node)
                except Exception:
                    log.exception("removing %s at unmount", node.silly)
