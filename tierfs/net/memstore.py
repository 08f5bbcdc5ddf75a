"""An in-memory FragmentStore: for tests, benchmarks of the network path, and
as the reference behaviour of the FragmentStore contract.

``write`` keeps the buffer it was given (it came from ``alloc``), so the data
plane's receive path is measured without a store-side copy; ``read`` returns
a view of the stored bytes, never a copy.
"""

from __future__ import annotations

from tierfs.errors import CorruptError, InvalidArgumentError, NoSpaceError, NotFoundError
from tierfs.net.protocol import crc32c
from tierfs.storage.api import FragmentInfo, FragmentKey

__all__ = ["MemoryFragmentStore"]


class MemoryFragmentStore:
    def __init__(self, target_id: int, capacity: int = 1 << 40, *, verify: bool = True) -> None:
        self.target_id = target_id
        self.capacity = capacity
        #: Check CRC32C on write and read like a disk store would (benchmarks
        #: of the pure network path turn it off).
        self.verify = verify
        self.used = 0
        self.data: dict[FragmentKey, tuple[memoryview, int]] = {}

    def alloc(self, size: int) -> memoryview:
        return memoryview(bytearray(size))

    def release(self, buf: memoryview) -> None:
        # Stored buffers stay referenced by ``data``; everything else is
        # garbage collected with its last reference.
        return None

    async def write(self, key: FragmentKey, data: memoryview, crc32c_: int) -> None:
        if self.verify and crc32c(data) != crc32c_:
            raise InvalidArgumentError(f"CRC32C mismatch for {key}")
        old = self.data.get(key)
        grow = len(data) - (len(old[0]) if old else 0)
        if self.used + grow > self.capacity:
            raise NoSpaceError(f"target {self.target_id} is full ({self.used}/{self.capacity} bytes)")
        # The view may be a store.alloc buffer the server releases after this
        # returns; owning it is fine because release() is a no-op here. A
        # caller-owned view (tests) is copied so later changes do not leak in.
        self.data[key] = (data if isinstance(data.obj, bytearray) and len(data.obj) == len(data)
                          else memoryview(bytearray(data)), crc32c_)
        self.used += grow

    async def read(self, key: FragmentKey, offset: int = 0, length: int = -1) -> memoryview:
        entry = self.data.get(key)
        if entry is None:
            raise NotFoundError(f"fragment {key} not found on target {self.target_id}")
        buf, crc = entry
        if offset < 0 or offset > len(buf):
            raise InvalidArgumentError(f"offset {offset} outside fragment of {len(buf)} bytes")
        end = len(buf) if length < 0 else min(len(buf), offset + length)
        if self.verify and crc32c(buf) != crc:
            raise CorruptError(f"fragment {key} failed its CRC32C check")
        return buf[offset:end].toreadonly()

    async def delete(self, key: FragmentKey) -> bool:
        entry = self.data.pop(key, None)
        if entry is None:
            return False
        self.used -= len(entry[0])
        return True

    async def stat(self, key: FragmentKey) -> FragmentInfo:
        entry = self.data.get(key)
        if entry is None:
            raise NotFoundError(f"fragment {key} not found on target {self.target_id}")
        return FragmentInfo(key, len(entry[0]), entry[1])

    def corrupt(self, key: FragmentKey, index: int = 0) -> None:
        """Flip a byte of a stored fragment (tests: CorruptError path)."""
        buf, crc = self.data[key]
        copy = bytearray(buf)
        copy[index] ^= 0xFF
        self.data[key] = (memoryview(copy), crc)
