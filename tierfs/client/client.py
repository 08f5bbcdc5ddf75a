"""``AsyncClient``: the client SDK's engine (namespace calls, the striped
read path and the chunk upload path). ``tierfs.client.sync.Client`` wraps it.

Reads compute chunk -> placement group -> targets locally (``Router``), then
fetch the byte ranges they need of the K data fragments of many chunks at
once, straight into the caller's buffer (the code is systematic and the
fragment format positional, see ``codec``). A fragment that fails (error,
timeout, CRC mismatch) or sits on a target known to be down makes that chunk
fetch K whole fragments, parity included, and decode. Writes encode each
chunk into K+M fragments and store them on the group's targets in parallel;
the file's new size and chunk versions become visible only when the writer
closes (``commit_write``), after every fragment is durable.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import functools
import gc
import logging
import os
import posixpath
import re
import stat as _stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from tierfs.buffers import BufferPool
from tierfs.chunk import (
    ChunkRecord,
    chunk_crc,
    chunk_crc_of,
    chunk_records,
    crc32c,
    fragment_size,
    moved_positions,
    parity_size,
    valid_bytes,
)
from tierfs.client.codec import Codec, codec_for
from tierfs.client.config import ClientConfig, client_tls
from tierfs.client.fanout import first_error, ordered
from tierfs.client.readcache import ReadCacheBudget
from tierfs.client.routing import Router
from tierfs.config import load
from tierfs.errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptError,
    InsufficientTargetsError,
    InvalidArgumentError,
    IsADirectoryError_,
    NoSpaceError,
    NotADirectoryError_,
    NotFoundError,
    PermissionDeniedError,
    StaleVersionError,
    TierFSError,
    TimeoutError_,
    UnavailableError,
)
from tierfs.meta.auth import resolve_token
from tierfs.meta.client import MetaClient
from tierfs.meta.ops import split_path
from tierfs.net import DataClient
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.storage.api import FragmentInfo, FragmentKey

if TYPE_CHECKING:
    from tierfs.client.file import AsyncFile
    from tierfs.kv.client import AsyncKV

__all__ = ["AsyncClient", "FileStat"]

log = logging.getLogger(__name__)

_TYPES = {pb.INODE_TYPE_FILE: "file", pb.INODE_TYPE_DIRECTORY: "directory", pb.INODE_TYPE_SYMLINK: "symlink"}
_MODE_BITS = {pb.INODE_TYPE_FILE: _stat.S_IFREG, pb.INODE_TYPE_DIRECTORY: _stat.S_IFDIR,
              pb.INODE_TYPE_SYMLINK: _stat.S_IFLNK}
#: A fragment failing with one of these will fail again: do not retry it.
_PERMANENT = (NotFoundError, CorruptError, InvalidArgumentError, StaleVersionError)
#: Targets that let a request time out during the chunk read under way (set
#: by ``_read_chunk``): not asked again by that read. A hung target (a
#: stopped process, a stalled disk) costs a read one request timeout, not
#: one per retry round, map refresh and last resort: with more than M of a
#: chunk's targets hung, a read took about 18 request timeouts (3 minutes
#: with the defaults) to fail, until stop 46.
_TIMED_OUT: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar("tierfs_read_timed_out",
                                                                            default=None)


class _Hedged(TierFSError):
    """A fragment fetch cancelled because it lagged: read from parity. Not a
    failure of the target (``_note`` ignores it); it is marked slow instead."""


class _PassedOver(UnavailableError):
    """A data fragment not asked because its target answered slowly just now
    (marked slow, not failed): it may still answer, so a decode counts it
    among the fragments to hedge to."""


class _Latencies:
    """Recent data-fragment fetch latencies (seconds, from the chunk's first
    request to the answer) and the adaptive hedge delay they give: twice
    their p95, so a healthy node on a busy client is never hedged but a node
    lagging by more than its peers' spread is."""

    __slots__ = ("_cached", "_n", "_xs")

    def __init__(self, size: int = 256) -> None:
        self._xs: collections.deque[float] = collections.deque(maxlen=size)
        self._n = 0
        self._cached = 0.05  # before any sample: a guess that is far below any timeout

    def add(self, x: float) -> None:
        self._xs.append(x)
        self._n += 1
        if self._n % 32 == 0:
            xs = sorted(self._xs)
            self._cached = 2 * xs[int(0.95 * (len(xs) - 1))]

    def hedge_delay(self, lo: float, hi: float) -> float:
        return min(max(self._cached, lo), max(lo, hi))


@dataclass(frozen=True, slots=True)
class FileStat:
    """What ``stat``/``ls(detail=True)`` return."""

    path: str
    inode: int
    type: str  # "file" | "directory" | "symlink"
    size: int
    mode: int  # st_mode (type bits included)
    uid: int
    gid: int
    mtime: float  # seconds since the epoch
    ctime: float
    nlink: int
    redundancy: str  # "ec:4+2", "replica:3"
    chunk_size: int
    writing: bool  # a write session is open

    @property
    def is_dir(self) -> bool:
        return self.type == "directory"

    @property
    def is_file(self) -> bool:
        return self.type == "file"


def _to_stat(path: str, attr: pb.Attr, layout: pb.Layout | None, writing: bool = False) -> FileStat:
    red = layout.redundancy if layout is not None else ""
    cs = layout.chunk_size if layout is not None else 0
    return FileStat(path=path, inode=attr.inode, type=_TYPES.get(attr.type, "unknown"), size=attr.size,
                    mode=_MODE_BITS.get(attr.type, 0) | (attr.mode & 0o7777), uid=attr.uid, gid=attr.gid,
                    mtime=attr.mtime_ns / 1e9, ctime=attr.ctime_ns / 1e9, nlink=attr.nlink,
                    redundancy=red, chunk_size=cs, writing=writing)


def _join(parent: str, name: str) -> str:
    return parent.rstrip("/") + "/" + name


_SLASHES = re.compile("//+")


def _norm(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidArgumentError(f"paths are absolute (start with '/'), got {path!r}")
    try:
        path.encode()
    except UnicodeEncodeError:
        # A str from os.fsdecode of bytes that are not UTF-8: TierFS names
        # are UTF-8 (a raw UnicodeEncodeError until stop 47).
        raise InvalidArgumentError(f"path {path!r} is not valid Unicode (TierFS names are UTF-8)") from None
    if "//" in path:
        # Repeated slashes name what one does (POSIX), leading ones too:
        # "//home" failed "empty name" until stop 48 (posixpath.normpath
        # keeps exactly two leading slashes, and meta refuses an empty name).
        path = _SLASHES.sub("/", path)
    return path


def _no_trailing_slash(path: str, what: str) -> None:
    """A path ending in '/' names a directory (POSIX): a file is not made or
    moved under one (until stop 47 a write of "/d/h/" made a file "h" the
    same path then could not reach)."""
    if len(path) > 1 and path.endswith("/"):
        raise IsADirectoryError_(f"{path}: a path ending in '/' names a directory; {what} is not one")


_T = TypeVar("_T")

#: Symbolic links followed on the way to a path at most (Linux's MAXSYMLINKS).
MAX_LINK_HOPS = 40
#: Unlinks in flight in a recursive rm (they share Batch calls to meta).
RM_JOBS = 32


class _IsLink(TierFSError):
    """Internal: the last component is a symbolic link (to be followed)."""


class GenerationGoneError(InsufficientTargetsError):
    """A chunk could not be read and its fragments answered NotFound: the
    generation the reader's view names may have been garbage-collected (the
    file was rewritten since it was looked up). Callers stat again and retry
    once on the new generation."""


@dataclass(slots=True)
class FileView:
    """What a read needs to know about one file (a snapshot)."""

    path: str
    inode: int
    size: int
    chunk_size: int
    codec: Codec
    groups: tuple[int, ...]
    record: Callable[[int], ChunkRecord | None]

    @classmethod
    def of(cls, path: str, info: pb.FileInfo) -> FileView:
        if info.attr.type == pb.INODE_TYPE_DIRECTORY:
            raise IsADirectoryError_(f"{path} is a directory")
        if info.attr.type != pb.INODE_TYPE_FILE:
            raise InvalidArgumentError(f"{path} is not a regular file")
        lay = info.layout
        return cls(path, info.attr.inode, info.attr.size, lay.chunk_size, codec_for(lay), tuple(lay.groups),
                   chunk_records(info).get)


def _zero(view: memoryview) -> None:
    if len(view):
        view[:] = bytes(len(view))


def _as_bytes_view(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise InvalidArgumentError("buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class AsyncClient:
    """The TierFS client (async). ``meta``: meta replica addresses (a list or
    a comma-separated string; default from ``TIERFS_META``); other options
    as in :class:`ClientConfig` (``config=`` or keyword overrides)."""

    def __init__(self, meta: Sequence[str] | str | None = None, *, config: ClientConfig | None = None,
                 **options: Any) -> None:
        meta_list: list[str] | None = None
        if isinstance(meta, ClientConfig):
            # Client(ClientConfig(...)): a TypeError "'ClientConfig' object is not iterable" until stop 48
            if config is not None:
                raise InvalidArgumentError("a ClientConfig given twice: as the first argument and as config=")
            meta, config = None, meta
        if meta is not None:
            meta_list = [a.strip() for a in meta.split(",") if a.strip()] if isinstance(meta, str) else list(meta)
        explicit_config = config is not None
        if config is None:
            config = load(ClientConfig, overrides={**options, **({"meta": meta_list} if meta_list else {})})
        elif meta_list is not None or options:
            config = config.replace(**options, **({"meta": meta_list} if meta_list is not None else {}))
        if not config.meta and os.environ.get("TIERFS_META", "").strip():
            # A ClientConfig made in code, without meta: the environment
            # names it, as for a client built from the environment.
            config = config.replace(meta=[a.strip() for a in os.environ["TIERFS_META"].split(",") if a.strip()])
        if not config.meta:
            raise ConfigError("no meta address: pass meta=[...] (or ClientConfig(meta=[...])) or set "
                              "TIERFS_META=host:port,...", field="meta")
        self.config = config
        # Chosen once, here: the MetaClient is made later, maybe on another
        # thread ("" = no credential, never a second lookup). A token given
        # here as "" stays "" (the config loader would read "" as unset).
        # A config built here from the environment holds TIERFS_TOKEN as its
        # token: that must not outrank token_file= or the CLI's --token-file,
        # so only what the caller handed over counts as given.
        if "token" in options or "token_file" in options:
            given = options.get("token")
            self._token = resolve_token(given if isinstance(given, str) else None, options.get("token_file"),
                                        config.data_dir) or ""
        elif explicit_config:
            self._token = resolve_token(config.token, config.token_file, config.data_dir) or ""
        else:
            self._token = resolve_token(None, None, config.data_dir) or ""
        self.pool = BufferPool(config.buffer_pool_bytes)
        #: What the read caches of this client's files hold, together (AsyncFile).
        self.read_cache = ReadCacheBudget(config.read_cache_bytes)
        self._meta: MetaClient | None = None
        self._data: DataClient | None = None
        self._router: Router | None = None
        self._closed = False
        self._lat = _Latencies()
        #: Fragment fetches cancelled by hedging so far (they lagged; parity was read instead).
        self.hedged = 0
        #: Chunk writes acknowledged with fewer than K+M fragments (the scrubber adds the rest).
        self.degraded_writes = 0
        #: Fragments (or replica copies) that read back self-consistent but
        #: wrong for their chunk's CRC32C; read around, left to the scrub.
        self.corrupt_fragments = 0
        #: Chunks read only from positions the first attempt passed over
        #: (members being rebuilt, positions recorded missing).
        self.last_resort_reads = 0
        #: Data-plane requests of reads that timed out (a hung or stalled target).
        self.timed_out_requests = 0
        #: Partial reads whose STATs could not all be had (a target did not
        #: answer in time, was not usable, or holds no fragment there): the
        #: whole chunk (or copy) was read instead and checked against the
        #: record's CRC32C (``verify_partial_reads``).
        self.whole_chunk_rereads = 0
        #: Chunk generations (EC: (inode, chunk, generation)) and copies
        #: (replicas: the same and the position) whose partial reads were
        #: verified, with the serials of the fragment files verified, by
        #: position (oldest first).
        self._verified: collections.OrderedDict[tuple[int, ...], dict[int, int]] = collections.OrderedDict()
        self._kv_pools: dict[str, Any] = {}
        self._kv_tiers: Any = None
        #: Open writers by inode: what renews a write capability (their lease).
        self._cap_renewers: dict[int, Callable[[], Awaitable[Any]]] = {}
        self._kv_caps: Any = None

    # ---- lifecycle ------------------------------------------------------------

    async def placement_version(self) -> int:
        """The cluster map version writes are placed with from now on (the
        map is fetched if there is none yet): a writer reports the oldest it
        used at commit, so meta can tell which fragments went to a member
        that a move or drain replaced meanwhile."""
        router = self._parts()[2]
        if not router.version:
            await router.refresh(force=True)
        return router.version

    async def current_placement(self, *, force: bool = False) -> tuple[int, dict[int, tuple[int, ...]]]:
        """The cluster map's version and groups (id -> targets) after a
        refresh (rate-limited by ``map_refresh_interval`` unless ``force``):
        a writer compares them with where its fragments went before it
        commits."""
        router = self._parts()[2]
        await router.refresh(force=force or not router.version)
        return router.version, router.groups

    def _parts(self) -> tuple[MetaClient, DataClient, Router]:
        if self._closed:
            raise UnavailableError("the client is closed")
        if self._meta is None or self._data is None or self._router is None:
            c = self.config
            tls = client_tls(c)
            self._meta = MetaClient(c.meta, deadline=c.meta_deadline, attempt_timeout=c.meta_attempt_timeout,
                                    backoff_initial=c.backoff_initial, backoff_max=c.backoff_max, token=self._token,
                                    tls=tls)
            self._data = DataClient(transport=c.transport, connections_per_peer=c.connections_per_peer,
                                    request_timeout=c.request_timeout, connect_timeout=c.connect_timeout,
                                    tls=tls.client_ssl_context() if tls is not None else None)
            self._router = Router(self._meta, self._data, min_interval=c.map_refresh_interval,
                                  failed_ttl=c.failed_target_ttl, max_age=c.map_max_age)
            self._meta.capability_sink = self._data.caps.add
            self._data.cap_refresher = self._refresh_cap
        return self._meta, self._data, self._router

    async def _refresh_cap(self, kind: int, scope: int, op: int) -> None:
        """A fresh capability from meta (the data client retries once after
        it): KV ones by GetKVCapability, a file's read one by a stat, a
        write one by renewing the writer's lease."""
        from tierfs.capability import KIND_KV, OP_WRITE

        meta, data, router = self._parts()
        if kind == KIND_KV:
            if self._kv_caps is None:
                from tierfs.kv.cluster import KVCapabilities

                self._kv_caps = KVCapabilities(lambda: self.meta, data, router)
            await self._kv_caps.refresh(scope)
        elif op == OP_WRITE:
            renew = self._cap_renewers.get(scope)
            if renew is not None:
                await renew()
        else:
            await meta.stat(scope)

    @property
    def meta(self) -> MetaClient:
        return self._parts()[0]

    async def _drop_meta_channels(self) -> None:
        """Close the gRPC channels (a fresh MetaClient opens new ones on the
        next call). gRPC cannot survive ``fork`` with live channels; see
        ``sync``."""
        old = self._meta
        if old is None or self._router is None:
            return
        c = self.config
        self._meta = MetaClient(c.meta, deadline=c.meta_deadline, attempt_timeout=c.meta_attempt_timeout,
                                backoff_initial=c.backoff_initial, backoff_max=c.backoff_max, token=self._token,
                                tls=old.tls)
        if self._data is not None:
            self._meta.capability_sink = self._data.caps.add
        # A new client id too: its request ids start again at 1 and must not
        # match the old ones in meta's retry de-duplication.
        self._router.meta = self._meta
        await old.close()
        # Finished aio calls can outlive their channel in reference cycles
        # (a MetaClient keeps a call to read its trailing metadata); one
        # still alive at fork() leaves the child's gRPC broken (hangs,
        # SIGSEGV: "Other threads are currently calling into gRPC").
        gc.collect()

    async def before_fork(self) -> None:
        """Close the metadata gRPC channels (the next call opens new ones).
        Code that runs this client on its own loop thread calls it from an
        ``os.register_at_fork(before=...)`` hook, as ``Client`` and the
        fsspec filesystem do: gRPC cannot survive ``fork`` with live
        channels."""
        await self._drop_meta_channels()

    # ---- KV cache (tierfs.kv) ----------------------------------------------------

    @property
    def kv(self) -> AsyncKV:
        """The KV API on the default pool (``ClientConfig.kv_pool``)."""
        return self.kv_pool(self.config.kv_pool)

    def kv_pool(self, name: str) -> AsyncKV:
        """The KV API on pool ``name`` (an unknown pool fails at first use, NotFoundError)."""
        from tierfs.kv.client import AsyncKV

        got = self._kv_pools.get(name)
        if got is None:
            if not name:
                raise InvalidArgumentError("empty KV pool name")
            got = self._kv_pools[name] = AsyncKV(self, name)
        return got  # type: ignore[no-any-return]

    def _kv_local(self) -> Any:
        """The client's local KV tiers (one set, shared by its pool handles), or None."""
        c = self.config
        if not (c.kv_dram_bytes or c.kv_ssd_bytes):
            return None
        if self._kv_tiers is None:
            from tierfs.kv.client import LocalTiers

            self._kv_tiers = LocalTiers(self)
        return self._kv_tiers

    async def close(self) -> None:
        if self._closed:
            return
        try:
            for h in list(self._kv_pools.values()):
                await h.close()
            if self._kv_tiers is not None:
                await self._kv_tiers.close()
            if self._kv_caps is not None:
                await self._kv_caps.close()
        finally:
            # Even when this close is cancelled (a task cancelled during its
            # cleanup), every data-plane connection is closed before it
            # returns: nothing is left for the garbage collector.
            self._closed = True
            meta, data, router = self._meta, self._data, self._router
            self._meta = self._data = self._router = None
            waits = data.begin_close() if data is not None else []
        try:
            if router is not None:
                await router.close()
            if waits:
                await asyncio.gather(*waits, return_exceptions=True)
            if meta is not None:
                await meta.close()
        finally:
            self.pool.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # ---- namespace ------------------------------------------------------------

    async def stat(self, path: str) -> FileStat:
        """The entry itself (a symbolic link as "symlink", as lstat(2));
        links in the components before it are followed."""
        info = await self._via_links(_norm(path), self.meta.stat, last=False)
        return _to_stat(path, info.attr, info.layout, info.writing)

    async def exists(self, path: str) -> bool:
        try:
            await self._via_links(_norm(path), self.meta.stat, last=False)
        except NotFoundError:
            return False
        return True

    async def resolve(self, path: str, *, last: bool = True) -> str:
        """``path`` with its symbolic links followed, as the kernel follows
        them: in every component but the last, and in the last too with
        ``last``; a relative target is taken from the link's directory, at
        most 40 links (``InvalidArgumentError`` after). From a component that
        does not exist on, the rest is returned as written (a new file or
        directory goes there).

        Meta walks a path as written (a link in the middle of one is "not a
        directory"); the client's methods that read, write or list call this
        when meta says a component is a link, so ``/ckpt/latest/x`` works
        with ``latest`` a link (the usual "latest checkpoint" pattern)."""
        parts = [p for p in _norm(path).split("/") if p not in ("", ".")]
        cur, hops = "/", 0
        while parts:
            name = parts.pop(0)
            if name == "..":
                cur = posixpath.dirname(cur)
                continue
            nxt = _join(cur, name)
            if not parts and not last:
                return nxt
            try:
                info = await self.meta.stat(nxt)
            except NotFoundError:
                # Nothing past a missing component can be a link: the rest
                # as written (the caller's call says what is missing, or
                # makes it: mkdir -p, a new file).
                return posixpath.normpath(posixpath.join(nxt, *parts))
            if info.attr.type != pb.INODE_TYPE_SYMLINK:
                cur = nxt
                continue
            hops += 1
            if hops > MAX_LINK_HOPS:
                raise InvalidArgumentError(f"{path}: too many levels of symbolic links (more than {MAX_LINK_HOPS})")
            target = await self.meta.readlink(nxt)
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            if target.startswith("/"):
                cur = "/"
        return cur

    async def _via_links(self, path: str, fn: Callable[[str], Awaitable[_T]], *, last: bool = True) -> _T:
        """``fn(path)``; when meta says a component of ``path`` is not a
        directory (a link there), or ``fn`` finds the last one a link
        (:class:`_IsLink`; with ``last``), ``fn`` again on the path with its
        links followed. The common case costs nothing more."""
        try:
            return await fn(path)
        except (NotADirectoryError_, _IsLink) as exc:
            resolved = await self.resolve(path, last=last)
            if resolved == posixpath.normpath(path):
                if isinstance(exc, _IsLink):
                    raise InvalidArgumentError(f"{path} is not a regular file") from None
                raise
            return await fn(resolved)

    async def _file_info(self, path: str) -> pb.FileInfo:
        """meta's stat of ``path``, a link in its last component refused as
        :class:`_IsLink` (for :meth:`_via_links` to follow)."""
        info = await self.meta.stat(path)
        if info.attr.type == pb.INODE_TYPE_SYMLINK:
            raise _IsLink(path)
        return info

    @overload
    async def ls(self, path: str = ..., *, detail: Literal[False] = ...) -> list[str]: ...

    @overload
    async def ls(self, path: str = ..., *, detail: Literal[True]) -> list[FileStat]: ...

    @overload
    async def ls(self, path: str = ..., *, detail: bool) -> list[Any]: ...

    async def ls(self, path: str = "/", *, detail: bool = False) -> list[Any]:
        """Names in a directory (sorted), or FileStat entries with ``detail``
        (a link to a directory lists the directory, as ls(1) does)."""
        meta = self.meta

        async def listing(p: str) -> list[Any]:
            out: list[Any] = []
            async for e in meta.iterdir(p):
                out.append(_to_stat(_join(path, e.name), e.attr, e.layout if e.HasField("layout") else None)
                           if detail else e.name)
            return out

        out = await self._via_links(_norm(path), listing)
        out.sort(key=lambda x: x.path if detail else x)
        return out

    async def walk(self, path: str) -> AsyncIterator[tuple[str, list[str], list[str]]]:
        """Like ``os.walk`` (top-down)."""
        # An explicit stack, not nested generators: a tree may be deeper than
        # Python's recursion limit (about 2000 levels fit in a 4096-byte path).
        stack = [path]
        while stack:
            top = stack.pop()
            dirs: list[str] = []
            files: list[str] = []
            async for e in self.meta.iterdir(_norm(top)):
                (dirs if e.attr.type == pb.INODE_TYPE_DIRECTORY else files).append(e.name)
            dirs.sort()
            yield top, list(dirs), sorted(files)
            stack.extend(_join(top, d) for d in reversed(dirs))

    async def mkdir(self, path: str, *, parents: bool = False, exist_ok: bool = False, mode: int = 0o755) -> None:
        """As mkdir(2) (``parents``: mkdir -p); links before the last
        component are followed."""
        async def make(p: str) -> None:
            await self._mkdir(p, parents=parents, exist_ok=exist_ok, mode=mode)

        await self._via_links(_norm(path), make, last=False)

    async def _mkdir(self, path: str, *, parents: bool, exist_ok: bool, mode: int) -> None:
        try:  # '..' and empty components are refused as meta refuses them
            split_path(path)  # (mkdir of "/d/.." said "the root always exists", -p took "//", until stop 47)
        except TierFSError as exc:
            raise type(exc)(f"{path}: {exc}") from None
        if path == "/" and not parents:
            if exist_ok:
                return
            raise AlreadyExistsError("/: the root directory always exists")  # as mkdir(1): "File exists"
        if not parents:
            try:
                await self.meta.mkdir(path, mode=mode)
            except AlreadyExistsError:
                # A link to a directory counts as one (as mkdir(1) -p takes it).
                if not exist_ok or not (await self.stat(await self.resolve(path))).is_dir:
                    raise
            return
        cur = ""
        parts = split_path(path)  # every component checked above: a bad one leaves no parent made
        for i, name in enumerate(parts):
            cur += "/" + name
            try:
                await self.meta.mkdir(cur, mode=mode)
            except AlreadyExistsError:
                st = await self.stat(cur)
                if st.type == "symlink" and i < len(parts) - 1:
                    # _via_links follows it (mkdir -p through a link to a directory)
                    raise NotADirectoryError_(f"{cur} is a symbolic link") from None
                if st.type == "symlink" and exist_ok and (await self.stat(await self.resolve(cur))).is_dir:
                    return  # the last component, a link to a directory: there already (mkdir -p)
                if not st.is_dir:
                    raise NotADirectoryError_(f"{cur} exists and is not a directory") from None
                if i == len(parts) - 1 and not exist_ok:
                    raise

    async def rm(self, path: str, *, recursive: bool = False,
                 progress: Callable[[int], None] | None = None) -> None:
        """Remove a file, a symlink, or a directory (its contents too with
        ``recursive``; an empty one without). The root directory is
        refused (InvalidArgumentError), with nothing removed. Links before
        the last component are followed; a link there is removed itself.
        ``progress``: called with the number of entries (files, links and
        directories) removed so far, after each removal of a recursive one."""
        async def remove(p: str) -> None:
            await self._rm(p, recursive=recursive, progress=progress)

        await self._via_links(_norm(path), remove, last=False)

    async def _rm(self, path: str, *, recursive: bool = False,
                  progress: Callable[[int], None] | None = None) -> None:
        path = _norm(path)
        if posixpath.normpath("/" + path.lstrip("/")) == "/":
            raise InvalidArgumentError("refusing to remove the root directory (remove what is in it instead)")
        st = await self.meta.stat(path)
        if st.attr.type != pb.INODE_TYPE_DIRECTORY:
            await self.meta.unlink(path)
            return
        if not recursive:
            await self.meta.rmdir(path)
            return

        count = 0

        def removed() -> None:
            nonlocal count
            count += 1
            if progress is not None:
                progress(count)

        async def enter(d: str) -> Iterator[str]:
            """Unlink every non-directory entry of ``d``, RM_JOBS at a time
            (concurrent unlinks share Batch calls: one at a time, rm -r of a
            directory of 30,000 files took a quarter of an hour here);
            returns its subdirectories."""
            kids = [(e.name, e.attr.type) async for e in self.meta.iterdir(d)]
            files = iter([n for n, t in kids if t != pb.INODE_TYPE_DIRECTORY])

            async def worker() -> None:
                for name in files:
                    # Gone meanwhile (another client removed it): as rm -rf,
                    # not an error (it failed the whole removal until stop 47).
                    with contextlib.suppress(NotFoundError):
                        await self.meta.unlink(_join(d, name))
                        removed()

            tasks = [asyncio.ensure_future(worker()) for _ in range(RM_JOBS)]
            try:
                await asyncio.gather(*tasks)
            finally:  # a failure (or a cancel) stops the other workers too
                for t in tasks:
                    t.cancel()
                await asyncio.wait(tasks)
            return iter([n for n, t in kids if t == pb.INODE_TYPE_DIRECTORY])

        # Depth first with an explicit stack, not recursion: a tree may be as
        # deep as a 4096-byte path allows (about 2000 levels), past Python's
        # recursion limit (rm -r of a tree 1000 levels deep died with a
        # RecursionError, having removed nothing).
        stack = [(path, await enter(path))]
        while stack:
            d, subdirs = stack[-1]
            for name in subdirs:
                with contextlib.suppress(NotFoundError):
                    stack.append((_join(d, name), await enter(_join(d, name))))
                    break
            else:
                stack.pop()
                if stack:
                    with contextlib.suppress(NotFoundError):
                        await self.meta.rmdir(d)
                        removed()
                else:
                    await self.meta.rmdir(d)
                    removed()

    async def rename(self, src: str, dst: str) -> None:
        """As rename(2): links before the last components are followed, the
        last ones are not (a link is renamed or replaced, not its target)."""
        src, dst = _norm(src), _norm(dst)
        if (src.endswith("/") or dst.endswith("/")) and len(src) > 1 and not (await self.stat(src)).is_dir:
            raise NotADirectoryError_(f"{src}: not a directory, and a path ending in '/' names one")
        try:
            await self.meta.rename(src, dst)
        except NotADirectoryError_:
            rs, rd = await self.resolve(src, last=False), await self.resolve(dst, last=False)
            if (rs, rd) == (posixpath.normpath(src), posixpath.normpath(dst)):
                raise
            await self.meta.rename(rs, rd)

    async def symlink(self, path: str, target: str) -> None:
        """Make ``path`` a symbolic link to ``target`` (absolute, or relative
        to the link's directory; it need not exist)."""
        path = _norm(path)
        _no_trailing_slash(path, "a symbolic link")
        await self.meta.symlink(path, target)

    async def readlink(self, path: str) -> str:
        """The target a link stores (links before it followed)."""
        return await self._via_links(_norm(path), self.meta.readlink, last=False)

    async def truncate(self, path: str, size: int) -> None:
        async def trunc(p: str) -> None:
            await self.meta.truncate(p, size)

        await self._via_links(_norm(path), trunc, last=False)

    async def chmod(self, path: str, mode: int) -> None:
        """Set the permission bits (0 to 0o7777; owner or root, as
        chmod(2): docs/security-authz.md)."""
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise InvalidArgumentError(f"chmod: mode {mode!r} is not a number from 0 to 0o7777")
        await self._via_links(_norm(path), lambda p: self.meta.setattr(p, mode=mode), last=False)

    async def chown(self, path: str, uid: int | None = None, gid: int | None = None) -> None:
        """Set the owner and/or group (None: unchanged; as chown(2): root
        changes the owner, the owner may change the group to one of its
        own: docs/security-authz.md)."""
        for what, v in (("uid", uid), ("gid", gid)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32 - 1):
                raise InvalidArgumentError(f"chown: {what} {v!r} is not a number from 0 to {2**32 - 2}")
        if uid is None and gid is None:
            raise InvalidArgumentError("chown: give a uid, a gid or both")
        await self._via_links(_norm(path), lambda p: self.meta.setattr(p, uid=uid, gid=gid), last=False)

    async def set_layout(self, path: str, *, chunk_size: int = 0, redundancy: str = "",
                         stripe_width: int = 0) -> pb.Layout:
        """Layout for new files under directory ``path`` (inherited)."""
        return await self._via_links(_norm(path), lambda p: self.meta.set_layout(
            p, chunk_size=chunk_size, redundancy=redundancy, stripe_width=stripe_width), last=False)

    # ---- whole-file helpers --------------------------------------------------------

    async def read_into(self, path: str, buffer: Any, offset: int = 0) -> int:
        """Fill ``buffer`` (bytearray, mmap, numpy array: anything writable
        and C-contiguous) with the file's bytes from ``offset``, straight from
        the network; returns the bytes read (short at EOF)."""
        dest = _as_bytes_view(buffer)
        if dest.readonly:
            raise InvalidArgumentError("read_into needs a writable buffer")
        if offset < 0:
            raise InvalidArgumentError(f"negative offset {offset}")
        view = FileView.of(path, await self._via_links(_norm(path), self._file_info))
        return (await self._read_fresh(view, offset, dest))[0]

    async def read_bytes(self, path: str) -> bytes:
        view = FileView.of(path, await self._via_links(_norm(path), self._file_info))
        buf = bytearray(view.size)
        n = (await self._read_fresh(view, 0, memoryview(buf)))[0]
        return bytes(buf[:n]) if n < len(buf) else bytes(buf)

    async def write_bytes(self, path: str, data: Any) -> int:
        f = await self.open(path, "wb")
        async with f:
            n: int = await f.write(data)
        return n

    async def open(self, path: str, mode: str = "rb") -> AsyncFile:
        """An :class:`~tierfs.client.file.AsyncFile` (modes r, w, a, x, with
        optional ``+``; always binary)."""
        from tierfs.client.file import AsyncFile

        async def opened(p: str) -> AsyncFile:
            return await AsyncFile.open(self, p, mode, links_refused=True)

        path = _norm(path)
        if path == "/":
            raise IsADirectoryError_("/: is the root directory")  # an InternalError from meta until stop 47
        if mode.strip("b") != "r":
            _no_trailing_slash(path, "a file opened for writing")
        return await self._via_links(path, opened)

    # ---- the read path ----------------------------------------------------------

    async def _read_fresh(self, view: FileView, offset: int, dest: memoryview) -> tuple[int, FileView]:
        """``_read_range``, and once more on a fresh look-up of the file when
        a chunk cannot be read from its generation and the file was rewritten
        since ``view`` was taken: the old generation collected (its fragments
        answer NotFound), or too few of its fragments left while the new one
        is whole. Returns the bytes read and the view that served them."""
        try:
            return await self._read_range(view, offset, dest), view
        except InsufficientTargetsError as exc:  # GenerationGoneError too
            try:
                info = await self.meta.stat(view.inode)
            except TierFSError:
                raise exc from None  # the read's own error, not the look-up's
            fresh = FileView.of(view.path, info)
            cs = view.chunk_size
            first, last = offset // cs, (offset + max(len(dest), 1) - 1) // cs
            if fresh.inode == view.inode and all(fresh.record(i) == view.record(i) for i in range(first, last + 1)):
                raise  # nothing changed: the fragments really are gone
            return await self._read_range(fresh, offset, dest), fresh

    async def _read_range(self, view: FileView, offset: int, dest: memoryview) -> int:
        """Read ``[offset, offset+len(dest))`` of ``view`` into ``dest``
        (clipped at EOF); returns the bytes read. Bytes past a chunk's valid
        length (tierfs.chunk.valid_bytes) and holes read as zeros."""
        end = min(offset + len(dest), view.size)
        if end <= offset:
            return 0
        cs = view.chunk_size
        jobs: list[Callable[[], Awaitable[None]]] = []
        for idx in range(offset // cs, (end - 1) // cs + 1):
            cstart = idx * cs
            a = max(offset, cstart) - cstart
            b = min(end, cstart + cs) - cstart
            d = dest[cstart + a - offset: cstart + b - offset]
            rec = view.record(idx)
            valid = 0 if rec is None else valid_bytes(rec, idx, cs, view.size)
            if valid < b:
                _zero(d[max(0, valid - a):])  # a hole, or past the valid bytes
            if rec is None or valid <= a:
                continue
            jobs.append(functools.partial(self._read_chunk, view, idx, rec, a, min(b, valid), d[: min(b, valid) - a]))
        err = first_error(await ordered(jobs, self.config.read_concurrency))
        if err is not None:
            raise self._read_refused(view, err) or err
        return end - offset

    def _read_refused(self, view: FileView, err: BaseException) -> PermissionDeniedError | None:
        """A PermissionDeniedError for a read the storage daemons refused for
        want of a capability because meta minted none (the caller may not read
        the file: Stat/Lookup answer anyway, as stat(2), but carry no read
        capability). Until then ``cat`` of another user's 0600 file said the
        chunk was unreadable, as if its data were lost."""
        from tierfs.net.protocol import Op

        if (not isinstance(err, InsufficientTargetsError) or "UnauthenticatedError" not in str(err)
                or self._data is None
                or self._data.caps.lookup(int(Op.READ), view.inode) is not None):
            return None
        exc = PermissionDeniedError(
            f"permission denied: read {view.path}: meta granted no read capability for it (inode "
            f"{view.inode}): the caller lacks read (r) permission on the file, or the capability expired")
        exc.__cause__ = err
        return exc

    async def _read_chunk(self, view: FileView, idx: int, rec: ChunkRecord, a: int, b: int,
                          dest: memoryview) -> None:
        self._parts()
        if not view.groups:
            raise StaleVersionError(f"{view.path} has no placement groups")
        gid = view.groups[idx % len(view.groups)]
        token = _TIMED_OUT.set(set()) if _TIMED_OUT.get() is None else None
        try:
            await self._read_chunk_attempts(view, idx, rec, a, b, dest, gid)
        finally:
            if token is not None:
                _TIMED_OUT.reset(token)

    async def _read_chunk_attempts(self, view: FileView, idx: int, rec: ChunkRecord, a: int, b: int,
                                   dest: memoryview, gid: int) -> None:
        _, _, router = self._parts()
        for attempt in (0, 1):
            used = router.version
            members = await router.targets(gid)
            if len(members) != view.codec.width:
                raise StaleVersionError(f"group {gid} has {len(members)} targets; {view.codec!r} needs "
                                        f"{view.codec.width}")
            targets, rebuilding = router.read_targets(gid, members)
            # Positions the chunk's record lists as not stored (a degraded
            # write, a scrub finding) are never asked: a returning node may
            # hold nothing there, or only an older generation's fragment.
            skip = rebuilding | frozenset(rec.missing)
            try:
                await self._read_from(view, idx, rec, targets, a, b, dest, skip)
                return
            except (InsufficientTargetsError, CorruptError) as exc:
                # The group may have moved (a target replaced, or balanced
                # onto another node): retry once on a newer map. Another
                # chunk's refresh may have fetched it already (then
                # ``refresh`` is rate-limited and says False): what counts is
                # whether the map differs from the one this attempt used. So
                # too when what this map's members hold does not decode to
                # the chunk (CorruptError): a former member's copy may be
                # wrong where the new member's is right (the file checker
                # soak, seed 16516: a forged fragment on the former member
                # of a moved position, two nodes down, and a reader whose
                # map predated the move).
                if attempt == 0:
                    with contextlib.suppress(TierFSError):
                        await router.refresh()
                    if router.version != used or router.read_targets(gid, router.groups.get(gid, ())) != (
                            targets, rebuilding):
                        continue
                if isinstance(exc, CorruptError):
                    raise
                # Last resort: the positions passed over above, at the group's
                # current members. A member being rebuilt may hold this
                # chunk's fragment already (its former member is the one that
                # died), and a position the record lists as missing may hold
                # the committed generation after all (a write that landed
                # after its writer gave up on it). Whatever they return is
                # checked against the chunk's CRC32C like any other fragment.
                if tuple(members) != targets or skip:
                    with contextlib.suppress(InsufficientTargetsError):
                        await self._read_from(view, idx, rec, tuple(members), a, b, dest, frozenset())
                        self.last_resort_reads += 1
                        return
                raise

    async def _read_from(self, view: FileView, idx: int, rec: ChunkRecord, targets: tuple[int, ...], a: int,
                         b: int, dest: memoryview, skip: frozenset[int]) -> None:
        if view.codec.replicated:
            await self._read_replica(view, idx, rec, targets, a, b, dest, skip)
        else:
            await self._read_ec(view, idx, rec, targets, a, b, dest, skip)

    @staticmethod
    def _why_not_asked(router: Any, rec: ChunkRecord, targets: tuple[int, ...], j: int,
                       skip: frozenset[int]) -> str:
        """Why fragment ``j`` was passed over, in words that name the cause
        (it used to say "offline, failed just now or being rebuilt" for all
        of them, also for a fragment a reader had found corrupt)."""
        t = targets[j]
        if j in rec.missing:
            return (f"fragment recorded as not stored on target {t} (a degraded write, or found missing or "
                    f"corrupt by a reader or the scrub; the repair rebuilds it)")
        if j in skip:
            return f"target {t} is being rebuilt"
        if router.down(t):
            return f"target {t} is offline in the cluster map"
        if router.failed_recently(t):
            return f"a request to target {t} failed just now"
        return f"target {t} answered slowly just now"

    def _note(self, target: int, exc: TierFSError) -> None:
        # A refused connection is cheap to try again; a target that let a
        # request time out (stalled, overloaded) is avoided for longer.
        if isinstance(exc, TimeoutError_):
            self.timed_out_requests += 1
            self._parts()[2].mark_failed(target, factor=4.0)
            hung = _TIMED_OUT.get()
            if hung is not None:
                hung.add(target)
        elif isinstance(exc, UnavailableError):
            self._parts()[2].mark_failed(target)

    async def _read_ec(self, view: FileView, idx: int, rec: ChunkRecord, targets: tuple[int, ...], a: int, b: int,
                       dest: memoryview, skip: frozenset[int] = frozenset()) -> None:
        """Chunk bytes ``[a, b)`` into ``dest``; positions in ``skip`` (members
        still being rebuilt, fragments not stored) are never asked."""
        _, data, router = self._parts()
        codec = view.codec
        cs, ver = view.chunk_size, rec.generation
        f = codec.frag_size(cs)
        pieces: list[tuple[int, int, memoryview]] = []
        for j in range(codec.k):
            # A fragment is stored trimmed: what lies past its stored length
            # reads as zeros and is not asked for.
            stored = j * f + fragment_size(j, codec.k, cs, rec.length)
            lo, hi = max(a, j * f), min(b, (j + 1) * f)
            if lo < hi and hi > stored:
                _zero(dest[max(lo, stored) - a: hi - a])
                hi = max(lo, stored)
            if lo < hi:
                pieces.append((j, lo - j * f, dest[lo - a: hi - a]))
        if not pieces:
            return
        bad: dict[int, TierFSError] = {}
        whole: dict[int, int] = {}  # data fragments read whole into dest: bytes they had
        down = [j for j, _, _ in pieces if j in skip or not router.usable(targets[j])]
        vkey = (view.inode, idx, ver)
        read_serials: dict[int, int] = {}  # position -> serial of the fragment file read
        if down:
            for j in down:
                why = self._why_not_asked(router, rec, targets, j, skip)
                slow = j not in skip and j not in rec.missing and router.only_slow(targets[j])
                bad[j] = _PassedOver(why) if slow else UnavailableError(why)
        else:
            keys = [FragmentKey(view.inode, idx, j, ver) for j, _, _ in pieces]
            items = [(targets[j], k, d, o) for (j, o, d), k in zip(pieces, keys, strict=True)]
            hedge = self._hedge_delay()
            res: list[int | TierFSError]
            crcs: list[int] = []
            serials: list[int] = []
            nonempty = [j for j in range(codec.k) if fragment_size(j, codec.k, cs, rec.length)]
            # A partial read: the data fragments' stored CRC32Cs, asked
            # alongside, stand in for the whole chunk's. Once they matched,
            # the fragment files' serials are remembered: a later partial
            # read whose answers carry the same serials read the very files
            # verified and needs no stat (docs/client.md, "Partial reads").
            stats: asyncio.Future[list[FragmentInfo | TierFSError]] | None = None
            partial = self.config.verify_partial_reads and not (a == 0 and b >= rec.length)
            cached = self._verified.get(vkey) if partial else None
            # Only where every target answers now: a stat must never hold a read up.
            if partial and cached is None and all(router.usable(targets[j]) and j not in skip for j in nonempty):
                stats = asyncio.ensure_future(data.stat_batch(
                    [(targets[j], FragmentKey(view.inode, idx, j, ver)) for j in nonempty],
                    timeout=self.config.request_timeout))
            t0 = time.monotonic()
            try:
                if hedge is None:
                    res = await data.read_batch(items, timeout=self.config.request_timeout, crcs=crcs,
                                                serials=serials)
                else:
                    # Parity can stand in only where its target may answer.
                    stand_in = sum(1 for j in range(codec.k, codec.width) if j not in skip
                                   and not router.down(targets[j]) and not router.failed_recently(targets[j]))
                    res = await self._hedged_batch(items, hedge, stand_in, crcs, serials=serials)
            except BaseException:
                if stats is not None:
                    stats.cancel()
                    await asyncio.gather(stats, return_exceptions=True)
                raise
            for (j, _, _), r in zip(pieces, res, strict=True):
                if isinstance(r, _Hedged):
                    router.mark_slow(targets[j], self.config.slow_target_ttl)
            got_crcs: dict[int, int] = {}
            for (j, o, d), r, c in zip(pieces, res, crcs, strict=True):
                if isinstance(r, int) and r == len(d):
                    if o == 0 and len(d) == fragment_size(j, codec.k, cs, rec.length):
                        whole[j] = r
                        got_crcs[j] = c
                elif isinstance(r, int):
                    bad[j] = CorruptError(f"fragment {j} on target {targets[j]} returned {r} of the {len(d)} bytes "
                                          f"its chunk record gives it")
                else:
                    bad[j] = r
                    self._note(targets[j], r)
            read_serials = {j: sr for (j, _, _), sr in zip(pieces, serials, strict=True)}
            if stats is not None and bad:
                stats.cancel()  # the decode checks the chunk's CRC32C itself
                await asyncio.gather(stats, return_exceptions=True)
            elif not bad and cached is not None and all(sr and cached.get(j) == sr for j, sr in read_serials.items()):
                return  # the very fragment files verified before
            elif not bad and cached is not None:
                # Some fragment read was replaced since the chunk was verified
                # (a repair, or bytes that are not the chunk's): verify again.
                self._verified.pop(vkey, None)
                if all(router.usable(targets[j]) and j not in skip for j in nonempty):
                    stats = asyncio.ensure_future(data.stat_batch(
                        [(targets[j], FragmentKey(view.inode, idx, j, ver)) for j in nonempty],
                        timeout=self.config.request_timeout))
            if stats is not None and not bad:
                # The stats may take a little longer than the read, not a
                # stalled target's timeout: past that (or when one failed)
                # the whole chunk is read and checked instead.
                took = time.monotonic() - t0
                await asyncio.wait({stats}, timeout=min(self.config.request_timeout / 4,
                                                        max(self.config.hedge_min, 3 * took)))
                if not stats.done():
                    stats.cancel()
                    await asyncio.gather(stats, return_exceptions=True)
                    await self._reread_whole(view, idx, rec, targets, a, b, dest, skip)
                    return
                if any(isinstance(i, TierFSError) for i in stats.result()):
                    await self._reread_whole(view, idx, rec, targets, a, b, dest, skip)
                    return
                why = self._check_stats(stats.result(), nonempty, codec.k, cs, rec, read_serials)
                if why:
                    await self._heal_chunk(view, idx, rec, targets, a, b, dest, skip, why)
                return
            if not bad:
                # The whole chunk was read: its data fragments' CRC32Cs (each
                # checked on arrival) must also combine to the chunk record's,
                # which catches a fragment that is wrong but self-consistent
                # (written with its own CRC). Tens of microseconds, no pass
                # over the bytes.
                if len(whole) == len(pieces) == len(nonempty) and a == 0 and b >= rec.length:
                    got = chunk_crc_of((got_crcs[j], whole[j]) for j, _, _ in pieces)
                    if got != rec.crc:
                        await self._heal_chunk(view, idx, rec, targets, a, b, dest, skip,
                                               f"its data fragments have crc32c {got:#010x}")
                    elif self.config.verify_partial_reads and all(read_serials.values()):
                        # The very files later partial reads may be served from.
                        self._remember_verified(vkey, read_serials)
                elif partial:
                    # A data fragment's STAT could not be asked (its target
                    # not usable, or no fragment stored there).
                    await self._reread_whole(view, idx, rec, targets, a, b, dest, skip)
                return
        used = {j: read_serials.get(j, 0) for j in whole}
        if await self._decode_into(view, idx, rec, targets, a, b, dest, bad, whole, skip, used) and \
                self.config.verify_partial_reads and used and all(used.values()):
            # The data fragments the verified decode used held the chunk's
            # bytes: partial reads from those same files need no STAT.
            self._remember_verified(vkey, used)

    async def _reread_whole(self, view: FileView, idx: int, rec: ChunkRecord, targets: tuple[int, ...], a: int,
                            b: int, dest: memoryview, skip: frozenset[int]) -> None:
        """A partial read of an EC chunk whose data fragments' STATs could not
        all be had: its bytes are checked only against their own CRC32C,
        which a fragment that is wrong but self-consistent passes. Read the
        whole chunk instead (checked against the record's CRC32C, decoded
        around a missing or wrong fragment) and return ``[a, b)`` of it. The
        data fragments it used are remembered as verified, so later partial
        reads from them need neither a STAT nor this."""
        self.whole_chunk_rereads += 1
        n = rec.length
        buf = self.pool.get(n)
        try:
            await self._read_ec(view, idx, rec, targets, 0, n, buf, skip)
            hi = max(a, min(b, n))
            dest[: hi - a] = buf[a:hi]
            _zero(dest[hi - a:])
        finally:
            self.pool.put(buf)

    def _check_stats(self, infos: list[FragmentInfo | TierFSError], stored: list[int], k: int, cs: int,
                     rec: ChunkRecord, read_serials: dict[int, int]) -> str:
        """The verdict on a partial read's data-fragment stats (every one
        answered): '' when their stored lengths and CRC32Cs match the chunk
        record; else what is wrong. ``read_serials``: the serial of each fragment file the read
        got its bytes from. A stat that describes another file than the one
        read (replaced between the two) proves nothing about the bytes: the
        chunk is then judged whole (the heal path). When every serial is
        known and they agree, the fragment files are remembered as verified."""
        got = [i for i in infos if not isinstance(i, TierFSError)]
        if len(got) != len(infos):
            raise AssertionError("_check_stats: every stat must have answered")
        by_j = dict(zip(stored, got, strict=True))
        for j, sr in read_serials.items():
            i = by_j.get(j)
            if i is not None and sr and i.serial and sr != i.serial:
                return f"its data fragment {j} was replaced while it was read"
        for j, i in by_j.items():
            if i.size != fragment_size(j, k, cs, rec.length):
                return f"its data fragment {j} is stored with {i.size} bytes, not {fragment_size(j, k, cs, rec.length)}"
        crc = chunk_crc_of((i.crc32c, i.size) for i in got)
        if crc != rec.crc:
            return f"its data fragments' stored crc32c combine to {crc:#010x}"
        if all(i.serial for i in got) and all(sr == by_j[j].serial for j, sr in read_serials.items() if j in by_j):
            self._remember_verified((got[0].key.inode, got[0].key.chunk, got[0].key.version),
                                    {j: i.serial for j, i in by_j.items()})
        return ""

    async def _heal_chunk(self, view: FileView, idx: int, rec: ChunkRecord, targets: tuple[int, ...], a: int,
                          b: int, dest: memoryview, skip: frozenset[int], why: str) -> None:
        """The fragments read do not match the chunk record's CRC32C although
        each matched its own: fetch every fragment of the chunk, find which
        ones differ from what the others decode to (fewest first, as the
        scrub does), and return chunk bytes ``[a, b)`` from the rest. If no
        K of them decode to the recorded CRC32C, CorruptError: nothing
        wrong is ever returned. The bad fragments are logged and counted
        (``corrupt_fragments``); the next whole-chunk scrub pass rewrites
        them (docs/repair.md)."""
        from tierfs.storage.repair import _File, find_bad_fragments, solve_chunk

        _, data, router = self._parts()
        codec, cs, ver = view.codec, view.chunk_size, rec.generation
        k, width = codec.k, codec.width
        sizes = [fragment_size(j, k, cs, rec.length) for j in range(width)]
        ask = [j for j in range(width) if j not in skip and sizes[j]]
        # Targets that answer now, unless too few are left to tell a bad
        # fragment from the rest (K + 1).
        if sum(1 for j in range(width) if j not in skip and router.usable(targets[j])) > k:
            skip = skip | {j for j in range(width) if not router.usable(targets[j])}
            ask = [j for j in ask if j not in skip]
        bufs = {j: memoryview(bytearray(sizes[j])) for j in ask}
        items = [(targets[j], FragmentKey(view.inode, idx, j, ver), bufs[j], 0) for j in ask]
        hedge = self._hedge_delay()
        if hedge is not None and len(ask) > k + 1:
            # Hedged like any read: once K + 1 have answered, enough to tell
            # one wrong fragment from the rest, a lagging one is not waited
            # for; it is asked again below, with the whole timeout, only if
            # those do not tell. Until stop 51 a stalled target here cost
            # the whole request timeout (10 s) on every such read.
            res = await self._hedged_batch(items, hedge, len(ask) - (k + 1), peers_first=True)
        else:
            res = await data.read_batch(items, timeout=self.config.request_timeout)
        have: dict[int, bytes] = {j: b"" for j in range(width) if j not in skip and not sizes[j]}
        errors: list[str] = []
        short: dict[int, str] = {}  # wrong stored lengths: bad, whatever the rest decode to
        hedged: set[int] = set()
        for j, r in zip(ask, res, strict=True):
            if isinstance(r, int) and r == sizes[j]:
                have[j] = bytes(bufs[j])
            elif isinstance(r, int):
                short[j] = f"{r} bytes, its chunk record gives it {sizes[j]}"
            elif isinstance(r, _Hedged):
                hedged.add(j)
                router.mark_slow(targets[j], self.config.slow_target_ttl)
            else:
                errors.append(f"fragment {j} on target {targets[j]}: "
                              f"{f'{r} bytes' if isinstance(r, int) else f'{type(r).__name__}: {r}'}")
        f = _File(kind=pb.REDUNDANCY_KIND_EC, k=k, m=codec.m, chunk_size=cs, size=rec.length, groups=[],
                  chunks={idx: rec}, writing=False, data_version=0)
        verdict = await asyncio.to_thread(find_bad_fragments, f, rec, have) if len(have) >= k else None
        asked = set(ask) - hedged
        late = [j for j in range(width) if j not in asked and j not in have]
        if verdict is None and late:
            # As a last resort, as ``_read_chunk`` does: the positions passed
            # over (listed missing, members being rebuilt, targets that
            # failed a moment ago) may hold the committed fragment all the
            # same, and one more good fragment is what tells a wrong one from
            # the rest. Judged like the others. (The file checker soak, seed
            # 12012: a target skipped as just failed while the K + 1 thought
            # usable held a forged and a corrupt fragment.)
            lbufs = {j: memoryview(bytearray(sizes[j])) for j in late if sizes[j]}
            lres = await data.read_batch([(targets[j], FragmentKey(view.inode, idx, j, ver), lbufs[j], 0)
                                          for j in lbufs], timeout=self.config.request_timeout)
            have.update({j: b"" for j in late if not sizes[j]})
            for j, r in zip(lbufs, lres, strict=True):
                if isinstance(r, int) and r == sizes[j]:
                    have[j] = bytes(lbufs[j])
                else:
                    errors.append(f"fragment {j} on target {targets[j]} (a last resort): "
                                  f"{f'{r} bytes' if isinstance(r, int) else f'{type(r).__name__}: {r}'}")
            verdict = await asyncio.to_thread(find_bad_fragments, f, rec, have) if len(have) >= k else None
        where = f"{view.path}: chunk {idx} (inode {view.inode}, generation {ver:#x})"
        errors += [f"fragment {j} on target {targets[j]}: {e}" for j, e in short.items()]
        if verdict is None:
            raise CorruptError(
                f"{where}: {why}, the chunk record {rec.crc:#010x}, and no {k} of the fragments "
                f"{sorted(have)} decode to it: not returned" + (f" ({'; '.join(errors)})" if errors else ""))
        good = {j: v for j, v in have.items() if j not in verdict}
        chunk = await asyncio.to_thread(solve_chunk, f, rec, good)
        verdict = {**verdict, **short}
        self.corrupt_fragments += len(verdict)
        log.warning("%s: %s, the chunk record %#010x: fragment(s) %s differ from what the others decode to; "
                    "returned the chunk decoded from %s (the scrub rewrites them)", where, why, rec.crc,
                    ", ".join(f"{j} on target {targets[j]}" for j in sorted(verdict)) or "none", sorted(good))
        fs = codec.frag_size(cs)
        for j in range(k):
            lo, hi = max(a, j * fs), min(b, (j + 1) * fs)
            if lo >= hi:
                continue
            src = chunk[j][lo - j * fs: hi - j * fs]
            dest[lo - a: lo - a + len(src)] = src
            _zero(dest[lo - a + len(src): hi - a])

    def _hedge_delay(self) -> float | None:
        """How long the data fragments of a chunk may take before parity is
        asked instead; None: hedging is off."""
        cfg = self.config
        if not cfg.hedged_reads:
            return None
        if cfg.hedge_after > 0:
            return cfg.hedge_after
        return self._lat.hedge_delay(cfg.hedge_min, cfg.request_timeout / 4)

    async def _hedged_batch(self, items: Sequence[tuple[int, FragmentKey, memoryview, int]], hedge: float,
                            m: int, crcs: list[int] | None = None, *,
                            peers_first: bool = False, serials: list[int] | None = None) -> list[int | TierFSError]:
        """``read_batch`` with one request per fragment; those still running
        after ``hedge`` seconds (and three times as long as the slowest
        answer so far, up to a quarter of the request timeout: a busy client
        slows every node alike) are cancelled and come back as
        :class:`_Hedged`, once at most as many are left as parity can stand
        in for (``m`` less the fragments that failed). ``peers_first``: none
        is given up before one of them has answered (a decode's fetches: on
        the clock alone it would give up the very fragments it needs). A cancelled request never writes its buffer again
        (the data plane drops the connection if its payload was landing)."""
        _, data, _ = self._parts()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        timeout = self.config.request_timeout
        lat = self._lat

        last = 0.0  # when the latest answer so far came (since t0)

        got_crcs: dict[int, int] = {}
        got_serials: dict[int, int] = {}

        async def one(n: int, item: tuple[int, FragmentKey, memoryview, int]) -> int | TierFSError:
            nonlocal last
            c: list[int] = []
            sr: list[int] = []
            r = (await data.read_batch([item], timeout=timeout, crcs=c, serials=sr))[0]
            if isinstance(r, int):
                got_crcs[n] = c[0]
                got_serials[n] = sr[0]
                last = loop.time() - t0
                lat.add(last)
            return r

        tasks = [loop.create_task(one(n, it)) for n, it in enumerate(items)]
        try:
            done, pending = await asyncio.wait(tasks, timeout=hedge)
            # A straggler lags its peers, not just the clock: when the others
            # themselves took long (bandwidth shared by many chunks in flight),
            # give it three times their time before reading parity instead.
            # Never past a quarter of the request timeout, though: on a loaded
            # machine the peers can take long enough for three times their
            # time to reach the timeout itself. While more are still out than
            # parity can stand in for (``m``, less the fragments that failed),
            # wait for answers until it can (each request has its own
            # deadline). Waiting for all of them then, as before, made a
            # stalled node cost the whole request timeout whenever its peers
            # were slower than the hedge delay (a fresh client's first reads,
            # a busy machine).
            cap = max(hedge, timeout / 4)

            def spare() -> int:  # how many more missing fragments parity can stand in for
                return m - sum(1 for t in done if t.exception() is not None or not isinstance(t.result(), int))

            while pending:
                if len(pending) > spare() or (peers_first and not last):
                    more, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    done |= more
                    continue
                if not done or (wait := min(3 * last, cap) - (loop.time() - t0)) <= 0:
                    break
                more, pending = await asyncio.wait(pending, timeout=wait)
                done |= more
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
                self.hedged += sum(1 for t in pending if t.cancelled())
        finally:
            left = [t for t in tasks if not t.done()]
            for t in left:
                t.cancel()
            if left:  # we are being cancelled: let them let go of their buffers first
                await asyncio.gather(*left, return_exceptions=True)
        out: list[int | TierFSError] = []
        for it, t in zip(items, tasks, strict=True):
            if t.cancelled():
                out.append(_Hedged(f"fragment {it[1]} on target {it[0]} lagged more than {hedge * 1e3:.0f} ms: "
                                   "read from parity instead"))
            else:
                out.append(t.result())
        if crcs is not None:
            crcs[:] = [got_crcs.get(n, 0) for n in range(len(items))]
        if serials is not None:
            serials[:] = [got_serials.get(n, 0) for n in range(len(items))]
        return out

    async def _decode_into(self, view: FileView, idx: int, rec: ChunkRecord, targets: tuple[int, ...], a: int,
                           b: int, dest: memoryview, bad: dict[int, TierFSError], whole: dict[int, int],
                           skip: frozenset[int] = frozenset(), used: dict[int, int] | None = None) -> bool:
        """Fetch whole fragments from any K targets (data first, then parity)
        and rebuild ``dest`` (chunk bytes ``[a, b)``) from them. ``whole``:
        data fragments already read whole into their place in ``dest``
        (they count towards K without a second fetch). Data fragments whose
        place lies wholly inside ``dest`` are fetched straight into it; the
        rest (parity, partial ranges) into pool buffers. Every fragment must
        have the length the chunk record gives it, and the K data fragments
        (fetched or rebuilt) must match the record's CRC32C before a byte is
        returned. ``used``: the serials of the fragment files in ``whole``;
        on return, those of every data fragment the decode used (0: not
        known). True: decoded and verified; False: the chunk did not match
        its record, and ``dest`` was filled by ``_heal_chunk`` instead."""
        _, data, router = self._parts()
        codec, cfg = view.codec, self.config
        cs, ver = view.chunk_size, rec.generation
        k, f = codec.k, codec.frag_size(cs)
        sizes = [fragment_size(j, k, cs, rec.length) for j in range(codec.width)]
        errors: dict[int, TierFSError] = dict(bad)
        perm = {j for j, e in bad.items() if isinstance(e, _PERMANENT)} | set(skip)
        for j in skip:
            errors.setdefault(j, UnavailableError(self._why_not_asked(router, rec, targets, j, skip)))
        hung = _TIMED_OUT.get() or set()
        for j in range(codec.width):
            if targets[j] in hung and j not in perm and j not in whole:
                errors.setdefault(j, TimeoutError_(f"target {targets[j]} let a request time out earlier in this read"))
                perm.add(j)
        order = sorted(range(codec.width), key=lambda j: (j in bad, not router.usable(targets[j]), j))
        # A data fragment's place in dest, when the range covers all of it.
        place = {j: dest[j * f - a: j * f - a + f] for j in range(k) if a <= j * f and (j + 1) * f <= b}
        have: dict[int, memoryview] = {j: place[j][:n] for j, n in whole.items() if j in place}
        bufs: list[memoryview] = []
        tried: set[int] = set()
        rounds, delay = 1, cfg.backoff_initial
        try:
            while len(have) < k:
                need = k - len(have)
                cands = [j for j in order if j not in have and j not in perm and j not in tried]
                if len(cands) < need:
                    left = [j for j in order if j not in have and j not in perm]
                    if rounds >= cfg.retries or len(left) < need:
                        detail = "; ".join(f"fragment {j} on target {targets[j]}: {type(e).__name__}: {e}"
                                           for j, e in sorted(errors.items()) if j not in have)
                        unasked = [j for j in left if j not in errors]
                        if unasked:
                            detail += (f"; fragment{'s' if len(unasked) > 1 else ''} "
                                       f"{', '.join(map(str, unasked))} not asked: with "
                                       f"{'them' if len(unasked) > 1 else 'it'} too few remain to make {k}")
                        gone = any(isinstance(e, NotFoundError) for e in errors.values())
                        raise (GenerationGoneError if gone else InsufficientTargetsError)(
                            f"{view.path}: chunk {idx} (inode {view.inode}, version {ver}) is unreadable: "
                            f"{len(have)} of the {k} fragments needed arrived ({codec!r}); {detail}")
                    rounds += 1
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, cfg.backoff_max)
                    tried = set()
                    continue
                pick = cands[:need]
                tried.update(pick)
                items = []
                for j in pick:
                    buf = place.get(j)
                    if buf is None:
                        buf = self.pool.get(f)
                        bufs.append(buf)
                    items.append((targets[j], FragmentKey(view.inode, idx, j, ver), buf, 0))
                # Hedged like a plain read: a fetch that lags its peers is
                # given up for another fragment, while one is left to ask
                # (a stalled node that no read has marked slow yet would
                # otherwise hold the decode to the request timeout).
                # Only fragments that may yet answer count: not one that
                # failed in this read or whose target failed just now (giving
                # up a slow but sound fetch for those lost whole chunks whose
                # surviving fragments take longer than the hedge delay: a
                # 64 MiB ec:1+1 chunk with its data target down). One passed
                # over only because its target was slow just now does count:
                # until stop 50, with M of them so, the K fetched were not
                # hedged, and one on a stalled node whose slow mark had lapsed
                # held the read for the whole request timeout.
                spare = sum(1 for j in order if j not in have and j not in perm and j not in tried
                            and isinstance(errors.get(j), _Hedged | _PassedOver | None)
                            and not router.down(targets[j])
                            and not router.failed_recently(targets[j]))
                hedge = self._hedge_delay() if spare else None
                got_serials: list[int] = []
                if hedge is None:
                    res = await data.read_batch(items, timeout=cfg.request_timeout, serials=got_serials)
                else:
                    # Never on the clock alone while peers are out (it would
                    # give up the very fragments the decode needs), and a
                    # lone fetch not before hedge_min.
                    res = await self._hedged_batch(items, max(hedge, cfg.hedge_min), spare,
                                                   peers_first=len(items) > 1, serials=got_serials)
                for n_, (j, (_, _, buf, _), r) in enumerate(zip(pick, items, res, strict=True)):
                    if isinstance(r, int) and r == sizes[j]:
                        have[j] = buf[:r]
                        if used is not None and j < k:
                            used[j] = got_serials[n_] if n_ < len(got_serials) else 0
                        router.mark_ok(targets[j])
                    elif isinstance(r, int):
                        errors[j] = CorruptError(f"{r} bytes, its chunk record gives it {sizes[j]}")
                        perm.add(j)
                    elif isinstance(r, _Hedged):
                        errors[j] = r
                        router.mark_slow(targets[j], cfg.slow_target_ttl)
                    else:
                        errors[j] = r
                        self._note(targets[j], r)
                        if isinstance(r, (*_PERMANENT, TimeoutError_)):
                            perm.add(j)
            rebuilt: dict[int, memoryview] = {}
            lost = [j for j in range(k) if j not in have]
            if lost:
                rebuilt = codec.reconstruct(have, parity_size(k, cs, rec.length), lost)
            got_crc = chunk_crc((have[j] if j in have else rebuilt[j])[: sizes[j]] for j in range(k))
            if got_crc != rec.crc:
                await self._heal_chunk(view, idx, rec, targets, a, b, dest, frozenset(skip),
                                       f"decoded from fragments {sorted(have)} it has crc32c {got_crc:#010x}")
                return False
            for j in range(k):
                lo, hi = max(a, j * f), min(b, (j + 1) * f)
                if lo >= hi:
                    continue
                got = have.get(j)
                if got is not None and j in place:  # already in its place
                    _zero(dest[lo - a + len(got): hi - a])
                    continue
                src = (got if got is not None else rebuilt[j])[lo - j * f: hi - j * f]
                dest[lo - a: lo - a + len(src)] = src
                _zero(dest[lo - a + len(src): hi - a])
            if used is not None:
                for j in [j for j in used if j not in have]:
                    del used[j]  # rebuilt, not read: its file was not what the check covered
            return True
        finally:
            for buf in bufs:
                self.pool.put(buf)

    async def _read_replica(self, view: FileView, idx: int, rec: ChunkRecord, targets: tuple[int, ...], a: int,
                            b: int, dest: memoryview, skip: frozenset[int] = frozenset()) -> None:
        _, data, router = self._parts()
        cfg = self.config
        ver = rec.generation
        w = len(targets)
        # Spread reads over the copies; targets known to be down go last.
        order = sorted(range(w), key=lambda j: (not router.usable(targets[j]), (j - idx) % w))
        errors: dict[int, TierFSError] = {j: UnavailableError(self._why_not_asked(router, rec, targets, j, skip))
                                          for j in skip}
        perm: set[int] = set(skip)
        hung = _TIMED_OUT.get() or set()
        for j in range(w):
            if targets[j] in hung and j not in perm:
                errors[j] = TimeoutError_(f"target {targets[j]} let a request time out earlier in this read")
                perm.add(j)
        delay = cfg.backoff_initial
        loop = asyncio.get_running_loop()
        for rnd in range(cfg.retries):
            # Hedging, first round only: a copy that lags is left for the next
            # one while another usable copy remains (never the last hope).
            hedge = self._hedge_delay() if rnd == 0 else None
            for i, j in enumerate(order):
                if j in perm:
                    continue
                key = FragmentKey(view.inode, idx, j, ver)
                # A copy left to hedge to: a usable one, or one only found
                # slow just now; or, when this copy is itself one that failed
                # or lagged just now, any other not given up in this read
                # (until stop 49, with every copy failed within failed_ttl,
                # say after a stall of the whole cluster, no copy was hedged:
                # a read waited the whole request timeout on a node that had
                # stalled again; until stop 50 so too with the other copies
                # only slow and this one stalled, its slow mark lapsed).
                mine = router.usable(targets[j])
                others = any(x not in perm and (router.usable(targets[x]) or router.only_slow(targets[x]) or not mine)
                             for x in order[i + 1:])
                crcs: list[int] = []
                # A partial read: the copy's stored length and CRC32C, asked
                # alongside, stand in for the whole copy's, as for an EC
                # chunk's data fragments; once they matched, later partial
                # reads of the same fragment file (same serial) need no stat.
                vkey = (view.inode, idx, ver, j)
                partial = cfg.verify_partial_reads and not (a == 0 and b >= rec.length)
                cached = self._verified.get(vkey) if partial else None
                stat: asyncio.Future[FragmentInfo] | None = None
                if partial and cached is None and router.usable(targets[j]):
                    stat = asyncio.ensure_future(data.stat(targets[j], key, timeout=cfg.request_timeout))
                t_read = loop.time()
                try:
                    why = await self._read_copy(view, idx, rec, targets, j, key, a, dest, crcs, errors, perm, hedge,
                                                others, stat, t_read, None if cached is None else cached.get(0, 0))
                finally:
                    if stat is not None:
                        stat.cancel()
                        await asyncio.gather(stat, return_exceptions=True)
                if why is None:
                    continue
                if why:
                    errors[j] = CorruptError(why)
                    perm.add(j)
                    self.corrupt_fragments += 1
                    log.warning("%s: chunk %d (inode %d, generation %#x): copy %d on target %d %s; reading "
                                "another copy (the scrub rewrites it)", view.path, idx, view.inode, ver, j,
                                targets[j], why)
                    continue
                router.mark_ok(targets[j])
                return
            if len(perm) == w or rnd == cfg.retries - 1:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, cfg.backoff_max)
        detail = "; ".join(f"copy {j} on target {targets[j]}: {type(e).__name__}: {e}" for j, e in sorted(errors.items()))
        gone = any(isinstance(e, NotFoundError) for e in errors.values())
        if errors and all(type(e) is CorruptError for e in errors.values()):
            raise CorruptError(f"{view.path}: chunk {idx} (inode {view.inode}, generation {ver:#x}): no copy of {w} "
                               f"matches its record: not returned; {detail}")
        raise (GenerationGoneError if gone else InsufficientTargetsError)(
            f"{view.path}: chunk {idx} (inode {view.inode}, generation {ver:#x}) is unreadable: no copy of {w} "
            f"answered; {detail}")

    async def _read_copy(self, view: FileView, idx: int, rec: ChunkRecord, targets: tuple[int, ...], j: int,
                         key: FragmentKey, a: int, dest: memoryview, crcs: list[int],
                         errors: dict[int, TierFSError], perm: set[int], hedge: float | None, others: bool,
                         stat: asyncio.Future[FragmentInfo] | None, t_read: float,
                         verified: int | None = None) -> str | None:
        """Read copy ``j`` of a replicated chunk into ``dest`` from ``a``.
        None: it could not be read (the reason is in ``errors``); '': its
        bytes are in ``dest`` and match what can be checked; else why the
        copy is wrong (self-consistent, but not the chunk's bytes).
        ``verified``: for a partial read, the serial of this copy's fragment
        file when it was verified (None: not verified yet; ``stat`` then
        asks, when the target is usable)."""
        _, data, router = self._parts()
        cfg = self.config
        loop = asyncio.get_running_loop()
        serials: list[int] = []
        try:
            if hedge is None or not others:
                n = await data.read_into(targets[j], key, dest, a, timeout=cfg.request_timeout, crcs=crcs,
                                         serials=serials)
            else:
                try:
                    n = await asyncio.wait_for(
                        data.read_into(targets[j], key, dest, a, timeout=cfg.request_timeout, crcs=crcs,
                                       serials=serials), hedge)
                except TimeoutError as exc:
                    if isinstance(exc, TierFSError):
                        raise  # the request's own deadline, not the hedge
                    # Cancelled: the data plane never writes dest again.
                    router.mark_slow(targets[j], cfg.slow_target_ttl)
                    self.hedged += 1
                    errors[j] = _Hedged(f"lagged more than {hedge * 1e3:.0f} ms: next copy read instead")
                    return None
                self._lat.add(loop.time() - t_read)
        except TierFSError as exc:
            self._copy_failed(targets, j, exc, errors, perm)
            return None
        if n != len(dest):  # every copy holds the record's length: ours ends early
            errors[j] = CorruptError(f"returned {n} of {len(dest)} bytes")
            perm.add(j)
            return None
        if a == 0 and n == rec.length and crcs and crcs[0] != rec.crc:
            # The whole copy, self-consistent but not the chunk's bytes.
            return f"has crc32c {crcs[0]:#010x}, the chunk record {rec.crc:#010x}"
        serial = serials[0] if serials else 0
        vkey = (view.inode, idx, rec.generation, j)
        if a == 0 and n == rec.length and crcs:
            if serial and cfg.verify_partial_reads:
                self._remember_verified(vkey, {0: serial})  # later partial reads of this file need no stat
            return ""
        if verified is not None and stat is None:
            if serial and serial == verified:
                return ""  # the very fragment file verified before
            # Replaced since it was verified (a repair, or bytes that are not
            # the chunk's): verify again.
            self._verified.pop(vkey, None)
            if router.usable(targets[j]):
                stat = asyncio.ensure_future(data.stat(targets[j], key, timeout=cfg.request_timeout))
        if stat is None:
            if cfg.verify_partial_reads and not (a == 0 and n >= rec.length):
                # The target was not usable for its STAT.
                return await self._reread_copy(view, idx, rec, targets, j, key, a, dest, errors, perm)
            return ""
        # The stat may take a little longer than the read, not a stalled
        # target's timeout: past that (or when it failed) the whole copy is
        # read and checked instead.
        took = loop.time() - t_read
        await asyncio.wait({stat}, timeout=min(cfg.request_timeout / 4, max(cfg.hedge_min, 3 * took)))
        if not stat.done() or stat.cancelled() or stat.exception() is not None:
            return await self._reread_copy(view, idx, rec, targets, j, key, a, dest, errors, perm)
        info = stat.result()
        if serial and info.serial and serial != info.serial:
            # The stat describes another file than the one read (replaced
            # between the two): it proves nothing about the bytes read.
            errors[j] = UnavailableError(f"copy {j} on target {targets[j]} was replaced while it was read")
            return None
        if info.size != rec.length:
            return f"is stored with {info.size} bytes, not the chunk record's {rec.length}"
        if info.crc32c != rec.crc:
            return f"is stored with crc32c {info.crc32c:#010x}, the chunk record {rec.crc:#010x}"
        if serial and info.serial:
            self._remember_verified(vkey, {0: serial})
        return ""

    def _copy_failed(self, targets: tuple[int, ...], j: int, exc: TierFSError, errors: dict[int, TierFSError],
                     perm: set[int]) -> None:
        """Copy ``j`` could not be read: noted, and not asked again this read
        when the error is permanent."""
        errors[j] = exc
        self._note(targets[j], exc)
        if isinstance(exc, (*_PERMANENT, TimeoutError_)):
            perm.add(j)  # a timeout: a hung target is not waited on twice in one read

    async def _reread_copy(self, view: FileView, idx: int, rec: ChunkRecord, targets: tuple[int, ...], j: int,
                           key: FragmentKey, a: int, dest: memoryview, errors: dict[int, TierFSError],
                           perm: set[int]) -> str | None:
        """A partial read of copy ``j`` whose STAT could not be had: its bytes
        are checked only against their own CRC32C, which a copy that is wrong
        but self-consistent passes. Read the whole copy instead, check it
        against the record's CRC32C and fill ``dest`` from it; the answer is
        ``_read_copy``'s. The copy's file is remembered as verified."""
        _, data, _ = self._parts()
        self.whole_chunk_rereads += 1
        buf = self.pool.get(rec.length)
        try:
            crcs: list[int] = []
            serials: list[int] = []
            try:
                n = await data.read_into(targets[j], key, buf, 0, timeout=self.config.request_timeout, crcs=crcs,
                                         serials=serials)
            except TierFSError as exc:
                self._copy_failed(targets, j, exc, errors, perm)
                return None
            if n != rec.length:
                errors[j] = CorruptError(f"returned {n} of its {rec.length} bytes")
                perm.add(j)
                return None
            crc = crcs[0] if crcs else crc32c(buf)
            if crc != rec.crc:
                return f"has crc32c {crc:#010x}, the chunk record {rec.crc:#010x}"
            dest[:] = buf[a: a + len(dest)]
            if serials and serials[0]:
                self._remember_verified((view.inode, idx, rec.generation, j), {0: serials[0]})
            return ""
        finally:
            self.pool.put(buf)

    def _remember_verified(self, vkey: tuple[int, ...], serials: dict[int, int]) -> None:
        """Remember that the fragment files with these serials (by position)
        held chunk ``vkey``'s recorded bytes: partial reads that get their
        bytes from those same files need no stat."""
        self._verified[vkey] = serials
        self._verified.move_to_end(vkey)
        while len(self._verified) > 65536:
            self._verified.popitem(last=False)

    # ---- the write path ---------------------------------------------------------

    def min_write_fragments(self, codec: Codec) -> int:
        """Fragments of a chunk that must be durable before its write counts
        (see ``ClientConfig.min_write_fragments``)."""
        n = self.config.min_write_fragments
        if n == 0:
            n = min(codec.width, 2) if codec.replicated else codec.k + min(1, codec.m)
        return max(codec.k, min(n, codec.width))

    async def _write_chunk(self, view: FileView, idx: int, version: int,
                           frags: Sequence[Any]) -> tuple[list[int], tuple[int, ...]]:
        """Store the K+M fragments of chunk ``idx`` (tagged ``version``) on its
        group, all in parallel. Degraded writes: the chunk counts as stored
        once ``min_write_fragments`` of them are durable. A position whose
        target the map shows offline or read-only (full) is not tried (while
        the others can still reach the minimum), nor, after its first
        NoSpace answer, a target that is full; one that fails otherwise is
        retried like any other and then left missing: the storage scrubber's missing-fragment step
        rebuilds it from the committed version. Fragments are keyed by
        version, so an older fragment on a returning node is never read as
        this one. Returns the positions not stored (recorded in meta at
        commit, so that repair starts at once) and the targets the others
        were stored on (the group as the map had it: a writer re-sends the
        fragments whose member changed since, see ``_resend_moved``)."""
        _, data, router = self._parts()
        cfg = self.config
        gid = view.groups[idx % len(view.groups)]
        targets = await router.targets(gid)
        width = len(frags)
        if len(targets) != width:
            raise StaleVersionError(f"group {gid} has {len(targets)} targets, {view.codec!r} needs {width}")
        need = self.min_write_fragments(view.codec)
        if any(router.write_skip(t) for t in targets):
            # About to skip a member: make sure the map is current (it may be
            # back), else the chunk loses redundancy for nothing. Rate-limited,
            # and a cheap version check when nothing changed.
            with contextlib.suppress(TierFSError):
                if await router.refresh():
                    targets = await router.targets(gid)
            if len(targets) != width:
                raise StaleVersionError(f"group {gid} has {len(targets)} targets, {view.codec!r} needs {width}")
        errors: dict[int, TierFSError] = {}
        done: set[int] = set()

        lost: set[int] = set()  # positions whose target failed or timed out in this write

        def plan(cands: Sequence[int]) -> list[int]:
            # Targets the map shows down or full are skipped: no retry storm
            # while a node is known to be away. (Not those that merely failed
            # a request recently: that would leave fragments missing on a
            # healthy node and need a repair for nothing.)
            why = {j: router.write_skip(targets[j]) for j in cands}
            up = [j for j in cands if not why[j]]
            if len(done) + len(up) < need:
                # The map may be stale: try them all rather than fail
                # unasked; but not again one that failed in this write and
                # that the map shows down (a stalled member of an ec:2+1
                # group cost every commit retries x request_timeout, 30 s,
                # after meta had marked it offline, until stop 49).
                return [j for j in cands if not (j in lost and router.down(targets[j]))]
            for j in cands:
                if j not in up:
                    errors.setdefault(j, UnavailableError(f"target {targets[j]} is {why[j]}"))
            return up

        pending = plan(range(width))
        delay = cfg.backoff_initial
        attempts = 0
        for attempt in range(cfg.retries):
            attempts = attempt + 1
            items = [(targets[j], FragmentKey(view.inode, idx, j, version), frags[j]) for j in pending]
            res: list[TierFSError | None]
            if cfg.hedged_writes and len(done) + len(pending) > need:
                res = await self._write_batch_lagged(items, need - len(done))
            else:
                res = await data.write_batch(items, timeout=cfg.request_timeout)
            failed = []
            for j, r in zip(pending, res, strict=True):
                if r is None:
                    done.add(j)
                    errors.pop(j, None)
                    continue
                errors[j] = r
                if isinstance(r, _Hedged):
                    # Given up for lagging while enough others are durable:
                    # left missing, not retried (a stalled node would cost
                    # another timeout per attempt); reads go around it too.
                    router.mark_slow(targets[j], cfg.slow_target_ttl)
                    router.mark_write_lagged(targets[j], cfg.slow_target_ttl)
                    continue
                if isinstance(r, NoSpaceError):
                    # Full: like an offline member, the position is left
                    # missing (not retried, not fatal while `need` others store it).
                    router.mark_full(targets[j])
                    continue
                self._note(targets[j], r)
                if not isinstance(r, UnavailableError | TimeoutError_ | CorruptError):
                    raise type(r)(f"{view.path}: chunk {idx}: fragment {j} on target {targets[j]}: {r}")
                failed.append(j)
                lost.add(j)
            if len(done) == width or (not failed and len(done) >= need):
                break
            if attempt == cfg.retries - 1:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, cfg.backoff_max)
            # The group may have changed (a dead member replaced): positions
            # whose target moved are (re)written to the new member.
            with contextlib.suppress(TierFSError):
                await router.refresh()
            fresh = await router.targets(gid)
            again = set(failed) | {j for j in range(width) if j not in done and j not in errors}
            if len(done) + len(again) < need:
                # Too many full members for this group: try them once more
                # (space may have come back) rather than fail unasked.
                again |= {j for j in range(width) if j not in done and isinstance(errors.get(j), NoSpaceError)}
            if fresh != targets and len(fresh) == len(targets):
                moved = {j for j in range(width) if fresh[j] != targets[j]}
                done -= moved
                again |= moved
                targets = fresh
            pending = plan(sorted(again))
            if len(done) + len(pending) < need:
                break  # what is left to ask cannot make the chunk durable: fail now
        if len(done) >= need:
            if len(done) < width:
                self.degraded_writes += 1
                log.info("%s: chunk %d version %d stored degraded on group %s: %d of %d fragments (%s)",
                         view.path, idx, version, gid, len(done), width,
                         "; ".join(f"fragment {j} on target {targets[j]}: {errors[j]}" for j in sorted(errors)))
            return [j for j in range(width) if j not in done], targets
        detail = "; ".join(f"fragment {j} on target {targets[j]}: {type(e).__name__}: {e}"
                           for j, e in sorted(errors.items()))
        full = sum(isinstance(e, NoSpaceError) for j, e in errors.items() if j not in done)
        # Full members alone left the chunk short: ENOSPC, not "unavailable"
        # (a FUSE close said "No route to host" for a full cluster).
        cls: type[TierFSError] = NoSpaceError if width - full < need else UnavailableError
        raise cls(f"{view.path}: chunk {idx} could not be stored on group {gid}"
                  f"{' (its targets are full)' if cls is NoSpaceError else ''}: {len(done)} of "
                  f"{width} fragments durable, {need} needed, after {attempts} attempt"
                  f"{'' if attempts == 1 else 's'}: {detail}")

    async def _write_batch_lagged(self, items: Sequence[tuple[int, FragmentKey, Any]],
                                  need: int) -> list[TierFSError | None]:
        """``write_batch`` with one request per fragment. Once ``need`` of
        them are durable, those still out after a quarter of the request
        timeout and three times as long as the slowest durable one took are
        cancelled and come back as :class:`_Hedged` (the chunk is stored
        degraded without them). A write cancelled after its bytes went out
        may still land: that is this generation's right fragment at a
        position the record lists as missing, which reads check and repair
        overwrites alike."""
        _, data, router = self._parts()
        loop = asyncio.get_running_loop()
        timeout = self.config.request_timeout
        t0 = loop.time()
        last = 0.0
        # A target a write gave up for lagging just now (a stalled node,
        # waited out by the write of the chunk before), or that failed or
        # timed out just now, or that the map shows down, is given only
        # three times its peers' time (at least hedge_min), not a quarter of
        # the request timeout again: until stop 50 a node stalled before
        # meta marked it offline cost every round of write_concurrency
        # chunks 2.5 s (a 320 MiB DCP save 13 s instead of 2 s). One only
        # hedged by a read (marked slow: tens of milliseconds behind on a
        # busy host) still gets the quarter: it is most likely just busy,
        # and a write left without it is a degraded chunk to repair.
        slow = {i for i, it in enumerate(items)
                if router.write_lagged(it[0]) or router.failed_recently(it[0]) or router.down(it[0])}

        async def one(item: tuple[int, FragmentKey, Any]) -> TierFSError | None:
            nonlocal last
            r = (await data.write_batch([item], timeout=timeout))[0]
            if r is None:
                last = loop.time() - t0
            return r

        tasks = [loop.create_task(one(it)) for it in items]
        pending: set[asyncio.Task[TierFSError | None]] = set(tasks)
        try:
            while pending:
                stored = sum(1 for t in tasks if t.done() and t.result() is None)
                wait = None
                if stored >= need:
                    floor = (self.config.hedge_min if all(i in slow for i, t in enumerate(tasks) if t in pending)
                             else timeout / 4)
                    wait = max(floor, 3 * last) - (loop.time() - t0)
                    if wait <= 0:
                        break
                _, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            left = [t for t in tasks if not t.done()]
            for t in left:
                t.cancel()
            if left:  # we are being cancelled: let them end first
                await asyncio.gather(*left, return_exceptions=True)
        return [_Hedged(f"fragment {it[1]} on target {it[0]} lagged its peers: not acknowledged within "
                        f"{(loop.time() - t0) * 1e3:.0f} ms, left missing")
                if t.cancelled() else t.result() for it, t in zip(items, tasks, strict=True)]

    async def _resend_moved(self, view: FileView, idx: int, rec: ChunkRecord, placed: Sequence[int],
                            members: Sequence[int]) -> ChunkRecord:
        """Put chunk ``idx`` (``rec``, uploaded in an open write session onto
        ``placed``) on its group's current ``members``: every fragment whose
        position changed member since (``moved_positions``: a rebalance
        move, a drain, a replacement) is sent to the new member under the
        same key. The fragments are byte-identical to what was sent, so each
        is copied from the member it went to; those that cannot be read
        there are rebuilt from the chunk read back (any K of the fragments
        it wrote, checked against the chunk's CRC) and encoded again.

        Returns the record to commit: ``rec``, or ``rec`` with the moved
        positions that could not be re-sent added to ``missing`` (the repair
        queue rebuilds them, as meta would have recorded them without the
        re-send). Fewer than K fragments left on current members: an
        error (nothing is committed)."""
        moved = moved_positions(placed, members, rec.missing)
        if not moved:
            return rec
        _, data, _ = self._parts()
        cfg, codec, cs = self.config, view.codec, view.chunk_size
        keys = {j: FragmentKey(view.inode, idx, j, rec.generation) for j in moved}
        frags: dict[int, memoryview] = {}
        errors: dict[int, TierFSError] = {}
        reads = []
        for j in moved:
            n = fragment_size(j, codec.k, cs, rec.length, replicated=codec.replicated)
            frags[j] = memoryview(bytearray(n))
            if n:
                reads.append(j)
        res = await data.read_batch([(placed[j], keys[j], frags[j], 0) for j in reads], timeout=cfg.request_timeout)
        lost = [j for j, r in zip(reads, res, strict=True) if not (isinstance(r, int) and r == len(frags[j]))]
        if lost:
            try:
                frags.update(await self._reencode(view, idx, rec, placed, frozenset(lost)))
            except TierFSError as exc:
                for j in lost:
                    del frags[j]
                    errors[j] = exc
        pending, delay = sorted(frags), cfg.backoff_initial
        for attempt in range(cfg.retries):
            if not pending:
                break
            wres = await data.write_batch([(members[j], keys[j], frags[j]) for j in pending],
                                          timeout=cfg.request_timeout)
            again = []
            for j, r in zip(pending, wres, strict=True):
                if r is None:
                    errors.pop(j, None)
                    continue
                errors[j] = r
                self._note(members[j], r)
                if isinstance(r, UnavailableError | TimeoutError_ | CorruptError):
                    again.append(j)
            pending = again
            if pending and attempt < cfg.retries - 1:
                await asyncio.sleep(delay)
                delay = min(delay * 2, cfg.backoff_max)
        if not errors:
            return rec
        missing = sorted(set(rec.missing) | set(errors))
        detail = "; ".join(f"fragment {j} (was on target {placed[j]}, now {members[j]}): {type(e).__name__}: {e}"
                           for j, e in sorted(errors.items()))
        if codec.width - len(missing) < codec.k:
            raise UnavailableError(f"{view.path}: chunk {idx}: its group changed during the write and only "
                                   f"{codec.width - len(missing)} of its fragments are on current members "
                                   f"({view.codec!r} needs {codec.k}): {detail}")
        log.info("%s: chunk %d: moved fragments not re-sent, left missing for repair: %s", view.path, idx, detail)
        return dataclasses.replace(rec, missing=tuple(missing))

    async def _reencode(self, view: FileView, idx: int, rec: ChunkRecord, placed: Sequence[int],
                        want: frozenset[int]) -> dict[int, memoryview]:
        """Fragments ``want`` of chunk ``idx`` as encoded at upload: the chunk
        read back from the targets it was stored on (``placed``; ``want``
        and the positions not stored skipped), checked against its CRC,
        encoded again (encoding is deterministic)."""
        codec, cs = view.codec, view.chunk_size
        buf = self.pool.get(codec.encode_size(cs))
        try:
            buf[rec.length:] = bytes(len(buf) - rec.length)
            read = self._read_replica if codec.replicated else self._read_ec
            await read(view, idx, rec, tuple(placed), 0, rec.length, buf[:rec.length], frozenset(rec.missing) | want)
            if crc32c(buf[:rec.length]) != rec.crc:
                raise CorruptError(f"{view.path}: chunk {idx} read back does not match its CRC32C {rec.crc:#x}")
            return {j: memoryview(bytes(fr)) for j, fr in enumerate(codec.encode(buf, rec.length, cs)) if j in want}
        finally:
            self.pool.put(buf)
