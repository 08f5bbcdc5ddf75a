"""KV tiers inside the client process: the Tier interface, DRAM and local SSD.

A tier stores immutable objects (a key of 1..512 bytes, a value of any
length) up to a capacity in bytes and evicts through its own policy
(``tierfs.kv.policy``). ``TierStack`` (``tierfs.kv.stack``) chains tiers:
it sets ``on_evict`` so an eviction demotes the object into the tier below
before its space is reused.

Both tiers here carve one pre-allocated space into extents of a fixed unit
(``ExtentAllocator``: segregated free lists by power of two with coalescing
of neighbours, so same-sized objects, the usual KV block, reuse each other's
extents exactly and a hole is merged with its free neighbours at once):

* ``DramTier``: one anonymous ``mmap`` arena, pre-faulted at construction
  (first touch of fresh memory runs at ~0.7 GiB/s here, reused memory at
  ~12 GB/s), or a pinned torch tensor where torch with CUDA is importable.
  A hit is one memcpy from the arena into the caller's buffer, done in the
  event loop without awaiting, so no eviction can reuse the slot mid-copy.
* ``SsdTier``: one pre-allocated file (``posix_fallocate``) opened with
  O_DIRECT through ``tierfs.storage.io``, in pages of ``page_size``. The
  index (key -> extent, size, CRC32C) lives in memory only: the tier is a
  per-process cache and starts empty each time (the file is truncated).
  Every get verifies the CRC32C; a mismatch is a miss and drops the object.

Slots are reference-counted: an object being read, borrowed or demoted
keeps its extent after a delete or an eviction until the last reader is
done, so a read returns the bytes that were stored or is a clean miss.
A tier belongs to one event loop and is not thread-safe.

An object may carry an expiry (``put(..., expires=)``, a ``time.monotonic()``
deadline; 0.0: none): past it, the object is a miss in every call, is never
demoted, and its space is reclaimed before anything live is evicted. A
TierStack passes the deadline along when it promotes or demotes, so a copy
never outlives the object it was made from (the cluster's TTLs reach the
local tiers this way: docs/kv.md).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tierfs.buffers import ALIGN, BufferPool, buffer_address, is_aligned
from tierfs.chunk import crc32c
from tierfs.errors import ConfigError, InvalidArgumentError, NoSpaceError
from tierfs.kv.policy import EvictionPolicy, make_policy
from tierfs.storage.io import IOBackend, open_backend

__all__ = [
    "MAX_KEY_BYTES",
    "Borrowed",
    "DramTier",
    "EvictCallback",
    "ExtentAllocator",
    "SsdTier",
    "Tier",
    "TierStats",
    "check_key",
    "dest_view",
    "source_view",
]

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 512

#: (key, the victim's bytes, its expiry deadline or 0.0)
EvictCallback = Callable[[bytes, memoryview, float], Awaitable[None]]


# -- keys and buffers ---------------------------------------------------------


def check_key(key: bytes | str) -> bytes:
    """``key`` as bytes (a str is encoded UTF-8); InvalidArgumentError unless 1..512 bytes."""
    if isinstance(key, str):
        try:
            key = key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(f"KV key {key!r} is not valid Unicode ({exc.reason}): give such a "
                                       f"key as bytes") from None
    elif not isinstance(key, bytes):
        raise InvalidArgumentError(f"a KV key is bytes or str, got {type(key).__name__}")
    if not key:
        raise InvalidArgumentError("a KV key must not be empty")
    if len(key) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"a KV key is at most {MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def _as_memoryview(buf: Any, role: str) -> memoryview:
    try:
        return memoryview(buf)
    except TypeError:
        pass
    if type(buf).__module__.startswith("torch") and getattr(buf, "device", None) is not None:
        # A CPU tensor has no buffer protocol of its own; its numpy alias
        # shares the memory. Untested here (no torch in this environment).
        if buf.device.type != "cpu":
            raise InvalidArgumentError(f"{role} is a {buf.device.type} tensor: this tier takes host memory")
        if not buf.is_contiguous():
            raise InvalidArgumentError(f"{role} tensor is not contiguous")
        import torch  # type: ignore[import-not-found,unused-ignore]

        return memoryview(buf.detach().view(torch.uint8).numpy())
    raise InvalidArgumentError(f"{role} must support the buffer protocol, got {type(buf).__name__}")


def source_view(buf: Any) -> memoryview:
    """A flat byte view of a value to store (any C-contiguous buffer)."""
    mv = _as_memoryview(buf, "the value")
    if not mv.c_contiguous:
        raise InvalidArgumentError("the value buffer is not C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def dest_view(buf: Any) -> memoryview:
    """A flat writable byte view of a destination; InvalidArgumentError for a
    read-only or non-contiguous buffer (nothing is written)."""
    mv = _as_memoryview(buf, "the destination")
    if mv.readonly:
        raise InvalidArgumentError("the destination buffer is read-only")
    if not mv.c_contiguous:
        raise InvalidArgumentError("the destination buffer is not C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def _too_small(key: bytes, need: int, have: int) -> InvalidArgumentError:
    return InvalidArgumentError(f"destination of {have} bytes is smaller than object {key!r} of {need} bytes")


# -- stats and the interface ------------------------------------------------


@dataclass(slots=True)
class TierStats:
    """Counters of one tier. ``promotions``/``demotions`` count the objects
    this tier received from the tier below / above (the stack counts them)."""

    name: str
    capacity: int
    used: int
    objects: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    puts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    promotions: int = 0
    demotions: int = 0
    corrupt: int = 0  # objects dropped because their CRC32C did not match

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Borrowed:
    """A read-only view of a stored object, pinned until ``release()``."""

    __slots__ = ("_release", "view")

    def __init__(self, view: memoryview, release: Callable[[], None]) -> None:
        self.view = view
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        rel, self._release = self._release, None
        if rel is not None:
            with contextlib.suppress(BufferError):  # someone kept an export of it: the GC drops it
                self.view.release()
            rel()

    def __enter__(self) -> Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Tier(abc.ABC):
    """One level of the KV hierarchy. Subclasses call ``super().__init__(name)``
    and bump the counters kept here (``stats()`` reports them)."""

    name: str
    on_evict: EvictCallback | None

    def __init__(self, name: str) -> None:
        self.name = name
        self.on_evict = None
        self.hits = self.misses = self.evictions = self.puts = 0
        self.bytes_in = self.bytes_out = 0
        self.promotions = self.demotions = self.corrupt = 0

    @abc.abstractmethod
    async def put(self, key: bytes, buf: memoryview, *, parent: bytes | None = None, expires: float = 0.0) -> bool:
        """Store ``buf`` under ``key``. False: not stored (exists, not admitted,
        larger than the tier, or ``expires`` passed already). The caller may
        reuse ``buf`` once it returns. ``expires``: a ``time.monotonic()``
        deadline after which the object is gone (0.0: never)."""

    @abc.abstractmethod
    async def get_into(self, key: bytes, dest: memoryview) -> int | None:
        """Copy the object into ``dest``: its size, or None on a miss.
        A ``dest`` smaller than the object: InvalidArgumentError, nothing written."""

    @abc.abstractmethod
    async def size_of(self, key: bytes) -> int | None: ...

    @abc.abstractmethod
    async def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abc.abstractmethod
    async def delete(self, key: bytes) -> bool: ...

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    def borrow(self, key: bytes) -> Borrowed | None:
        """A pinned view of the stored bytes without a copy, where the tier can
        give one (a memory tier); None otherwise or on a miss."""
        return None

    def expiry_of(self, key: bytes) -> float:
        """The deadline of the object under ``key`` (0.0: none, or not known);
        asked right after a hit, to promote the object with it."""
        return 0.0

    def _stats(self, capacity: int, used: int, objects: int) -> TierStats:
        return TierStats(
            self.name, capacity, used, objects, self.hits, self.misses, self.evictions, self.puts,
            self.bytes_in, self.bytes_out, self.promotions, self.demotions, self.corrupt,
        )  # fmt: skip


# -- the extent allocator -----------------------------------------------------


class ExtentAllocator:
    """First-fit over free extents of ``units`` units, bucketed by power of two.

    Bucket ``k`` holds the free extents of length in [2**k, 2**(k+1)). ``alloc(n)``
    first looks for a fit among a few extents of n's own bucket (so a hole left by
    an object of the same size is reused exactly), then splits the smallest
    extent of a higher bucket. ``free`` merges the extent with free neighbours.
    Every operation is O(1) apart from the short bucket scan.
    """

    _SCAN = 8

    def __init__(self, units: int) -> None:
        if units <= 0:
            raise ValueError("an extent allocator needs at least one unit")
        self.total = units
        self.free_units = 0
        self._by_start: dict[int, int] = {}  # start -> length
        self._by_end: dict[int, int] = {}  # end -> start
        self._buckets: list[dict[int, None]] = [{} for _ in range(units.bit_length())]
        self._insert(0, units)

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._buckets[length.bit_length() - 1][start] = None
        self.free_units += length

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]
        del self._buckets[length.bit_length() - 1][start]
        self.free_units -= length

    def alloc(self, n: int) -> int | None:
        """Start of a fresh extent of ``n`` units, or None when no free extent is long enough."""
        if n <= 0 or n > self.free_units:
            return None
        k = n.bit_length() - 1
        by_start = self._by_start
        found = -1
        for i, start in enumerate(self._buckets[k]):
            if by_start[start] >= n:
                found = start
                break
            if i >= self._SCAN:
                break
        if found < 0:
            for bucket in self._buckets[k + 1 :]:
                if bucket:
                    found = next(iter(bucket))
                    break
            else:
                if n & (n - 1):  # bucket k may still hold a fit past the scan
                    found = next((s for s in self._buckets[k] if by_start[s] >= n), -1)
                if found < 0:
                    return None
        length = by_start[found]
        self._remove(found, length)
        if length > n:
            self._insert(found + n, length - n)
        return found

    def free(self, start: int, n: int) -> None:
        if n <= 0 or start < 0 or start + n > self.total:
            raise ValueError(f"extent [{start}, {start + n}) outside [0, {self.total})")
        if start in self._by_start or (start + n) in self._by_end:
            raise ValueError(f"extent [{start}, {start + n}) is already free (double free)")
        left = self._by_end.get(start)
        if left is not None:
            self._remove(left, start - left)
            n += start - left
            start = left
        right = self._by_start.get(start + n)
        if right is not None:
            self._remove(start + n, right)
            n += right
        self._insert(start, n)

    def extents(self) -> list[tuple[int, int]]:
        """The free extents as (start, length), sorted (for tests and diagnostics)."""
        return sorted(self._by_start.items())


# -- shared machinery of the extent-backed tiers ------------------------------


class _Entry:
    __slots__ = ("crc", "dead", "end", "expires", "key", "off", "pos", "refs", "size", "units")

    def __init__(self, key: bytes, off: int, units: int, size: int, unit: int) -> None:
        self.key = key
        self.off = off  # in units
        self.units = units
        self.size = size
        self.pos = off * unit  # in bytes: the hot path slices [pos, end) without arithmetic
        self.end = self.pos + size
        self.crc = 0
        self.refs = 0
        self.dead = False  # removed from the index; the extent goes when refs drops to 0
        self.expires = 0.0  # time.monotonic() deadline; 0.0: never


class _ExtentTier(Tier):
    """Index, accounting, eviction, demotion and slot pinning over an ExtentAllocator."""

    def __init__(self, name: str, capacity_bytes: int, unit: int, policy: str | EvictionPolicy) -> None:
        super().__init__(name)
        self.capacity = capacity_bytes
        self.unit = unit
        self._alloc = ExtentAllocator(capacity_bytes // unit)
        self._policy = make_policy(policy, capacity_bytes=capacity_bytes) if isinstance(policy, str) else policy
        self._on_access = self._policy.on_access
        self._index: dict[bytes, _Entry] = {}
        # Keys being written (put between its checks and its insert) ->
        # whether a delete or a newer put of the key came meanwhile: then
        # the write ends without inserting (it would bring back a value the
        # caller has since dropped or replaced).
        self._writing: dict[bytes, list[bool]] = {}
        self._used = 0
        self._held = 0  # extents out of the index but not yet free (zombies, in-flight writes)
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._expiring = 0  # objects in the index with an expiry
        self._soonest = 0.0  # no object expires before this (0.0: none to expire)

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    # subclass hooks
    @abc.abstractmethod
    async def _store(self, e: _Entry, src: memoryview) -> None:
        """Write ``src`` into ``e``'s extent (and set ``e.crc`` if the tier checks it)."""

    @abc.abstractmethod
    async def _demote(self, e: _Entry, cb: EvictCallback) -> None:
        """Hand ``e``'s bytes to ``cb`` (the extent is pinned meanwhile)."""

    def _lookup(self, key: Any) -> tuple[bytes, _Entry | None]:
        """The live entry under ``key``; an expired one is dropped here."""
        try:
            e = self._index.get(key)
        except TypeError:
            e = None
        if e is None:
            key = check_key(key)
            e = self._index.get(key)
        if e is not None and e.expires and e.expires <= time.monotonic():
            self._drop(e)
            return key, None
        return key, e

    def _drop(self, e: _Entry) -> None:
        """Take ``e`` out of the index (expired: it is not demoted)."""
        if self._index.get(e.key) is e:
            del self._index[e.key]
            self._policy.on_remove(e.key)
            self._retire(e)

    def _purge_expired(self) -> bool:
        """Drop every expired object (once one may have expired); True if any was."""
        now = time.monotonic()
        if not self._expiring or now < self._soonest:
            return False
        gone = [e for e in self._index.values() if e.expires and e.expires <= now]
        for e in gone:
            self._drop(e)
        self._soonest = min((e.expires for e in self._index.values() if e.expires), default=0.0)
        return bool(gone)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name} is closed")

    # -- pins and frees ------------------------------------------------------

    def _unref(self, e: _Entry) -> None:
        e.refs -= 1
        if e.dead and e.refs == 0:
            self._held -= e.units
            self._free(e)

    def _retire(self, e: _Entry) -> None:
        """``e`` left the index: free its extent now, or when its last reader is done."""
        e.dead = True
        self._used -= e.size
        if e.expires:
            self._expiring -= 1
        if e.refs == 0:
            self._free(e)
        else:
            self._held += e.units

    def _free(self, e: _Entry) -> None:
        self._alloc.free(e.off, e.units)
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    # -- eviction --------------------------------------------------------------

    async def _evict_one(self) -> bool:
        key = self._policy.pop_victim()
        if key is None:
            return False
        e = self._index.pop(key, None)
        if e is None:
            return True  # the policy knew a key this tier no longer holds
        self.evictions += 1
        cb = self.on_evict
        if e.expires and e.expires <= time.monotonic():
            cb = None  # expired: nothing to demote
        e.refs += 1
        self._retire(e)
        try:
            if cb is not None:
                await self._demote(e, cb)
        except Exception:
            log.warning("tier %s: demoting %r failed; dropped", self.name, key, exc_info=True)
        finally:
            self._unref(e)
        return True

    async def _allocate(self, units: int) -> int:
        while True:
            self._check_open()  # close() wakes the waiters below: they stop here
            off = self._alloc.alloc(units)
            if off is not None:
                return off
            if self._purge_expired() or await self._evict_one():
                continue
            if self._held > 0:
                # space is pinned by readers or reserved by other puts: it comes back
                fut = asyncio.get_running_loop().create_future()
                self._waiters.append(fut)
                await fut
                continue
            raise NoSpaceError(
                f"tier {self.name}: no extent of {units * self.unit} bytes free with nothing evictable"
            )

    # -- the interface -------------------------------------------------------

    def _may_put(self, key: bytes, expires: float) -> bool:
        """False if ``key`` is held (live) or being written, or ``expires`` passed."""
        if key in self._writing or (expires and expires <= time.monotonic()):
            return False
        return self._lookup(key)[1] is None

    def _insert(self, e: _Entry, expires: float, parent: bytes | None) -> None:
        key, size = e.key, e.size
        self._index[key] = e
        self._used += size
        if expires:
            e.expires = expires
            self._expiring += 1
            if not self._soonest or expires < self._soonest:
                self._soonest = expires
        self._policy.on_insert(key, size, parent)
        self.puts += 1
        self.bytes_in += size
        self._wake()  # a new evictable object for a put waiting on space

    async def put(self, key: bytes, buf: memoryview, *, parent: bytes | None = None, expires: float = 0.0) -> bool:
        self._check_open()
        src = source_view(buf)
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            key = check_key(key)
        return await self._put_checked(key, src, src.nbytes, expires, parent)

    async def _put_checked(self, key: bytes, src: Any, size: int, expires: float, parent: bytes | None) -> bool:
        """The steps of a put once ``key`` and ``src`` are valid (a subclass
        whose sources may be other than memoryviews calls this too)."""
        busy = self._writing.get(key)
        if busy is not None:
            # Another put of the key is being written: it may hold other
            # bytes (an overwrite racing a fill or a demotion of the old
            # value). Neither lands: the key is a miss here, never the
            # older value (until stop 47 the older one landed and this one
            # was refused).
            busy[0] = True
            return False
        if (key in self._index or expires) and not self._may_put(key, expires):
            return False
        units = max(1, -(-size // self.unit))
        if units > self._alloc.total or not self._policy.admit(key, size):
            return False
        mine = self._writing[key] = [False]
        try:
            off = await self._allocate(units)
            e = _Entry(key, off, units, size, self.unit)
            self._held += units
            try:
                await self._store(e, src)
            except BaseException:
                self._held -= units
                self._free(e)
                raise
            self._held -= units
        finally:
            if self._writing.get(key) is mine:
                del self._writing[key]
        if self._closed or mine[0]:
            if not self._closed:
                self._free(e)
            return False
        self._insert(e, expires, parent)
        return True

    async def size_of(self, key: bytes) -> int | None:
        _, e = self._lookup(key)
        return None if e is None else e.size

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if self._expiring:
            return [self._lookup(k)[1] is not None for k in keys]
        index = self._index
        return [
            (k in index) if type(k) is bytes and 0 < len(k) <= MAX_KEY_BYTES else (check_key(k) in index)
            for k in keys
        ]

    def expiry_of(self, key: bytes) -> float:
        e = self._index.get(key) if type(key) is bytes else None
        return 0.0 if e is None else e.expires

    async def delete(self, key: bytes) -> bool:
        key, e = self._lookup(key)
        busy = self._writing.get(key)
        if busy is not None:
            busy[0] = True  # being written: it will not be inserted
            if e is None:
                return True
        if e is None:
            return False
        del self._index[key]
        self._policy.on_remove(key)
        self._retire(e)
        return True

    def stats(self) -> TierStats:
        return self._stats(self.capacity, self._used, len(self._index))

    def keys(self) -> list[bytes]:
        return list(self._index)

    def _drop_corrupt(self, e: _Entry) -> None:
        self.corrupt += 1
        self._drop(e)


# -- DRAM -------------------------------------------------------------------------


def _pinned_arena(size: int) -> tuple[memoryview, Any] | None:
    """A page-locked arena from torch where torch with CUDA is importable.
    Untested in this environment (no torch)."""
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    except Exception:
        log.warning("pinned arena of %d bytes failed; using pageable memory", size, exc_info=True)
        return None
    return memoryview(t.numpy()).cast("B"), t


class DramTier(_ExtentTier):
    """Objects in one pre-allocated memory arena, carved into extents of ``granule`` bytes.

    ``capacity_bytes`` is the arena (rounded down to the granule). ``pin``:
    "auto" uses page-locked memory through torch when CUDA is available, True
    insists, False never tries. The arena is faulted in at construction.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        policy: str | EvictionPolicy = "lru",
        granule: int = ALIGN,
        pin: bool | str = "auto",
        name: str = "dram",
    ) -> None:
        if granule < 1 or granule & (granule - 1):
            raise ConfigError(f"granule must be a power of two, got {granule}", field="granule")
        if capacity_bytes < granule:
            raise ConfigError(f"capacity {capacity_bytes} is below one granule ({granule})", field="capacity_bytes")
        if pin not in (True, False, "auto"):
            raise ConfigError(f"pin must be True, False or 'auto', got {pin!r}", field="pin")
        capacity_bytes = capacity_bytes // granule * granule
        super().__init__(name, capacity_bytes, granule, policy)
        self._owner: Any = None
        pinned = _pinned_arena(capacity_bytes) if pin else None
        if pin is True and pinned is None:
            raise ConfigError("pinned memory needs torch with CUDA", field="pin")
        self.pinned = pinned is not None
        if pinned is not None:
            self._mv, self._owner = pinned
        else:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._owner = mmap.mmap(-1, capacity_bytes, flags=flags)
            self._mv = memoryview(self._owner)
            if not getattr(mmap, "MAP_POPULATE", 0):
                for i in range(0, capacity_bytes, mmap.PAGESIZE):
                    self._mv[i] = 0

    async def _store(self, e: _Entry, src: memoryview) -> None:
        o = e.off * self.unit
        self._mv[o : o + e.size] = src

    async def _demote(self, e: _Entry, cb: EvictCallback) -> None:
        v = self._mv[e.pos : e.end].toreadonly()
        try:
            await cb(e.key, v, e.expires)
        finally:
            with contextlib.suppress(BufferError):
                v.release()

    async def get_into(self, key: bytes, dest: memoryview) -> int | None:
        return self.get_into_nowait(key, dest)

    def get_into_nowait(self, key: bytes, dest: memoryview) -> int | None:
        """``get_into`` without a coroutine (a DRAM hit never waits): what
        TierStack calls on its top tier when the tier has it."""
        # The hot path of a DRAM hit: a handful of attribute reads around one
        # memcpy. Anything unusual (str key, miss, odd dest) takes _get_slow.
        e = self._index.get(key) if type(key) is bytes else None
        if e is None or e.expires:
            return self._get_slow(key, dest)
        if type(dest) is memoryview:
            d = dest
        else:
            try:
                d = memoryview(dest)
            except TypeError:
                return self._get_slow(key, dest)
        n = e.size
        if d.readonly or not d.c_contiguous or d.nbytes < n or d.format != "B":
            return self._get_slow(key, dest)
        # one memcpy, no await: nothing can evict and reuse the slot meanwhile
        d[:n] = self._mv[e.pos : e.end]
        self._on_access(key)
        self.hits += 1
        self.bytes_out += n
        return n

    def _get_slow(self, key: bytes, dest: Any) -> int | None:
        d = dest_view(dest)
        key, e = self._lookup(key)
        if e is None:
            self.misses += 1
            self._policy.on_miss(key)
            return None
        n = e.size
        if d.nbytes < n:
            raise _too_small(key, n, d.nbytes)
        o = e.off * self.unit
        d[:n] = self._mv[o : o + n]
        self._policy.on_access(key)
        self.hits += 1
        self.bytes_out += n
        return n

    def borrow(self, key: bytes) -> Borrowed | None:
        key, e = self._lookup(key)
        if e is None:
            return None
        e.refs += 1
        return Borrowed(self._mv[e.pos : e.end].toreadonly(), lambda: self._unref(e))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._index.clear()
        self._wake()
        with contextlib.suppress(BufferError):
            self._mv.release()
        if isinstance(self._owner, mmap.mmap):
            with contextlib.suppress(BufferError):  # a borrowed view still out: the GC unmaps it
                self._owner.close()
        self._owner = None


# -- local SSD --------------------------------------------------------------------


def _sweep_stale_tier_files(d: Path) -> None:
    """Remove ``kvtier-*.bin`` files in ``d`` that no live tier holds (its
    flock): left by processes killed before they closed their tier."""
    for f in d.glob("kvtier-*.bin"):
        try:
            fd = os.open(f, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # in use
            continue
        try:
            f.unlink(missing_ok=True)
            log.info("removed %s, an SSD tier file no process holds", f)
        except OSError:
            pass
        finally:
            os.close(fd)


class SsdTier(_ExtentTier):
    """Objects in one pre-allocated file, in extents of ``page_size`` bytes, read
    and written with O_DIRECT through ``tierfs.storage.io``.

    ``path``: the file, or a directory to hold ``kvtier-<pid>.bin``. The file is
    locked (flock) for this process, truncated and ``posix_fallocate``d to
    ``capacity_bytes`` (rounded down to the page). ``backend``/``pool``: share
    the caller's; otherwise the tier opens its own (``io_backend``, "auto").
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        policy: str | EvictionPolicy = "lru",
        page_size: int = ALIGN,
        backend: IOBackend | None = None,
        pool: BufferPool | None = None,
        io_backend: str = "auto",
        io_threads: int = 4,
        name: str = "ssd",
    ) -> None:
        if page_size < ALIGN or page_size % ALIGN or page_size & (page_size - 1):
            raise ConfigError(f"page_size must be a power of two multiple of {ALIGN}, got {page_size}", field="page_size")
        if capacity_bytes < page_size:
            raise ConfigError(f"capacity {capacity_bytes} is below one page ({page_size})", field="capacity_bytes")
        capacity_bytes = capacity_bytes // page_size * page_size
        super().__init__(name, capacity_bytes, page_size, policy)
        p = Path(path)
        #: the tier named its own file (``path`` was a directory): removed
        #: on close; a file the caller named is kept, emptied
        self._own_file = p.is_dir()
        if self._own_file:
            _sweep_stale_tier_files(p)
            p = p / f"kvtier-{os.getpid()}.bin"
        elif not p.parent.is_dir():
            raise ConfigError(f"no directory {str(p.parent)!r} for the SSD tier's file {p.name!r}: make it first",
                              field="path")
        self.path = p
        for _ in range(5):
            try:
                fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise ConfigError(f"cannot open the SSD tier's file {str(p)!r}: {exc.strerror}",
                                  field="path") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(f"{p} is in use by another SSD tier", field="path") from None
            # Another process's sweep may have removed the file between our
            # open and our lock: lock the file the path names, or try again.
            try:
                if os.stat(p).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise ConfigError(f"{p} keeps being removed under the SSD tier", field="path")
        try:
            os.ftruncate(fd, 0)
            try:
                os.posix_fallocate(fd, 0, capacity_bytes)
            except OSError as exc:
                raise NoSpaceError(f"cannot pre-allocate {capacity_bytes} bytes for {p}: {exc}") from exc
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd  # held open for the flock; I/O goes through the backend's O_DIRECT fd
        self._own_pool = pool is None
        self._pool = pool if pool is not None else BufferPool(64 << 20)
        self._own_backend = backend is None
        self._backend = backend
        self._io_backend = io_backend
        self._io_threads = io_threads
        self._fd = -1
        self.direct = False
        #: objects from this size up that are not whole pages are read into an
        #: aligned destination directly, all but their last partial page
        self.split_min = 256 << 10
        #: objects up to this size are read in the calling thread (a plain
        #: ``preadv``) when the get is alone: no other read of this tier in
        #: flight, and none asked for in the same loop turn (a batch's gets,
        #: gathered). At one read at a time the hop through the backend (a
        #: ring's completion, or a worker thread, then the event loop's
        #: wake-up) cost as much as the read itself. The loop is held for one
        #: such read (~0.1 ms at 64 KiB); gets together go through the
        #: backend together, so that the device serves them in parallel.
        self.inline_max = 256 << 10
        self._reading = 0
        self._asking = 0

    async def _open(self) -> None:
        # the backend binds to the running loop (io_uring), hence opened lazily
        if self._backend is None:
            self._backend = open_backend(self._io_backend, self._pool, threads=self._io_threads)
        self._fd = await self._backend.open(self.path, os.O_RDWR, direct=True)
        self.direct = self._backend.is_direct(self._fd)
        if not self.direct:
            log.warning("%s: O_DIRECT refused by the file system; buffered I/O", self.path)

    async def _store(self, e: _Entry, src: memoryview) -> None:
        if self._fd < 0:
            await self._open()
        assert self._backend is not None
        n = e.size
        e.crc = crc32c(src)
        padded = e.units * self.unit
        where = e.off * self.unit
        if n == padded and is_aligned(src):
            await self._backend.write_at(self._fd, src, where)
            return
        buf = self._pool.get(padded)
        try:
            buf[:n] = src
            if padded > n:
                buf[n:] = bytes(padded - n)
            await self._backend.write_at(self._fd, buf, where)
        finally:
            self._pool.put(buf)

    async def _read_verified(self, e: _Entry, into: memoryview) -> bool:
        """Read ``e`` into ``into`` (page aligned, ``e.units`` pages or exactly
        ``e.size`` bytes when aligned); True when the CRC32C matches."""
        assert self._backend is not None
        got = await self._backend.read_at(self._fd, into, e.pos)
        return self._verified(e, got >= e.size and crc32c(into[: e.size]) == e.crc)

    async def _read_split(self, e: _Entry, target: memoryview) -> bool:
        """Read ``e`` into an aligned ``target`` of exactly ``e.size`` bytes that
        is not a whole number of pages: the pages straight into it, the last
        partial page through a one-page bounce buffer, both at once."""
        assert self._backend is not None
        head = e.size // self.unit * self.unit
        tail = e.size - head
        buf = self._pool.get(self.unit)
        try:
            got_head, got_tail = await asyncio.gather(
                self._backend.read_at(self._fd, target[:head], e.pos),
                self._backend.read_at(self._fd, buf, e.pos + head),
            )
            ok = got_head == head and got_tail >= tail
            ok = ok and crc32c(buf[:tail], crc32c(target[:head])) == e.crc
            if ok:
                target[head:] = buf[:tail]
        finally:
            self._pool.put(buf)
        return self._verified(e, ok)

    async def _read_async(self, e: _Entry, target: memoryview) -> bool:
        """Read ``e`` into ``target`` (exactly ``e.size`` bytes) through the
        backend; True when its CRC32C matches."""
        n = e.size
        if n % self.unit == 0 and _aligned_addr(target):
            return await self._read_verified(e, target)
        if n >= self.split_min and _aligned_addr(target):
            return await self._read_split(e, target)
        buf = self._pool.get(e.units * self.unit)
        try:
            ok = await self._read_verified(e, buf)
            if ok:
                target[:] = buf[:n]
        finally:
            self._pool.put(buf)
        return ok

    def _read_inline(self, e: _Entry, target: memoryview) -> bool:
        """``_read_async`` in the calling thread, for a small object (see
        ``inline_max``): straight into ``target`` where it is whole pages at
        an aligned address, else through a pooled page-aligned buffer."""
        n = e.size
        if n % self.unit == 0 and _aligned_addr(target):
            got = os.preadv(self._fd, [target], e.pos)
            return self._verified(e, got >= n and crc32c(target) == e.crc)
        buf = self._pool.get(e.units * self.unit)
        try:
            got = os.preadv(self._fd, [buf], e.pos)
            ok = self._verified(e, got >= n and crc32c(buf[:n]) == e.crc)
            if ok:
                target[:] = buf[:n]
        finally:
            self._pool.put(buf)
        return ok

    def _verified(self, e: _Entry, ok: bool) -> bool:
        if not ok:
            log.warning("%s: object %r failed its CRC32C check; dropped", self.path, e.key)
            self._drop_corrupt(e)
        return ok

    async def get_into(self, key: bytes, dest: memoryview) -> int | None:
        d = dest_view(dest)
        try:
            e = self._index.get(key)
        except TypeError:
            e = None
        if e is None or e.expires:
            key, e = self._lookup(key)
            if e is None:
                self.misses += 1
                self._policy.on_miss(key)
                return None
        n = e.size
        if d.nbytes < n:
            raise _too_small(key, n, d.nbytes)
        e.refs += 1
        try:
            target = d[:n]
            inline = n <= self.inline_max and not self._reading and self._fd >= 0
            if inline:
                # One loop turn first: gets gathered with this one (a batch)
                # say so meanwhile, and then all go through the backend.
                self._asking += 1
                try:
                    await asyncio.sleep(0)
                finally:
                    self._asking -= 1
                inline = not self._asking and not self._reading and self._fd >= 0
            # Straight into the caller's memory where it is page aligned; on a
            # CRC mismatch dest then holds what was read, but the answer is a miss.
            if inline:
                ok = self._read_inline(e, target)
            else:
                self._reading += 1
                try:
                    ok = await self._read_async(e, target)
                finally:
                    self._reading -= 1
        finally:
            self._unref(e)
        if not ok:
            self.misses += 1
            return None
        self._policy.on_access(key)
        self.hits += 1
        self.bytes_out += n
        return n

    async def _demote(self, e: _Entry, cb: EvictCallback) -> None:
        buf = self._pool.get(e.units * self.unit)
        try:
            self._reading += 1
            try:
                ok = await self._read_verified(e, buf)
            finally:
                self._reading -= 1
            if ok:
                with buf[: e.size].toreadonly() as v:
                    await cb(e.key, v, e.expires)
        finally:
            self._pool.put(buf)

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """(file offset, size) of a stored object: for diagnostics and tests."""
        _, e = self._lookup(key)
        return None if e is None else (e.off * self.unit, e.size)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._index.clear()
        self._wake()
        if self._backend is not None:
            if self._fd >= 0:
                await self._backend.close(self._fd)
                self._fd = -1
            if self._own_backend:
                await self._backend.aclose()
        if self._own_pool:
            self._pool.close()
        # Its contents are of no use to anyone once closed (the index lived
        # in this process): give the space back. A file per process left
        # behind filled the SSD as engine processes restarted.
        try:
            if self._own_file:
                self.path.unlink(missing_ok=True)
            else:
                os.ftruncate(self._lock_fd, 0)
        except OSError as exc:
            log.warning("SSD tier %s: could not free its file: %s", self.path, exc)
        os.close(self._lock_fd)


def _aligned_addr(buf: memoryview) -> bool:
    addr = buffer_address(buf)
    return addr is not None and addr % ALIGN == 0
