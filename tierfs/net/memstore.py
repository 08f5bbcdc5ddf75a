"""An in-memory FragmentStore: for tests, benchmarks of the network path, and
as the reference behaviour of the FragmentStore contract.

Payload buffers come from a :class:`~tierfs.buffers.BufferPool` and ``write``
adopts the buffer it was given when it came from ``alloc`` (no store-side
copy); ``read`` returns a read-only view of the stored bytes, never a copy.
A replaced or deleted fragment's buffer goes back to the pool only once the
last view handed out by ``read`` has been released, so a read answer still in
a send queue never sees its bytes reused. Each stored fragment has a serial,
new whenever it is written or replaced, as the disk engine's fragment files
do (docs/dataplane.md, "Serials").
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field

from tierfs.buffers import BufferPool
from tierfs.errors import CorruptError, InvalidArgumentError, NoSpaceError, NotFoundError
from tierfs.net.protocol import crc32c
from tierfs.storage.api import FragmentInfo, FragmentKey

__all__ = ["MemoryFragmentStore"]

#: Serials of stored fragments: from a random start in each process, below 2**62.
_serials = itertools.count(secrets.randbits(61) + 1)


@dataclass(eq=False, slots=True)
class _Blob:
    buf: memoryview
    crc: int
    pooled: bool
    readers: int = 0
    dead: bool = False
    views: list[memoryview] = field(default_factory=list)
    serial: int = field(default_factory=lambda: next(_serials))


class MemoryFragmentStore:
    def __init__(self, target_id: int, capacity: int = 1 << 40, *, verify: bool = True,
                 pool: BufferPool | None = None) -> None:
        self.target_id = target_id
        self.capacity = capacity
        #: Check CRC32C on write and read like a disk store would (benchmarks
        #: of the pure network path turn it off).
        self.verify = verify
        self.pool = pool if pool is not None else BufferPool(256 << 20)
        self.used = 0
        self._blobs: dict[FragmentKey, _Blob] = {}
        # alloc'd buffers not (yet) adopted by write: id -> view
        self._loose: dict[int, memoryview] = {}
        # views handed out by read: id -> blob
        self._lent: dict[int, _Blob] = {}

    @property
    def data(self) -> dict[FragmentKey, tuple[memoryview, int]]:
        """Stored fragments as (bytes view, crc) (tests inspect this)."""
        return {k: (b.buf, b.crc) for k, b in self._blobs.items()}

    def alloc(self, size: int) -> memoryview:
        view = self.pool.get(size)
        self._loose[id(view)] = view
        return view

    def release(self, buf: memoryview) -> None:
        view = self._loose.pop(id(buf), None)
        if view is not None:
            self.pool.put(view)
            return
        blob = self._lent.pop(id(buf), None)
        if blob is not None:
            blob.readers -= 1
            self._maybe_free(blob)

    def _maybe_free(self, blob: _Blob) -> None:
        if blob.dead and blob.readers == 0 and blob.pooled:
            blob.pooled = False
            self.pool.put(blob.buf)

    def _drop(self, key: FragmentKey) -> int:
        blob = self._blobs.pop(key, None)
        if blob is None:
            return -1
        size = len(blob.buf)
        self.used -= size
        blob.dead = True
        self._maybe_free(blob)
        return size

    def put(self, key: FragmentKey, data: bytes | bytearray | memoryview, crc: int | None = None) -> None:
        """Store ``data`` directly (tests seed fragments, even with a wrong CRC)."""
        view = self.pool.get(len(data))
        view[:] = data
        self._drop(key)
        self._blobs[key] = _Blob(view, crc32c(data) if crc is None else crc, True)
        self.used += len(data)

    async def write(self, key: FragmentKey, data: memoryview, crc32c_: int) -> None:
        if self.verify and crc32c(data) != crc32c_:
            raise InvalidArgumentError(f"CRC32C mismatch for {key}")
        old = self._blobs.get(key)
        if self.used + len(data) - (len(old.buf) if old else 0) > self.capacity:
            raise NoSpaceError(f"target {self.target_id} is full ({self.used}/{self.capacity} bytes)")
        adopted = self._loose.pop(id(data), None)
        if adopted is None:  # a caller-owned buffer: copy it
            adopted = self.pool.get(len(data))
            adopted[:] = data
        self._drop(key)
        self._blobs[key] = _Blob(adopted, crc32c_, True)
        self.used += len(data)

    async def read(self, key: FragmentKey, offset: int = 0, length: int = -1) -> memoryview:
        blob = self._blobs.get(key)
        if blob is None:
            raise NotFoundError(f"fragment {key} not found on target {self.target_id}")
        size = len(blob.buf)
        if offset < 0 or offset > size:
            raise InvalidArgumentError(f"offset {offset} outside fragment of {size} bytes")
        end = size if length < 0 else min(size, offset + length)
        if self.verify and crc32c(blob.buf) != blob.crc:
            raise CorruptError(f"fragment {key} failed its CRC32C check")
        view = blob.buf[offset:end].toreadonly()
        blob.readers += 1
        self._lent[id(view)] = blob
        return view

    async def read_with_crc(self, key: FragmentKey, offset: int = 0, length: int = -1) -> tuple[memoryview, int | None]:
        """``read`` plus the CRC32C of the returned bytes when it is the
        stored one (a whole-fragment read), else None. The data plane uses
        this optional extension to skip recomputing it."""
        view, crc, _ = await self.read_with_info(key, offset, length)
        return view, crc

    async def read_with_info(self, key: FragmentKey, offset: int = 0,
                             length: int = -1) -> tuple[memoryview, int | None, int]:
        """``read_with_crc`` plus the serial of the fragment the bytes came
        from (nothing awaits between the read and the lookup: it is that
        fragment's)."""
        view = await self.read(key, offset, length)
        blob = self._lent[id(view)]
        whole = offset == 0 and len(view) == len(blob.buf)
        return view, (blob.crc if whole else None), blob.serial

    async def delete(self, key: FragmentKey) -> bool:
        return self._drop(key) >= 0

    async def stat(self, key: FragmentKey) -> FragmentInfo:
        blob = self._blobs.get(key)
        if blob is None:
            raise NotFoundError(f"fragment {key} not found on target {self.target_id}")
        return FragmentInfo(key, len(blob.buf), blob.crc, blob.serial)

    def corrupt(self, key: FragmentKey, index: int = 0) -> None:
        """Flip a byte of a stored fragment (tests: the CorruptError path)."""
        self._blobs[key].buf[index] ^= 0xFF

    def close(self) -> None:
        self.pool.close()
