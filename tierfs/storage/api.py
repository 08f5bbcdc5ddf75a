"""The contract between the data-plane server and the chunk engine.

A fragment is identified by (inode, chunk index, fragment index, version).
The data-plane server receives payloads into buffers it gets from the store
(``alloc``, so O_DIRECT backends can hand out aligned memory) and calls the
store; the store never sees sockets, the server never sees files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, order=True, slots=True)
class FragmentKey:
    inode: int
    chunk: int
    fragment: int
    version: int

    def __post_init__(self) -> None:
        for name in ("inode", "chunk", "fragment", "version"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0 or v >= 1 << 64:
                raise ValueError(f"FragmentKey.{name} must be an unsigned 64-bit integer, got {v!r}")


@dataclass(frozen=True, slots=True)
class FragmentInfo:
    key: FragmentKey
    size: int
    crc32c: int
    #: The serial of the fragment file described (0: not known): it changes
    #: whenever the file is replaced. READ answers carry the serial of the
    #: file they read, so a stat's verdict applies to the bytes of a read
    #: with the same serial (docs/dataplane.md, "Serials").
    serial: int = 0


class FragmentStore(Protocol):
    """One target (a directory on one disk) as the data plane sees it."""

    target_id: int

    def alloc(self, size: int) -> memoryview:
        """A writable buffer of exactly ``size`` bytes for an incoming payload
        (pooled and aligned where the backend needs it)."""

    def release(self, buf: memoryview) -> None:
        """Return a buffer from ``alloc`` or ``read`` to the pool."""

    async def write(self, key: FragmentKey, data: memoryview, crc32c: int) -> None:
        """Durably store ``data`` (CRC32C already checked by the caller against
        ``crc32c``): temp file, fsync, rename, dir fsync. Raises NoSpaceError,
        InvalidArgumentError."""

    async def read(self, key: FragmentKey, offset: int = 0, length: int = -1) -> memoryview:
        """The bytes of ``key`` in [offset, offset+length) (``-1``: to the end),
        verified against the stored CRC32C. Raises NotFoundError, CorruptError.
        The caller releases the returned view with ``release``."""

    async def delete(self, key: FragmentKey) -> bool:
        """Remove ``key``; False if it was not there."""

    async def stat(self, key: FragmentKey) -> FragmentInfo:
        """Size and CRC32C of ``key``. Raises NotFoundError."""


class KVTargetStore(Protocol):
    """One target's KV store as the data plane sees it
    (:class:`tierfs.storage.kvstore.KVStore`). ``pool_id`` is a KV pool's id."""

    def alloc(self, size: int) -> memoryview:
        """A buffer for an incoming value; put takes it over."""

    def release(self, buf: memoryview) -> None:
        """Give back a buffer from ``alloc`` (not put) or a view from ``get``."""

    async def put(self, pool_id: int, key: bytes, value: memoryview, crc: int, *, overwrite: bool = False,
                  ttl_ms: int = 0, pin: int = 0, pin_ttl_ms: int = 0, stamp: int = 0) -> bool:
        """Store ``value`` (its CRC32C checked by the caller); False if ``key``
        was there with a stamp of at least ``stamp`` (a no-op). Takes
        ownership of ``value``."""

    async def get(self, pool_id: int, key: bytes, since: int = 0) -> tuple[memoryview, int] | None:
        """(value, CRC32C), valid until ``release``; None is a miss (also
        an object put with a placement stamp before ``since``)."""

    async def get_with_ttl(self, pool_id: int, key: bytes, since: int = 0) -> tuple[memoryview, int, int] | None:
        """``get`` and the milliseconds the object has left (0: no TTL)."""

    def contains(self, pool_id: int, keys: list[bytes], since: int | Sequence[int] = 0) -> list[bool]: ...

    def crcs(self, pool_id: int, keys: list[bytes], since: int | Sequence[int] = 0) -> list[int | None]:
        """Each key's stored CRC32C, None where ``contains`` says absent."""

    def has_pool(self, pool_id: int) -> bool: ...

    async def delete(self, pool_id: int, key: bytes) -> bool: ...

    def pin(self, pool_id: int, key: bytes, kind: int, ttl_ms: int = 0) -> bool: ...

    def unpin(self, pool_id: int, key: bytes) -> bool: ...
