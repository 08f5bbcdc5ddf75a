"""The chunk engine: one storage target (a directory on one disk) as a FragmentStore.

On-disk layout (format 1; see docs/storage.md)::

    <target>/target.json                      {"format": 1, "target_id": N}
    <target>/LOCK                             flock'ed by the engine that has the target open
    <target>/tmp/<random>.tmp                 writes in progress (wiped at start)
    <target>/quarantine/<key>.<ns>            corrupt fragments moved aside by the scrubber
    <target>/frags/<inode & 0xff:02x>/<inode:016x>/<chunk:x>.<fragment:x>.<version:x>

A fragment file is a header region followed by the payload, both padded to
4096 bytes so that the whole file moves with O_DIRECT::

    [0, hdr_len)      header: magic "TFSFRAG1", format, hdr_len, key, size,
                      CRC32C of the payload, block size (64 KiB), block count,
                      one *prefix* CRC32C per block (the CRC of payload[0:end
                      of that block]), then a CRC32C of the header itself;
                      zero padded to a multiple of 4096.
    [hdr_len, ...)    payload, zero padded to a multiple of 4096.

Prefix CRCs make every check one pass: a full read chains CRC32C over the
payload and compares with the last entry (which is the fragment's CRC); a
ranged read covering blocks b0..b1 seeds CRC32C with entry b0-1 and must
arrive at entry b1, so it reads and checks at most 64 KiB beyond what was
asked at each end. A mismatch raises CorruptError and bumps ``corrupt``;
bad bytes are never returned.

Durability: a write goes to a fresh file in ``tmp/`` (O_DIRECT), is
fdatasync'ed, renamed into place, and the destination directory (and the
fan-out directory when the inode directory is new) is fsync'ed before the
call returns. Directory fsyncs of concurrent writes into the same directory
are coalesced. A crash leaves either the complete old state or the complete
new fragment; leftovers in ``tmp/`` are deleted on start. Rewriting an
existing key replaces it atomically (repair of a corrupt copy, idempotent
retries); new contents should use a new version, and old versions are
deleted by the caller (meta GC).

The in-memory index maps key -> on-disk length and is rebuilt at start from a
directory scan (no file is read); a fragment's size and CRC are learned from
its header on first access and cached. Every read verifies against the
header of the very file it opened, so a concurrent replace can never make a
reader mix two versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import json
import logging
import os
import secrets
import stat
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import crc32c as _crc32c

from tierfs.buffers import ALIGN, BufferPool, round_up
from tierfs.errors import (
    ConfigError,
    CorruptError,
    InternalError,
    InvalidArgumentError,
    NoSpaceError,
    NotFoundError,
    TierFSError,
    UnavailableError,
)
from tierfs.fsutil import fsync_dir, make_private, makedirs_durable
from tierfs.storage.api import FragmentInfo, FragmentKey
from tierfs.storage.io.base import IOBackend

__all__ = [
    "BLOCK_SIZE",
    "FORMAT_VERSION",
    "ChunkEngine",
    "TargetState",
    "TargetStats",
    "crc32c",
    "fragment_path",
    "header_length",
]


#: How fragment files are opened to read. O_NONBLOCK changes nothing for a
#: regular file; a FIFO where a fragment's file was (mkfifo in the data
#: dir) then opens at once and fails the regular-file check, where a plain
#: open waited for a writer for ever, on the event loop: the whole daemon hung.
_OPEN_READ = os.O_RDONLY | os.O_NONBLOCK

log = logging.getLogger(__name__)

MAGIC = b"TFSFRAG1"
FORMAT_VERSION = 1
BLOCK_SIZE = 64 << 10
# magic, format, flags, hdr_len, inode, chunk, fragment, version, size, crc, block, nblocks
_FIXED = struct.Struct("<8sHHIQQQQQIII")
_U32 = struct.Struct("<I")
# CRC work above this size runs in a worker thread (the C code drops the GIL)
# when other operations are in flight
_CRC_THREAD_MIN = 1 << 20
# below this much free space (after the reserve) the target reports
# READ_ONLY (still serves reads); the storage config's ``min_free`` overrides it
_FULL_BELOW = 1 << 20


def crc32c(data: memoryview | bytes, value: int = 0) -> int:
    """CRC32C (Castagnoli), chainable: crc32c(b, crc32c(a)) == crc32c(a + b)."""
    return int(_crc32c.crc32c(data, value, 1))


def _nblocks(size: int) -> int:
    return (size + BLOCK_SIZE - 1) // BLOCK_SIZE


def header_length(size: int) -> int:
    """Bytes of the (padded) header region of a ``size``-byte fragment."""
    return round_up(_FIXED.size + 4 * _nblocks(size) + 4)


def fragment_path(root: Path, key: FragmentKey) -> Path:
    return root / "frags" / f"{key.inode & 0xFF:02x}" / f"{key.inode:016x}" / f"{key.chunk:x}.{key.fragment:x}.{key.version:x}"


def _prefix_crcs(data: memoryview) -> list[int]:
    out: list[int] = []
    c = 0
    for off in range(0, data.nbytes, BLOCK_SIZE):
        c = crc32c(data[off : off + BLOCK_SIZE], c)
        out.append(c)
    return out


class TargetState:
    """Target states as meta understands them (``TargetState`` in meta.proto)."""

    ONLINE = "online"
    READ_ONLY = "read_only"  # full: serves reads, refuses writes
    FAILED = "failed"  # its directory is unusable


@dataclass(frozen=True, slots=True)
class TargetStats:
    target_id: int
    path: str
    capacity: int  # bytes of the file system (minus the reserve)
    used: int  # bytes of fragment files on this target
    free: int  # bytes still writable before the reserve is reached
    fragments: int
    state: str
    counters: dict[str, int]


@dataclass(slots=True)
class _Header:
    key: FragmentKey
    size: int
    crc: int
    hdr_len: int
    prefix: tuple[int, ...]


#: Serials of index entries: a new one for every fragment file installed or
#: found at start-up, from a random start per process (so that one daemon's
#: serials do not repeat its previous run's), below 2**62.
_serials = itertools.count(secrets.randbits(61) + 1)


@dataclass(slots=True)
class _Entry:
    file_len: int
    size: int = -1  # -1: not learned yet (after a restart, before first access)
    crc: int = 0
    #: Changes whenever the fragment's file is replaced (a repair, a rewrite):
    #: READ and STAT answers carry it, so a client that verified this copy
    #: once knows whether later partial reads still read what it verified.
    serial: int = field(default_factory=lambda: next(_serials))
    #: (inode, ctime, size) of the file as installed or found: a file changed on
    #: disk behind the engine's back (rewritten in place, copied or renamed
    #: over) gets a new serial, so no client's earlier verdict covers it.
    ident: tuple[int, int, int] | None = None


def _parse_header(buf: memoryview, key: FragmentKey, path: Path | str) -> _Header:
    if buf.nbytes < _FIXED.size:
        raise CorruptError(f"{path}: truncated header ({buf.nbytes} bytes)")
    magic, fmt, _flags, hdr_len, ino, chunk, frag, ver, size, crc, block, nblocks = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC or fmt != FORMAT_VERSION:
        raise CorruptError(f"{path}: not a format-{FORMAT_VERSION} fragment (magic {magic!r}, format {fmt})")
    if block != BLOCK_SIZE or nblocks != _nblocks(size) or hdr_len != header_length(size):
        raise CorruptError(f"{path}: inconsistent header (size {size}, blocks {nblocks}x{block}, hdr {hdr_len})")
    end = _FIXED.size + 4 * nblocks
    if buf.nbytes < end + 4:
        raise CorruptError(f"{path}: truncated header table")
    (stored,) = _U32.unpack_from(buf, end)
    if crc32c(buf[:end]) != stored:
        raise CorruptError(f"{path}: header checksum mismatch")
    if FragmentKey(ino, chunk, frag, ver) != key:
        raise CorruptError(f"{path}: holds fragment {(ino, chunk, frag, ver)}, expected {key}")
    prefix = struct.unpack_from(f"<{nblocks}I", buf, _FIXED.size)
    if nblocks and prefix[-1] != crc:
        raise CorruptError(f"{path}: header CRC table does not end in the fragment CRC")
    return _Header(key, size, crc, hdr_len, prefix)


class _DirSyncer:
    """Coalesces fsyncs of one directory: a caller is covered by the first
    fsync that *starts* after it asked, and all callers waiting at that moment
    share it."""

    def __init__(self, backend: IOBackend) -> None:
        self._backend = backend
        self._next: dict[str, asyncio.Future[None]] = {}
        self._running: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def sync(self, path: str) -> None:
        fut = self._next.get(path)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._next[path] = fut
            if path not in self._running:
                self._start(path)
        await asyncio.shield(fut)

    def _start(self, path: str) -> None:
        fut = self._next.pop(path)
        self._running.add(path)
        task = asyncio.get_running_loop().create_task(self._run(path, fut))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, path: str, fut: asyncio.Future[None]) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                await self._backend.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(exc)
        else:
            if not fut.done():
                fut.set_result(None)
        finally:
            self._running.discard(path)
            if path in self._next:
                self._start(path)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: every waiter got it through shield

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class _KeyLocks:
    def __init__(self) -> None:
        self._locks: dict[FragmentKey, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: FragmentKey) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class ChunkEngine:
    """One target's fragments on local disk; implements ``FragmentStore``.

    Build with ``ChunkEngine(...)`` then ``await engine.open()`` (creates the
    layout, wipes ``tmp/``, scans the index); ``await engine.close()`` at the
    end. All coroutine methods run on one event loop.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        target_id: int,
        backend: IOBackend,
        pool: BufferPool,
        *,
        reserved_bytes: int = 0,
        max_fragment_size: int = 256 << 20,
        min_free: int = _FULL_BELOW,
        min_free_fraction: float = 0.0,
    ) -> None:
        self.root = Path(root)
        self._root_str = str(self.root)
        self.target_id = target_id
        self.backend = backend
        self.pool = pool
        self.reserved_bytes = reserved_bytes
        self.max_fragment_size = max_fragment_size
        self.min_free = min_free
        self.min_free_fraction = min_free_fraction
        #: Called (no arguments) when a write finds the target full, so the
        #: daemon can tell meta at once rather than at the next heartbeat.
        self.on_full: Callable[[], None] | None = None
        self._index: dict[FragmentKey, _Entry] = {}
        self._used = 0
        self._locks = _KeyLocks()
        self._dirsync = _DirSyncer(backend)
        self._known_dirs: set[str] = set()
        self._failed: str | None = None
        self._full = False
        # Free bytes the target needs again after a write hit ENOSPC (or the
        # reserve) before it reports ONLINE: min_free alone could flap when
        # the fragment that did not fit is larger than min_free.
        self._full_need = 0
        self._last_need = 0
        self._busy = 0  # reads + writes in progress
        self._suspects: set[FragmentKey] = set()
        self._opened = False
        self._lock_fd: int | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "writes",
                "reads",
                "deletes",
                "bytes_written",
                "bytes_read",
                "corrupt",
                "rejected_crc",
                "no_space",
                "io_errors",
                "temp_cleaned",
                "scrubbed",
                "quarantined",
            ),
            0,
        )

    # -- lifecycle -------------------------------------------------------------

    async def open(self) -> None:
        await asyncio.to_thread(self._open_sync)
        self._opened = True

    def _open_sync(self) -> None:
        makedirs_durable(self.root)  # or a power cut forgets a new target
        self._take_lock()
        try:
            self._open_locked()
        except BaseException:
            assert self._lock_fd is not None
            os.close(self._lock_fd)
            self._lock_fd = None
            raise

    def _take_lock(self) -> None:
        """One engine per target directory: a second daemon (or a second
        --target naming the same disk) must not write into it too."""
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"{self.root} is in use by {holder}", field="targets") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _open_locked(self) -> None:
        meta = self.root / "target.json"
        if meta.exists():
            try:
                info = json.loads(meta.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{meta}: unreadable ({exc})", field="targets") from None
            if info.get("format") != FORMAT_VERSION:
                raise ConfigError(f"{meta}: unsupported format {info.get('format')!r}", field="targets")
            stored = int(info.get("target_id", 0))
            if self.target_id == 0:
                self.target_id = stored
            elif stored not in (0, self.target_id):
                raise ConfigError(
                    f"{self.root} belongs to target {stored}, not {self.target_id}", field="targets"
                )
        self._persist_identity()
        for sub in ("tmp", "frags", "quarantine"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
            make_private(self.root / sub)  # also those an older version made 0755
        for name in os.listdir(self.root / "tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / "tmp" / name)
                self.counters["temp_cleaned"] += 1
        self._fsync_dir_sync(self.root / "tmp")
        self._fsync_dir_sync(self.root)
        self._scan()

    def _persist_identity(self) -> None:
        meta = self.root / "target.json"
        body = json.dumps({"format": FORMAT_VERSION, "target_id": self.target_id}, sort_keys=True)
        if meta.exists() and meta.read_text() == body:
            return
        tmp = self.root / "target.json.tmp"
        with open(tmp, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, meta)
        self._fsync_dir_sync(self.root)

    def set_target_id(self, target_id: int) -> None:
        """Adopt the id meta assigned and persist it in ``target.json``."""
        if target_id != self.target_id:
            self.target_id = target_id
            self._persist_identity()

    _fsync_dir_sync = staticmethod(fsync_dir)

    def _scan(self) -> None:
        index: dict[FragmentKey, _Entry] = {}
        used = 0
        frags = self.root / "frags"
        for fan in os.scandir(frags):
            if not fan.is_dir():
                continue
            for ino_dir in os.scandir(fan.path):
                try:
                    inode = int(ino_dir.name, 16)
                except ValueError:
                    log.warning("target %s: ignoring stray %s", self.target_id, ino_dir.path)
                    continue
                if not ino_dir.is_dir():
                    continue
                entries = list(os.scandir(ino_dir.path))
                if not entries:
                    # left behind by deletes (GC); nothing can race us at start
                    with contextlib.suppress(OSError):
                        os.rmdir(ino_dir.path)
                    continue
                self._known_dirs.add(ino_dir.path)
                for f in entries:
                    try:
                        chunk, frag, ver = (int(p, 16) for p in f.name.split("."))
                        key = FragmentKey(inode, chunk, frag, ver)
                    except ValueError:
                        log.warning("target %s: ignoring stray %s", self.target_id, f.path)
                        continue
                    st = f.stat()
                    size = st.st_size
                    index[key] = _Entry(size, ident=(st.st_ino, st.st_ctime_ns, size))
                    used += size
        self._index = index
        self._used = used

    async def close(self) -> None:
        await self._dirsync.drain()
        self._opened = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- FragmentStore --------------------------------------------------------------

    def _fpath(self, key: FragmentKey) -> str:
        return (
            f"{self._root_str}/frags/{key.inode & 0xFF:02x}/{key.inode:016x}/"
            f"{key.chunk:x}.{key.fragment:x}.{key.version:x}"
        )

    def alloc(self, size: int) -> memoryview:
        return self.pool.get(size)

    def release(self, buf: memoryview) -> None:
        self.pool.put(buf)

    async def write(self, key: FragmentKey, data: memoryview, crc32c: int) -> None:
        self._busy += 1
        try:
            await self._write(key, data, crc32c)
        finally:
            self._busy -= 1

    async def _write(self, key: FragmentKey, data: memoryview, crc32c: int) -> None:
        self._check_usable()
        if not isinstance(data, memoryview):
            data = memoryview(data)
        if data.format != "B" or data.ndim != 1:
            if not data.c_contiguous:
                raise InvalidArgumentError("fragment payload must be a contiguous buffer")
            data = data.cast("B")
        size = data.nbytes
        if size > self.max_fragment_size:
            raise InvalidArgumentError(f"fragment of {size} bytes exceeds the limit of {self.max_fragment_size}")
        prefix = await self._crc_chain(data)
        actual = prefix[-1] if prefix else 0
        if actual != crc32c:
            self.counters["rejected_crc"] += 1
            raise CorruptError(f"payload CRC32C {actual:08x} does not match the sender's {crc32c:08x}; not stored")
        hdr_len = header_length(size)
        padded = round_up(size)
        file_len = hdr_len + padded
        self._last_need = file_len
        self._check_space(file_len)

        hdr = self.pool.get(hdr_len)
        body = self.pool.extent(data, padded) if size else None
        copied = body is None and size > 0
        if copied:
            body = self.pool.get(padded)
            body[:size] = data
        try:
            self._fill_header(hdr, key, size, actual, prefix)
            if body is not None and padded > size:
                body[size:padded] = bytes(padded - size)
            tmp = self.root / "tmp" / f"{secrets.token_hex(8)}.tmp"
            await self._write_temp(tmp, hdr, body)
        finally:
            self.pool.put(hdr)
            if copied and body is not None:
                self.pool.put(body)
        try:
            async with self._locks.hold(key):
                await self._install(tmp, key, _Entry(file_len, size, actual))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.counters["writes"] += 1
        self.counters["bytes_written"] += size

    async def read(self, key: FragmentKey, offset: int = 0, length: int = -1) -> memoryview:
        view, _ = await self.read_with_crc(key, offset, length)
        return view

    async def read_with_crc(self, key: FragmentKey, offset: int = 0, length: int = -1) -> tuple[memoryview, int | None]:
        """``read`` plus the verified CRC32C of the returned bytes when they are
        the whole fragment (None for a part): the data plane then needs no
        second pass over the payload."""
        view, crc, _ = await self.read_with_info(key, offset, length)
        return view, crc

    async def read_with_info(self, key: FragmentKey, offset: int = 0,
                             length: int = -1) -> tuple[memoryview, int | None, int]:
        """``read_with_crc`` plus the serial of the fragment file the bytes
        came from (0 when it was replaced while they were read)."""
        self._busy += 1
        try:
            return await self._read(key, offset, length)
        finally:
            self._busy -= 1

    def serial(self, key: FragmentKey) -> int:
        """The serial of the fragment file now indexed for ``key`` (0: none)."""
        entry = self._index.get(key)
        return 0 if entry is None else entry.serial

    async def _read(self, key: FragmentKey, offset: int, length: int) -> tuple[memoryview, int | None, int]:
        self._check_readable()
        if offset < 0 or length < -1:
            raise InvalidArgumentError(f"bad range offset={offset} length={length}")
        entry = self._index.get(key)
        if entry is None:
            raise NotFoundError(f"fragment {key} not on target {self.target_id}")
        path = self._fpath(key)
        try:
            fd = await self.backend.open(path, _OPEN_READ)
        except FileNotFoundError:
            raise NotFoundError(f"fragment {key} not on target {self.target_id}") from None
        except OSError as exc:
            try:
                st: os.stat_result | None = os.stat(path)
            except OSError:
                st = None
            if st is not None and not stat.S_ISREG(st.st_mode):  # a backend that cannot open it at all
                self._suspects.add(key)
                self._regular(st, key, path)
            raise self._io_error("open", path, exc) from exc
        crc: int | None = None
        try:
            self._observe(entry, self._regular(os.fstat(fd), key, path))
            if offset == 0 and (length == -1 or (entry.size >= 0 and length >= entry.size)):
                view, hdr = await self._read_whole(fd, path, key, entry)
                crc = hdr.crc
            else:
                view, hdr = await self._read_range(fd, path, key, entry, offset, length)
                if offset == 0 and view.nbytes == hdr.size:
                    crc = hdr.crc
        except CorruptError:
            self._suspects.add(key)  # the scrubber re-checks it and quarantines it
            raise
        finally:
            await self.backend.close(fd)
        self.counters["reads"] += 1
        self.counters["bytes_read"] += view.nbytes
        # The file opened is the one this entry describes unless it was
        # replaced meanwhile: then no serial (the client verifies again).
        return view, crc, entry.serial if self._index.get(key) is entry else 0

    async def delete(self, key: FragmentKey) -> bool:
        self._check_readable()
        path = fragment_path(self.root, key)
        async with self._locks.hold(key):
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used -= entry.file_len
            try:
                os.unlink(path)
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise self._io_error("unlink", path, exc) from exc
            try:
                await self._dirsync.sync(str(path.parent))
            except OSError as exc:
                raise self._io_error("fsync", path.parent, exc) from exc
        self.counters["deletes"] += 1
        return True

    async def stat(self, key: FragmentKey) -> FragmentInfo:
        self._check_readable()
        entry = self._index.get(key)
        if entry is None:
            raise NotFoundError(f"fragment {key} not on target {self.target_id}")
        path = self._fpath(key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise NotFoundError(f"fragment {key} not on target {self.target_id}") from None
        except OSError as exc:
            raise self._io_error("stat", path, exc) from exc
        try:
            self._observe(entry, self._regular(st, key, path))  # (CorruptError is an OSError: not above)
        except CorruptError:
            self._suspects.add(key)
            raise
        if entry.size < 0:
            try:
                fd = await self.backend.open(path, _OPEN_READ)
            except FileNotFoundError:
                raise NotFoundError(f"fragment {key} not on target {self.target_id}") from None
            try:
                await self._read_header(fd, path, key, entry)
            except CorruptError:
                self._suspects.add(key)
                raise
            finally:
                await self.backend.close(fd)
        return FragmentInfo(key, entry.size, entry.crc, entry.serial)

    # -- beyond the protocol ---------------------------------------------------------

    async def verify(self, key: FragmentKey) -> FragmentInfo:
        """Read and check the whole fragment (header and payload); for scrub."""
        view = await self.read(key)
        try:
            info = await self.stat(key)
        finally:
            self.release(view)
        return info

    def suspects(self) -> list[FragmentKey]:
        """Fragments a read found corrupt since they were last scrubbed."""
        return sorted(self._suspects)

    async def scrub_one(self, key: FragmentKey) -> int:
        """Verify ``key`` completely; a corrupt fragment is quarantined (moved
        out of ``frags/``), so it reads as missing and repair rebuilds it.
        Returns the bytes checked."""
        entry = self._index.get(key)
        try:
            info = await self.verify(key)
        except NotFoundError:
            self._suspects.discard(key)
            return 0
        except CorruptError as err:
            await self.quarantine(key, str(err))
            return entry.file_len if entry is not None else 0
        self._suspects.discard(key)
        self.counters["scrubbed"] += 1
        return info.size

    async def quarantine(self, key: FragmentKey, reason: str) -> bool:
        """Move ``key``'s file to ``quarantine/`` (kept for inspection, never
        served) and forget it; False if it was not there."""
        self._check_usable()
        path = fragment_path(self.root, key)
        dest = self.root / "quarantine" / f"{key.inode:016x}.{key.chunk:x}.{key.fragment:x}.{key.version:x}.{time.time_ns()}"
        async with self._locks.hold(key):
            self._suspects.discard(key)
            try:
                os.rename(path, dest)
            except FileNotFoundError:
                self._drop(key)
                return False
            except OSError as exc:
                raise self._io_error("quarantine", path, exc) from exc
            self._drop(key)
            try:
                await asyncio.gather(self._dirsync.sync(str(path.parent)), self._dirsync.sync(str(dest.parent)))
            except OSError as exc:
                raise self._io_error("fsync", path.parent, exc) from exc
        self.counters["quarantined"] += 1
        log.error("target %s: quarantined %s: %s", self.target_id, key, reason)
        return True

    def _regular(self, st: os.stat_result, key: FragmentKey, path: Path | str) -> os.stat_result:
        """``st``, when it is a regular file's; else CorruptError: something
        else (a directory, a device) stands where the fragment's file was,
        which scrub moves to quarantine and repair rebuilds (until stop 49 it
        was an InternalError for ever: "Is a directory")."""
        if not stat.S_ISREG(st.st_mode):
            raise CorruptError(f"fragment {key} on target {self.target_id}: {path} is not a regular file "
                               f"(mode {st.st_mode:#o})")
        return st

    def _observe(self, entry: _Entry, st: os.stat_result) -> None:
        """Note the identity of the file ``entry`` describes; a file that
        changed since (not through this engine, which installs a new entry
        for every file it writes) gets a new serial and is parsed again."""
        ident = (st.st_ino, st.st_ctime_ns, st.st_size)
        if entry.ident is None:
            entry.ident = ident
        elif entry.ident != ident:
            log.warning("target %s: a fragment file changed on disk behind the engine (inode, ctime, size "
                        "%s -> %s): served under a new serial", self.target_id, entry.ident, ident)
            entry.ident = ident
            if entry.serial:
                entry.serial = next(_serials)
            entry.size, entry.crc = -1, 0

    def _drop(self, key: FragmentKey) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._used -= entry.file_len

    def keys(self, inode: int | None = None) -> Iterator[FragmentKey]:
        """The fragments on this target (a snapshot), optionally of one inode."""
        for k in list(self._index):
            if inode is None or k.inode == inode:
                yield k

    def __contains__(self, key: FragmentKey) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def state(self) -> str:
        if self._failed is not None:
            return TargetState.FAILED
        try:
            st = os.statvfs(self.root)
        except OSError as exc:
            self._fail(f"statvfs failed: {exc}")
            return TargetState.FAILED
        free = int(st.f_bavail * st.f_frsize) - self.reserved_bytes
        full = free < max(self.min_free_bytes(int(st.f_blocks * st.f_frsize)), self._full_need)
        if not full:
            self._full_need = 0  # space came back (files deleted, a bigger volume)
        self._full = full
        return TargetState.READ_ONLY if full else TargetState.ONLINE

    def min_free_bytes(self, fs_bytes: int) -> int:
        """Free bytes (after the reserve) under which the target is READ_ONLY."""
        return max(self.min_free, int(self.min_free_fraction * max(0, fs_bytes - self.reserved_bytes)))

    def _mark_full(self, need: int, free: int | None = None) -> None:
        was, self._full = self._full, True
        self.counters["no_space"] += 1
        try:
            st = os.statvfs(self.root)
            if free is None:
                free = int(st.f_bavail * st.f_frsize) - self.reserved_bytes
            floor = self.min_free_bytes(int(st.f_blocks * st.f_frsize))
        except OSError:
            free, floor = free or 0, self.min_free
        # READ_ONLY until space really returns: more free than when the
        # write failed, by the write's size (at most min_free), so that a
        # target which refused one large fragment does not flap back at once.
        self._full_need = max(self._full_need, max(free, 0) + min(need + 2 * ALIGN, max(floor, ALIGN)))
        if not was and self.on_full is not None:
            self.on_full()

    def stats(self) -> TargetStats:
        state = self.state()
        try:
            st = os.statvfs(self.root)
            capacity = max(0, st.f_blocks * st.f_frsize - self.reserved_bytes)
            free = max(0, st.f_bavail * st.f_frsize - self.reserved_bytes)
        except OSError:
            capacity = free = 0
        return TargetStats(
            target_id=self.target_id,
            path=str(self.root),
            capacity=capacity,
            used=self._used,
            free=free,
            fragments=len(self._index),
            state=state,
            counters=dict(self.counters),
        )

    # -- write internals -----------------------------------------------------------

    def _offload(self, nbytes: int) -> bool:
        # A worker thread lets CRC work use another core while the loop keeps
        # other I/O going; alone, the hop costs more than it saves.
        return nbytes >= _CRC_THREAD_MIN and self._busy > 1

    async def _crc_chain(self, data: memoryview) -> list[int]:
        if self._offload(data.nbytes):
            return await asyncio.to_thread(_prefix_crcs, data)
        return _prefix_crcs(data)

    @staticmethod
    def _fill_header(hdr: memoryview, key: FragmentKey, size: int, crc: int, prefix: list[int]) -> None:
        n = len(prefix)
        hdr_len = hdr.nbytes
        _FIXED.pack_into(
            hdr, 0, MAGIC, FORMAT_VERSION, 0, hdr_len, key.inode, key.chunk, key.fragment, key.version,
            size, crc, BLOCK_SIZE, n,
        )
        struct.pack_into(f"<{n}I", hdr, _FIXED.size, *prefix)
        end = _FIXED.size + 4 * n
        _U32.pack_into(hdr, end, crc32c(hdr[:end]))
        hdr[end + 4 :] = bytes(hdr_len - end - 4)

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return int(st.f_bavail * st.f_frsize) - self.reserved_bytes

    def _check_space(self, need: int) -> None:
        try:
            free = self._free_bytes()
        except OSError as exc:
            raise self._io_error("statvfs", self.root, exc) from exc
        # headroom for the directory blocks a new fragment may need
        if free < need + 2 * ALIGN:
            self._mark_full(need, free)
            raise NoSpaceError(
                f"target {self.target_id} is full: {max(free, 0)} bytes free (after a reserve of "
                f"{self.reserved_bytes}), fragment needs {need}"
            )

    async def _write_temp(self, tmp: Path, hdr: memoryview, body: memoryview | None) -> None:
        try:
            fd = await self.backend.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise self._io_error("create", tmp, exc) from exc
        ok = False
        try:
            ops = [self.backend.write_at(fd, hdr, 0)]
            if body is not None:
                ops.append(self.backend.write_at(fd, body, hdr.nbytes))
            results = await asyncio.gather(*ops, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            await self.backend.fsync(fd, datasync=True)
            ok = True
        except OSError as exc:
            raise self._io_error("write", tmp, exc) from exc
        finally:
            await self.backend.close(fd)
            if not ok:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    async def _install(self, tmp: Path, key: FragmentKey, entry: _Entry) -> None:
        path = fragment_path(self.root, key)
        ino_dir = str(path.parent)
        for _attempt in range(3):
            new_dir = ino_dir not in self._known_dirs
            try:
                if new_dir:
                    os.makedirs(ino_dir, exist_ok=True)
                os.rename(tmp, path)
            except FileNotFoundError:
                self._known_dirs.discard(ino_dir)  # removed under us: recreate
                if not tmp.exists():
                    raise
                continue
            except OSError as exc:
                raise self._io_error("rename", path, exc) from exc
            break
        else:
            raise InternalError(f"could not install {path}")
        # What the file looks like as installed: the writer's client trusts
        # these bytes under this entry's serial without reading them back.
        with contextlib.suppress(OSError):
            st = os.stat(path)
            entry.ident = (st.st_ino, st.st_ctime_ns, st.st_size)
        old = self._index.get(key)
        if old is not None:
            # Until the new entry is indexed, a read may open the new file
            # while finding the old entry: it must not vouch for those bytes.
            old.serial = 0
        syncs = [self._dirsync.sync(ino_dir)]
        if new_dir:
            syncs.append(self._dirsync.sync(str(path.parent.parent)))
            syncs.append(self._dirsync.sync(str(path.parent.parent.parent)))
        try:
            await asyncio.gather(*syncs)
        except OSError as exc:
            raise self._io_error("fsync", ino_dir, exc) from exc
        self._known_dirs.add(ino_dir)
        old = self._index.get(key)
        if old is not None:
            self._used -= old.file_len
        self._index[key] = entry
        self._used += entry.file_len

    # -- read internals --------------------------------------------------------------

    async def _read_header(self, fd: int, path: Path | str, key: FragmentKey, entry: _Entry) -> _Header:
        hdr_len = header_length(entry.size) if entry.size >= 0 else ALIGN
        buf = self.pool.get(hdr_len)
        try:
            n = await self._pread(fd, buf, 0, path)
            if n >= _FIXED.size:
                # the header says how long it is (a guess from a stale size, or
                # none after a restart, may be short); the parse checks it
                want = _FIXED.unpack_from(buf, 0)[3]
                if isinstance(want, int) and hdr_len < want <= 1 << 24 and want % ALIGN == 0:
                    self.pool.put(buf)
                    buf = self.pool.get(want)
                    n = await self._pread(fd, buf, 0, path)
            hdr = self._parse(buf[:n], key, path)
        finally:
            self.pool.put(buf)
        entry.size, entry.crc = hdr.size, hdr.crc
        return hdr

    async def _read_whole(
        self, fd: int, path: Path | str, key: FragmentKey, entry: _Entry
    ) -> tuple[memoryview, _Header]:
        want = entry.file_len
        for _attempt in range(2):
            buf = self.pool.get(max(want, ALIGN))
            try:
                n = await self._pread(fd, buf, 0, path)
                hdr = self._parse(buf[:n], key, path)
                end = hdr.hdr_len + hdr.size
                if end > n:
                    real = os.fstat(fd).st_size
                    if real > want and _attempt == 0:
                        want = real  # replaced by a larger fragment since the scan
                        self.pool.put(buf)
                        continue
                    raise self._corrupt(f"{path}: {n} bytes on disk, header promises {end}")
                payload = buf[hdr.hdr_len : end]
                got = await self._crc_chain_value(payload, 0)
                if got != hdr.crc:
                    raise self._corrupt(f"{path}: payload CRC32C {got:08x} != stored {hdr.crc:08x}")
            except BaseException:
                self.pool.put(buf)
                raise
            entry.size, entry.crc = hdr.size, hdr.crc
            return payload, hdr
        raise InternalError("unreachable")  # pragma: no cover

    async def _read_range(
        self, fd: int, path: Path | str, key: FragmentKey, entry: _Entry, offset: int, length: int
    ) -> tuple[memoryview, _Header]:
        hdr = await self._read_header(fd, path, key, entry)
        size = hdr.size
        if offset > size:
            raise InvalidArgumentError(f"offset {offset} is beyond the end of {key} ({size} bytes)")
        end = size if length == -1 else min(size, offset + length)
        if end <= offset:
            return self.pool.get(0), hdr
        b0, b1 = offset // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
        lo = b0 * BLOCK_SIZE
        hi = min((b1 + 1) * BLOCK_SIZE, size)
        buf = self.pool.get(round_up(hi - lo))
        try:
            n = await self._pread(fd, buf, hdr.hdr_len + lo, path)
            if n < hi - lo:
                raise self._corrupt(f"{path}: short payload ({n} of {hi - lo} bytes at {lo})")
            seed = hdr.prefix[b0 - 1] if b0 else 0
            got = await self._crc_chain_value(buf[: hi - lo], seed)
            if got != hdr.prefix[b1]:
                raise self._corrupt(f"{path}: CRC32C mismatch in blocks {b0}..{b1}")
        except BaseException:
            self.pool.put(buf)
            raise
        return buf[offset - lo : end - lo], hdr

    async def _crc_chain_value(self, data: memoryview, seed: int) -> int:
        if self._offload(data.nbytes):
            return await asyncio.to_thread(crc32c, data, seed)
        return crc32c(data, seed)

    async def _pread(self, fd: int, buf: memoryview, offset: int, path: Path | str) -> int:
        try:
            return await self.backend.read_at(fd, buf, offset)
        except OSError as exc:
            raise self._io_error("read", path, exc) from exc

    def _parse(self, buf: memoryview, key: FragmentKey, path: Path | str) -> _Header:
        try:
            return _parse_header(buf, key, path)
        except CorruptError:
            self.counters["corrupt"] += 1
            raise

    def _corrupt(self, msg: str) -> CorruptError:
        self.counters["corrupt"] += 1
        log.error("target %s: %s", self.target_id, msg)
        return CorruptError(msg)

    # -- health ------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if not self._opened:
            raise UnavailableError(f"target {self.target_id} is not open")
        if self._failed is not None:
            raise UnavailableError(f"target {self.target_id} failed: {self._failed}")

    def _check_readable(self) -> None:
        self._check_usable()

    def _fail(self, why: str) -> None:
        if self._failed is None:
            log.error("target %s marked failed: %s", self.target_id, why)
            self._failed = why

    def _io_error(self, op: str, path: Path | str, exc: OSError) -> TierFSError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._mark_full(self._last_need)
            return NoSpaceError(f"target {self.target_id} is full ({op} {path}: {exc.strerror})")
        self.counters["io_errors"] += 1
        if exc.errno in (errno.EIO, errno.EROFS, errno.ENODEV, errno.ENXIO):
            self._fail(f"{op} {path}: {exc}")
            return UnavailableError(f"target {self.target_id} failed: {op} {path}: {exc.strerror}")
        return InternalError(f"target {self.target_id}: {op} {path}: {exc}")
