"""The ``tierfs://`` fsspec filesystem: :class:`TierFSFileSystem`, an
``fsspec.asyn.AsyncFileSystem`` over :class:`tierfs.client.AsyncClient`.

Registered through the ``fsspec.specs`` entry point, so ``fsspec.open(
"tierfs:///ckpt/x")``, ``fsspec.filesystem("tierfs")``, pandas, pyarrow
(``PyFileSystem(FSSpecHandler(fs))``), ``torch.load`` and DCP's
``FsspecWriter``/``FsspecReader`` reach TierFS by URL. ``tierfs://a/b`` and
``tierfs:///a/b`` both name ``/a/b``. The cluster comes from the storage
option ``meta=`` or ``TIERFS_META``.

The client lives on the loop the filesystem runs on (fsspec's IO thread for a
blocking instance) and is created there on first use. Before a ``fork`` its
gRPC channels are closed (gRPC does not survive a fork with live ones); a
forked child forgets the parent's client and loop and makes its own on first
use. Clients the filesystem made are closed at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import os
import posixpath
import re
import weakref
from collections.abc import Callable, Coroutine, Iterable
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TypeVar

from fsspec.asyn import AsyncFileSystem, get_loop, sync  # type: ignore[import-untyped]
from fsspec.callbacks import DEFAULT_CALLBACK  # type: ignore[import-untyped]
from fsspec.spec import AbstractBufferedFile  # type: ignore[import-untyped]
from fsspec.utils import isfilelike, tokenize  # type: ignore[import-untyped]

from tierfs.client import AsyncClient, AsyncFile, ClientConfig, FileStat
from tierfs.config import load
from tierfs.errors import (
    AlreadyExistsError,
    ConfigError,
    InvalidArgumentError,
    InvalidRenameError,
    NotADirectoryError_,
    NotFoundError,
)
from tierfs.integrations.common import resolve

__all__ = ["TierFSFile", "TierFSFileSystem"]

T = TypeVar("T")

#: Bytes moved per step by put_file / get_file / cp_file (a multiple of the
#: usual chunk sizes, so whole chunks are encoded straight from the buffer).
STREAM_BLOCK = 8 << 20
#: Tree removal: entries removed at once.
RM_CONCURRENCY = 32
#: A ranged read asking for more than this without knowing the size looks the size up first.
_UNSIZED_READ_MAX = 64 << 20

_CLIENT_FIELDS = frozenset(f.name for f in dataclasses.fields(ClientConfig)) - {"meta"}
#: Storage options fsspec itself understands (listings cache); passed on to it.
_FSSPEC_OPTIONS = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths"})
_MODES = ("rb", "wb", "ab", "xb")

#: Every filesystem by id (fsspec filesystems compare equal by options, so not a WeakSet).
_LIVE: weakref.WeakValueDictionary[int, TierFSFileSystem] = weakref.WeakValueDictionary()


def _before_fork() -> None:
    for fs in list(_LIVE.values()):
        fs._quiesce_for_fork()


def _at_exit() -> None:
    for fs in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            fs.close(timeout=5.0)


os.register_at_fork(before=_before_fork)
atexit.register(_at_exit)


def _on_loop(loop: asyncio.AbstractEventLoop | None) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _info(st: FileStat, name: str) -> dict[str, Any]:
    """An fsspec info dict (``name`` without the protocol)."""
    typ = st.type if st.type in ("file", "directory") else "other"
    out: dict[str, Any] = {
        "name": name, "size": st.size if typ == "file" else 0, "type": typ, "mode": st.mode,
        "mtime": st.mtime, "ctime": st.ctime, "uid": st.uid, "gid": st.gid, "nlink": st.nlink,
        "ino": st.inode, "islink": st.type == "symlink",
    }
    if st.chunk_size:  # from stat; ls entries carry no layout
        out.update(chunk_size=st.chunk_size, redundancy=st.redundancy, writing=st.writing)
    return out


def _ancestors(path: str) -> Iterable[str]:
    while path not in ("/", ""):
        path = posixpath.dirname(path)
        yield path


def _slice(start: int | None, end: int | None, size: int) -> tuple[int, int]:
    """fsspec's ``cat_file`` range (Python slice semantics: negative counts
    from the end, out-of-range clamps) as absolute ``[a, b)``."""
    a, b, _ = slice(start, end).indices(size)
    return a, max(a, b)


class TierFSFileSystem(AsyncFileSystem):  # type: ignore[misc]
    """fsspec filesystem on a TierFS cluster (protocol ``tierfs``).

    Storage options: ``meta`` (``"host:port,..."`` or a list; default
    ``TIERFS_META``), or ``client=`` an existing :class:`AsyncClient` (used
    as is, not closed by the filesystem); ``config=`` a :class:`ClientConfig`;
    any :class:`ClientConfig` field by name (``transport="shm"``,
    ``request_timeout=5``; ``timeout=`` is short for ``request_timeout``);
    ``auto_mkdir`` (default True: writing a file creates its missing parent
    directories, as object stores and fsspec's own tests expect);
    ``block_size`` (default 5 MiB: the read-ahead and write buffer of
    :meth:`open`); and fsspec's own ``asynchronous``, ``loop``,
    ``batch_size`` and listings-cache options.
    """

    protocol = "tierfs"
    root_marker = "/"
    _pid: int  # set by AsyncFileSystem.__init__
    _loop: asyncio.AbstractEventLoop | None
    asynchronous: bool

    def __init__(self, meta: str | list[str] | tuple[str, ...] | None = None, *, client: AsyncClient | None = None,
                 config: ClientConfig | None = None, auto_mkdir: bool = True, block_size: int | None = None,
                 timeout: float | None = None, asynchronous: bool = False,
                 loop: asyncio.AbstractEventLoop | None = None, batch_size: int | None = None,
                 **options: Any) -> None:
        unknown = sorted(set(options) - _CLIENT_FIELDS - _FSSPEC_OPTIONS)
        if unknown:
            raise ConfigError(f"unknown tierfs:// storage option(s) {', '.join(map(repr, unknown))} (options: "
                              f"meta, client, config, auto_mkdir, block_size, timeout, any ClientConfig field)",
                              field=unknown[0])
        if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
            raise ConfigError(f"must be a positive number of bytes, not {block_size!r}", field="block_size")
        overrides = {k: v for k, v in options.items() if k in _CLIENT_FIELDS}
        if timeout is not None:
            overrides.setdefault("request_timeout", timeout)
        if client is not None:
            if not isinstance(client, AsyncClient):
                raise ConfigError(f"must be a tierfs.client.AsyncClient, not {type(client).__name__}",
                                  field="client")
            if meta is not None or config is not None or overrides:
                raise ConfigError("client= comes with its own configuration: pass client options (meta, config, "
                                  f"{', '.join(sorted(overrides)) or 'timeout'}) without it", field="client")
            cfg = client.config
        else:
            # token= (a ClientConfig field) is among the overrides.
            target = resolve({"meta": meta}, meta_key="meta", pool_key="kv_pool", where="tierfs:// storage option")
            base = config if config is not None else load(ClientConfig)
            cfg = base.replace(meta=list(target.meta), **overrides)
        # Passed on so that pickling (fsspec's __reduce__) rebuilds the same filesystem.
        storage = {k: v for k, v in {"meta": meta, "client": client, "config": config, "timeout": timeout,
                                     "block_size": block_size}.items() if v is not None}
        if not auto_mkdir:
            storage["auto_mkdir"] = False
        super().__init__(asynchronous=asynchronous, loop=loop, batch_size=batch_size, **storage, **options)
        self.config: ClientConfig = cfg
        self.auto_mkdir = auto_mkdir
        self.blocksize = block_size or AbstractBufferedFile.DEFAULT_BLOCK_SIZE
        self._given = client
        self._given_pid = os.getpid()
        self._client: AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._owned = False
        _LIVE[id(self)] = self

    # ---- the client, its loop, fork and exit --------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        # fsspec's own property refuses to work in a forked child; this one
        # forgets the parent's loop and client instead (the child makes its own).
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._client, self._client_loop, self._owned = None, None, False
            if not self.asynchronous:
                self._loop = get_loop()
        return self._loop  # type: ignore[no-any-return]

    async def _get_client(self) -> AsyncClient:
        """The client for the running loop, made on it on first use."""
        running = asyncio.get_running_loop()
        self.loop  # noqa: B018 - the fork check
        c = self._client
        if c is not None and (self._client_loop is running or not self._owned):
            return c
        if c is not None:  # made on a loop this (asynchronous) instance no longer runs on
            self._retire(c, self._client_loop)
        if self._given is not None and os.getpid() == self._given_pid:
            c, owned = self._given, False
        else:
            c, owned = AsyncClient(config=self.config), True
        self._client, self._client_loop, self._owned = c, running, owned
        return c

    @staticmethod
    def _retire(c: AsyncClient, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is not None and loop.is_running() and not loop.is_closed():
            asyncio.run_coroutine_threadsafe(c.close(), loop)

    def _quiesce_for_fork(self) -> None:
        c, loop = self._client, self._client_loop
        if c is None or loop is None or self._pid != os.getpid() or not loop.is_running() or _on_loop(loop):
            return
        fut = asyncio.run_coroutine_threadsafe(c.before_fork(), loop)
        try:
            fut.result(timeout=5.0)
        except Exception:  # never fail the caller's fork
            fut.cancel()

    def close(self, timeout: float | None = 10.0) -> None:
        """Close the client this filesystem made (a client passed as
        ``client=`` is left open). The filesystem stays usable: the next call
        makes a new client."""
        c, loop, owned = self._client, self._client_loop, self._owned
        self._client, self._client_loop, self._owned = None, None, False
        if c is None or not owned or self._pid != os.getpid():
            return
        if loop is None or not loop.is_running() or loop.is_closed():
            return
        if _on_loop(loop):
            loop.create_task(c.close())
            return
        asyncio.run_coroutine_threadsafe(c.close(), loop).result(timeout)

    async def _aclose(self) -> None:
        """``close`` for an asynchronous instance, on its loop."""
        c, owned = self._client, self._owned
        self._client, self._client_loop, self._owned = None, None, False
        if c is not None and owned:
            await c.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        async def go() -> T:
            return await coro

        return sync(self.loop, go)  # type: ignore[no-any-return]

    # ---- paths ----------------------------------------------------------------------

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = os.fspath(path) if not isinstance(path, str) else path
        if path.startswith("tierfs://"):
            path = path[len("tierfs://"):]
        elif path.startswith("tierfs::"):
            path = path[len("tierfs::"):]
        if "::" in path or "://" in path:  # another protocol's URL (a chain): left alone
            return path.rstrip("/")
        return "/" + re.sub("/{2,}", "/", path).strip("/")

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        return {}  # a URL names a path only; the cluster comes from meta= / TIERFS_META

    def unstrip_protocol(self, name: str) -> str:
        return name if name.startswith("tierfs://") else "tierfs://" + self._strip_protocol(name)

    # ---- metadata ----------------------------------------------------------------------

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        c = await self._get_client()
        st = await c.stat(path)
        if st.type != "symlink":
            return _info(st, path)
        # As fsspec's local filesystem: a link's type and size are its
        # target's, with islink and destination (a dangling one: "other").
        dest = await c.meta.readlink(path)
        try:
            out = _info(await c.stat(await c.resolve(path)), path)
        except (FileNotFoundError, NotADirectoryError):
            out = _info(st, path)
        out.update(islink=True, destination=dest)
        return out

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        c = await self._get_client()
        try:
            entries = await c.ls(path, detail=True)
        except NotADirectoryError:
            st = await c.stat(path)  # a file lists as itself, as in fsspec's local filesystem
            if st.is_dir:
                raise
            return [_info(st, path)] if detail else [path]
        infos = [_info(e, e.path) for e in entries]
        return infos if detail else [i["name"] for i in infos]

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        """fsspec's ``find``, listing each level's directories at once
        (fsspec's walks them one after another)."""
        if maxdepth is not None and maxdepth < 1:
            raise ValueError("maxdepth must be at least 1")
        detail = kwargs.pop("detail", False)
        path = self._strip_protocol(path)
        c = await self._get_client()
        out: dict[str, dict[str, Any]] = {}
        try:
            st = await c.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is not None and not st.is_dir:
            out[path] = _info(st, path)
        elif st is not None:
            if withdirs and path != "/":
                out[path] = _info(st, path)
            level, depth = [path], 1
            sem = asyncio.Semaphore(RM_CONCURRENCY)

            async def listing(d: str) -> list[FileStat]:
                async with sem:
                    try:
                        return await c.ls(d, detail=True)
                    except (FileNotFoundError, NotADirectoryError):
                        return []  # gone meanwhile: left out, as fsspec's walk does

            while level:
                below: list[str] = []
                for entries in await asyncio.gather(*(listing(d) for d in level)):
                    for e in entries:
                        if not e.is_dir:
                            out[e.path] = _info(e, e.path)
                            continue
                        if withdirs:
                            out[e.path] = _info(e, e.path)
                        if maxdepth is None or depth < maxdepth:
                            below.append(e.path)
                level, depth = below, depth + 1
        names = sorted(out)
        return {n: out[n] for n in names} if detail else names

    async def _exists(self, path: str, **kwargs: Any) -> bool:
        try:
            await self._info(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    async def _isdir(self, path: str) -> bool:
        try:
            return (await self._info(path))["type"] == "directory"  # type: ignore[no-any-return]
        except (FileNotFoundError, NotADirectoryError):
            return False

    async def _isfile(self, path: str) -> bool:
        try:
            return (await self._info(path))["type"] == "file"  # type: ignore[no-any-return]
        except (FileNotFoundError, NotADirectoryError):
            return False

    async def _checksum(self, path: str) -> int:
        """Changes whenever the file's contents may have (every write session
        bumps the data version; every chunk upload has its own generation;
        a truncate changes the size): computed from metadata, no data read."""
        path = self._strip_protocol(path)
        c = await self._get_client()
        info = await c.meta.stat(path)
        a = info.attr
        chunks = [(r.index, r.generation, r.valid, r.crc32c) for r in info.chunks]
        return int(tokenize(a.inode, a.type, a.size, a.data_version, a.mtime_ns, chunks), 16)

    def checksum(self, path: str) -> int:
        return self._run(self._checksum(path))

    async def _modified(self, path: str) -> datetime:
        return datetime.fromtimestamp((await self._info(path))["mtime"], tz=UTC)

    def modified(self, path: str) -> datetime:
        """The last modification time (UTC). TierFS keeps no creation time,
        so ``created`` is not implemented."""
        return self._run(self._modified(path))

    # ---- directories -----------------------------------------------------------------

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        c = await self._get_client()
        if path == "/":
            raise FileExistsError("/ exists")
        if create_parents:
            await self._mkdirs(c, path, exist_ok=False)
        else:
            await c.mkdir(path)

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        path = self._strip_protocol(path)
        c = await self._get_client()
        if path == "/":
            if not exist_ok:
                raise FileExistsError("/ exists")
            return
        await self._mkdirs(c, path, exist_ok=exist_ok)

    async def _mkdirs(self, c: AsyncClient, path: str, *, exist_ok: bool) -> None:
        """``mkdir -p``: one metadata call when the parent exists (the
        client's ``mkdir(parents=True)`` walks down from the root), one more
        per missing level."""
        try:
            await c.meta.mkdir(path)
            return
        except AlreadyExistsError:
            if not exist_ok:
                raise
        except NotFoundError:
            parent = posixpath.dirname(path)
            if parent == "/":
                raise
            await self._mkdirs(c, parent, exist_ok=True)
            try:
                await c.meta.mkdir(path)
                return
            except AlreadyExistsError:  # made meanwhile by a concurrent call
                if not exist_ok:
                    raise
        if not (await c.stat(path)).is_dir:
            raise FileExistsError(f"{path} exists and is not a directory")  # as os.makedirs

    async def _rmdir(self, path: str) -> None:
        path = self._strip_protocol(path)
        c = await self._get_client()
        if not (await c.stat(path)).is_dir:
            raise NotADirectoryError_(f"{path} is not a directory")
        await c.rm(path)

    def rmdir(self, path: str) -> None:
        self._run(self._rmdir(path))

    async def _ensure_parent(self, c: AsyncClient, path: str) -> bool:
        """Create ``path``'s missing parents (``auto_mkdir``); False when
        there is nothing to create."""
        parent = posixpath.dirname(path)
        if not self.auto_mkdir or parent == "/":
            return False
        await self._mkdirs(c, parent, exist_ok=True)
        return True

    # ---- removal and renames -------------------------------------------------------------

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        c = await self._get_client()
        await c.rm(path)

    async def _rm(self, path: str | list[str], recursive: bool = False, batch_size: int | None = None,
                  maxdepth: int | None = None, **kwargs: Any) -> None:
        c = await self._get_client()
        if "/" in self._strip_protocol([path] if isinstance(path, str) else list(path)):
            # As rm(1) without --no-preserve-root: refused before anything goes.
            raise InvalidArgumentError("refusing to remove the root directory (remove what is in it instead)")
        if maxdepth is not None:
            # Only what lies within maxdepth: deepest first, one level at a time
            # (a directory goes once its children have).
            paths = await self._expand_path(path, recursive=recursive, maxdepth=maxdepth)
            by_depth: dict[int, list[str]] = {}
            for p in paths:
                by_depth.setdefault(p.count("/"), []).append(p)
            for depth in sorted(by_depth, reverse=True):
                await self._bounded([c.rm(p) for p in by_depth[depth]])
            return
        paths = await self._expand_path(path, recursive=False)
        chosen = set(paths)
        tops = [p for p in paths if not any(a in chosen for a in _ancestors(p))]
        await self._bounded([self._rm_one(c, p, recursive) for p in tops])

    async def _rm_one(self, c: AsyncClient, path: str, recursive: bool) -> None:
        st = await c.stat(path)
        if not st.is_dir:
            await c.meta.unlink(path)
        elif recursive:
            await self._rm_tree(c, path)
        else:
            await c.meta.rmdir(path)  # a non-empty directory: DirectoryNotEmptyError

    async def _rm_tree(self, c: AsyncClient, path: str) -> None:
        entries = await c.ls(path, detail=True)
        await self._bounded([self._rm_tree(c, e.path) if e.is_dir else c.meta.unlink(e.path) for e in entries])
        await c.meta.rmdir(path)

    @staticmethod
    async def _bounded(coros: Iterable[Coroutine[Any, Any, Any]], limit: int = RM_CONCURRENCY) -> None:
        sem = asyncio.Semaphore(limit)

        async def one(co: Coroutine[Any, Any, Any]) -> None:
            async with sem:
                await co

        results = await asyncio.gather(*(one(co) for co in coros), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _mv(self, path1: str | list[str], path2: str, recursive: bool = False, maxdepth: int | None = None,
                  **kwargs: Any) -> None:
        """Rename (one metadata operation per source; directories move whole,
        whatever ``recursive``). ``path2`` an existing directory, or ending
        in "/", receives the sources by name, as ``cp`` would place them."""
        c = await self._get_client()
        many = isinstance(path1, list) or any(ch in path1 for ch in "*?[")
        srcs = await self._expand_path(path1) if many else [self._strip_protocol(path1)]
        dst = self._strip_protocol(path2)
        into = many or path2.endswith("/") or await self._isdir(dst)
        for src in srcs:
            target = posixpath.join(dst, posixpath.basename(src)) if into else dst
            if target == src:
                continue
            try:
                await c.rename(src, target)
            except NotFoundError:
                await c.stat(src)  # the source is missing: that error
                if (target.rstrip("/") + "/").startswith(src.rstrip("/") + "/"):
                    # Refused before auto_mkdir makes the missing parents
                    # (inside src: they stayed, until stop 47).
                    raise InvalidRenameError(f"cannot move {src} into its own subtree ({target})") from None
                if not await self._ensure_parent(c, target):
                    raise
                await c.rename(src, target)

    def mv(self, path1: str | list[str], path2: str, recursive: bool = False, maxdepth: int | None = None,
           **kwargs: Any) -> None:
        self._run(self._mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs))

    async def _mv_file(self, path1: str, path2: str) -> None:
        await self._mv(path1, path2)

    # ---- whole files ------------------------------------------------------------------------

    async def _open_file(self, c: AsyncClient, path: str, mode: str) -> AsyncFile:
        """``c.open``; a writer whose parent is missing creates it first (``auto_mkdir``)."""
        try:
            return await c.open(path, mode)
        except NotFoundError:
            if mode == "rb" or not await self._ensure_parent(c, path):
                raise
            return await c.open(path, mode)

    async def _create_empty(self, c: AsyncClient, path: str, mode: str) -> None:
        """An empty file at ``path`` without a write session (one metadata
        call): "create" fails on an existing name, "overwrite" truncates."""
        try:
            try:
                await c.meta.create(path)
            except NotFoundError:
                if not await self._ensure_parent(c, path):
                    raise
                await c.meta.create(path)
        except AlreadyExistsError:
            if mode == "create":
                raise
            st = await c.stat(path)
            if not st.is_file:
                raise IsADirectoryError(f"{path} is a directory") from None
            if st.size:
                await c.truncate(path, 0)

    async def _touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        c = await self._get_client()
        if truncate:
            await self._create_empty(c, path, "overwrite")
            return
        with contextlib.suppress(FileExistsError):  # left as is: the client has no call that only sets times
            await self._create_empty(c, path, "create")

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        """Create an empty file, or (``truncate``) empty an existing one.
        Without ``truncate`` an existing file is left as is (its mtime is
        not updated)."""
        self._run(self._touch(path, truncate=truncate, **kwargs))

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None,
                        **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        c = await self._get_client()
        if start is None and end is None:
            return await c.read_bytes(path)
        a = start or 0
        if a < 0 or end is None or end < 0 or end - a > _UNSIZED_READ_MAX or end <= a:
            a, b = _slice(start, end, (await c.stat(path)).size)
        else:
            b = end  # both known and small enough: no size look-up, the read stops at EOF
        if b <= a:
            if not (await c.stat(path)).is_file:
                raise IsADirectoryError(f"{path} is a directory")
            return b""
        buf = bytearray(b - a)
        n = await c.read_into(path, buf, a)
        return bytes(buf) if n == len(buf) else bytes(memoryview(buf)[:n])

    async def _pipe_file(self, path: str, value: Any, mode: str = "overwrite", **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        c = await self._get_client()
        if not len(memoryview(value)):
            await self._create_empty(c, path, mode)
            return
        f = await self._open_file(c, path, "xb" if mode == "create" else "wb")
        async with f:  # an exception aborts: nothing half-written becomes visible
            await f.write(value)

    async def _put_file(self, lpath: str, rpath: str, callback: Any = DEFAULT_CALLBACK, mode: str = "overwrite",
                        **kwargs: Any) -> None:
        rpath = self._strip_protocol(rpath)
        if os.path.isdir(lpath):
            await self._makedirs(rpath, exist_ok=True)
            return
        c = await self._get_client()
        with open(lpath, "rb") as src:
            size = os.fstat(src.fileno()).st_size
            callback.set_size(size)
            if not size:
                await self._create_empty(c, rpath, mode)
                return
            f = await self._open_file(c, rpath, "xb" if mode == "create" else "wb")
            async with f:
                buf = memoryview(bytearray(STREAM_BLOCK))
                while n := await asyncio.to_thread(src.readinto, buf):
                    # The writer copies (or encodes) the bytes before it
                    # returns, so the buffer is reused at once.
                    await f.write(buf[:n])
                    callback.relative_update(n)

    async def _get_file(self, rpath: str, lpath: Any, callback: Any = DEFAULT_CALLBACK, outfile: Any = None,
                        **kwargs: Any) -> None:
        rpath = self._strip_protocol(rpath)
        c = await self._get_client()
        if isfilelike(lpath):
            outfile = lpath
        elif (await c.stat(rpath)).is_dir:
            os.makedirs(lpath, exist_ok=True)
            return
        src = await c.open(rpath, "rb")
        try:
            callback.set_size(src.size)
            if outfile is None:
                os.makedirs(os.path.dirname(os.path.abspath(lpath)), exist_ok=True)
            out = outfile if outfile is not None else open(lpath, "wb")  # noqa: SIM115 - closed below
            try:
                await _pump(src, out.write, callback, to_thread=True)
            finally:
                if outfile is None:
                    out.close()
        finally:
            await src.close()

    async def _cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        path1, path2 = self._strip_protocol(path1), self._strip_protocol(path2)
        c = await self._get_client()
        try:
            src = await c.open(path1, "rb")
        except IsADirectoryError:
            await self._makedirs(path2, exist_ok=True)
            return
        try:
            if path1 == path2:
                return  # a "wb" open would truncate the source
            if not src.size:
                await self._create_empty(c, path2, "overwrite")
                return
            dst = await self._open_file(c, path2, "wb")
            async with dst:
                await _pump(src, dst.write, DEFAULT_CALLBACK, to_thread=False)
        finally:
            await src.close()

    # ---- file objects ----------------------------------------------------------------------

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, autocommit: bool = True,
              cache_options: dict[str, Any] | None = None, **kwargs: Any) -> TierFSFile:
        return TierFSFile(self, self._strip_protocol(path), mode, block_size=block_size or self.blocksize,
                          autocommit=autocommit, cache_options=cache_options, **kwargs)


async def _pump(src: AsyncFile, write: Callable[[memoryview], Any], callback: Any, *, to_thread: bool) -> None:
    """Copy ``src`` to ``write`` a block at a time; with ``to_thread`` (a
    local file) each block's write runs in a thread while the next block is
    read, using two buffers."""
    bufs = (memoryview(bytearray(STREAM_BLOCK)), memoryview(bytearray(STREAM_BLOCK)))
    pending: asyncio.Future[Any] | None = None
    i = 0
    try:
        while True:
            buf = bufs[i % 2]
            n = await src.readinto(buf)
            if pending is not None:
                await pending
                pending = None
            if not n:
                return
            if to_thread:
                pending = asyncio.ensure_future(asyncio.to_thread(write, buf[:n]))
            else:
                await write(buf[:n])
            callback.relative_update(n)
            i += 1
    finally:
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)


class TierFSFile(AbstractBufferedFile):  # type: ignore[misc]
    """A file of :class:`TierFSFileSystem` (``fs.open``): buffered, with
    random-access reads (``rb``: each cache miss is one ranged read of a
    snapshot of the file taken at open) and writes through one TierFS write
    session (``wb``, ``ab``, ``xb``), published at close. Leaving a ``with``
    block by an exception aborts a writer: nothing of it becomes visible.
    With ``autocommit=False`` (an fsspec transaction) close keeps the session
    open and ``commit()`` publishes, ``discard()`` aborts."""

    def __init__(self, fs: TierFSFileSystem, path: str, mode: str = "rb", block_size: int | None = None,
                 autocommit: bool = True, cache_type: str = "readahead", cache_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        if mode not in _MODES:
            raise ValueError(f"tierfs:// files open in modes {', '.join(_MODES)} (text modes through fsspec.open), "
                             f"not {mode!r}")
        self._af: AsyncFile | None = None
        self.fs = fs
        self._pid = os.getpid()
        kwargs.pop("size", None)  # given when unpickled; the size comes from the open below
        self._io = asyncio.Lock()  # one AsyncFile call at a time (background caches fetch from threads)
        af = fs._run(self._open_async(fs, path, mode))
        self._af = af
        try:
            super().__init__(fs, path, mode, block_size=block_size or "default", autocommit=autocommit,
                             cache_type=cache_type, cache_options=cache_options,
                             size=af.size if mode == "rb" else None, **kwargs)
        except BaseException:
            self._release(publish=False)
            raise
        if mode == "ab":
            self.loc = af.size

    @staticmethod
    async def _open_async(fs: TierFSFileSystem, path: str, mode: str) -> AsyncFile:
        c = await fs._get_client()
        return await fs._open_file(c, path, mode)

    # ---- reading ------------------------------------------------------------------------

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs._run(self._read(start, end))  # type: ignore[no-any-return]

    async def _read(self, start: int, end: int) -> bytes:
        af = self._af
        assert af is not None
        end = min(end, self.size)
        if end <= start:
            return b""
        buf = bytearray(end - start)
        async with self._io:
            af.seek(start)
            n = await af.readinto(buf)
        return bytes(buf) if n == len(buf) else bytes(memoryview(buf)[:n])

    # ---- writing ------------------------------------------------------------------------

    def _initiate_upload(self) -> None:
        pass  # the write session was opened with the file (so "xb" fails at open)

    def _upload_chunk(self, final: bool = False) -> bool:
        data = self.buffer.getbuffer()
        try:
            self.fs._run(self._write(data, final))
        finally:
            data.release()
        return True

    async def _write(self, data: memoryview, final: bool) -> None:
        af = self._af
        assert af is not None
        async with self._io:
            try:
                if len(data):
                    await af.write(data)
                if final and self.autocommit:
                    await af.close()
            except BaseException:
                await af.abort()
                raise

    def commit(self) -> None:
        """Publish the file (after close, in a transaction)."""
        af = self._af
        if af is not None and not af.closed:
            self.fs._run(af.close())

    def discard(self) -> None:
        """Abort the write session: nothing written becomes visible."""
        af = self._af
        if af is not None and not af.closed and af.writable():
            self.fs._run(af.abort())

    # ---- closing --------------------------------------------------------------------------

    closed: bool  # a property of AbstractBufferedFile

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()
        finally:
            self.closed = True
            if self.mode == "rb":
                self._release(publish=False)

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if e is not None and self.mode != "rb" and not self.closed:
            self.closed = True
            self.discard()
            return
        self.close()

    def __del__(self) -> None:
        # Never blocks, never raises: an unclosed writer is aborted (never
        # published half-written), an unclosed reader's buffers released.
        if not getattr(self, "closed", True):
            self.closed = True
            with contextlib.suppress(Exception):
                self._release(publish=False)

    def _release(self, *, publish: bool) -> None:
        """Close (reader) or abort (writer) the AsyncFile without waiting."""
        af, self._af = getattr(self, "_af", None), None
        if af is None or af.closed or self._pid != os.getpid():
            return
        loop = self.fs._client_loop
        if loop is None or not loop.is_running() or loop.is_closed():
            return
        coro = af.close() if (publish or not af.writable()) else af.abort()
        if _on_loop(loop):
            loop.create_task(coro)
        else:
            asyncio.run_coroutine_threadsafe(coro, loop)

    def __repr__(self) -> str:
        return f"<TierFSFile tierfs://{self.path} mode={self.mode!r}>"

