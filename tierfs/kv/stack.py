"""TierStack: KV tiers chained top (fastest) to bottom, with promotion and demotion.

* ``get_into`` walks the tiers top-down; a hit in a lower tier is copied into
  every tier above it (subject to their admission) before the call returns.
* Each tier but the last gets an ``on_evict`` that puts the victim into the
  tier below before its space is reused (a tier that has it already ignores
  the put); the last tier's victims are dropped.
* Write-through (default): ``put`` stores into every tier before returning.
  Write-back: ``put`` returns once the object is in the top tier; workers fill
  the lower tiers from the top tier's copy (pinned meanwhile, so the caller
  may reuse its buffer at once). The queue is bounded: a put waits when it is
  full. ``flush()`` waits until it is empty. Write-back needs a top tier that
  can lend its copy (``Tier.borrow``: the DRAM tier).
* An object's expiry (``put(..., expires=)``) goes with every copy: into
  each tier on a put, with a promotion (``Tier.expiry_of`` of the tier that
  hit) and with a demotion.

The stack belongs to one event loop, like its tiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from tierfs.errors import ConfigError, InvalidArgumentError
from tierfs.kv.tiers import (
    MAX_KEY_BYTES,
    EvictCallback,
    Tier,
    TierStats,
    check_key,
    dest_view,
    source_view,
)

__all__ = ["TierStack"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def _key(key: Any) -> bytes:
    if type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES:
        return key
    return check_key(key)


class TierStack:
    """Tiers from fastest to slowest (see the module docstring)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_back: bool = False,
        queue_size: int = 256,
        workers: int = 2,
        promote: bool = True,
        concurrency: int = 32,
    ) -> None:
        if not tiers:
            raise ConfigError("a tier stack needs at least one tier", field="tiers")
        if len({id(t) for t in tiers}) != len(tiers):
            raise ConfigError("the same tier appears twice in the stack", field="tiers")
        if queue_size < 1 or workers < 1 or concurrency < 1:
            raise ConfigError("queue_size, workers and concurrency must be >= 1")
        if write_back and len(tiers) > 1 and type(tiers[0]).borrow is Tier.borrow:
            raise ConfigError(
                f"write-back needs a top tier that lends its copy (Tier.borrow); {type(tiers[0]).__name__} does not",
                field="write_back",
            )
        self.tiers = list(tiers)
        self.write_back = write_back and len(tiers) > 1
        self.promote = promote
        self.concurrency = concurrency
        self.write_back_errors = 0
        self._queue_size = queue_size
        self._n_workers = workers
        self._queue: asyncio.Queue[tuple[bytes, bytes | None, int, float]] | None = None
        self._workers: list[asyncio.Task[None]] = []
        # key -> [write-backs queued, delete epoch]: a delete while a write-back is
        # queued must not be undone by it
        self._inflight: dict[bytes, list[int]] = {}
        # Reads of lower tiers in flight, deletes so far, and each key's last
        # delete while any such read runs: a promotion of what a read found
        # is skipped if its key was deleted since the read began (it put a
        # deleted value back into the upper tiers, until stop 47).
        self._reading = 0
        self._deletes = 0
        self._deleted: dict[bytes, int] = {}
        for i, t in enumerate(self.tiers[:-1]):
            t.on_evict = self._demoter(self.tiers[i + 1])
        # a memory top tier answers without a coroutine (DramTier.get_into_nowait)
        self._top_nowait: Callable[[bytes, memoryview], int | None] | None = getattr(
            self.tiers[0], "get_into_nowait", None
        )

    @staticmethod
    def _demoter(below: Tier) -> EvictCallback:
        async def demote(key: bytes, view: memoryview, expires: float) -> None:
            if await below.put(key, view, expires=expires):
                below.demotions += 1

        return demote

    # -- single-key operations ---------------------------------------------------

    async def put(self, key: bytes | str, buf: Any, parent: bytes | None = None, expires: float = 0.0) -> bool:
        """Store ``buf``; False when no tier stored it (present already, or not
        admitted). ``expires``: a ``time.monotonic()`` deadline (0.0: none)."""
        k = _key(key)
        src = source_view(buf)
        top = self.tiers[0]
        if self.write_back:
            if await top.put(k, src, parent=parent, expires=expires):
                await self._enqueue(k, parent, expires)
                return True
            if (await top.contains([k]))[0]:
                return False
            tiers = self.tiers[1:]  # the top tier would not take it: write the rest through
        else:
            tiers = self.tiers
        stored = False
        for t in tiers:
            if await t.put(k, src, parent=parent, expires=expires):
                stored = True
        return stored

    async def get_into(self, key: bytes | str, dest: Any) -> int | None:
        """Copy the object into ``dest``; its size, or None when no tier has it."""
        nowait = self._top_nowait
        if nowait is not None and type(key) is bytes:
            n = nowait(key, dest)  # validates key and dest itself
            if n is not None or len(self.tiers) == 1:
                return n
            return await self._get_below(key, dest_view(dest), 1)
        k = _key(key)
        d = dest_view(dest)
        n = await self.tiers[0].get_into(k, d)
        if n is not None:
            return n
        return await self._get_below(k, d, 1)

    async def _get_below(self, key: bytes, d: memoryview, start: int) -> int | None:
        tiers = self.tiers
        mark = self._deletes
        self._reading += 1
        try:
            for i in range(start, len(tiers)):
                n = await tiers[i].get_into(key, d)
                if n is not None:
                    if self.promote and self._deleted.get(key, 0) <= mark:
                        await self._promote(key, d[:n], i, tiers[i].expiry_of(key))
                        if self._deleted.get(key, 0) > mark:  # deleted while promoting
                            for t in tiers[:i]:
                                await t.delete(key)
                    return n
            return None
        finally:
            self._reading -= 1
            if not self._reading:
                self._deleted.clear()

    async def _promote(self, key: bytes, view: memoryview, level: int, expires: float) -> None:
        # dest is the caller's and is not theirs again until get_into returns
        for t in self.tiers[:level]:
            try:
                if await t.put(key, view, expires=expires):
                    t.promotions += 1
            except Exception:
                log.warning("promoting %r into %s failed", key, t.name, exc_info=True)

    async def contains(self, keys: Sequence[bytes | str]) -> list[bool]:
        ks = [_key(k) for k in keys]
        res = await self.tiers[0].contains(ks)
        for t in self.tiers[1:]:
            missing = [i for i, v in enumerate(res) if not v]
            if not missing:
                break
            sub = await t.contains([ks[i] for i in missing])
            for i, v in zip(missing, sub, strict=True):
                if v:
                    res[i] = True
        return res

    async def delete(self, key: bytes | str) -> bool:
        """Remove the object from every tier; True when any had it."""
        k = _key(key)
        state = self._inflight.get(k)
        if state is not None:
            state[1] += 1
        self._deletes += 1
        if self._reading:
            self._deleted[k] = self._deletes
        found = False
        for t in self.tiers:
            if await t.delete(k):
                found = True
        return found

    # -- batches ---------------------------------------------------------------------

    async def _bounded(self, n: int, fn: Callable[[int], Awaitable[_T]]) -> list[_T]:
        """``[await fn(0), ..., await fn(n - 1)]``, ``concurrency`` at a time, in order."""
        out: list[_T] = []
        for lo in range(0, n, self.concurrency):
            hi = min(n, lo + self.concurrency)
            out.extend(await asyncio.gather(*(fn(i) for i in range(lo, hi))))
        return out

    async def batch_put(
        self, keys: Sequence[bytes | str], bufs: Sequence[Any], parents: Sequence[bytes | None] | None = None
    ) -> list[bool]:
        if len(keys) != len(bufs) or (parents is not None and len(parents) != len(keys)):
            raise InvalidArgumentError(f"batch_put: {len(keys)} keys, {len(bufs)} buffers, parents {len(parents or ())}")
        ps = list(parents) if parents is not None else [None] * len(keys)
        ks = [_key(k) for k in keys]
        srcs = [source_view(b) for b in bufs]  # all validated before anything is stored
        return await self._bounded(len(ks), lambda i: self.put(ks[i], srcs[i], ps[i]))

    async def batch_get_into(self, keys: Sequence[bytes | str], dests: Sequence[Any]) -> list[int | None]:
        if len(keys) != len(dests):
            raise InvalidArgumentError(f"batch_get_into: {len(keys)} keys, {len(dests)} buffers")
        ks = [_key(k) for k in keys]
        ds = [dest_view(d) for d in dests]
        top = self.tiers[0]
        out: list[int | None] = []
        for k, d in zip(ks, ds, strict=True):
            out.append(await top.get_into(k, d))
        missing = [i for i, n in enumerate(out) if n is None]
        if missing and len(self.tiers) > 1:
            got = await self._bounded(
                len(missing), lambda j: self._get_below(ks[missing[j]], ds[missing[j]], 1)
            )
            for i, n in zip(missing, got, strict=True):
                out[i] = n
        return out

    async def batch_contains(self, keys: Sequence[bytes | str]) -> list[bool]:
        return await self.contains(keys)

    # -- write-back ------------------------------------------------------------------

    async def _enqueue(self, key: bytes, parent: bytes | None, expires: float) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue(self._queue_size)
            self._workers = [asyncio.create_task(self._drain()) for _ in range(self._n_workers)]
        state = self._inflight.setdefault(key, [0, 0])
        state[0] += 1
        await self._queue.put((key, parent, state[1], expires))

    async def _drain(self) -> None:
        q = self._queue
        assert q is not None
        while True:
            key, parent, epoch, expires = await q.get()
            try:
                await self._write_down(key, parent, epoch, expires)
            except Exception:
                self.write_back_errors += 1
                log.warning("write-back of %r failed", key, exc_info=True)
            finally:
                state = self._inflight.get(key)
                if state is not None:
                    state[0] -= 1
                    if state[0] <= 0:
                        del self._inflight[key]
                q.task_done()

    async def _write_down(self, key: bytes, parent: bytes | None, epoch: int, expires: float) -> None:
        state = self._inflight.get(key)
        b = self.tiers[0].borrow(key)
        if b is None:
            return  # gone from the top tier: deleted, or evicted (and so demoted)
        written: list[Tier] = []
        with b:
            for t in self.tiers[1:]:
                if state is not None and state[1] != epoch:
                    break
                if await t.put(key, b.view, parent=parent, expires=expires):
                    written.append(t)
        if state is not None and state[1] != epoch:
            for t in written:  # deleted while we were copying it down
                await t.delete(key)

    async def flush(self) -> None:
        """Wait until every write-back queued so far has reached the lower tiers."""
        if self._queue is not None:
            await self._queue.join()

    # -- the rest ----------------------------------------------------------------------

    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    async def close(self) -> None:
        """Flush, stop the workers and close every tier."""
        try:
            await self.flush()
        finally:
            for w in self._workers:
                w.cancel()
            for w in self._workers:
                with contextlib.suppress(asyncio.CancelledError):
                    await w
            self._workers = []
            self._queue = None
            for t in self.tiers:
                t.on_evict = None
            for t in self.tiers:
                await t.close()
