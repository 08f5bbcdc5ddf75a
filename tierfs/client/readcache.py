"""The byte budget of a client's read caches, shared by all of its files."""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierfs.client.file import AsyncFile

__all__ = ["ReadCacheBudget"]


class ReadCacheBudget:
    """The bytes the read caches of all files of one client hold, bounded by
    ``ClientConfig.read_cache_bytes``. Each load of a chunk into a file's
    cache reserves its bytes here and gives them back when its buffer goes
    back to the pool. When a reservation does not fit, the least recently
    used chunks that have finished loading (of any file, but not the ones
    the asking read needs) are dropped; a chunk still loading is never
    taken from the read that waits for it. A reservation that still does
    not fit fails, and that read goes around the cache."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        # load -> (file, chunk, bytes), least recently used first.
        self._loads: collections.OrderedDict[asyncio.Task[int], tuple[AsyncFile, int, int]] = (
            collections.OrderedDict())

    def __len__(self) -> int:
        return len(self._loads)

    def reserve(self, nbytes: int, file: AsyncFile, keep: tuple[int, ...]) -> bool:
        if nbytes > self.limit:
            return False
        if self.used + nbytes > self.limit:
            for task, (f, idx, _) in list(self._loads.items()):
                if self.used + nbytes <= self.limit:
                    break
                if not task.done() or (f is file and idx in keep) or f._chunks.get(idx, (None,))[0] is not task:
                    continue
                f._drop_chunk(idx)  # done: its bytes come back now
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def register(self, task: asyncio.Task[int], file: AsyncFile, idx: int, nbytes: int) -> None:
        self._loads[task] = (file, idx, nbytes)

    def touch(self, task: asyncio.Task[int]) -> None:
        if task in self._loads:
            self._loads.move_to_end(task)

    def release(self, task: asyncio.Task[int]) -> None:
        got = self._loads.pop(task, None)
        if got is not None:
            self.used -= got[2]
