"""``client.kv``: the KV-cache API of :class:`~tierfs.client.AsyncClient` and
:class:`~tierfs.client.Client`.

A pool handle (:class:`AsyncKV`, blocking :class:`KV`) puts and gets
immutable objects by key. Below it sit the client's own tiers, when
configured (``ClientConfig.kv_dram_bytes``, ``kv_ssd_path``/``kv_ssd_bytes``),
and the cluster pool:

- a get looks in the local tiers first (top-down; a hit in a lower one is
  promoted), then in the cluster, and a cluster hit fills the local tiers;
- a put goes into the local tiers and to the cluster: at once
  (write-through, the default) or in the background (``kv_write_back``; the
  put returns once the object is local, :meth:`AsyncKV.flush` waits);
- an eviction from DRAM demotes into the SSD tier; below the last local tier
  the object is in the cluster already (or on its way there).

Keys are ``str`` or ``bytes`` (:mod:`tierfs.kv.keys`); buffers anything with
the buffer protocol, numpy arrays, contiguous torch CPU tensors, and CUDA
tensors (staged through pinned host memory: :mod:`tierfs.kv.gpu`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tierfs.errors import InvalidArgumentError, TierFSError
from tierfs.kv.cluster import ClusterTier
from tierfs.kv.keys import (
    MAX_KEY_BYTES,
    byte_view,
    is_cuda_tensor,
    itemsize_of,
    normalize_key,
    normalize_keys,
)

if TYPE_CHECKING:
    from tierfs.client.client import AsyncClient
    from tierfs.client.sync import Client

__all__ = ["KV", "AsyncKV", "LocalTiers"]

PIN_SOFT, PIN_HARD = 1, 2
#: tierfs.storage.kvstore.MAX_TTL_MS (not imported: the client does not load the daemon's store)
MAX_TTL_MS = 10 * 365 * 86_400_000
#: Buffer types that need no dtype or device handling (the single-object fast path).
_PLAIN = (bytes, bytearray, memoryview)


def _ttl_ms(ttl: float | None, what: str) -> int:
    if ttl is None:
        return 0
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool):
        raise InvalidArgumentError(f"{what} must be a number of seconds, got {ttl!r}")
    if not ttl > 0:  # NaN too
        raise InvalidArgumentError(f"{what} must be > 0 seconds, got {ttl}")
    if ttl * 1000 > MAX_TTL_MS:
        raise InvalidArgumentError(f"{what} of {ttl} s is past the longest TTL, {MAX_TTL_MS // 1000} s (ten years)")
    return max(1, int(ttl * 1000))


class LocalTiers:
    """The client process's own tiers (DRAM, local SSD), shared by every pool
    handle of one client; keys are prefixed with the pool name."""

    def __init__(self, client: AsyncClient) -> None:
        from tierfs.kv.stack import TierStack
        from tierfs.kv.tiers import DramTier, SsdTier

        c = client.config
        tiers: list[Any] = []
        if c.kv_dram_bytes:
            tiers.append(DramTier(c.kv_dram_bytes, policy=c.kv_dram_policy))
        if c.kv_ssd_bytes:
            ssd = SsdTier(c.kv_ssd_path, c.kv_ssd_bytes, policy=c.kv_ssd_policy)
            ssd.inline_max = c.kv_ssd_inline_bytes
            tiers.append(ssd)
        self.tiers = tiers
        self.stack = TierStack(tiers, write_back=False)

    async def close(self) -> None:
        await self.stack.close()


class AsyncKV:
    """One KV pool, as seen from one client. Get it as ``client.kv`` (the
    default pool) or ``client.kv_pool(name)``."""

    def __init__(self, client: AsyncClient, pool: str) -> None:
        self.client = client
        self.pool = pool
        _, data, router = client._parts()
        self.cluster = ClusterTier(router, data, pool, timeout=client.config.kv_timeout,
                                   min_bandwidth=client.config.kv_min_bandwidth,
                                   verify_copies=client.config.kv_verify_copies,
                                   require_witness=client.config.kv_require_witness)
        self._local: LocalTiers | None = client._kv_local()
        self._router = router
        # Local tier keys: the pool's name and id, then the key (an id, so
        # that a pool removed and made again under the same name never
        # serves the old one's objects from a client's DRAM or SSD tier).
        self._prefixes: dict[int, bytes] = {}
        self._write_back = client.config.kv_write_back and self._local is not None
        self._wb_limit = client.config.kv_write_back_bytes
        self._wb_bytes = 0
        self._wb_room = asyncio.Condition()
        self._wb_tasks: set[asyncio.Task[None]] = set()
        # key -> its write-back sends in flight: a later delete, overwrite,
        # TTL put or pin of the key waits for them (_after_write_back)
        self._wb_keys: dict[bytes, set[asyncio.Task[None]]] = {}
        # Local fills racing a drop (_fill_local): drops so far, and each
        # key's last drop while a fill is running.
        self._drops = 0
        self._dropped: dict[bytes, int] = {}
        self._filling = 0
        # key -> this client's write-through puts of it in flight: a fill
        # skips such a key (the cluster may still hold the value the put
        # replaces), and a put's end counts as a drop for fills running.
        self._putting: dict[bytes, int] = {}
        self._wb_errors: collections.deque[TierFSError] = collections.deque(maxlen=16)
        self._prefetches: set[asyncio.Task[None]] = set()
        self.counters = {"write_back_pending": 0, "write_back_failed": 0, "write_back_waits": 0, "prefetched": 0,
                         "prefetch_misses": 0}

    async def _local_for(self) -> LocalTiers | None:
        """The local tiers, once this pool's id is known (local keys carry
        it); None without local tiers, or when the pool's route cannot be
        had (meta unreachable with no map yet, or the pool removed): its
        local copies are then not used. Until stop 47 such calls used pool
        id 0, so a fresh client's first put stored a copy that its later
        overwrite and delete (under the real id) never reached, and a get
        after `kv pool rm` served it."""
        if self._local is None or self._router.kv_pools.get(self.pool) is not None:
            return self._local
        try:
            await self.cluster.route()
        except TierFSError:
            return None
        return self._local if self._router.kv_pools.get(self.pool) is not None else None

    def _users_key(self, exc: InvalidArgumentError, k: bytes) -> InvalidArgumentError:
        """A local tier's error about ``k`` in the caller's words: its key,
        not the local key (pool name and id before it)."""
        return InvalidArgumentError(str(exc).replace(repr(self._lk(k)), repr(k)))

    def _lk(self, key: bytes) -> bytes:
        route = self._router.kv_pools.get(self.pool)
        pid = route.pool_id if route is not None else 0
        prefix = self._prefixes.get(pid)
        if prefix is None:
            prefix = self._prefixes[pid] = self.pool.encode() + b"\0" + str(pid).encode()
        lk = prefix + b"\0" + key
        if len(lk) <= MAX_KEY_BYTES:
            return lk
        # A key near the limit: its digest (after \1, so never a key's own
        # bytes after \0), as the local tiers take 512 bytes at most and
        # the prefix must not make a valid key invalid there.
        return prefix + b"\1" + hashlib.blake2b(key, digest_size=32).digest()

    # ---- single objects ----------------------------------------------------------

    async def put(self, key: str | bytes, buf: Any, *, overwrite: bool = False, ttl: float | None = None,
                  pin: str | None = None, pin_ttl: float | None = None) -> bool:
        """Store ``buf`` under ``key``. False if the key was there (a no-op:
        keys are content-addressed) unless ``overwrite``. ``ttl``: seconds
        until it expires; ``pin``: "soft" (with ``pin_ttl``) or "hard" (counted
        against the pool's pin quota) keeps it from eviction."""
        if self._local is None and ttl is None and pin is None and pin_ttl is None and type(buf) in _PLAIN:
            # The common case of a direct SDK user: no local tiers, one object.
            return await self.cluster.put(normalize_key(key), byte_view(buf, writable=False), overwrite=overwrite)
        return (await self.batch_put([key], [buf], overwrite=overwrite, ttl=ttl, pin=pin, pin_ttl=pin_ttl))[0]

    async def get_into(self, key: str | bytes, buf: Any) -> int | None:
        """Copy the object straight into ``buf``; its size, or None on a miss.
        InvalidArgumentError (nothing past the buffer written) if it does not fit."""
        t = type(buf)
        if t is bytearray or (t is memoryview and buf.itemsize == 1):
            # One object into a plain byte buffer (no dtype to check): the
            # common case, without batch_get_into's lists.
            k = normalize_key(key)
            view = byte_view(buf, writable=True)
            local = await self._local_for()
            if local is None:
                return await self.cluster.get_into(k, view)
            try:
                n = await local.stack.get_into(self._lk(k), view)
            except InvalidArgumentError as exc:
                raise self._users_key(exc, k) from None
            if n is not None:
                return n
            out: list[int | None] = [None]
            await self._from_cluster([k], [view], [0], out)
            return out[0]
        if self._local is None and t in _PLAIN:
            return await self.cluster.get_into(normalize_key(key), byte_view(buf, writable=True))
        return (await self.batch_get_into([key], [buf]))[0]

    async def get(self, key: str | bytes) -> bytes | None:
        """The object as ``bytes``, or None."""
        k = normalize_key(key)
        if await self._local_for() is not None:
            got = await self._local_get_bytes(k)
            if got is not None:
                return got
        expiries: list[float] = []
        mark = self._fill_start()
        try:
            value = await self.cluster.get(k, expiries)
            if value is not None:
                await self._fill_local(k, memoryview(value), expiries[0], mark)
        finally:
            self._fill_end()
        return value

    async def exists(self, key: str | bytes) -> bool:
        return (await self.batch_contains([key]))[0]

    async def delete(self, key: str | bytes) -> bool:
        """Remove the object from every tier; True if the cluster had it.
        A write-back put of the key still on its way to the cluster is
        waited for first: sent after the delete, it would bring the object
        back once the delete was acknowledged."""
        k = normalize_key(key)
        if self._local is None:
            await self._after_write_back([k])
            return await self.cluster.delete(k)
        await self._drop_local(k)
        await self._after_write_back([k])
        try:
            return await self.cluster.delete(k)
        finally:
            # A get of this client's that ran meanwhile may have filled the
            # key in again from the cluster, before the delete reached it.
            await self._drop_local(k)

    # ---- batches -----------------------------------------------------------------

    async def batch_put(self, keys: Sequence[str | bytes], bufs: Sequence[Any], *, overwrite: bool = False,
                        ttl: float | None = None, pin: str | None = None,
                        pin_ttl: float | None = None) -> list[bool]:
        """Many puts; the requests for one storage node go out together."""
        if len(keys) != len(bufs):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
        ks = normalize_keys(keys)
        try:
            views = [byte_view(b, writable=False, what=f"buffer {i}") for i, b in enumerate(bufs)]
        except InvalidArgumentError:
            # CUDA tensors have no byte view: staged through pinned memory (tierfs.kv.gpu).
            # Tried only here, so host buffers pay nothing for it.
            if not any(is_cuda_tensor(b) for b in bufs):
                raise
            from tierfs.kv.gpu import put_cuda

            return await put_cuda(self, ks, bufs, overwrite=overwrite, ttl=ttl, pin=pin, pin_ttl=pin_ttl)
        ttl_ms = _ttl_ms(ttl, "ttl")
        pin_kind = {None: 0, "soft": PIN_SOFT, "hard": PIN_HARD}.get(pin, -1)
        if pin_kind < 0:
            raise InvalidArgumentError(f"pin is 'soft', 'hard' or None, not {pin!r}")
        pin_ttl_ms = _ttl_ms(pin_ttl, "pin_ttl")
        local = await self._local_for()
        kept_local = [False] * len(ks)
        if local is not None:
            parent: bytes | None = None
            # the local copies expire no later than the cluster's, whose TTL
            # starts when the daemons have the object
            expires = time.monotonic() + ttl_ms / 1000 if ttl_ms else 0.0
            for i, (k, v) in enumerate(zip(ks, views, strict=True)):
                lk = self._lk(k)
                if overwrite:
                    # A local tier's put keeps what it holds (content
                    # addressing): the old value would go on being served
                    # here, to the client that overwrote it.
                    await self._drop_local(k)
                kept_local[i] = await local.stack.put(lk, v, parent=parent, expires=expires)
                if not kept_local[i] and (await local.stack.contains([lk]))[0]:
                    # Held here already: maybe another value (a put without
                    # overwrite of a key the cluster evicted or another
                    # client deleted, which the cluster then stores). This
                    # value goes in its place; if the cluster keeps another,
                    # the copy is dropped below (until stop 47 the old one
                    # went on being served to this client).
                    await self._drop_local(k)
                    kept_local[i] = await local.stack.put(lk, v, parent=parent, expires=expires)
                parent = lk
        if self._write_back and not overwrite and not ttl_ms and not pin_kind:
            await self._queue_write_back(ks, views)
            return [True] * len(ks)
        if overwrite or ttl_ms or pin_kind:
            # after this client's earlier write-back puts of these keys, as
            # issued: a late one could replace an overwrite (another stamp)
            # or outlive a TTL put's object
            await self._after_write_back(ks)
        if self._local is not None:
            self._put_start(ks)
        try:
            done = await self.cluster.batch_put(ks, views, overwrite=overwrite, ttl_ms=ttl_ms, pin=pin_kind,
                                                pin_ttl_ms=pin_ttl_ms)
        except BaseException:
            # Nothing changes when a put fails: not this client's local
            # tiers either (until stop 46 it went on reading the value the
            # cluster refused, while every other client read the old one).
            if self._local is not None:
                self._put_end(ks)
                for k in ks:
                    await self._drop_local(k)
            raise
        if self._local is not None:
            self._put_end(ks)
        if self._local is not None:
            # False: the cluster kept what it had (a put without overwrite of
            # a key it holds): that, not this value, is what the key reads.
            # True, with no local copy of this value (too big for the tiers,
            # not admitted): a get of this client's that read the old value
            # from the cluster while the put ran must not fill it in after
            # (it did, until stop 47, for an overwrite).
            for k, ok, kept in zip(ks, done, kept_local, strict=True):
                if not ok or not kept:
                    await self._drop_local(k)
        return done

    async def batch_get_into(self, keys: Sequence[str | bytes], bufs: Sequence[Any], *,
                             misfit: str = "raise") -> list[int | None]:
        """Many gets, each straight into its buffer: sizes, None for misses.

        An object that does not fit its buffer, or is not a whole number of
        its dtype's elements, raises InvalidArgumentError naming the key
        (``misfit="raise"``, a caller's sizing bug); ``misfit="miss"`` makes
        it that key's miss instead, for engines, to which bytes under a
        page's key that are not a page are a miss like any other (the
        buffer may then hold some of them)."""
        if misfit not in ("raise", "miss"):
            raise InvalidArgumentError(f"misfit is 'raise' or 'miss', not {misfit!r}")
        if len(keys) != len(bufs):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
        ks = normalize_keys(keys)
        try:
            views = [byte_view(b, writable=True, what=f"buffer {i}") for i, b in enumerate(bufs)]
        except InvalidArgumentError:
            if not any(is_cuda_tensor(b) for b in bufs):
                raise
            from tierfs.kv.gpu import get_into_cuda

            return await get_into_cuda(self, ks, bufs, misfit=misfit)
        miss = misfit == "miss"
        out: list[int | None] = [None] * len(ks)
        todo = list(range(len(ks)))
        local = await self._local_for()
        if local is not None:
            rest = []
            for i in todo:
                try:
                    n = await local.stack.get_into(self._lk(ks[i]), views[i])
                except InvalidArgumentError as exc:
                    if not miss:
                        raise self._users_key(exc, ks[i]) from None
                    continue  # the cluster holds the same object: a miss
                if n is None:
                    rest.append(i)
                else:
                    out[i] = n
            todo = rest
        if todo:
            await self._from_cluster(ks, views, todo, out, misfit_miss=miss)
        for i, n in enumerate(out):
            size = itemsize_of(bufs[i])
            if n is not None and n % size:
                if miss:
                    out[i] = None
                    continue
                raise InvalidArgumentError(
                    f"object {ks[i]!r} of {n} bytes is not a whole number of {size}-byte elements of its "
                    f"buffer's dtype")
        return out

    async def _from_cluster(self, ks: list[bytes], views: list[memoryview], todo: list[int],
                            out: list[int | None], *, misfit_miss: bool = False) -> None:
        """Get ``ks[i]`` for each ``i`` in ``todo`` from the cluster into
        ``views[i]``, its size into ``out[i]``, and fill the local tiers with the hits."""
        expiries: list[float] = []
        mark = self._fill_start()
        try:
            got = await self.cluster.batch_get_into([ks[i] for i in todo], [views[i] for i in todo], expiries,
                                                    misfit_miss=misfit_miss)
            for i, n, exp in zip(todo, got, expiries, strict=True):
                out[i] = n
                if n is not None:
                    await self._fill_local(ks[i], views[i][:n], exp, mark)
        finally:
            self._fill_end()

    async def batch_contains(self, keys: Sequence[str | bytes]) -> list[bool]:
        """Presence of each key (local tiers, then one request per storage
        target for the rest)."""
        ks = normalize_keys(keys)
        out = [False] * len(ks)
        todo = list(range(len(ks)))
        tiers = await self._local_for() if ks else None
        if tiers is not None:
            local = await tiers.stack.contains([self._lk(k) for k in ks])
            todo = [i for i in todo if not local[i]]
            for i, hit in enumerate(local):
                out[i] = hit
        if todo:
            got = await self.cluster.contains([ks[i] for i in todo])
            for i, hit in zip(todo, got, strict=True):
                out[i] = hit
        return out

    async def batch_exists(self, keys: Sequence[str | bytes]) -> int:
        """How many *leading* keys are present: the prefix an engine can load."""
        present = await self.batch_contains(keys)
        for i, hit in enumerate(present):
            if not hit:
                return i
        return len(present)

    # ---- prefetch, pins, flush, stats ------------------------------------------------------

    def prefetch(self, keys: Sequence[str | bytes]) -> asyncio.Task[None] | None:
        """Start loading ``keys`` from the cluster into the local tiers in the
        background (returns the task; None when there are no local tiers)."""
        ks = normalize_keys(keys)
        if self._local is None or not ks:
            return None
        task = asyncio.get_running_loop().create_task(self._prefetch(ks))
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)
        return task

    async def _prefetch(self, ks: list[bytes]) -> None:
        tiers = await self._local_for()
        if tiers is None:
            return
        local = await tiers.stack.contains([self._lk(k) for k in ks])
        for k, hit in zip(ks, local, strict=True):
            if hit:
                continue
            expiries: list[float] = []
            mark = self._fill_start()
            try:
                try:
                    value = await self.cluster.get(k, expiries)
                except TierFSError:
                    value = None
                if value is None:
                    self.counters["prefetch_misses"] += 1
                    continue
                if await self._fill_local(k, memoryview(value), expiries[0], mark):
                    self.counters["prefetched"] += 1
            finally:
                self._fill_end()

    async def pin(self, key: str | bytes, *, hard: bool = False, ttl: float | None = None) -> bool:
        """Keep ``key`` from eviction in the cluster: a soft pin (expires
        after ``ttl`` s) or a hard one (counted against the pool's pin quota;
        NoSpaceError past it). False if the object is not there."""
        await self._after_write_back([normalize_key(key)])
        return await self.cluster.pin(normalize_key(key), PIN_HARD if hard else PIN_SOFT, _ttl_ms(ttl, "ttl"))

    async def unpin(self, key: str | bytes) -> bool:
        k = normalize_key(key)
        await self._after_write_back([k])
        return await self.cluster.pin(k, 0)

    async def flush(self) -> None:
        """Wait until every write-back put is in the cluster (and prefetches are done).
        Raises the first write-back failure since the last flush."""
        while self._wb_tasks or self._prefetches:
            await asyncio.gather(*self._wb_tasks, *self._prefetches, return_exceptions=True)
        if self._local is not None:
            await self._local.stack.flush()
        if self._wb_errors:
            exc = self._wb_errors.popleft()
            self._wb_errors.clear()
            raise exc

    def stats(self) -> dict[str, Any]:
        """Per-tier counters (hits, misses, evictions, bytes moved) and the cluster's."""
        tiers: list[dict[str, Any]] = []
        if self._local is not None:
            tiers = [s.as_dict() for s in self._local.stack.stats()]
        return {"pool": self.pool, "tiers": tiers, "cluster": self.cluster.stats().as_dict(),
                **self.counters, "write_back_pending": self._wb_bytes}

    async def close(self) -> None:
        await asyncio.gather(*self._wb_tasks, *self._prefetches, return_exceptions=True)

    # ---- internals ---------------------------------------------------------------

    async def _local_get_bytes(self, k: bytes) -> bytes | None:
        assert self._local is not None
        size = None
        for t in self._local.tiers:
            size = await t.size_of(self._lk(k))
            if size is not None:
                break
        if size is None:
            # size_of counts nothing: a miss in every local tier, as
            # get_into counts one (kv stats showed 0 misses for gets the
            # cluster answered)
            for t in self._local.tiers:
                t.misses += 1
            return None
        buf = bytearray(size)
        n = await self._local.stack.get_into(self._lk(k), memoryview(buf))
        return None if n is None else bytes(buf[:n])

    async def _queue_write_back(self, ks: list[bytes], views: list[memoryview]) -> None:
        need = sum(len(v) for v in views)
        async with self._wb_room:
            await self._wb_room.wait_for(lambda: self._wb_bytes == 0 or self._wb_bytes + need <= self._wb_limit)
            self._wb_bytes += need
        copies = [memoryview(bytes(v)) for v in views]  # the caller may reuse its buffers at once
        task = asyncio.get_running_loop().create_task(self._send_back(ks, copies, need))
        self._wb_tasks.add(task)
        task.add_done_callback(self._wb_tasks.discard)
        for k in ks:
            self._wb_keys.setdefault(k, set()).add(task)
        task.add_done_callback(lambda t: self._wb_forget(t, ks))

    def _wb_forget(self, task: asyncio.Task[None], ks: list[bytes]) -> None:
        for k in ks:
            pending = self._wb_keys.get(k)
            if pending is not None:
                pending.discard(task)
                if not pending:
                    del self._wb_keys[k]

    async def _after_write_back(self, ks: Sequence[bytes]) -> None:
        """Wait until no write-back send of any of ``ks`` is in flight (each
        ends in the cluster or as a failure ``flush`` reports), so that this
        client's operations on a key reach the cluster in the order it made
        them (docs/kv.md, "Writes")."""
        if not self._wb_keys:
            return
        pending = {t for k in ks for t in self._wb_keys.get(k, ())}
        if pending:
            self.counters["write_back_waits"] += 1
            await asyncio.wait(pending)

    # A cluster read that fills the local tiers may have fetched the object
    # before this client deleted or overwrote the key (a prefetch, or a get
    # running beside the delete); filled after, it would be served here
    # again. A fill skips a key dropped since it started.

    def _fill_start(self) -> int:
        self._filling += 1
        return self._drops

    def _fill_end(self) -> None:
        self._filling -= 1
        if not self._filling:
            self._dropped.clear()

    def _put_start(self, ks: Sequence[bytes]) -> None:
        for k in ks:
            self._putting[k] = self._putting.get(k, 0) + 1

    def _put_end(self, ks: Sequence[bytes]) -> None:
        """A put's cluster write is over: a fill that read the cluster
        before (maybe the value it replaced) must not land after it. Until
        stop 48 a fill of an overwritten key whose new local copy had been
        evicted meanwhile stayed, and this client read the old value after
        the overwrite was acknowledged."""
        for k in ks:
            n = self._putting.get(k, 0) - 1
            if n > 0:
                self._putting[k] = n
            else:
                self._putting.pop(k, None)
            self._drops += 1
            if self._filling:
                self._dropped[k] = self._drops

    async def _fill_local(self, k: bytes, view: memoryview, expires: float, mark: int) -> bool:
        if self._local is None or self._dropped.get(k, 0) > mark or k in self._putting:
            # dropped since the read started, or a put of it still on its
            # way to the cluster (whose old value the read may have got)
            return False
        await self._local.stack.put(self._lk(k), view, expires=expires)
        if self._dropped.get(k, 0) > mark:
            # Dropped while the fill was being written (an overwrite or a
            # delete of this client's): what it wrote below the tier the
            # drop found it in must not stay (until stop 47 it did).
            await self._local.stack.delete(self._lk(k))
            return False
        return True

    async def _drop_local(self, k: bytes) -> None:
        assert self._local is not None
        self._drops += 1
        if self._filling:
            self._dropped[k] = self._drops
        await self._local.stack.delete(self._lk(k))

    async def _send_back(self, ks: list[bytes], copies: list[memoryview], need: int) -> None:
        try:
            done = await self.cluster.batch_put(ks, copies)
            # The cluster kept another value for these (already there): the
            # local copies would read otherwise than every other client.
            for k, ok in zip(ks, done, strict=True):
                if not ok and self._local is not None:
                    await self._drop_local(k)
        except TierFSError as exc:
            self.counters["write_back_failed"] += len(ks)
            self._wb_errors.append(exc)
            if self._local is not None:
                for k in ks:  # never reached the cluster: not served from here either
                    await self._drop_local(k)
        finally:
            async with self._wb_room:
                self._wb_bytes -= need
                self._wb_room.notify_all()


class KV:
    """The blocking face of :class:`AsyncKV` (``Client.kv``)."""

    def __init__(self, client: Client, pool: str) -> None:
        self._client = client
        self.pool = pool

    def _run(self, fn: str, *args: Any, **kw: Any) -> Any:
        async def call() -> Any:
            akv = self._client.aclient.kv_pool(self.pool)
            return await getattr(akv, fn)(*args, **kw)

        return self._client._run(call())

    def put(self, key: str | bytes, buf: Any, **kw: Any) -> bool:
        return bool(self._run("put", key, buf, **kw))

    def get_into(self, key: str | bytes, buf: Any) -> int | None:
        r: int | None = self._run("get_into", key, buf)
        return r

    def get(self, key: str | bytes) -> bytes | None:
        r: bytes | None = self._run("get", key)
        return r

    def exists(self, key: str | bytes) -> bool:
        return bool(self._run("exists", key))

    def delete(self, key: str | bytes) -> bool:
        return bool(self._run("delete", key))

    def batch_put(self, keys: Sequence[str | bytes], bufs: Sequence[Any], **kw: Any) -> list[bool]:
        r: list[bool] = self._run("batch_put", keys, bufs, **kw)
        return r

    def batch_get_into(self, keys: Sequence[str | bytes], bufs: Sequence[Any], *,
                       misfit: str = "raise") -> list[int | None]:
        r: list[int | None] = self._run("batch_get_into", keys, bufs, misfit=misfit)
        return r

    def batch_contains(self, keys: Sequence[str | bytes]) -> list[bool]:
        r: list[bool] = self._run("batch_contains", keys)
        return r

    def batch_exists(self, keys: Sequence[str | bytes]) -> int:
        return int(self._run("batch_exists", keys))

    def prefetch(self, keys: Sequence[str | bytes]) -> None:
        async def call() -> None:
            self._client.aclient.kv_pool(self.pool).prefetch(keys)

        self._client._run(call())

    def pin(self, key: str | bytes, *, hard: bool = False, ttl: float | None = None) -> bool:
        return bool(self._run("pin", key, hard=hard, ttl=ttl))

    def unpin(self, key: str | bytes) -> bool:
        return bool(self._run("unpin", key))

    def flush(self) -> None:
        self._run("flush")

    def stats(self) -> dict[str, Any]:
        async def call() -> dict[str, Any]:
            return self._client.aclient.kv_pool(self.pool).stats()

        return self._client._run(call())
