"""The disk I/O backend interface and the alignment logic every backend shares.

A backend moves bytes between memory and file descriptors asynchronously. A
subclass supplies four primitives (one positional read, one positional write,
one fsync, each possibly short, plus shutdown); this base turns them into the
public contract that the conformance suite checks for every backend:

* ``open(path, flags, mode, direct=True)`` opens with ``O_DIRECT`` when asked
  and the file system accepts it (tmpfs and FUSE may refuse: the fd is then
  buffered, and ``is_direct(fd)`` says so).
* ``read_at(fd, buf, offset)`` fills ``buf`` unless end of file comes first and
  returns the byte count; ``write_at(fd, buf, offset)`` writes all of ``buf``.
  Both accept any size, offset and buffer on any fd. On an O_DIRECT fd the
  fast path needs a page-aligned buffer, offset and length (pool buffers
  are); anything else goes through an aligned bounce buffer, and an unaligned
  write becomes read-modify-write of the edge blocks plus an ``ftruncate``
  back to the logical end, so the file looks exactly as a buffered write
  would leave it. Unaligned writes on one fd are serialized among
  themselves, so concurrent writes to disjoint byte ranges never lose each
  other's bytes even when they share a 4 KiB block (overlapping concurrent
  writes have no defined order, as with pwrite).
* Errors are ``OSError`` with the kernel's errno, identical across backends.
* If the awaiting task is cancelled while the kernel owns the buffer, the
  cancellation is held back until the operation has finished, so the caller
  can never recycle memory that a DMA is still filling.
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from typing import ClassVar, TypeVar

from tierfs.buffers import ALIGN, BufferPool, is_aligned, round_up

__all__ = ["IOBackend"]

_T = TypeVar("_T")


class IOBackend(ABC):
    """Async positional file I/O (see the module docstring for the contract)."""

    name: ClassVar[str] = ""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self._direct_fds: set[int] = set()
        self._edge_locks: dict[int, asyncio.Lock] = {}

    # -- primitives -------------------------------------------------------

    @abstractmethod
    async def _pread(self, fd: int, buf: memoryview, offset: int) -> int:
        """One read syscall's worth; may be short; 0 at EOF."""

    @abstractmethod
    async def _pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        """One write syscall's worth; may be short."""

    @abstractmethod
    async def _fsync(self, fd: int, datasync: bool) -> None: ...

    @abstractmethod
    async def aclose(self) -> None:
        """Wait for in-flight operations and release the backend's resources."""

    # -- public -----------------------------------------------------------

    async def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644, *, direct: bool = True) -> int:
        flags |= os.O_CLOEXEC
        if direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, mode)
            except OSError as exc:
                if exc.errno != 22:  # EINVAL: this file system has no O_DIRECT
                    raise
            else:
                self._direct_fds.add(fd)
                return fd
        return os.open(path, flags, mode)

    def is_direct(self, fd: int) -> bool:
        return fd in self._direct_fds

    async def close(self, fd: int) -> None:
        self._direct_fds.discard(fd)
        self._edge_locks.pop(fd, None)
        os.close(fd)

    async def fsync(self, fd: int, *, datasync: bool = False) -> None:
        await self._fsync(fd, datasync)

    async def read_at(self, fd: int, buf: memoryview, offset: int) -> int:
        if offset < 0:
            raise OSError(22, "negative offset")
        if buf.nbytes == 0:
            return 0
        if fd in self._direct_fds and not (offset % ALIGN == 0 and is_aligned(buf)):
            return await self._bounce_read(fd, buf, offset)
        return await self._read_full(fd, buf, offset)

    async def write_at(self, fd: int, buf: memoryview, offset: int) -> None:
        if offset < 0:
            raise OSError(22, "negative offset")
        if buf.nbytes == 0:
            return
        if fd in self._direct_fds and not (offset % ALIGN == 0 and is_aligned(buf)):
            await self._bounce_write(fd, buf, offset)
            return
        await self._write_full(fd, buf, offset)

    # -- shared machinery --------------------------------------------------

    async def _read_full(self, fd: int, buf: memoryview, offset: int) -> int:
        done = 0
        total = buf.nbytes
        while done < total:
            n = await self._pread(fd, buf[done:], offset + done)
            if n == 0:
                break
            done += n
            if fd in self._direct_fds and done % ALIGN:
                break  # a short O_DIRECT read ends inside the last block: EOF
        return done

    async def _write_full(self, fd: int, buf: memoryview, offset: int, *, locked: bool = False) -> None:
        done = 0
        total = buf.nbytes
        while done < total:
            n = await self._pwrite(fd, buf[done:], offset + done)
            if n <= 0:
                raise OSError(5, f"write returned {n} with {total - done} bytes left")
            done += n
            if fd in self._direct_fds and done < total and done % ALIGN:
                # the rest is no longer aligned: finish through a bounce buffer
                if locked:
                    await self._bounce_write_locked(fd, buf[done:], offset + done)
                else:
                    await self._bounce_write(fd, buf[done:], offset + done)
                return

    async def _bounce_read(self, fd: int, buf: memoryview, offset: int) -> int:
        start = offset // ALIGN * ALIGN
        end = round_up(offset + buf.nbytes)
        tmp = self.pool.get(end - start)
        try:
            n = await self._read_full(fd, tmp, start)
            avail = max(0, min(n - (offset - start), buf.nbytes))
            if avail:
                buf[:avail] = tmp[offset - start : offset - start + avail]
            return avail
        finally:
            self.pool.put(tmp)

    async def _bounce_write(self, fd: int, buf: memoryview, offset: int) -> None:
        lock = self._edge_locks.get(fd)
        if lock is None:
            lock = self._edge_locks[fd] = asyncio.Lock()
        async with lock:
            await self._bounce_write_locked(fd, buf, offset)

    async def _bounce_write_locked(self, fd: int, buf: memoryview, offset: int) -> None:
        start = offset // ALIGN * ALIGN
        end = round_up(offset + buf.nbytes)
        old_size = os.fstat(fd).st_size
        tmp = self.pool.get(end - start)
        try:
            head = offset - start
            tail = end - (offset + buf.nbytes)
            if head:
                await self._fill_block(fd, tmp[:ALIGN], start, old_size)
            if tail and (end - ALIGN >= start + ALIGN or not head):
                await self._fill_block(fd, tmp[end - start - ALIGN :], end - ALIGN, old_size)
            tmp[head : head + buf.nbytes] = buf
            await self._write_full(fd, tmp, start, locked=True)
        finally:
            self.pool.put(tmp)
        new_size = max(old_size, offset + buf.nbytes)
        # trim the padding back off, unless a concurrent write has already
        # extended the file past it (then the padding is its gap of zeros)
        if new_size < end and os.fstat(fd).st_size == end:
            os.ftruncate(fd, new_size)

    async def _fill_block(self, fd: int, block: memoryview, offset: int, size: int) -> None:
        """Load the existing 4 KiB block at ``offset`` (zeros past EOF)."""
        n = await self._read_full(fd, block, offset) if offset < size else 0
        if n < ALIGN:
            block[n:] = bytes(ALIGN - n)

    @staticmethod
    async def _uncancellable(fut: asyncio.Future[_T]) -> _T:
        """Await ``fut``; if cancelled meanwhile, first let it finish (the kernel
        or a thread still uses the caller's buffer), then re-raise."""
        cancelled = False
        while True:
            try:
                result = await asyncio.shield(fut)
            except asyncio.CancelledError:
                if fut.cancelled():
                    raise
                cancelled = True
                if fut.done():
                    break
                continue
            if cancelled:
                raise asyncio.CancelledError()
            return result
        fut.exception()  # retrieved: the error, if any, has no one to go to
        raise asyncio.CancelledError()
