"""Aligned, pooled I/O buffers shared by the disk path and the data plane.

Every buffer is an anonymous ``mmap`` (so its address is page aligned, which
O_DIRECT and io_uring need) whose length is a *size class*: a multiple of
4096 on a geometric ladder with four steps per power of two (4 KiB, 8 KiB,
12 KiB, 16 KiB, 20 KiB, 24 KiB, 28 KiB, 32 KiB, 40 KiB, ...), so the waste is
at most 25% and a 1 MiB + 4 KiB request does not take 2 MiB. ``get(size)``
hands out a ``memoryview`` of exactly ``size`` bytes over the start of such a
region; ``put(view)`` returns it. Fresh memory is slow to touch for the first
time (~0.7 GiB/s here), so regions are pre-faulted (``MAP_POPULATE``) and
reused: freed regions stay in per-class free lists while the idle total is
under ``max_idle_bytes``; past that they are unmapped. Buffers above
``max_pooled_size`` are never cached. With ``max_total_bytes`` the pool
never maps more than that in all (idle regions are dropped to make room);
a ``get`` that cannot fit raises ``UnavailableError`` (an overload to retry,
not a crash of the node).

The pool is guarded by one lock, so an event loop and I/O threads may share
it. ``put`` of a view the pool does not own, or a second ``put`` of the same
buffer, raises ``ValueError`` (a double free here would mean two owners of
the same memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from dataclasses import dataclass

from tierfs.errors import UnavailableError

__all__ = ["ALIGN", "BufferPool", "PoolStats", "buffer_address", "is_aligned", "round_up"]

ALIGN = 4096
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def buffer_address(buf: memoryview) -> int | None:
    """Address of the first byte of ``buf``; None for read-only or empty views
    (whose address cannot be taken without a copy)."""
    if buf.readonly or buf.nbytes == 0:
        return None
    if not buf.c_contiguous:
        return None
    ref = ctypes.c_char.from_buffer(buf.cast("B") if buf.format != "B" else buf)
    addr = ctypes.addressof(ref)
    del ref
    return addr


def is_aligned(buf: memoryview, align: int = ALIGN) -> bool:
    """True when ``buf`` starts on an ``align`` boundary and is a multiple of it
    long (what O_DIRECT accepts without a bounce copy)."""
    if buf.nbytes % align:
        return False
    if buf.nbytes == 0:
        return True
    addr = buffer_address(buf)
    return addr is not None and addr % align == 0


def _size_class(size: int) -> int:
    size = max(round_up(size), ALIGN)
    if size <= 4 * ALIGN:
        return size
    top = 1 << (size - 1).bit_length()  # next power of two >= size
    step = top // 8  # quarter of the previous power of two
    return round_up((size + step - 1) // step * step)


@dataclass(frozen=True, slots=True)
class PoolStats:
    idle_bytes: int
    in_use_bytes: int
    in_use_buffers: int
    allocations: int
    reuses: int


class BufferPool:
    """A thread-safe pool of page-aligned buffers (see the module docstring)."""

    def __init__(
        self,
        max_idle_bytes: int = 1 << 30,
        *,
        max_total_bytes: int | None = None,
        max_pooled_size: int = 256 << 20,
        populate: bool = True,
    ) -> None:
        if max_idle_bytes < 0:
            raise ValueError("max_idle_bytes must be >= 0")
        if max_total_bytes is not None and max_total_bytes < ALIGN:
            raise ValueError("max_total_bytes must be at least one page")
        self.max_idle_bytes = max_idle_bytes
        self.max_total_bytes = max_total_bytes
        self.max_pooled_size = max_pooled_size
        self._flags = _MAP_FLAGS if populate else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        # id(region) -> (region, base address); the address lets ``extent``
        # tell whether a view starts at the region's first byte.
        self._live: dict[int, tuple[mmap.mmap, int]] = {}
        self._idle_bytes = 0
        self._in_use_bytes = 0
        self._allocations = 0
        self._reuses = 0
        self._closed = False
        self._free_addr: dict[int, int] = {}

    # -- public -------------------------------------------------------------

    def get(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes at the start of an aligned
        region of ``capacity(view)`` bytes. The contents are not zeroed."""
        if size < 0:
            raise ValueError(f"buffer size must be >= 0, got {size}")
        cls = self.region_size(size)
        region: mmap.mmap | None = None
        victims: list[mmap.mmap] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("BufferPool is closed")
            free = self._free.get(cls)
            if free:
                region = free.pop()
                self._idle_bytes -= cls
                self._reuses += 1
                self._live[id(region)] = (region, self._free_addr.pop(id(region)))
                self._in_use_bytes += cls
                return memoryview(region)[:size]
            cap = self.max_total_bytes
            if cap is not None:
                # make room by dropping idle regions of other sizes first
                for lst in self._free.values():
                    while lst and self._in_use_bytes + self._idle_bytes + cls > cap:
                        r = lst.pop()
                        self._free_addr.pop(id(r), None)
                        self._idle_bytes -= len(r)
                        victims.append(r)
                if self._in_use_bytes + cls > cap:
                    in_use = self._in_use_bytes
                    for r in victims:
                        self._unmap(r)
                    raise UnavailableError(
                        f"buffer pool exhausted: {in_use} bytes in use, {cls} more asked, limit {cap}; retry later"
                    )
            self._in_use_bytes += cls  # reserved before mapping, so the cap holds under races
            self._allocations += 1
        for r in victims:
            self._unmap(r)
        try:
            region = mmap.mmap(-1, cls, flags=self._flags)
        except BaseException:
            with self._lock:
                self._in_use_bytes -= cls
            raise
        base = memoryview(region)
        addr = buffer_address(base)
        base.release()
        assert addr is not None
        with self._lock:
            self._live[id(region)] = (region, addr)
        return memoryview(region)[:size]

    def put(self, view: memoryview) -> None:
        """Give ``view`` (or any view over the same region) back to the pool."""
        try:
            region = view.obj
        except ValueError:
            raise ValueError("buffer was already released (returned twice?)") from None
        key = id(region)
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is None or entry[0] is not region:
                if entry is not None:
                    self._live[key] = entry
                raise ValueError("buffer was not handed out by this pool (or was already returned)")
            cls = len(region)
            self._in_use_bytes -= cls
            keep = (
                not self._closed
                and cls <= self.max_pooled_size
                and self._idle_bytes + cls <= self.max_idle_bytes
            )
            if keep:
                self._free.setdefault(cls, []).append(region)
                self._idle_bytes += cls
                self._free_addr[key] = entry[1]
        with contextlib.suppress(BufferError):
            view.release()  # fails if someone sliced it further; harmless
        if not keep:
            self._unmap(region)

    def owns(self, view: memoryview) -> bool:
        region = view.obj
        with self._lock:
            entry = self._live.get(id(region))
            return entry is not None and entry[0] is region

    def region_size(self, size: int) -> int:
        """Bytes of the region a ``get(size)`` maps (its size class): what
        the buffer really costs in memory."""
        return _size_class(size) if size <= self.max_pooled_size else round_up(max(size, 1))

    def capacity(self, view: memoryview) -> int:
        """Bytes of the aligned region behind a pool view."""
        if not self.owns(view):
            raise ValueError("buffer was not handed out by this pool")
        return len(view.obj)  # type: ignore[arg-type]

    def extent(self, view: memoryview, length: int) -> memoryview | None:
        """A view of the first ``length`` bytes of the region behind ``view``
        when ``view`` is a pool buffer starting at its region's first byte and
        the region is long enough; None otherwise. Used to write a padded tail
        without copying the payload."""
        region = view.obj
        with self._lock:
            entry = self._live.get(id(region))
        if entry is None or entry[0] is not region or len(region) < length:  # type: ignore[arg-type]
            return None
        if view.nbytes and buffer_address(view) != entry[1]:
            return None
        return memoryview(region)[:length]  # type: ignore[arg-type]

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                idle_bytes=self._idle_bytes,
                in_use_bytes=self._in_use_bytes,
                in_use_buffers=len(self._live),
                allocations=self._allocations,
                reuses=self._reuses,
            )

    def trim(self) -> int:
        """Unmap every idle region; returns the bytes released."""
        with self._lock:
            regions = [r for lst in self._free.values() for r in lst]
            self._free.clear()
            self._free_addr.clear()
            freed = self._idle_bytes
            self._idle_bytes = 0
        for r in regions:
            self._unmap(r)
        return freed

    def close(self) -> None:
        """Drop idle regions; buffers still out are unmapped when returned."""
        with self._lock:
            self._closed = True
        self.trim()

    # -- internals ----------------------------------------------------------

    @staticmethod
    def _unmap(region: mmap.mmap) -> None:
        with contextlib.suppress(BufferError):
            region.close()  # a stray view still exports it: the GC unmaps it later
