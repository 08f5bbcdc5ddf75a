"""The portable backend: ``os.preadv``/``os.pwritev``/``fsync`` in a thread pool.

Works on every kernel and file system; used where io_uring is unavailable or
when configured. Each operation costs one hop to a worker thread (the GIL is
released inside the syscall, so disk time overlaps with the event loop).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tierfs.buffers import BufferPool
from tierfs.storage.io.base import IOBackend

__all__ = ["PosixBackend"]


class PosixBackend(IOBackend):
    name = "posix"

    def __init__(self, pool: BufferPool, threads: int = 8) -> None:
        super().__init__(pool)
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierfs-io")
        self._closed = False

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._closed:
            raise RuntimeError("backend is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.run_in_executor(self._executor, fn, *args)
        return await self._uncancellable(fut)

    async def _pread(self, fd: int, buf: memoryview, offset: int) -> int:
        n: int = await self._run(os.preadv, fd, [buf], offset)
        return n

    async def _pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        n: int = await self._run(os.pwritev, fd, [buf], offset)
        return n

    async def _fsync(self, fd: int, datasync: bool) -> None:
        await self._run(os.fdatasync if datasync else os.fsync, fd)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
