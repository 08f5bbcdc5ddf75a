"""The per-target KV store: the storage daemon's side of a KV pool.

One :class:`KVStore` per target serves every KV pool on that target. Each
pool has a memory budget (a cache of the hot objects, kept in pool buffers
and handed out zero-copy) and a disk budget (the capacity: every object of a
pool with a disk budget is written to disk, so a restart keeps it). A pool
with ``disk_bytes == 0`` lives in memory only; one with ``memory_bytes == 0``
on disk only. docs/storage_kv.md has the whole story; in short:

* objects are immutable: a put of an existing key is a no-op (False) unless
  ``overwrite``; an object enters the index only once it is complete (on
  disk: written to ``tmp/`` and renamed), so it is never seen half-written;
* nothing is fsynced per put unless the pool asks (``KVPoolSpec.fsync``);
* on-disk layout (under the target's directory, which the chunk engine
  shares; it never looks into ``kv/``)::

      <target>/kv/<pool_id>/tmp/<gen:016x>.tmp          puts in progress (wiped at open)
      <target>/kv/<pool_id>/<gen & 0xff:02x>/<gen:016x> one object: 4 KiB header + payload
      <target>/kv/.trash-<pool_id>-<ns>/                 a removed pool, deleted in the background

  Every object file has its own generation (a store-wide counter), so a
  file is never rewritten with other contents: an overwrite writes a new
  file and unlinks the old one, and a reader that opened the old file still
  reads the old object whole;
* the header (one page) holds the key, size, CRC32C, expiry and pin, and its
  own CRC32C; ``open()`` rebuilds the index from the headers and discards
  torn objects (bad header, wrong length); a payload that fails its CRC at
  ``get`` is deleted and answered as a miss, never returned;
* each tier (memory, disk) evicts with the pool's policy when a put would
  take it past ``high_watermark`` of its budget, down to ``low_watermark``;
  evicting from memory drops only the memory copy when the object is on
  disk. A put never fails while something is evictable; when nothing is
  (all pinned), ``NoSpaceError`` and nothing changed;
* a get's view stays valid until ``release(view)``: memory copies are
  reference counted and freed by the last reader, disk reads land in a
  buffer of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import heapq
import logging
import os
import shutil
import stat
import struct
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierfs.buffers import ALIGN, BufferPool, round_up
from tierfs.chunk import crc32c as _crc32c
from tierfs.errors import (
    InternalError,
    InvalidArgumentError,
    NoSpaceError,
    NotFoundError,
    TierFSError,
    UnavailableError,
)
from tierfs.fsutil import boot_id, fsync_dir, make_private, makedirs_durable, syncfs, write_durable
from tierfs.kv.policy import EvictionPolicy, make_policy
from tierfs.storage.io.base import IOBackend
from tierfs.storage.io.posix import PosixBackend

__all__ = [
    "DEFAULT_SOFT_PIN_TTL_MS",
    "HEADER_BYTES",
    "MAX_KEY_BYTES",
    "MAX_TTL_MS",
    "PIN_HARD",
    "PIN_NONE",
    "PIN_SOFT",
    "KVPoolSpec",
    "KVPoolUsage",
    "KVStore",
    "object_file_length",
]

log = logging.getLogger(__name__)

#: A stored key: the data plane's 8-byte tenant prefix, then the user's key
#: of at most MAX_KV_KEY (512) bytes (docs/security-caps.md, "KV tenants").
MAX_KEY_BYTES = 512 + 8
PIN_NONE, PIN_SOFT, PIN_HARD = 0, 1, 2
#: a soft pin asked for without a TTL lasts this long
DEFAULT_SOFT_PIN_TTL_MS = 60_000
#: the longest TTL (object or pin) a put may ask for: ten years (an expiry
#: is stored as wall-clock nanoseconds in 64 bits)
MAX_TTL_MS = 10 * 365 * 86_400_000

MAGIC = b"TFSKVOB1"
FORMAT_VERSION = 1
HEADER_BYTES = ALIGN
# magic, format, pin, key_len, pool_id, gen, size, crc, expiry_ns, pin_expiry_ns; then the key,
# then a CRC32C of everything before it
_HDR = struct.Struct("<8sHHIQQQIqq")
_U32 = struct.Struct("<I")
# After the key's CRC: the placement stamp and a CRC32C of the header up to
# it. Zeros (a file written before stamps) read as stamp 0; readers of that
# release stop at the key's CRC, so the format number did not change.
_EXT = struct.Struct("<QI")
# CRC work above this size runs in a worker thread while other operations are in flight
_CRC_THREAD_MIN = 1 << 20


#: In ``kv/`` while a store is open: the boot id of the machine that opened
#: it. Found at open under another boot id, it says the machine went down
#: (a power cut, a crash of the kernel) with the store open, so what was not
#: fsynced may be gone: pools without ``fsync`` start empty (docs/storage_kv.md,
#: "After a power cut"). A clean ``close()`` writes everything back and
#: removes it.
RUNNING_FILE = ".running"


def object_file_length(size: int) -> int:
    """Bytes on disk of a ``size``-byte object (header page + page-padded payload)."""
    return HEADER_BYTES + round_up(size)


def _memory_charge(size: int) -> int:
    # what a memory copy costs against the budget: the pages it occupies
    return round_up(max(size, 1))


@dataclass(frozen=True, slots=True)
class KVPoolSpec:
    """What a target needs to know about one KV pool (filled from the cluster map)."""

    pool_id: int  # > 0
    name: str
    memory_bytes: int  # this target's memory budget for the pool (0: disk only)
    disk_bytes: int  # this target's disk budget for the pool (0: memory only, lost on restart)
    fsync: bool = False  # fsync each put (and delete) before acking
    pin_quota_bytes: int = 0  # hard-pinned bytes allowed on this target
    policy: str = "lru"
    high_watermark: float = 0.95  # evict when a tier would pass high * budget ...
    low_watermark: float = 0.85  # ... down to low * budget

    def check(self) -> None:
        """Raise InvalidArgumentError unless the spec is usable."""
        where = f"KV pool {self.name!r} (id {self.pool_id})"
        if self.pool_id <= 0:
            raise InvalidArgumentError(f"{where}: pool id must be > 0")
        if self.memory_bytes < 0 or self.disk_bytes < 0 or self.pin_quota_bytes < 0:
            raise InvalidArgumentError(f"{where}: budgets and pin quota must be >= 0")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise InvalidArgumentError(
                f"{where}: watermarks need 0 < low ({self.low_watermark}) <= high ({self.high_watermark}) <= 1"
            )
        make_policy(self.policy)  # raises InvalidArgumentError for an unknown name


@dataclass(frozen=True, slots=True)
class KVPoolUsage:
    """One pool's usage and counters on one target."""

    pool_id: int
    name: str
    objects: int
    memory_used: int
    disk_used: int
    pinned_bytes: int
    puts: int
    hits: int
    misses: int
    evictions: int
    expired: int
    corrupt: int
    torn_discarded: int
    bytes_in: int
    bytes_out: int
    memory_bytes: int = 0  # the budgets, for context
    disk_bytes: int = 0
    memory_objects: int = 0  # objects with a memory copy
    hard_pinned_bytes: int = 0
    memory_evictions: int = 0  # memory copies dropped (the object stays on disk)
    deletes: int = 0

    def as_dict(self) -> dict[str, int | str]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


_COUNTERS = (
    "puts", "hits", "misses", "evictions", "expired", "corrupt", "torn_discarded",
    "bytes_in", "bytes_out", "memory_evictions", "deletes", "stale",
)


class _MemBuf:
    """A memory copy: a pool buffer freed by whoever lets go of it last (the
    store when it drops the copy, or the last reader's ``release``)."""

    __slots__ = ("dropped", "refs", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.refs = 0
        self.dropped = False


@dataclass(slots=True, eq=False)
class _Obj:
    key: bytes
    size: int
    crc: int
    gen: int
    expiry_ns: int  # 0: never
    pin: int
    pin_expiry_ns: int  # 0: never
    path: str | None = None  # the object's file; None in a memory-only pool
    mem: _MemBuf | None = None
    in_cap: bool = False  # in the capacity tier's policy (evictable)
    in_mem: bool = False  # in the memory tier's policy (disk pools: the copy is evictable)
    # The writer's placement stamp (docs/kv.md, "Overwrites and map changes"):
    # a get that asks for a later one (``since``) is a miss. 0: none given.
    stamp: int = 0

    def expired(self, now_ns: int) -> bool:
        return 0 < self.expiry_ns <= now_ns


class _Tier:
    """Byte accounting of one tier of one pool. ``used`` includes puts in
    progress (reserved before they write); ``evictable`` is what the policy
    holds, so ``used - evictable`` is what eviction can never free."""

    def __init__(self, budget: int, high: float, low: float, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.used = 0
        self.evictable = 0
        self.set_budget(budget, high, low)

    def set_budget(self, budget: int, high: float, low: float) -> None:
        self.budget = budget
        self.high = int(budget * high)
        self.low = int(budget * low)

    def fits(self, need: int, freeable: int = 0) -> bool:
        return self.used - self.evictable - freeable + need <= self.high


class _Pool:
    def __init__(self, spec: KVPoolSpec, directory: Path) -> None:
        self.spec = spec
        self.dir = directory
        self.index: dict[bytes, _Obj] = {}
        self.mem = _Tier(spec.memory_bytes, spec.high_watermark, spec.low_watermark,
                         make_policy(spec.policy, capacity_bytes=spec.memory_bytes))
        self.disk = _Tier(spec.disk_bytes, spec.high_watermark, spec.low_watermark,
                          make_policy(spec.policy, capacity_bytes=spec.disk_bytes))
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.pinned = 0
        self.hard_pinned = 0
        self.ttl_heap: list[tuple[int, int, bytes]] = []
        self.pin_heap: list[tuple[int, int, bytes]] = []
        self.known_dirs: set[str] = set()
        self.mem_copies = 0  # disk pools: objects with a memory copy
        self.dead = False

    @property
    def has_disk(self) -> bool:
        return self.spec.disk_bytes > 0

    @property
    def cap(self) -> _Tier:
        """The tier that holds every object (eviction from it drops the object)."""
        return self.disk if self.has_disk else self.mem

    def cap_charge(self, size: int) -> int:
        return object_file_length(size) if self.has_disk else _memory_charge(size)

    def where(self, target_id: int) -> str:
        return f"KV pool {self.spec.name!r} on target {target_id}"


@dataclass(slots=True)
class _Loaded:
    """Objects of one pool directory found by ``open()``, until a ``configure``
    adopts (or drops) the pool."""

    objs: list[_Obj]
    torn: int
    expired: int


class _KeyLocks:
    def __init__(self) -> None:
        self._locks: dict[tuple[int, bytes], tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: tuple[int, bytes]) -> AsyncIterator[None]:
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


def _normalize_key(key: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    elif not isinstance(key, bytes):
        key = bytes(key)
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgumentError(f"a KV key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def _byte_view(value: memoryview | bytes | bytearray) -> memoryview:
    view = value if isinstance(value, memoryview) else memoryview(value)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise InvalidArgumentError("a KV value must be a contiguous buffer")
        view = view.cast("B")
    return view


def _pack_header(buf: memoryview, pool_id: int, obj: _Obj) -> None:
    n = len(obj.key)
    _HDR.pack_into(buf, 0, MAGIC, FORMAT_VERSION, obj.pin, n, pool_id, obj.gen, obj.size, obj.crc,
                   obj.expiry_ns, obj.pin_expiry_ns)
    end = _HDR.size + n
    buf[_HDR.size:end] = obj.key
    _U32.pack_into(buf, end, _crc32c(buf[:end]))
    _EXT.pack_into(buf, end + 4, obj.stamp, 0)
    _U32.pack_into(buf, end + 12, _crc32c(buf[:end + 12]))
    tail = end + _U32.size + _EXT.size
    buf[tail:] = bytes(buf.nbytes - tail)


def _parse_header(buf: memoryview | bytes, path: str) -> tuple[int, _Obj]:
    """(pool id, object) from a header page; ValueError says why it is unusable."""
    if len(buf) < _HDR.size:
        raise ValueError(f"{path}: truncated header ({len(buf)} bytes)")
    magic, fmt, pin, klen, pool_id, gen, size, crc, expiry, pin_expiry = _HDR.unpack_from(buf, 0)
    if magic != MAGIC or fmt != FORMAT_VERSION:
        raise ValueError(f"{path}: not a format-{FORMAT_VERSION} KV object (magic {magic!r})")
    if not 1 <= klen <= MAX_KEY_BYTES or pin not in (PIN_NONE, PIN_SOFT, PIN_HARD):
        raise ValueError(f"{path}: bad header fields (key length {klen}, pin {pin})")
    end = _HDR.size + klen
    (stored,) = _U32.unpack_from(buf, end)
    if _crc32c(bytes(buf[:end])) != stored:
        raise ValueError(f"{path}: header checksum mismatch")
    key = bytes(buf[_HDR.size:end])
    stamp, ext_crc = _EXT.unpack_from(buf, end + 4)
    if (stamp or ext_crc) and _crc32c(bytes(buf[:end + 12])) != ext_crc:
        raise ValueError(f"{path}: header stamp checksum mismatch")
    return pool_id, _Obj(key, size, crc, gen, expiry, pin, pin_expiry, path, stamp=stamp)


# Object files are opened with O_NONBLOCK: it changes nothing for a regular
# file, and a FIFO where an object's file was (mkfifo in the data dir) then
# fails at once (a read: ESPIPE; a write with no reader: ENXIO) and is
# dropped as corrupt, where a plain open waited for ever - at the store's
# open, and on the event loop at a get: the whole daemon hung.


def _mode(path: str) -> int | None:
    """``path``'s st_mode (not following a symlink), or None if it cannot be stat'ed."""
    try:
        return os.lstat(path).st_mode
    except OSError:
        return None


def _obj_path(directory: Path, gen: int) -> str:
    return f"{directory}/{gen & 0xFF:02x}/{gen:016x}"


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            # a directory where an object's file was (dropped as corrupt or
            # torn): it goes too. Before, the unlink failed, the rest
            # of the batch stayed, and at open the store did not open.
            shutil.rmtree(p, ignore_errors=True)


class KVStore:
    """Every KV pool of one target (see the module docstring).

    ``await store.open()`` (rebuilds the index from disk), then
    ``store.configure(specs)`` with the pools from the cluster map (a pool not
    listed is dropped with its objects, so call it only with the real map),
    then put/get/...; ``await store.close()`` at the end. All methods run on
    one event loop. ``clock`` (wall-clock seconds) may be injected for tests
    of TTLs; expiries are stored as wall-clock times so they hold across a
    restart.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        target_id: int,
        pool: BufferPool,
        backend: IOBackend | None = None,
        clock: Callable[[], float] = time.time,
        sweep_interval: float = 1.0,
    ) -> None:
        self.root = Path(root)
        self.kv_root = self.root / "kv"
        self.target_id = target_id
        self.pool = pool
        self._own_backend = backend is None
        self.backend: IOBackend = backend if backend is not None else PosixBackend(pool, threads=4)
        self._clock = clock
        self._sweep_interval = sweep_interval
        self._pools: dict[int, _Pool] = {}
        self._loaded: dict[int, _Loaded] = {}
        self._locks = _KeyLocks()
        self._gen = 0
        self._busy = 0
        # views handed out by get(): id -> (view, memory copy or None for a private buffer)
        self._lent: dict[int, tuple[memoryview, _MemBuf | None]] = {}
        # regions handed out by alloc(), not yet given to put() or release()
        self._allocs: dict[int, object] = {}
        self._unlink_q: list[str] = []
        self._reaping: asyncio.Future[None] | None = None  # the reaper's unlink batch in flight
        self._trash_q: list[str] = []
        self._dirty: dict[int, tuple[_Pool, _Obj]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._persister: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._opened = False
        #: the machine went down with this store open (see RUNNING_FILE)
        self.after_power_cut = False
        self._had_disk = False  # a pool with a disk budget was served: write back at close
        self._marked = False  # RUNNING_FILE holds this boot

    # -- lifecycle -------------------------------------------------------------

    async def open(self) -> None:
        """Rebuild the index from disk. Torn objects (unreadable header, wrong
        length) and expired ones are deleted and counted; payloads are checked
        at get, not here."""
        loaded, max_gen, trash = await asyncio.to_thread(self._scan)
        self._loaded = loaded
        self._gen = max(self._gen, max_gen)
        self._trash_q.extend(trash)
        self._opened = True
        if trash:
            self._kick_reaper()
        if self._sweep_interval > 0:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    def _scan(self) -> tuple[dict[int, _Loaded], int, list[str]]:
        makedirs_durable(self.kv_root)
        make_private(self.kv_root)
        running = self.kv_root / RUNNING_FILE
        now_boot = boot_id()
        try:
            then = running.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            then = None
        self.after_power_cut = then is not None and then != now_boot
        if self.after_power_cut:
            # The mark keeps the old boot until configure() has dropped what
            # needs dropping: a restart before that drops it then.
            log.warning("target %s: the machine went down with the KV store open (boot %s, now %s): "
                        "KV pools without fsync start empty", self.target_id, then, now_boot)
        else:
            self._mark_running()
        now = self._now_ns()
        loaded: dict[int, _Loaded] = {}
        max_gen = 0
        trash: list[str] = []
        for entry in os.scandir(self.kv_root):
            if entry.name.startswith(".trash-"):
                trash.append(entry.path)
                continue
            if entry.name.startswith(RUNNING_FILE):
                continue
            try:
                pool_id = int(entry.name)
            except ValueError:
                log.warning("target %s: ignoring stray %s", self.target_id, entry.path)
                continue
            if not entry.is_dir() or pool_id <= 0:
                continue
            best: dict[bytes, _Obj] = {}
            torn = expired = 0
            stale: list[str] = []
            tmp = Path(entry.path) / "tmp"
            if tmp.is_dir():
                for t in os.scandir(tmp):
                    stale.append(t.path)
            for fan in os.scandir(entry.path):
                if fan.name == "tmp" or not fan.is_dir():
                    continue
                for f in os.scandir(fan.path):
                    try:
                        gen = int(f.name, 16)
                    except ValueError:
                        continue
                    max_gen = max(max_gen, gen)
                    obj = self._load_header(f.path, pool_id, gen)
                    if obj is None:
                        torn += 1
                        stale.append(f.path)
                    elif obj.expired(now):
                        expired += 1
                        stale.append(f.path)
                    else:
                        # two files of one key: an overwrite's leftover; the newer one wins
                        old = best.get(obj.key)
                        if old is None or old.gen < obj.gen:
                            best[obj.key] = obj
                            if old is not None and old.path is not None:
                                stale.append(old.path)
                        else:
                            stale.append(f.path)
            _unlink_all(stale)
            loaded[pool_id] = _Loaded(sorted(best.values(), key=lambda o: o.gen), torn, expired)
            if torn:
                log.warning("target %s: KV pool %d: discarded %d torn objects", self.target_id, pool_id, torn)
        return loaded, max_gen, trash

    def _load_header(self, path: str, pool_id: int, gen: int) -> _Obj | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            head = os.pread(fd, HEADER_BYTES, 0)
            length = os.fstat(fd).st_size
        except OSError:
            return None
        finally:
            os.close(fd)
        try:
            pid, obj = _parse_header(head, path)
        except ValueError as exc:
            log.warning("target %s: torn KV object: %s", self.target_id, exc)
            return None
        if pid != pool_id or obj.gen != gen or length != object_file_length(obj.size):
            log.warning("target %s: torn KV object %s (%d bytes on disk, header says %d of pool %d gen %x)",
                        self.target_id, path, length, object_file_length(obj.size), pid, obj.gen)
            return None
        return obj

    async def close(self) -> None:
        """Stop the background work and finish pending unlinks and pin updates.
        Views still lent out stay valid until released."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._opened = False
        for p in self._pools.values():
            for obj in p.index.values():
                if obj.mem is not None:
                    self._drop_buf(obj.mem)
                    obj.mem = None
        self._pools.clear()
        if self._own_backend:
            await self.backend.aclose()
        # Everything written back, then the mark of an open store goes: the
        # next open, after a reboot or not, keeps what is on disk.
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self._clean_shutdown)

    def _mark_running(self) -> None:
        write_durable(self.kv_root / RUNNING_FILE, boot_id().encode("ascii") + b"\n")
        self._marked = True

    def _clean_shutdown(self) -> None:
        if not self._marked:
            return  # opened after a power cut, never configured: the next open still drops
        try:
            if self._had_disk:
                syncfs(self.kv_root)
        except OSError as exc:
            log.warning("target %s: KV store not written back at close (%s): it counts as a power cut "
                        "after a reboot", self.target_id, exc)
            return
        os.unlink(self.kv_root / RUNNING_FILE)
        fsync_dir(self.kv_root)

    # -- configuration -----------------------------------------------------------

    def configure(self, pools: Sequence[KVPoolSpec]) -> None:
        """Make the target's pools exactly ``pools``: new ones are added (with
        what ``open()`` found on disk for them), changed ones resized (a
        shrink evicts down at once), unlisted ones dropped: their objects are
        no longer served and their files are deleted in the background.
        Changing a pool between memory-only and disk-backed starts it empty.
        A bad spec raises InvalidArgumentError and changes nothing."""
        self._check_open()
        specs = list(pools)
        seen: set[int] = set()
        for s in specs:
            s.check()
            if s.pool_id in seen:
                raise InvalidArgumentError(f"KV pool id {s.pool_id} listed twice")
            seen.add(s.pool_id)
        for pid in [pid for pid in self._pools if pid not in seen]:
            self._drop_pool(self._pools.pop(pid))
        for pid in [pid for pid in self._loaded if pid not in seen]:
            del self._loaded[pid]
            self._trash_dir(self.kv_root / str(pid))
        for s in specs:
            p = self._pools.get(s.pool_id)
            if p is not None and (s.disk_bytes > 0) != p.has_disk:
                self._drop_pool(self._pools.pop(s.pool_id))
                p = None
            if p is None:
                self._pools[s.pool_id] = self._new_pool(s)
            else:
                self._resize(p, s)
        if not self._marked:
            self._mark_running()  # after a power cut: what it undid is dropped now

    def _new_pool(self, spec: KVPoolSpec) -> _Pool:
        p = _Pool(spec, self.kv_root / str(spec.pool_id))
        found = self._loaded.pop(spec.pool_id, None)
        if not p.has_disk:
            if found is not None:
                self._trash_dir(p.dir)
            return p
        if found is not None and self.after_power_cut and not spec.fsync:
            # Unsynced deletes, overwrites and evictions may have been undone
            # by the cut: any file here may hold a value the key no longer has.
            if found.objs:
                log.warning("%s: %d objects dropped after a power cut (the pool does not fsync)",
                            p.where(self.target_id), len(found.objs))
            self._trash_dir(p.dir)
            found = None
        self._had_disk = True
        makedirs_durable(p.dir / "tmp")
        if found is not None:
            p.counters["torn_discarded"] += found.torn
            p.counters["expired"] += found.expired
            for obj in found.objs:  # oldest first, so LRU evicts the oldest
                p.index[obj.key] = obj
                p.disk.used += object_file_length(obj.size)
                pin, obj.pin = obj.pin, PIN_NONE
                if pin:
                    self._set_pin(p, obj, pin, obj.pin_expiry_ns)
                else:
                    self._cap_evictable(p, obj, True)
                if obj.expiry_ns:
                    heapq.heappush(p.ttl_heap, (obj.expiry_ns, obj.gen, obj.key))
            self._shrink(p)
        return p

    def _resize(self, p: _Pool, spec: KVPoolSpec) -> None:
        old = p.spec
        p.spec = spec
        for tier, budget in ((p.mem, spec.memory_bytes), (p.disk, spec.disk_bytes)):
            tier.set_budget(budget, spec.high_watermark, spec.low_watermark)
        if spec.policy != old.policy:
            p.mem.policy = make_policy(spec.policy, capacity_bytes=spec.memory_bytes)
            p.disk.policy = make_policy(spec.policy, capacity_bytes=spec.disk_bytes)
            for obj in sorted(p.index.values(), key=lambda o: o.gen):
                if obj.in_cap:
                    p.cap.policy.on_insert(obj.key, p.cap_charge(obj.size))
                if obj.in_mem:
                    p.mem.policy.on_insert(obj.key, _memory_charge(obj.size))
        self._shrink(p)

    def _shrink(self, p: _Pool) -> None:
        self._make_room(p, p.cap, 0, capacity=True)
        if p.has_disk:
            self._make_room(p, p.mem, 0, capacity=False)
        if p.cap.used > p.cap.high:
            log.warning("%s: %d bytes in use over a budget of %d (pinned objects stay)",
                        p.where(self.target_id), p.cap.used, p.cap.budget)

    def _drop_pool(self, p: _Pool) -> None:
        p.dead = True
        for obj in p.index.values():
            if obj.mem is not None:
                self._drop_buf(obj.mem)
                obj.mem = None
        p.index.clear()
        if p.has_disk:
            self._trash_dir(p.dir)

    def _trash_dir(self, directory: Path) -> None:
        # renamed at once (so nothing in it is served or re-indexed), deleted in the background
        dest = self.kv_root / f".trash-{directory.name}-{time.time_ns()}"
        try:
            os.rename(directory, dest)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.error("target %s: cannot move %s aside: %s", self.target_id, directory, exc)
            return
        self._trash_q.append(str(dest))
        self._kick_reaper()

    # -- buffers -----------------------------------------------------------------

    def alloc(self, size: int) -> memoryview:
        """A buffer to receive a value into; give it to ``put`` (which owns it
        from then on, whatever the outcome) or back to ``release``."""
        buf = self.pool.get(size)
        self._allocs[id(buf.obj)] = buf.obj
        return buf

    def release(self, buf: memoryview) -> None:
        """Return a view from ``get`` (the object's bytes may be freed once
        no reader holds them) or an unused ``alloc`` buffer."""
        lent = self._lent.pop(id(buf), None)
        if lent is not None:
            view, mb = lent
            if mb is None:
                self.pool.put(view)
            else:
                mb.refs -= 1
                with contextlib.suppress(BufferError):
                    view.release()
                if mb.refs == 0 and mb.dropped:
                    self.pool.put(mb.view)
            return
        region = buf.obj
        if self._allocs.get(id(region)) is region:
            del self._allocs[id(region)]
            self.pool.put(buf)
            return
        raise ValueError("buffer was not handed out by this store's get() or alloc() (or was released twice)")

    def _take_alloc(self, view: memoryview) -> bool:
        """True (and the store now owns it) when ``view`` lies in an alloc() buffer."""
        try:
            region = view.obj
        except ValueError:
            return False
        if self._allocs.get(id(region)) is region:
            del self._allocs[id(region)]
            return True
        return False

    def _lend(self, view: memoryview, mb: _MemBuf | None) -> memoryview:
        if mb is not None:
            mb.refs += 1
            view = mb.view.toreadonly()
        self._lent[id(view)] = (view, mb)
        return view

    def _drop_buf(self, mb: _MemBuf) -> None:
        mb.dropped = True
        if mb.refs == 0:
            self.pool.put(mb.view)

    # -- operations ----------------------------------------------------------------

    async def put(
        self,
        pool_id: int,
        key: bytes,
        value: memoryview,
        crc: int,
        *,
        overwrite: bool = False,
        ttl_ms: int = 0,
        pin: int = PIN_NONE,
        pin_ttl_ms: int = 0,
        stamp: int = 0,
    ) -> bool:
        """Store ``value`` (whose CRC32C ``crc`` the caller has verified) under
        ``key``. True: stored; False: the key exists (nothing done) unless
        ``overwrite``. A buffer from ``alloc()`` belongs to the store from
        this call on (it may become the memory copy, or is released).
        Evicts first when the pool is full; NoSpaceError only when nothing
        is evictable or the hard-pin quota would be passed, and then nothing
        changed. NotFoundError for an unknown pool. ``stamp``: the writer's
        placement stamp; an object there with an earlier one is replaced
        (a reader as up to date as the writer would not be served it)."""
        owned = isinstance(value, memoryview) and self._take_alloc(value)
        try:
            view = _byte_view(value)
            key = _normalize_key(key)
            if pin not in (PIN_NONE, PIN_SOFT, PIN_HARD):
                raise InvalidArgumentError(f"unknown pin kind {pin}")
            if not (0 <= ttl_ms <= MAX_TTL_MS and 0 <= pin_ttl_ms <= MAX_TTL_MS):
                raise InvalidArgumentError(f"TTLs must be 0 (none) to {MAX_TTL_MS} ms (ten years), got "
                                           f"{ttl_ms} and pin {pin_ttl_ms}")
            p = self._pool(pool_id)
            self._busy += 1
            try:
                kept = await self._put(p, key, view, crc & 0xFFFFFFFF, owned, overwrite, ttl_ms, pin, pin_ttl_ms,
                                       stamp)
            finally:
                self._busy -= 1
            if kept:
                owned = False
            return kept is not None
        finally:
            if owned:
                self.pool.put(value)

    async def _put(
        self, p: _Pool, key: bytes, view: memoryview, crc: int, owned: bool, overwrite: bool,
        ttl_ms: int, pin: int, pin_ttl_ms: int, stamp: int = 0,
    ) -> bool | None:
        """None: not stored (the key existed); else whether ``view`` became the memory copy."""
        size = view.nbytes
        cap = p.cap
        charge = p.cap_charge(size)
        if charge > cap.high:
            raise InvalidArgumentError(
                f"{p.where(self.target_id)}: a {size}-byte object can never fit "
                f"({charge} bytes needed, {cap.high} allowed at the {p.spec.high_watermark:.0%} watermark)"
            )
        async with self._locks.hold((p.spec.pool_id, key)):
            if p.dead:
                raise NotFoundError(f"KV pool {p.spec.name!r} was removed from target {self.target_id}")
            now = self._now_ns()
            old = p.index.get(key)
            if old is not None and old.expired(now):
                self._remove(p, old)
                p.counters["expired"] += 1
                old = None
            if old is not None and not overwrite and old.stamp >= stamp:
                return None
            if pin == PIN_HARD:
                freed = old.size if old is not None and old.pin == PIN_HARD else 0
                if p.hard_pinned - freed + size > p.spec.pin_quota_bytes:
                    raise NoSpaceError(
                        f"{p.where(self.target_id)}: hard pin of {size} bytes would pass the pin quota "
                        f"({p.hard_pinned - freed} of {p.spec.pin_quota_bytes} bytes pinned; the pool's "
                        f"pin_quota, `tierfs kv pool create --pin-quota`)"
                    )
            if not self._fits(p, charge, old, now):
                raise NoSpaceError(
                    f"{p.where(self.target_id)}: no room for {size} bytes and nothing evictable "
                    f"({cap.used} of {cap.budget} bytes used, {cap.used - cap.evictable} pinned or in flight)"
                )
            if old is not None:
                self._remove(p, old)
            self._make_room(p, cap, charge, capacity=True)
            cap.used += charge  # reserved while the object is written
            self._gen += 1
            obj = _Obj(key, size, crc, self._gen, now + ttl_ms * 1_000_000 if ttl_ms else 0, PIN_NONE, 0,
                       stamp=stamp)
            mb: _MemBuf | None = None
            kept = False
            try:
                if p.has_disk:
                    obj.path = await self._write_object(p, obj, view, owned, pin,
                                                        self._pin_expiry(pin, pin_ttl_ms, now))
                    if p.dead:
                        self._unlink_later(obj.path)
                        raise NotFoundError(f"KV pool {p.spec.name!r} was removed from target {self.target_id}")
                else:
                    if owned:
                        mb, kept = _MemBuf(view), True
                    else:
                        mb = _MemBuf(self.pool.get(size))
                        mb.view[:] = view
            except NoSpaceError as exc:  # the file system is fuller than the budgets say
                if not p.dead:
                    cap.used -= charge
                raise NoSpaceError(f"{p.where(self.target_id)}: {exc}") from exc
            except BaseException:
                if not p.dead:
                    cap.used -= charge
                raise
            p.index[key] = obj
            if pin:
                self._set_pin(p, obj, pin, self._pin_expiry(pin, pin_ttl_ms, now))
            else:
                self._cap_evictable(p, obj, True)
            if obj.expiry_ns:
                heapq.heappush(p.ttl_heap, (obj.expiry_ns, obj.gen, key))
            if mb is not None:
                obj.mem = mb  # memory-only pool: the copy is the object, charged to cap
            elif p.has_disk:
                kept = self._keep_in_memory(p, obj, view, owned)
            p.counters["puts"] += 1
            p.counters["bytes_in"] += size
            return kept

    def _fits(self, p: _Pool, charge: int, old: _Obj | None, now: int) -> bool:
        def freeable() -> int:
            # an overwritten object goes too, even if it is pinned
            return p.cap_charge(old.size) if old is not None and not old.in_cap else 0

        if p.cap.fits(charge, freeable()):
            return True
        self._sweep_pool(p, now)  # lapsed pins and expired objects may make room
        if old is not None and p.index.get(old.key) is not old:
            old = None
        return p.cap.fits(charge, freeable())

    def _pin_expiry(self, pin: int, ttl_ms: int, now: int) -> int:
        if pin == PIN_SOFT and ttl_ms == 0:
            ttl_ms = DEFAULT_SOFT_PIN_TTL_MS
        return now + ttl_ms * 1_000_000 if pin and ttl_ms else 0

    async def get(self, pool_id: int, key: bytes, since: int = 0) -> tuple[memoryview, int] | None:
        """(a read-only view of the value, its CRC32C), or None: a miss
        (absent, expired, or found torn or corrupt on disk, which is then
        deleted and counted). Give the view back with ``release``; until
        then it keeps its bytes whatever happens to the object."""
        got = await self.get_with_ttl(pool_id, key, since)
        return None if got is None else (got[0], got[1])

    async def get_with_ttl(self, pool_id: int, key: bytes, since: int = 0) -> tuple[memoryview, int, int] | None:
        """``get``, and the milliseconds the object has left to live (0: no
        TTL), rounded down so that a copy kept that long never outlives it.
        ``since``: the placement stamp the caller's map requires; an object
        put with an earlier one may predate an overwrite it missed, so it is
        a miss (counted ``stale``; a put with the caller's stamp replaces it)."""
        key = _normalize_key(key)
        p = self._pool(pool_id)
        obj = p.index.get(key)
        if obj is not None and obj.expired(self._now_ns()):
            self._remove(p, obj)
            p.counters["expired"] += 1
            obj = None
        if obj is not None and obj.stamp < since:
            p.counters["stale"] += 1
            obj = None
        if obj is None:
            p.counters["misses"] += 1
            p.cap.policy.on_miss(key)
            return None
        if obj.mem is not None:
            self._touch(p, obj)
            p.counters["hits"] += 1
            p.counters["bytes_out"] += obj.size
            return self._lend(obj.mem.view, obj.mem), obj.crc, self._ttl_left_ms(obj)
        self._busy += 1
        try:
            payload = await self._read_object(p, obj)
        finally:
            self._busy -= 1
        if payload is None:
            p.counters["misses"] += 1
            return None
        mb: _MemBuf | None = None
        if p.index.get(key) is obj and not p.dead:
            self._touch(p, obj)
            if obj.mem is None and self._admit_memory(p, obj):
                mb = _MemBuf(payload)
                self._attach_memory(p, obj, mb)
        p.counters["hits"] += 1
        p.counters["bytes_out"] += obj.size
        return self._lend(payload, mb), obj.crc, self._ttl_left_ms(obj)

    def _ttl_left_ms(self, obj: _Obj) -> int:
        if not obj.expiry_ns:
            return 0
        return max(1, (obj.expiry_ns - self._now_ns()) // 1_000_000)

    def contains(self, pool_id: int, keys: Sequence[bytes], since: int | Sequence[int] = 0) -> list[bool]:
        """Which of ``keys`` are present (no I/O; expired ones are not, nor
        ones put with a placement stamp before ``since``: one for all, or
        one per key)."""
        p = self._pool(pool_id)
        now = self._now_ns()
        least = [since] * len(keys) if isinstance(since, int) else since
        out: list[bool] = []
        for k, s in zip(keys, least, strict=True):
            obj = p.index.get(_normalize_key(k))
            out.append(obj is not None and not obj.expired(now) and obj.stamp >= s)
        return out

    def crcs(self, pool_id: int, keys: Sequence[bytes], since: int | Sequence[int] = 0) -> list[int | None]:
        """The stored CRC32C of each of ``keys`` (None: not present, as for
        ``contains``), from the index (no I/O): what a replica get compares
        the copy it read with (docs/kv.md, "Forged copies")."""
        p = self._pool(pool_id)
        now = self._now_ns()
        least = [since] * len(keys) if isinstance(since, int) else since
        out: list[int | None] = []
        for k, s in zip(keys, least, strict=True):
            obj = p.index.get(_normalize_key(k))
            out.append(obj.crc if obj is not None and not obj.expired(now) and obj.stamp >= s else None)
        return out

    async def delete(self, pool_id: int, key: bytes) -> bool:
        """Remove ``key``; False if it was not there. Its file is gone when
        this returns (and fsynced away when the pool asks for fsync)."""
        key = _normalize_key(key)
        p = self._pool(pool_id)
        async with self._locks.hold((pool_id, key)):
            obj = p.index.get(key)
            if p.dead:
                return False
            if obj is None:
                # Evicted, or never here: a file of the key that an eviction
                # or an overwrite left for the reaper goes now (below).
                await self._unlink_queued(p, None)
                return False
            self._remove(p, obj, unlink=False)
            if obj.expired(self._now_ns()):
                p.counters["expired"] += 1
                await self._unlink_queued(p, obj.path)
                return False
            await self._unlink_queued(p, obj.path)
            p.counters["deletes"] += 1
            return True

    async def _unlink_queued(self, p: _Pool, path: str | None) -> None:
        """Unlink ``path`` and every file queued for the reaper so far, and
        wait for a batch the reaper is unlinking now. An object file an
        overwrite or an eviction left for the reaper is otherwise still on
        disk when a delete of its key is acknowledged, and if the daemon dies
        before the reaper gets to it, the next ``open()`` finds it as the
        key's newest file and serves the deleted key again."""
        queued, self._unlink_q = self._unlink_q, []
        paths = ([path] if path is not None else []) + queued
        try:
            if paths:
                await asyncio.to_thread(_unlink_all, paths)
                if p.spec.fsync:
                    for d in sorted({os.path.dirname(x) for x in paths}):
                        await asyncio.to_thread(fsync_dir, d)
        except OSError as exc:
            self._unlink_q.extend(x for x in queued if os.path.lexists(x))  # the reaper tries them again
            raise self._io_error("unlink", path or queued[0], exc) from exc
        busy = self._reaping
        if busy is not None:
            await asyncio.wait({busy})

    def pin(self, pool_id: int, key: bytes, kind: int, ttl_ms: int = 0) -> bool:
        """Keep ``key`` from eviction: PIN_SOFT for ``ttl_ms`` (default
        DEFAULT_SOFT_PIN_TTL_MS), PIN_HARD until unpinned (or ``ttl_ms``),
        counted against the pool's pin quota (NoSpaceError past it, nothing
        changed). False: not present. Re-pinning replaces the pin."""
        key = _normalize_key(key)
        if kind not in (PIN_SOFT, PIN_HARD):
            raise InvalidArgumentError(f"pin kind must be PIN_SOFT or PIN_HARD, got {kind}")
        if not 0 <= ttl_ms <= MAX_TTL_MS:
            raise InvalidArgumentError(f"pin TTL must be 0 to {MAX_TTL_MS} ms (ten years), got {ttl_ms}")
        p = self._pool(pool_id)
        obj = self._live(p, key)
        if obj is None:
            return False
        if kind == PIN_HARD and obj.pin != PIN_HARD and p.hard_pinned + obj.size > p.spec.pin_quota_bytes:
            raise NoSpaceError(
                f"{p.where(self.target_id)}: hard pin of {obj.size} bytes would pass the pin quota "
                f"({p.hard_pinned} of {p.spec.pin_quota_bytes} bytes pinned; the pool's pin_quota, "
                f"`tierfs kv pool create --pin-quota`)"
            )
        self._set_pin(p, obj, kind, self._pin_expiry(kind, ttl_ms, self._now_ns()))
        self._persist(p, obj)
        return True

    def unpin(self, pool_id: int, key: bytes) -> bool:
        """Make ``key`` evictable again; False: not present."""
        key = _normalize_key(key)
        p = self._pool(pool_id)
        obj = self._live(p, key)
        if obj is None:
            return False
        if obj.pin:
            self._set_pin(p, obj, PIN_NONE, 0)
            self._persist(p, obj)
        return True

    def sweep(self) -> int:
        """Reclaim expired objects and lapse expired pins now (a background
        task does this every ``sweep_interval``); returns how many of either."""
        now = self._now_ns()
        return sum(self._sweep_pool(p, now) for p in list(self._pools.values()))

    def usage(self) -> list[KVPoolUsage]:
        out = []
        for pid in sorted(self._pools):
            p = self._pools[pid]
            c = p.counters
            out.append(KVPoolUsage(
                pool_id=pid, name=p.spec.name, objects=len(p.index), memory_used=p.mem.used,
                disk_used=p.disk.used, pinned_bytes=p.pinned, puts=c["puts"], hits=c["hits"],
                misses=c["misses"], evictions=c["evictions"], expired=c["expired"], corrupt=c["corrupt"],
                torn_discarded=c["torn_discarded"], bytes_in=c["bytes_in"], bytes_out=c["bytes_out"],
                memory_bytes=p.spec.memory_bytes, disk_bytes=p.spec.disk_bytes,
                memory_objects=p.mem_copies if p.has_disk else len(p.index),
                hard_pinned_bytes=p.hard_pinned, memory_evictions=c["memory_evictions"],
                deletes=c["deletes"],
            ))
        return out

    # -- index bookkeeping -------------------------------------------------------------

    def has_pool(self, pool_id: int) -> bool:
        """Whether ``pool_id`` is configured here (and not being dropped)."""
        p = self._pools.get(pool_id)
        return p is not None and not p.dead

    def _pool(self, pool_id: int) -> _Pool:
        self._check_open()
        p = self._pools.get(pool_id)
        if p is None:
            raise NotFoundError(f"no KV pool {pool_id} on target {self.target_id}")
        return p

    def _check_open(self) -> None:
        if not self._opened:
            raise UnavailableError(f"KV store of target {self.target_id} is not open")

    def _now_ns(self) -> int:
        return int(self._clock() * 1e9)

    def _live(self, p: _Pool, key: bytes) -> _Obj | None:
        obj = p.index.get(key)
        if obj is not None and obj.expired(self._now_ns()):
            self._remove(p, obj)
            p.counters["expired"] += 1
            return None
        return obj

    def _cap_evictable(self, p: _Pool, obj: _Obj, yes: bool) -> None:
        charge = p.cap_charge(obj.size)
        if yes and not obj.in_cap:
            p.cap.policy.on_insert(obj.key, charge)
            p.cap.evictable += charge
            obj.in_cap = True
        elif not yes and obj.in_cap:
            p.cap.policy.on_remove(obj.key)
            p.cap.evictable -= charge
            obj.in_cap = False

    def _set_pin(self, p: _Pool, obj: _Obj, kind: int, expiry_ns: int) -> None:
        if obj.pin:
            p.pinned -= obj.size
        if obj.pin == PIN_HARD:
            p.hard_pinned -= obj.size
        obj.pin, obj.pin_expiry_ns = kind, expiry_ns
        if kind:
            p.pinned += obj.size
        if kind == PIN_HARD:
            p.hard_pinned += obj.size
        self._cap_evictable(p, obj, kind == PIN_NONE)
        if kind and expiry_ns:
            heapq.heappush(p.pin_heap, (expiry_ns, obj.gen, obj.key))

    def _touch(self, p: _Pool, obj: _Obj) -> None:
        if obj.in_cap:
            p.cap.policy.on_access(obj.key)
        if obj.in_mem:
            p.mem.policy.on_access(obj.key)

    def _admit_memory(self, p: _Pool, obj: _Obj) -> bool:
        """Whether a disk pool should keep a memory copy of ``obj``, making room
        for it in the memory tier (which only drops other copies)."""
        charge = _memory_charge(obj.size)
        if charge > p.mem.high or not p.mem.policy.admit(obj.key, obj.size):
            return False
        self._make_room(p, p.mem, charge, capacity=False)
        return p.mem.used + charge <= p.mem.high

    def _attach_memory(self, p: _Pool, obj: _Obj, mb: _MemBuf) -> None:
        charge = _memory_charge(obj.size)
        obj.mem = mb
        p.mem_copies += 1
        p.mem.used += charge
        p.mem.policy.on_insert(obj.key, charge)
        p.mem.evictable += charge
        obj.in_mem = True

    def _keep_in_memory(self, p: _Pool, obj: _Obj, view: memoryview, owned: bool) -> bool:
        """After a disk pool's put: keep a memory copy if the memory tier takes
        it. True when ``view`` itself became the copy."""
        if not self._admit_memory(p, obj):
            return False
        if owned:
            self._attach_memory(p, obj, _MemBuf(view))
            return True
        try:
            buf = self.pool.get(obj.size)
        except TierFSError:
            return False  # buffer pool exhausted: the object is on disk anyway
        buf[:] = view
        self._attach_memory(p, obj, _MemBuf(buf))
        return False

    def _drop_memory(self, p: _Pool, obj: _Obj) -> None:
        """Disk pools: forget the memory copy (readers keep theirs)."""
        if obj.mem is None:
            return
        charge = _memory_charge(obj.size)
        if obj.in_mem:
            p.mem.policy.on_remove(obj.key)
            p.mem.evictable -= charge
            obj.in_mem = False
        p.mem.used -= charge
        p.mem_copies -= 1
        self._drop_buf(obj.mem)
        obj.mem = None

    def _remove(self, p: _Pool, obj: _Obj, *, unlink: bool = True) -> None:
        """Take ``obj`` out of the pool (its file is unlinked in the background
        unless the caller does it)."""
        if p.index.get(obj.key) is not obj:
            return
        del p.index[obj.key]
        self._cap_evictable(p, obj, False)
        if obj.pin:
            p.pinned -= obj.size
            if obj.pin == PIN_HARD:
                p.hard_pinned -= obj.size
            obj.pin = PIN_NONE
        p.cap.used -= p.cap_charge(obj.size)
        if p.has_disk:
            self._drop_memory(p, obj)
        elif obj.mem is not None:
            self._drop_buf(obj.mem)
            obj.mem = None
        if unlink and obj.path is not None:
            self._unlink_later(obj.path)

    def _make_room(self, p: _Pool, tier: _Tier, need: int, *, capacity: bool) -> None:
        """Evict from ``tier`` when ``need`` more bytes would pass its high
        watermark, down to its low watermark (or until nothing is evictable)."""
        if tier.used + need <= tier.high:
            return
        while tier.used + need > tier.low:
            victim = tier.policy.pop_victim()
            if victim is None:
                break
            obj = p.index.get(victim)
            if capacity:
                if obj is None or not obj.in_cap:
                    continue  # not ours to evict (a policy out of step): never a pinned object
                obj.in_cap = False
                tier.evictable -= p.cap_charge(obj.size)
                self._remove(p, obj)
                p.counters["evictions"] += 1
            else:
                if obj is None or not obj.in_mem:
                    continue
                obj.in_mem = False
                tier.evictable -= _memory_charge(obj.size)
                self._drop_memory(p, obj)
                p.counters["memory_evictions"] += 1

    def _sweep_pool(self, p: _Pool, now: int) -> int:
        n = 0
        while p.ttl_heap and p.ttl_heap[0][0] <= now:
            t, gen, key = heapq.heappop(p.ttl_heap)
            obj = p.index.get(key)
            if obj is not None and obj.gen == gen and obj.expiry_ns == t:
                self._remove(p, obj)
                p.counters["expired"] += 1
                n += 1
        while p.pin_heap and p.pin_heap[0][0] <= now:
            t, gen, key = heapq.heappop(p.pin_heap)
            obj = p.index.get(key)
            if obj is not None and obj.gen == gen and obj.pin and obj.pin_expiry_ns == t:
                self._set_pin(p, obj, PIN_NONE, 0)
                self._persist(p, obj)
                n += 1
        return n

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval)
            try:
                self.sweep()
            except Exception:  # keep sweeping; the next round may succeed
                log.exception("target %s: KV sweep failed", self.target_id)

    # -- disk --------------------------------------------------------------------------

    async def _write_object(
        self, p: _Pool, obj: _Obj, view: memoryview, owned: bool, pin: int, pin_expiry_ns: int
    ) -> str:
        size = obj.size
        padded = round_up(size)
        hdr = self.pool.get(HEADER_BYTES)
        body = self.pool.extent(view, padded) if owned and size else None
        copied = body is None and size > 0
        try:
            if copied:
                body = self.pool.get(padded)
                body[:size] = view
            if body is not None and padded > size:
                body[size:padded] = bytes(padded - size)
            # the header carries the pin it will have once installed
            _pack_header(hdr, p.spec.pool_id,
                         _Obj(obj.key, size, obj.crc, obj.gen, obj.expiry_ns, pin, pin_expiry_ns, stamp=obj.stamp))
            tmp = f"{p.dir}/tmp/{obj.gen:016x}.tmp"
            final = _obj_path(p.dir, obj.gen)
            try:
                fd = await self.backend.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                if p.dead:
                    raise NotFoundError(f"KV pool {p.spec.name!r} was removed from target {self.target_id}") from None
                raise
            except OSError as exc:
                raise self._io_error("create", tmp, exc) from exc
            ok = False
            try:
                ops = [self.backend.write_at(fd, hdr, 0)]
                if body is not None:
                    ops.append(self.backend.write_at(fd, body, HEADER_BYTES))
                for r in await asyncio.gather(*ops, return_exceptions=True):
                    if isinstance(r, BaseException):
                        raise r
                if p.spec.fsync:
                    await self.backend.fsync(fd, datasync=True)
                ok = True
            except OSError as exc:
                raise self._io_error("write", tmp, exc) from exc
            finally:
                await self.backend.close(fd)
                if not ok:
                    _unlink_all([tmp])
        finally:
            self.pool.put(hdr)
            if copied and body is not None:
                self.pool.put(body)
        fan = os.path.dirname(final)
        new_dir = fan not in p.known_dirs
        try:
            if new_dir:
                os.makedirs(fan, exist_ok=True)
            os.rename(tmp, final)
        except OSError as exc:
            _unlink_all([tmp])
            if p.dead:
                raise NotFoundError(f"KV pool {p.spec.name!r} was removed from target {self.target_id}") from None
            raise self._io_error("rename", final, exc) from exc
        p.known_dirs.add(fan)
        if p.spec.fsync:
            try:
                await asyncio.to_thread(fsync_dir, fan)
                if new_dir:
                    await asyncio.to_thread(fsync_dir, p.dir)
            except OSError as exc:
                raise self._io_error("fsync", fan, exc) from exc
        return final

    async def _read_object(self, p: _Pool, obj: _Obj) -> memoryview | None:
        """The verified payload of ``obj``'s file in a buffer of its own, or
        None when the file is gone (evicted, deleted or overwritten since the
        lookup) or fails its checks (then it is deleted and counted)."""
        assert obj.path is not None
        length = object_file_length(obj.size)
        why: str | None = None
        for _attempt in range(2):
            buf = self.pool.get(length)
            try:
                try:
                    fd = await self.backend.open(obj.path, os.O_RDONLY | os.O_NONBLOCK)
                except FileNotFoundError:
                    self.pool.put(buf)
                    # a file leaves only after its index entry, so if the entry is
                    # still there, someone else removed the file: forget it too
                    if p.index.get(obj.key) is obj:
                        log.warning("%s: %s vanished", p.where(self.target_id), obj.path)
                        self._remove(p, obj, unlink=False)
                    return None
                try:
                    n = await self.backend.read_at(fd, buf, 0)
                finally:
                    await self.backend.close(fd)
            except OSError as exc:
                self.pool.put(buf)
                if (mode := _mode(obj.path)) is not None and not stat.S_ISREG(mode):
                    # Something else (a directory) stands where the object's
                    # file was: corrupt, dropped, a miss. Before, every get
                    # was an InternalError ("Is a directory"), never dropped.
                    self._corrupt(p, obj, f"{obj.path} is not a regular file (mode {mode:#o})")
                    return None
                raise self._io_error("read", obj.path, exc) from exc
            why = self._check_read(p, obj, buf, n)
            if why is None:
                payload = buf[HEADER_BYTES:HEADER_BYTES + obj.size]
                if self._busy > 1 and obj.size >= _CRC_THREAD_MIN:
                    got = await asyncio.to_thread(_crc32c, payload)
                else:
                    got = _crc32c(payload)
                if got == obj.crc:
                    return payload
                self.pool.put(buf)
                why = f"payload CRC32C {got:08x} != stored {obj.crc:08x}"
                break
            # a header is rewritten in place when a pin changes: a read racing
            # that may see a mixed page, so a bad header gets a second look
            self.pool.put(buf)
        self._corrupt(p, obj, str(why))
        return None

    def _check_read(self, p: _Pool, obj: _Obj, buf: memoryview, n: int) -> str | None:
        if n < object_file_length(obj.size):
            return f"{n} bytes on disk, {object_file_length(obj.size)} expected"
        try:
            pid, hdr = _parse_header(buf[:HEADER_BYTES], obj.path or "")
        except ValueError as exc:
            return str(exc)
        if (pid, hdr.key, hdr.gen, hdr.size, hdr.crc) != (p.spec.pool_id, obj.key, obj.gen, obj.size, obj.crc):
            return f"header of {hdr.key!r} gen {hdr.gen:x} does not match the index"
        return None

    def _corrupt(self, p: _Pool, obj: _Obj, why: str) -> None:
        p.counters["corrupt"] += 1
        log.error("%s: corrupt object %s (%s): dropped", p.where(self.target_id), obj.path, why)
        if p.index.get(obj.key) is obj:
            self._remove(p, obj)
        elif obj.path is not None:
            self._unlink_later(obj.path)

    def _io_error(self, op: str, path: str, exc: OSError) -> TierFSError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return NoSpaceError(f"target {self.target_id} is full ({op} {path}: {exc.strerror})")
        if exc.errno in (errno.EIO, errno.EROFS, errno.ENODEV, errno.ENXIO):
            return UnavailableError(f"target {self.target_id} failed: {op} {path}: {exc.strerror}")
        return InternalError(f"target {self.target_id}: {op} {path}: {exc}")

    # -- background work -------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _unlink_later(self, path: str | None) -> None:
        if path is not None:
            self._unlink_q.append(path)
            self._kick_reaper()

    def _kick_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = self._spawn(self._reap())

    async def _reap(self) -> None:
        while self._unlink_q or self._trash_q:
            paths, self._unlink_q = self._unlink_q, []
            dirs, self._trash_q = self._trash_q, []
            try:
                if paths:
                    # a delete waits for this batch (_unlink_queued)
                    fut = self._reaping = asyncio.ensure_future(asyncio.to_thread(_unlink_all, paths))
                    try:
                        await fut
                    finally:
                        self._reaping = None
                for d in dirs:
                    await asyncio.to_thread(shutil.rmtree, d, True)
            except OSError as exc:
                log.error("target %s: KV cleanup failed: %s", self.target_id, exc)

    def _persist(self, p: _Pool, obj: _Obj) -> None:
        """Write ``obj``'s pin into its header (in the background; one writer,
        which always writes the latest state)."""
        if obj.path is None:
            return
        self._dirty[id(obj)] = (p, obj)
        if self._persister is None or self._persister.done():
            self._persister = self._spawn(self._persist_loop())

    async def _persist_loop(self) -> None:
        while self._dirty:
            _, (p, obj) = self._dirty.popitem()
            if p.dead or p.index.get(obj.key) is not obj or obj.path is None:
                continue
            hdr = self.pool.get(HEADER_BYTES)
            try:
                _pack_header(hdr, p.spec.pool_id, obj)
                fd = await self.backend.open(obj.path, os.O_WRONLY | os.O_NONBLOCK)
                try:
                    await self.backend.write_at(fd, hdr, 0)
                    if p.spec.fsync:
                        await self.backend.fsync(fd, datasync=True)
                finally:
                    await self.backend.close(fd)
            except FileNotFoundError:
                pass  # evicted or deleted meanwhile
            except OSError as exc:
                log.error("target %s: cannot record the pin of %s: %s", self.target_id, obj.path, exc)
            finally:
                self.pool.put(hdr)
