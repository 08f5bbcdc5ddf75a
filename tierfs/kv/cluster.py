"""The cluster tier: a KV pool on the storage daemons, reached over the data plane.

No metadata call per key: a key maps to one of the pool's placement groups
by a stable hash (xxh3-64 of the key, modulo the number of groups) and its
object lives on that group's targets:

- ``replica:N``: a put goes to each of the N targets; a get asks the first
  usable one and falls back to the others on a miss or an error.
- ``ec:K+M``: the value is split into K data fragments plus M parity (the
  file path's codec); fragment j is stored under the same key on target j,
  with the object's length in an 8-byte trailer. A get fetches the K data
  fragments and decodes around missing ones.

The pool is a cache: a target that is down, slow or answers an error turns
into a miss within the request deadline (``ClientConfig.kv_timeout``), never
a hang and never an exception for a get. Every answer's payload is checked
against the object's CRC32C, the one the writer computed, end to end.

``ClusterTier`` is what ``client.kv`` drives (batches, TTLs, pins).
``ClusterKVTier`` puts it behind the :class:`tierfs.kv.tiers.Tier`
interface (the one the conformance suite and ``TierStack`` use): keys and
buffers checked like the local tiers', an object larger than one target's
budget not stored (False), and its own client, made in whichever event loop
uses it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import xxhash

from tierfs.errors import (
    InvalidArgumentError,
    NoSpaceError,
    NotFoundError,
    StaleVersionError,
    TierFSError,
    TimeoutError_,
    UnavailableError,
)
from tierfs.kv.placement import group_of, jump_hash, jump_span, mapped_since, placement
from tierfs.kv.tiers import Tier, TierStats, check_key, dest_view, source_view
from tierfs.net.protocol import (
    KV_GROUP,
    KV_OVERWRITE,
    KV_PIN_SHIFT,
    KV_STAMP_SHIFT,
    MAX_KV_EXISTS_KEYS,
)

if TYPE_CHECKING:
    from tierfs.client.client import AsyncClient
    from tierfs.client.config import ClientConfig
    from tierfs.client.routing import KVPoolRoute, Router
    from tierfs.net import DataClient

__all__ = ["ClusterKVTier", "ClusterStats", "ClusterTier", "KVCapabilities", "group_of", "jump_hash", "jump_span",
           "mapped_since", "placement"]

log = logging.getLogger(__name__)

_LEN = struct.Struct("<Q")
# An EC fragment's trailer: the whole value's CRC32C, then one word holding
# the value's length (low 48 bits), the fragment's position plus one (8 bits)
# and a format mark (top 8 bits). Fragments of different values of one key
# (an overwrite with a holder down, a put that failed half-way) then differ
# in their trailers even when the lengths are equal, and the decoded value is
# checked against the CRC. The first format had only the length (``_LEN``):
# such fragments are still read, as before; readers of that format see a
# different length in each fragment of this one, hence a miss, not bytes.
_TRAILER = struct.Struct("<IQ")
_EC_MARK = 0xEC
_N_BITS = 48
#: Maps a KV put tries before it gives up on daemons that place its key elsewhere.
_MAP_TRIES = 3


def _ec_tail(n: int, j: int) -> int:
    return n | (j + 1) << _N_BITS | _EC_MARK << 56


_Tag = tuple[int, int, int]  # (format, value length, value CRC32C or 0)
_R = TypeVar("_R")
#: CRC32Cs of replica values a client remembers as vouched for (~100 bytes each).
_KNOWN_MAX = 65_536
#: Seconds between two WARNING lines about copies that disagree (the others are counted).
DISAGREE_LOG_INTERVAL = 10.0


def _ec_fragment(v: Any, j: int) -> tuple[_Tag, memoryview] | None:
    """The version tag and payload of what target ``j`` of the group stored
    under the key, or None when it is not fragment ``j`` of any value."""
    mv = memoryview(v)
    if len(mv) >= _TRAILER.size:
        crc, tail = _TRAILER.unpack_from(mv, len(mv) - _TRAILER.size)
        if tail >> 56 == _EC_MARK:
            if (tail >> _N_BITS) & 0xFF != j + 1:
                return None
            return (2, tail & ((1 << _N_BITS) - 1), crc), mv[:len(mv) - _TRAILER.size]
    if len(mv) >= _LEN.size:
        return (1, _LEN.unpack_from(mv, len(mv) - _LEN.size)[0], 0), mv[:len(mv) - _LEN.size]
    return None


def expiry_at(t0: float, ttl_ms: int) -> float:
    """The ``time.monotonic()`` deadline of an object a daemon said, in an
    answer to a request sent at ``t0``, has ``ttl_ms`` left (0.0: none).
    Counted from the request, not the answer: never later than the daemon's."""
    return t0 + ttl_ms / 1000 if ttl_ms else 0.0


async def _cancel(fut: asyncio.Future[Any] | None) -> None:
    """Cancel a request asked alongside another (and wait for it). One that
    already failed has its exception retrieved: unread, asyncio logs it
    with a traceback ("Task exception was never retrieved") when the
    future is collected, as it did for a witness asked of a dead node."""
    if fut is None:
        return
    if not fut.done():
        fut.cancel()
        await asyncio.gather(fut, return_exceptions=True)
    elif not fut.cancelled():
        fut.exception()


async def _timed(fetch: Callable[[list[int]], Awaitable[_R]], expiries: list[float] | None) -> _R:
    """``fetch(ttls)``; with ``expiries``, the deadline of what it found
    appended (0.0: no TTL, or a miss), from the last TTL a daemon answered
    and the time the fetch started."""
    t0 = time.monotonic()
    ttls: list[int] = []
    got = await fetch(ttls)
    if expiries is not None:
        expiries.append(expiry_at(t0, ttls[-1]) if got is not None and ttls else 0.0)
    return got


def _soonest(ttls: Sequence[int]) -> int:
    """The shortest of the TTLs that are set (0: none is)."""
    return min((t for t in ttls if t), default=0)


def _judge_more(tag: _Tag | None, fetched: int, width: int) -> bool:
    """After K fragments of one value (``tag``) failed to decode to its
    CRC32C: whether positions are left unfetched (fetch them all and judge)."""
    return tag is not None and tag[0] == 2 and fetched < width


def _ec_could_agree(have: int, left: int, k: int) -> bool:
    """Whether an EC get is to ask on: no K fragments of one value yet
    (``have``: the most of any one), and the ``left`` positions not asked
    could still make K. Once they cannot (the key is absent from K of the
    positions asked, say), asking them only waits on them, a stalled
    daemon's whole deadline: the get is a miss at once."""
    return have < k and left > 0 and have + left >= k


def _fewest_left_out(have: Sequence[int], k: int) -> Iterator[tuple[int, ...]]:
    """The K-subsets of the positions ``have`` to decode from once they all
    together decoded wrong (a wrong fragment whose trailer agrees): those
    that leave out one position first, then two, and so on, each once. One
    wrong fragment among N is found within N tries. Every K-subset in
    lexicographic order, as before stop 41, took up to C(N-1, K-1) tries
    before the first without position 0: 330 for ec:8+4, 3,876 for ec:16+4.
    Every K-subset still comes in the end (leaving out N-K)."""
    pos = sorted(have)
    seen: set[tuple[int, ...]] = set()
    for r in range(1, len(pos) - k + 1):
        for out in itertools.combinations(pos, r):
            keep = tuple(j for j in pos if j not in out)[:k]
            if keep not in seen:
                seen.add(keep)
                yield keep


def _ec_agreeing(got: dict[int, tuple[_Tag, memoryview]], k: int) -> tuple[int, _Tag | None]:
    """How many fragments of one value ``got`` holds at most, and that
    value's tag once it has ``k`` (else None)."""
    count: dict[_Tag, int] = {}
    for tag, _ in got.values():
        count[tag] = count.get(tag, 0) + 1
    if not count:
        return 0, None
    tag = max(count, key=lambda t: (count[t], t[0]))
    return count[tag], (tag if count[tag] >= k else None)


@dataclass
class ClusterStats:
    name: str = "cluster"
    puts: int = 0
    put_skipped: int = 0  # already there
    put_failures: int = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0  # requests that failed (target down, timeout): counted as misses too
    fallbacks: int = 0  # gets served by a copy other than the first
    # Replica pools (kv_verify_copies): copies read that no other copy could
    # vouch for (none held the key, none answered in time, a daemon before
    # stop 39), served unless kv_require_witness made them misses
    # (unwitnessed_misses), and gets whose copy another copy's CRC32C
    # contradicted (a miss; both copies dropped).
    unwitnessed: int = 0
    unwitnessed_misses: int = 0
    disagreements: int = 0
    bytes_in: int = 0  # stored into the cluster
    bytes_out: int = 0  # loaded from the cluster
    deletes: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


def _ec_results(out: Sequence[bool], moved: Sequence[int], n: int) -> list[bool | None]:
    """The outcome of each key of an EC batch that stopped at key ``len(out)``:
    those before it as put (a key a daemon placed elsewhere, None), the rest None."""
    res: list[bool | None] = list(out) + [None] * (n - len(out))
    for i in moved:
        res[i] = None
    return res


def _batch_failure(exc: TierFSError, results: list[bool | None]) -> TierFSError:
    """``exc`` (one key's failure in a batch put) again, with each key's
    outcome in ``batch_results`` (True stored, False there already, None not
    stored) and its message saying how the rest of the batch went."""
    stored = sum(1 for r in results if r is True)
    there = sum(1 for r in results if r is False)
    failed = len(results) - stored - there
    out = type(exc)(f"{exc.message} (batch of {len(results)} keys: {stored} stored, {there} there already, "
                    f"{failed} not stored; the error's batch_results gives each key's outcome)")
    out.batch_results = results
    return out


def _nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else len(buf)


class KVCapabilities:
    """The KV capabilities of one client (docs/security-caps.md): fetched
    from meta (``GetKVCapability``) the first time a storage daemon asks for
    one, kept in the data client's capability cache, and renewed in the
    background once half their life is gone, so requests never wait for
    meta while the client is in use."""

    def __init__(self, meta: Any, data: DataClient, router: Router) -> None:
        self._meta = meta  # a callable returning the current MetaClient
        self.data = data
        self.router = router
        #: pool id -> (pool name, expiry ms, lifetime ms)
        self.held: dict[int, tuple[str, int, int]] = {}
        self._task: asyncio.Task[None] | None = None
        self._fetching: dict[int, asyncio.Task[None]] = {}

    async def fetch(self, name: str) -> None:
        import time

        r = await self._meta().get_kv_capability(name)
        if not r.capability:
            return  # meta mints none (security off)
        self.data.caps.add(r.capability)
        now = int(time.time() * 1000)
        self.held[int(r.pool_id)] = (name, int(r.expiry_ms), max(1, int(r.expiry_ms) - now))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._renew_loop(), name="kv-cap-renew")

    async def refresh(self, pool_id: int) -> None:
        """A fresh capability for pool ``pool_id`` (one fetch at a time per pool)."""
        t = self._fetching.get(pool_id)
        if t is None:
            name = self.held.get(pool_id, ("",))[0] or next(
                (n for n, r in self.router.kv_pools.items() if r.pool_id == pool_id), "")
            if not name:
                await self.router.refresh(force=True)
                name = next((n for n, r in self.router.kv_pools.items() if r.pool_id == pool_id), "")
            if not name:
                raise NotFoundError(f"no KV pool with id {pool_id}")
            t = self._fetching[pool_id] = asyncio.get_running_loop().create_task(self.fetch(name))
            t.add_done_callback(lambda _t: self._fetching.pop(pool_id, None))
        await asyncio.shield(t)

    async def _renew_loop(self) -> None:
        import time

        while self.held:
            now = int(time.time() * 1000)
            due = [(pid, name) for pid, (name, exp, life) in self.held.items() if exp - now < life // 2]
            for pid, name in due:
                try:
                    await self.fetch(name)
                except TierFSError:
                    # Meta unreachable or the pool gone: the next request
                    # that needs it asks again.
                    self.held.pop(pid, None)
            nxt = min((exp - life // 2 for _, exp, life in self.held.values()), default=now + 1000)
            await asyncio.sleep(min(30.0, max(0.2, (nxt - int(time.time() * 1000)) / 1000)))

    async def close(self) -> None:
        for t in [self._task, *self._fetching.values()]:
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._task = None


class ClusterTier:
    """A KV pool on the cluster (the bottom tier)."""

    name = "cluster"

    def __init__(self, router: Router, data: DataClient, pool: str, *, timeout: float,
                 min_bandwidth: int = 0, verify_copies: bool = True, require_witness: bool = False) -> None:
        self.router = router
        self.data = data
        self.pool = pool
        self.timeout = timeout
        #: Replica pools: compare the copy a get reads with another copy's
        #: stored CRC32C (ClientConfig.kv_verify_copies; docs/kv.md).
        self.verify_copies = verify_copies
        #: With verify_copies: a copy read that no other copy vouches for,
        #: and whose CRC32C this client does not know, is a miss
        #: (ClientConfig.kv_require_witness).
        self.require_witness = require_witness
        #: Replica pools: (pool id, xxh3_64 of the key) -> a CRC32C a value
        #: of the key is known to have (this client put it, or two copies
        #: agreed on it), most recent last. A copy read with that CRC32C
        #: (checked end to end on arrival) needs no witness.
        self._known: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        #: Bytes/s a request's payload is allowed (ClientConfig.kv_min_bandwidth).
        self.min_bandwidth = min_bandwidth
        self.counters = ClusterStats()
        self.on_evict = None  # the cluster evicts on its own; nothing is demoted below it
        self._disagree_quiet_until = 0.0
        self._disagree_unlogged = 0
        #: Each target's last failure here (it marked the target failed):
        #: what a put that skipped it and failed on the others says of it.
        self._last_failure: dict[int, TierFSError] = {}

    async def route(self) -> KVPoolRoute:
        return await self.router.kv_pool(self.pool)

    async def max_object_bytes(self) -> int:
        """An upper bound on the value a put to this pool can send: one
        frame per copy, K fragments of a frame each in an EC pool (the
        pool's per-target budgets may allow less; a put says so)."""
        route = await self.route()
        frame = int(self.data.limits.max_frame_bytes)
        if route.copies == 0:
            return min((1 << _N_BITS) - 1, route.k * (frame - _TRAILER.size))
        return frame

    async def _read_route(self, n: int) -> KVPoolRoute | None:
        """The route for a read of ``n`` keys; None when the client has no
        map of the pool yet and meta cannot be reached (no leader, all
        replicas down): the read is then ``n`` misses, since the store is a
        cache and an engine recomputes a miss, while an error would fail its
        request. A pool meta does not know still raises NotFoundError."""
        try:
            return await self.route()
        except (UnavailableError, TimeoutError_) as exc:
            if self.router.kv_pools.get(self.pool) is not None:
                raise
            self.counters.errors += 1
            self.counters.misses += n
            self.counters.extra["no_map"] = self.counters.extra.get("no_map", 0) + n
            log.warning("KV pool %r: no map yet and meta unreachable (%s): %d read(s) answered as misses",
                        self.pool, exc, n)
            return None

    def _batch_deadline(self, items: Sequence[tuple[Any, ...]], at: int) -> float:
        """The deadline of a batch whose items hold their buffer at ``at``."""
        return self._deadline(sum(_nbytes(it[at]) for it in items))

    def _deadline(self, nbytes: int) -> float:
        """A request's deadline: ``timeout`` plus its bytes at the slowest
        rate allowed, so a batch of hundreds of MiB is not a miss for its
        size alone, while a dead target still costs one ``timeout``-scale
        wait for a small request."""
        return self.timeout + (nbytes / self.min_bandwidth if self.min_bandwidth > 0 else 0.0)

    def _targets(self, route: KVPoolRoute, key: bytes) -> tuple[int, ...]:
        if not route.groups:
            raise UnavailableError(f"KV pool {route.name!r} has no placement groups yet (too few storage nodes?)")
        return route.groups[group_of(key, len(route.groups))]

    def _orders(self, route: KVPoolRoute, keys: Sequence[bytes]) -> list[list[tuple[int, int]]]:
        """The read order of each key, as (target, placement stamp) pairs;
        the order is computed once per group (a batch of a thousand keys
        touches a handful of groups)."""
        cache: dict[tuple[int, ...], list[int]] = {}
        out = []
        for k in keys:
            members, stamps = placement(route, k)
            o = cache.get(members)
            if o is None:
                o = cache[members] = self._read_order(members)
            out.append([(t, stamps[members.index(t)]) for t in o])
        return out

    def _read_pairs(self, route: KVPoolRoute, key: bytes) -> list[tuple[int, int]]:
        """One key's read order as (target, placement stamp) pairs."""
        members, stamps = placement(route, key)
        return [(t, stamps[members.index(t)]) for t in self._read_order(members)]

    def _read_order(self, targets: tuple[int, ...]) -> list[int]:
        """Usable copies first (in group order), then those the map has no
        verdict on; a target that failed a request within the router's
        ``failed_ttl`` or that the map calls down is not asked at all: its
        objects are misses at once (a cache), not one deadline each."""
        up = [t for t in targets if self.router.usable(t)]
        return up + [t for t in targets if t not in up and not self.router.failed_recently(t)
                     and not self.router.down(t)]

    def _ec_order(self, targets: tuple[int, ...]) -> list[int]:
        """An EC get's fragment positions in read order, by the rule of
        :meth:`_read_order`: usable first, then those the map has no verdict
        on; a target that failed within ``failed_ttl`` or that the map calls
        down is not asked. Before, every position was in the order (those
        last), and a get that found fewer than K fragments on the
        others (an absent key: the common case in a cache) asked a stalled
        one and waited out its whole ``kv_timeout``, key after key."""
        return [targets.index(t) for t in self._read_order(targets)]

    def _next_copy(self, order: list[tuple[int, int]], attempt: int) -> bool:
        """Whether a key of a batch read (or lookup) that missed at
        ``attempt`` has a copy left to ask; the copies after it on targets
        that failed since its order was made (a request of this very call
        timed out there) are dropped from ``order`` first. Before, the order
        made at the start held: a key that missed on a live copy asked next
        the stalled daemon other keys had just waited out, and the call
        waited a second whole ``kv_timeout`` on it."""
        order[attempt + 1:] = [p for p in order[attempt + 1:]
                               if not self.router.failed_recently(p[0]) and not self.router.down(p[0])]
        return attempt + 1 < len(order)

    def _failed(self, target: int, exc: TierFSError) -> None:
        self.counters.errors += 1
        # A refusal is an answer from a healthy daemon (a bad request, no
        # such pool, no room): not a reason to pass over the target. Until
        # stop 46 a NoSpaceError (a full pin quota) made every get and
        # contains of that target a miss for failed_target_ttl.
        # A target that let a request time out (stalled, overloaded) is
        # passed over four times as long, as the file client does: meta
        # calls a stalled daemon down only after its heartbeat timeout (10 s
        # by default), and with the plain ttl (5 s) a second kv_timeout was
        # waited out on it before that.
        if not isinstance(exc, (InvalidArgumentError, NotFoundError, NoSpaceError)):
            self.router.mark_failed(target, factor=4.0 if isinstance(exc, TimeoutError_) else 1.0)
            self._last_failure[target] = exc

    # ---- put ---------------------------------------------------------------------

    async def put(self, key: bytes, buf: memoryview, *, parent: bytes | None = None, overwrite: bool = False,
                  ttl_ms: int = 0, pin: int = 0, pin_ttl_ms: int = 0) -> bool:
        route = self.router.kv_pools.get(self.pool)
        if route is not None and route.copies == 1 and not pin_ttl_ms:
            # One copy: one request on the lightest path (no batch grouping).
            members, stamps = placement(route, key)
            t = members[0]
            flags = (KV_OVERWRITE if overwrite else 0) | ((pin & 3) << KV_PIN_SHIFT) | stamps[0] << KV_STAMP_SHIFT
            try:
                stored = await self.data.kv_put(t, route.pool_id, key, buf, flags=flags, ttl_ms=ttl_ms,
                                                timeout=self._deadline(len(buf)))
            except StaleVersionError:
                # The daemon's map moved the key: the batch path refreshes
                # the map and puts again.
                self._misplaced(1)
                await self.router.refresh(force=True)
                return (await self.batch_put([key], [buf], overwrite=overwrite, ttl_ms=ttl_ms, pin=pin,
                                             _tries=1))[0]
            except NotFoundError as exc:
                self.counters.put_failures += 1
                await self._raise_if_removed(route, exc)
                raise
            except (InvalidArgumentError, NoSpaceError):
                self.counters.put_failures += 1
                raise
            except TierFSError as exc:
                self._failed(t, exc)
                self.counters.put_failures += 1
                raise UnavailableError(f"KV put of {key!r} reached no target of pool {route.name!r}: {exc}") from None
            self.router.mark_ok(t)
            if stored:
                self.counters.puts += 1
                self.counters.bytes_in += len(buf)
            else:
                self.counters.put_skipped += 1
            return stored
        return (await self.batch_put([key], [buf], overwrite=overwrite, ttl_ms=ttl_ms, pin=pin,
                                     pin_ttl_ms=pin_ttl_ms))[0]

    async def batch_put(self, keys: Sequence[bytes], bufs: Sequence[memoryview], *, overwrite: bool = False,
                        ttl_ms: int = 0, pin: int = 0, pin_ttl_ms: int = 0, _tries: int = 0) -> list[bool]:
        """Store each object on its targets; True where stored, False where it
        was there already. UnavailableError when an object reached no target.

        A daemon whose map is newer than ours refuses a key that a change
        moved out of its group (StaleVersionError): those keys are put
        again with a refreshed map, up to ``_MAP_TRIES`` maps in all."""
        out = [False] * len(keys)
        todo = list(range(len(keys)))
        while True:
            route = await self.route()
            moved: list[int] = []
            sub_keys, sub_bufs = [keys[i] for i in todo], [bufs[i] for i in todo]
            try:
                if route.copies == 0:
                    res = await self._ec_put(route, sub_keys, sub_bufs, overwrite=overwrite, ttl_ms=ttl_ms,
                                             moved=moved)
                else:
                    res = await self._copies_put(route, sub_keys, sub_bufs, overwrite=overwrite, ttl_ms=ttl_ms,
                                                 pin=pin, pin_ttl_ms=pin_ttl_ms, moved=moved)
            except TierFSError as exc:
                if isinstance(exc, (NotFoundError, UnavailableError)):
                    await self._raise_if_removed(route, exc)
                if exc.batch_results is None or len(keys) == 1:
                    raise
                # The other keys of the batch went out too, and some were
                # stored (hard-pinned ones count against the pin quota):
                # say which, rather than look as if nothing changed.
                results: list[bool | None] = [out[i] for i in range(len(keys))]
                for i in todo:
                    results[i] = None
                for j, i in enumerate(todo):
                    results[i] = exc.batch_results[j]
                raise _batch_failure(exc, results) from None
            for j, i in enumerate(todo):
                out[i] = res[j]
            if not moved:
                return out
            todo = [todo[j] for j in moved]
            _tries += 1
            if _tries >= _MAP_TRIES:
                self.counters.put_failures += len(todo)
                raise UnavailableError(
                    f"KV put of {keys[todo[0]]!r} in pool {route.name!r}: the daemons kept placing it elsewhere "
                    f"than this client's map after {_tries} refreshes (map version {self.router.version})")
            self._misplaced(len(todo))
            await self.router.refresh(force=True)

    async def _raise_if_removed(self, route: KVPoolRoute, exc: TierFSError) -> None:
        """After a put refused by a daemon that has no such pool (it said
        "no KV pool 2 on target 1", by id): if meta's map no longer has the
        pool, say so by name. Otherwise (the daemon has not caught up yet,
        or meta cannot be asked) the caller raises ``exc``."""
        if "no KV pool" not in str(exc):
            return
        try:
            await self.router.refresh(force=True)
        except TierFSError:
            return
        now = self.router.kv_pools.get(self.pool)
        if now is None or now.pool_id != route.pool_id:
            raise NotFoundError(f"KV pool {self.pool!r} was removed (`tierfs kv pool ls` lists the pools); "
                                f"nothing was stored") from None

    def _misplaced(self, n: int) -> None:
        self.counters.extra["map_retries"] = self.counters.extra.get("map_retries", 0) + n

    async def _copies_put(self, route: KVPoolRoute, keys: Sequence[bytes], bufs: Sequence[memoryview], *,
                          overwrite: bool, ttl_ms: int, pin: int, pin_ttl_ms: int, moved: list[int]) -> list[bool]:
        """One pass of :meth:`batch_put` in a ``replica:N`` pool; the indexes
        of keys a daemon refused as misplaced go to ``moved``."""
        flags = (KV_OVERWRITE if overwrite else 0) | ((pin & 3) << KV_PIN_SHIFT)
        items: list[tuple[int, int, bytes, memoryview, int | None, int, int]] = []
        owner: list[int] = []
        from tierfs.net.protocol import crc32c

        # A plain put of an unpinned value skips a copy that failed a
        # request within failed_target_ttl too, as reads do: that copy then
        # lacks the key, like an evicted one (a get misses there and asks
        # the next). Not an overwrite, pin or delete: a copy they skip would
        # keep the previous value or pin, and only the map's word (down,
        # then the group stamp) fences it (docs/kv.md, "Deadlines").
        skip_failed = not overwrite and pin == 0 and pin_ttl_ms == 0
        skipped: dict[int, list[int]] = {}  # key index -> copies skipped as failed
        value_crcs: list[int] = []
        for i, (key, buf) in enumerate(zip(keys, bufs, strict=True)):
            crc = crc32c(buf)  # once per object, not once per copy
            value_crcs.append(crc)
            members, stamps = placement(route, key)
            if route.copies > 1:
                # Skipping a copy the map calls down: each copy gets the
                # group stamp, so that a daemon whose map has that copy back
                # (or replaced) refuses (docs/kv.md, "Writers that skip a copy").
                grouped = flags | KV_GROUP | max(stamps) << KV_STAMP_SHIFT
                ask = [t for t in members if not self.router.down(t)]
                if skip_failed:
                    # Every copy failed just now: ask them all, as before.
                    fresh = [t for t in ask if not self.router.failed_recently(t)]
                    if fresh and len(fresh) < len(ask):
                        skipped[i] = [t for t in ask if t not in fresh]
                        ask = fresh
                for t in ask:
                    items.append((t, route.pool_id, key, buf, crc, grouped, ttl_ms))
                    owner.append(i)
                continue
            for t, stamp in zip(members, stamps, strict=True):
                items.append((t, route.pool_id, key, buf, crc, flags | stamp << KV_STAMP_SHIFT, ttl_ms))
                owner.append(i)
        res = await self.data.kv_put_batch(items, timeout=self._batch_deadline(items, 3)) if pin_ttl_ms == 0 else \
            [await self._put_one(it, pin_ttl_ms) for it in items]
        stored = [False] * len(keys)
        reached = [False] * len(keys)
        first_error: list[TierFSError | None] = [None] * len(keys)
        missed: dict[int, list[int]] = {}
        errors: dict[int, list[tuple[int, TierFSError]]] = {}  # each copy's refusal
        misplaced: set[int] = set()
        for it, i, r in zip(items, owner, res, strict=True):
            if isinstance(r, StaleVersionError):
                misplaced.add(i)
                continue
            if isinstance(r, TierFSError):
                self._failed(it[0], r)
                if first_error[i] is None:
                    first_error[i] = r
                missed.setdefault(i, []).append(it[0])
                errors.setdefault(i, []).append((it[0], r))
                continue
            reached[i] = True
            stored[i] = stored[i] or r
            self.router.mark_ok(it[0])
        moved.extend(sorted(misplaced))
        stuck: set[int] = set()
        if overwrite:
            for i, targets in missed.items():
                if i not in misplaced and reached[i] and not await self._drop_copies(route, keys[i], targets):
                    stuck.add(i)
        results: list[bool | None] = [None] * len(keys)
        failure: TierFSError | None = None
        for i, buf in enumerate(bufs):
            if i in misplaced:
                continue
            if i in stuck:
                self.counters.put_failures += 1
                failure = failure or UnavailableError(
                    f"KV overwrite of {keys[i]!r} in pool {route.name!r} failed on target(s) {missed[i]}, and their "
                    f"copy of the previous value could not be deleted either: {first_error[i]}")
                continue
            if not reached[i]:
                self.counters.put_failures += 1
                answers = errors.get(i, [])
                if answers:
                    # A copy skipped as failed is one answer too (it may
                    # be the copy with room): named, with why it failed.
                    answers = answers + [
                        (t, UnavailableError("not asked: it failed a request within failed_target_ttl"
                                             + (f" ({self._last_failure[t]})" if t in self._last_failure else "")))
                        for t in skipped.get(i, [])]
                if failure is None and answers:
                    first = answers[0][1]
                    bad = next((e for _, e in answers if isinstance(e, InvalidArgumentError)), None)
                    if bad is not None:  # the request itself: no copy could ever take it
                        failure = InvalidArgumentError(bad.message)
                    elif isinstance(first, (NotFoundError, NoSpaceError)) and all(
                            type(e) is type(first) for _, e in answers):
                        failure = type(first)(first.message)
                    else:
                        # Every copy's answer, whatever the order they were
                        # sent in: one copy down and the other out of space
                        # said only "cannot connect" (the first sent) until
                        # stop 49.
                        failure = UnavailableError(
                            f"KV put of {keys[i]!r} reached no target of pool {route.name!r}: "
                            + "; ".join(f"target {t}: {e}" for t, e in answers))
                elif failure is None:
                    failure = UnavailableError(f"KV put of {keys[i]!r} reached no target of pool {route.name!r}")
                continue
            results[i] = stored[i]
            if self.verify_copies and route.copies > 1:
                self._vouch(route.pool_id, keys[i], value_crcs[i])  # our own value
            if stored[i]:
                self.counters.puts += 1
                self.counters.bytes_in += len(buf)
            else:
                self.counters.put_skipped += 1
        if failure is not None:
            failure.batch_results = results
            raise failure
        return stored

    async def _drop_copies(self, route: KVPoolRoute, key: bytes, targets: Sequence[int]) -> bool:
        """After an overwrite that some of ``key``'s targets failed (their
        copy may still hold the previous value, and a get may ask them
        first): delete it there. False when a delete failed too: the
        overwrite is then not acknowledged (it raises), since the old value
        may still be served."""
        ok = True
        for t in targets:
            try:
                await self.data.kv_delete(t, route.pool_id, key, timeout=self.timeout)
            except TierFSError as exc:
                self._failed(t, exc)
                ok = False
        return ok

    async def _put_one(self, it: tuple[int, int, bytes, memoryview, int | None, int, int],
                       pin_ttl_ms: int) -> bool | TierFSError:
        try:
            return await self.data.kv_put(it[0], it[1], it[2], it[3], crc=it[4], flags=it[5], ttl_ms=it[6],
                                          pin_ttl_ms=pin_ttl_ms, timeout=self._deadline(_nbytes(it[3])))
        except TierFSError as exc:
            return exc

    # ---- get ---------------------------------------------------------------------

    async def get_into(self, key: bytes, dest: memoryview, expiries: list[float] | None = None) -> int | None:
        """The object into ``dest``: its size, or None. ``expiries``, if
        given, gets its ``time.monotonic()`` deadline appended (0.0: no TTL,
        or a miss): how long a copy of it may be kept."""
        route = self.router.kv_pools.get(self.pool) or await self._read_route(1)
        if route is None:
            if expiries is not None:
                expiries.append(0.0)
            return None
        if route.copies == 0:
            return (await self._ec_get(route, [key], [dest], expiries))[0]
        # One key: one request on the lightest path (no batch grouping).
        ttls: list[int] | None = None if expiries is None else []
        timeout = self._deadline(_nbytes(dest))

        def fetch(t: int, stamp: int, crcs: list[int]) -> Awaitable[int | None]:
            return self.data.kv_get_into(t, route.pool_id, key, dest, timeout=timeout, ttls=ttls, since=stamp,
                                         crcs=crcs)

        n, t0 = await self._replica_get(route, key, fetch, int, invalid_raises=True)
        if expiries is not None:
            expiries.append(expiry_at(t0, ttls[-1]) if n is not None and ttls else 0.0)
        return n

    async def _replica_get(self, route: KVPoolRoute, key: bytes,
                           fetch: Callable[[int, int, list[int]], Awaitable[_R | None]],
                           size: Callable[[Any], int], *, invalid_raises: bool = False) -> tuple[_R | None, float]:
        """One key from a replica pool: each copy in read order (``fetch(target,
        stamp, crcs)``, None on a miss) until one is a hit the copy check
        does not refuse. Returns it (None: a miss) and when its request began.
        ``size(hit)``: its bytes. ``invalid_raises``: an InvalidArgumentError
        (the caller's buffer too small) is raised, not a miss."""
        pairs = self._read_pairs(route, key)
        known = self._known_crc(route, key)
        for attempt, (t, stamp) in enumerate(pairs):
            t0 = time.monotonic()
            witness = None if known is not None else self._ask_witness(route, key, pairs, attempt)
            crcs: list[int] = []
            try:
                got = await fetch(t, stamp, crcs)
            except TierFSError as exc:
                if invalid_raises and isinstance(exc, InvalidArgumentError):
                    self.counters.errors += 1
                    await _cancel(witness)
                    raise
                self._failed(t, exc)
                await _cancel(witness)
                continue
            if got is None:
                await _cancel(witness)
                continue
            if not await self._vouched(route, key, t, pairs, attempt, crcs[0], witness, t0, known):
                break  # a miss: the copies disagree, or none vouches and one must
            self.counters.hits += 1
            self.counters.bytes_out += size(got)
            if attempt:
                self.counters.fallbacks += 1
                self.router.mark_ok(t)
            return got, t0
        self.counters.misses += 1
        return None, 0.0

    async def batch_get_into(self, keys: Sequence[bytes], dests: Sequence[memoryview],
                             expiries: list[float] | None = None, *, misfit_miss: bool = False) -> list[int | None]:
        """Each object straight into its buffer: its size, or None (a miss).
        One request per key to its first usable copy, all keys of one server
        in one write; misses and errors retry on the next copy. ``expiries``:
        as for ``get_into``, one entry per key. An object larger than its
        buffer raises InvalidArgumentError, or with ``misfit_miss`` is that
        key's miss (engines: bytes under a page's key that are not a page)."""
        route = await self._read_route(len(keys))
        if route is None:
            if expiries is not None:
                expiries.extend([0.0] * len(keys))
            return [None] * len(keys)
        if route.copies == 0:
            return await self._ec_get(route, keys, dests, expiries, misfit_miss=misfit_miss)
        out: list[int | None] = [None] * len(keys)
        deadlines = [0.0] * len(keys)
        orders = self._orders(route, keys)
        todo = [i for i in range(len(keys)) if orders[i]]
        known = {i: c for i in todo if (c := self._known_crc(route, keys[i])) is not None}
        attempt = 0
        too_small: InvalidArgumentError | None = None
        while todo:
            items = [(orders[i][attempt][0], route.pool_id, keys[i], dests[i], orders[i][attempt][1])
                     for i in todo]
            ttls: list[int] = []
            crcs: list[int] = []
            t0 = time.monotonic()
            # Each key's next copy is asked for its stored CRC32C alongside
            # (one KV_EXISTS per target), the witness of the copy read.
            witness = self._ask_witnesses(route, keys, orders, [i for i in todo if i not in known], attempt)
            try:
                res = await self.data.kv_get_batch(items, timeout=self._batch_deadline(items, 3), ttls=ttls,
                                                   crcs=crcs)
            except BaseException:
                await _cancel(witness)
                raise
            hits = [i for i, r in zip(todo, res, strict=True) if isinstance(r, int)]
            judged = await self._judge_batch(route, keys, orders, attempt, hits,
                                             {i: c for i, c in zip(todo, crcs, strict=True)}, witness, t0, known)
            again: list[int] = []
            for i, r, ttl in zip(todo, res, ttls, strict=True):
                if isinstance(r, InvalidArgumentError):
                    # The caller's buffer is too small: every copy would say
                    # so, and the call raises (below), as for one key.
                    self.counters.errors += 1
                    if too_small is None:
                        # "KV object b'k' of 20480 bytes does not fit ...", not "KV object b'k': KV object of"
                        said = str(r.message).removeprefix("KV object")
                        too_small = InvalidArgumentError(f"KV object {keys[i]!r}{said}")
                    continue
                if isinstance(r, TierFSError):
                    self._failed(orders[i][attempt][0], r)
                elif r is not None and not judged.get(i, True):
                    continue  # a miss: the copies disagree, or none vouches and one must
                elif r is not None:
                    out[i] = r
                    deadlines[i] = expiry_at(t0, ttl)
                    self.router.mark_ok(orders[i][attempt][0])
                    self.counters.hits += 1
                    self.counters.bytes_out += r
                    if attempt:
                        self.counters.fallbacks += 1
                    continue
                if attempt + 1 < len(orders[i]):
                    again.append(i)
            # After the loop: every failure of this round marked first.
            todo = [i for i in again if self._next_copy(orders[i], attempt)]
            attempt += 1
        self.counters.misses += sum(1 for r in out if r is None)
        if too_small is not None and not misfit_miss:
            # Any key's: a sizing bug must not look like a miss. (Until stop
            # 44 a batch of two or more keys made it a miss, one key raised.)
            raise too_small
        if expiries is not None:
            expiries.extend(deadlines)
        return out

    # ---- witnesses: a copy read is compared with another copy's CRC32C -------------------

    def _ask_witness(self, route: KVPoolRoute, key: bytes, pairs: list[tuple[int, int]],
                     attempt: int) -> asyncio.Future[list[int | None] | None] | None:
        """Ask the copy after the one read at ``attempt`` (in read order) for
        ``key``'s stored CRC32C, alongside the read; None when there is none
        or copies are not verified."""
        if not self.verify_copies or attempt + 1 >= len(pairs):
            return None
        t, stamp = pairs[attempt + 1]
        return asyncio.ensure_future(self.data.kv_crcs(t, route.pool_id, [key], timeout=self.timeout, since=stamp))

    def _ask_witnesses(self, route: KVPoolRoute, keys: Sequence[bytes], orders: list[list[tuple[int, int]]],
                       todo: list[int], attempt: int) -> asyncio.Future[dict[int, int | None]] | None:
        """``_ask_witness`` for a batch: one KV_EXISTS (with CRCs) per
        (target, stamp) of the keys' next copies. The future's answer maps a
        key's index to its witness CRC32C (None: the witness holds no such
        object); keys whose witness did not answer, or is of a release that
        does not know the question, are left out."""
        if not self.verify_copies:
            return None
        by: dict[tuple[int, int], list[int]] = {}
        for i in todo:
            if attempt + 1 < len(orders[i]):
                by.setdefault(orders[i][attempt + 1], []).append(i)
        if not by:
            return None

        async def one(where: tuple[int, int], idx: list[int]) -> dict[int, int | None]:
            out: dict[int, int | None] = {}
            for s in range(0, len(idx), MAX_KV_EXISTS_KEYS):
                part = idx[s:s + MAX_KV_EXISTS_KEYS]
                try:
                    got = await self.data.kv_crcs(where[0], route.pool_id, [keys[i] for i in part],
                                                  timeout=self.timeout, since=where[1])
                except TierFSError:
                    # The rest go unwitnessed: a stalled witness costs one
                    # deadline, not one per MAX_KV_EXISTS_KEYS keys (a round
                    # that had itself waited one out then waited another).
                    break
                if got is not None:
                    out.update(zip(part, got, strict=True))
            return out

        async def all_of() -> dict[int, int | None]:
            out: dict[int, int | None] = {}
            for d in await asyncio.gather(*(one(w, idx) for w, idx in by.items())):
                out.update(d)
            return out

        return asyncio.ensure_future(all_of())

    async def _witness_answer(self, fut: asyncio.Future[_R] | None, t0: float) -> _R | None:
        """The witness's answer, waited for a little longer than the read
        took (at least 50 ms), never a stalled target's whole deadline:
        past that, None (the copy read goes unwitnessed)."""
        if fut is None:
            return None
        took = time.monotonic() - t0
        await asyncio.wait({fut}, timeout=min(self.timeout, max(0.05, 3 * took)))
        if not fut.done():
            await _cancel(fut)
            return None
        if fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()

    def _known_crc(self, route: KVPoolRoute, key: bytes) -> int | None:
        """A CRC32C a value of ``key`` is known to have (replica pools, the
        check on), or None."""
        if not self.verify_copies or route.copies < 2:
            return None
        return self._known.get((route.pool_id, xxhash.xxh3_64_intdigest(key)))

    def _vouch(self, pool_id: int, key: bytes, crc: int) -> None:
        k = (pool_id, xxhash.xxh3_64_intdigest(key))
        self._known[k] = crc
        self._known.move_to_end(k)
        if len(self._known) > _KNOWN_MAX:
            self._known.popitem(last=False)

    async def _vouched(self, route: KVPoolRoute, key: bytes, t: int, pairs: list[tuple[int, int]], attempt: int,
                       crc: int, witness: asyncio.Future[list[int | None] | None] | None, t0: float,
                       known: int | None = None) -> bool:
        """One replica get's verdict on the copy it read from ``t`` (stored
        CRC32C ``crc``): False when the witness holds the key with another
        CRC32C. A copy rewritten whole with other bytes and its own CRC32C
        (a misdirected or buggy write) passes every check of its own; only
        another copy can contradict it, and which of the two is right cannot
        be told, so the get is a miss and both copies are dropped (the next
        put stores the key afresh; a cache loses nothing it must keep).
        ``known``: a CRC32C the key's value is known to have (then no
        witness was asked alongside): a copy with it needs none; one with
        another (an overwrite since, or a forgery) asks one now."""
        if not self.verify_copies:
            return True
        if known is not None:
            if crc == known:
                self._vouch(route.pool_id, key, crc)
                return True
            witness, t0 = self._ask_witness(route, key, pairs, attempt), time.monotonic()
        got = await self._witness_answer(witness, t0)
        w = got[0] if got else None
        if w is None:
            self.counters.unwitnessed += 1
            if self.require_witness:
                self.counters.unwitnessed_misses += 1
                return False
            return True
        if w == crc:
            self._vouch(route.pool_id, key, crc)
            return True
        await self._disagree(route, key, [t, pairs[attempt + 1][0]], crc, w)
        return False

    async def _judge_batch(self, route: KVPoolRoute, keys: Sequence[bytes], orders: list[list[tuple[int, int]]],
                           attempt: int, hits: list[int], crcs: dict[int, int],
                           witness: asyncio.Future[dict[int, int | None]] | None, t0: float,
                           known: dict[int, int]) -> dict[int, bool]:
        """``_vouched`` for a batch round: each hit's verdict by key index.
        Hits of a known CRC32C were asked no witness alongside; those whose
        copy has another one ask theirs now."""
        if not self.verify_copies or not hits:
            await _cancel(witness)
            return {}
        got = await self._witness_answer(witness, t0) or {}
        changed = [i for i in hits if i in known and known[i] != crcs[i]]
        if changed:
            later = self._ask_witnesses(route, keys, orders, changed, attempt)
            extra: dict[int, int | None] | None = await self._witness_answer(later, time.monotonic())
            got.update(extra or {})
        out: dict[int, bool] = {}
        for i in hits:
            if i in known and known[i] == crcs[i]:
                self._vouch(route.pool_id, keys[i], crcs[i])
                continue
            w = got.get(i)
            if w is None:
                self.counters.unwitnessed += 1
                if self.require_witness:
                    self.counters.unwitnessed_misses += 1
                    out[i] = False
            elif w == crcs[i]:
                self._vouch(route.pool_id, keys[i], crcs[i])
            elif w != crcs[i]:
                out[i] = False
                await self._disagree(route, keys[i], [orders[i][attempt][0], orders[i][attempt + 1][0]],
                                     crcs[i], w)
        return out

    async def _disagree(self, route: KVPoolRoute, key: bytes, targets: list[int], crc: int, other: int) -> None:
        self.counters.disagreements += 1
        self._known.pop((route.pool_id, xxhash.xxh3_64_intdigest(key)), None)
        # One line per DISAGREE_LOG_INTERVAL at most, with a count of the
        # rest: concurrent plain puts of other bytes (docs/kv.md) flooded the
        # log with one WARNING per get (until stop 48). The counter has all.
        now = time.monotonic()
        if now >= self._disagree_quiet_until:
            more = (f" ({self._disagree_unlogged} more since the last such line)"
                    if self._disagree_unlogged else "")
            self._disagree_unlogged = 0
            self._disagree_quiet_until = now + DISAGREE_LOG_INTERVAL
            log.warning("KV pool %s: key %r: the copy on target %d has crc32c %#010x, the one on target %d %#010x: "
                        "a miss, and both copies dropped%s", route.name, key, targets[0], crc, targets[1], other,
                        more)
        else:
            self._disagree_unlogged += 1
        with contextlib.suppress(TierFSError):
            await self._drop_copies(route, key, targets)

    # ---- exists / delete / pin ---------------------------------------------------------

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key: one KV_EXISTS per target involved (per copy
        round), not one request per key."""
        route = await self._read_route(len(keys))
        out = [False] * len(keys)
        if route is None:
            return out
        orders = self._orders(route, keys)
        if self.require_witness and self.verify_copies and route.copies >= 2:
            return await self._contains_witnessed(route, keys, orders)
        todo = [i for i in range(len(keys)) if orders[i]]
        attempt = 0
        while todo:
            # One KV_EXISTS per (target, placement stamp): keys of one group
            # share their stamps unless they came to it at different times.
            by_target: dict[tuple[int, int], list[int]] = {}
            for i in todo:
                by_target.setdefault(orders[i][attempt], []).append(i)
            targets = list(by_target)
            answers = await asyncio.gather(*(self._exists_on(t, route.pool_id, [keys[i] for i in by_target[t]])
                                             for t in targets))
            again: list[int] = []
            for t, got in zip(targets, answers, strict=True):
                for i, hit in zip(by_target[t], got, strict=True):
                    if hit:
                        out[i] = True
                    elif self._next_copy(orders[i], attempt):
                        again.append(i)
            todo = sorted(again)
            attempt += 1
        return out

    async def _contains_witnessed(self, route: KVPoolRoute, keys: Sequence[bytes],
                                  orders: list[list[tuple[int, int]]]) -> list[bool]:
        """``contains`` for a client with ``kv_require_witness``: present
        only where a get would hit, so that an engine is not told of blocks
        its load then misses. Every copy is asked for its stored CRC32C (one
        KV_EXISTS with KV_WITH_CRC per target and stamp); a get reads the
        first copy that holds the key and serves it only if the copy after
        it has the same CRC32C, or the client knows the value has it (it put
        it, or two copies agreed). A copy that did not answer, or whose
        daemon is of a release before stop 39 (it cannot say its CRC32C),
        counts as absent."""
        by: dict[tuple[int, int], list[int]] = {}
        for i, order in enumerate(orders):
            for where in order:
                by.setdefault(where, []).append(i)
        places = list(by)
        answers = await asyncio.gather(*(self._crcs_on(w, route.pool_id, [keys[i] for i in by[w]]) for w in places))
        crcs: dict[tuple[int, tuple[int, int]], int | None] = {}
        for w, got in zip(places, answers, strict=True):
            for i, c in zip(by[w], got, strict=True):
                crcs[(i, w)] = c
        out: list[bool] = []
        for i, order in enumerate(orders):
            seen = [crcs.get((i, w)) for w in order]
            first = next((a for a, c in enumerate(seen) if c is not None), None)
            if first is None:
                out.append(False)
                continue
            c = seen[first]
            out.append(c == self._known_crc(route, keys[i]) or (first + 1 < len(seen) and seen[first + 1] == c))
        return out

    async def _crcs_on(self, where: tuple[int, int], pool_id: int, keys: list[bytes]) -> list[int | None]:
        """Each key's stored CRC32C on one target (None: absent, or not
        known: no answer, or a daemon too old to give it)."""
        t, stamp = where
        out: list[int | None] = []
        for s in range(0, len(keys), MAX_KV_EXISTS_KEYS):
            part = keys[s:s + MAX_KV_EXISTS_KEYS]
            try:
                got = await self.data.kv_crcs(t, pool_id, part, timeout=self.timeout, since=stamp)
            except TierFSError as exc:
                self._failed(t, exc)
                break  # the rest are not known either: one deadline per target, not one per part
            out += got if got is not None else [None] * len(part)
        return out + [None] * (len(keys) - len(out))

    async def _exists_on(self, where: tuple[int, int], pool_id: int, keys: list[bytes]) -> list[bool]:
        t, stamp = where
        out: list[bool] = []
        for s in range(0, len(keys), MAX_KV_EXISTS_KEYS):
            part = keys[s:s + MAX_KV_EXISTS_KEYS]
            try:
                out += await self.data.kv_exists(t, pool_id, part, timeout=self.timeout, since=stamp)
            except TierFSError as exc:
                # The rest are absent too, unasked: a stalled target costs
                # one deadline, not one per MAX_KV_EXISTS_KEYS keys.
                self._failed(t, exc)
                break
        return out + [False] * (len(keys) - len(out))

    async def delete(self, key: bytes) -> bool:
        """Delete every copy (or fragment) a get could still be served;
        True if any held the key. A copy on a target the map calls down is
        skipped in pools whose puts skip it too (its copies are stale when
        it returns: placement stamps). UnavailableError when a copy that
        could still be served was not reached: the delete is then not
        acknowledged (in an EC pool, when K fragments may be left). A
        daemon whose newer map places the key elsewhere refuses: the map is
        refreshed and the delete tried again (``_MAP_TRIES`` maps)."""
        route, existed, failed, error = await self._each_copy(
            key, "delete", lambda r, t, stamp: self.data.kv_delete(t, r.pool_id, key, timeout=self.timeout,
                                                                   since=stamp, group=r.copies != 1),
            grouped=True)
        if failed and (route.copies > 0 or len(failed) >= route.k):
            raise UnavailableError(
                f"KV delete of {key!r} in pool {route.name!r} did not reach target(s) {failed}, and the key "
                f"may still be served from there: {error}")
        self.counters.deletes += existed > 0
        return existed > 0

    async def _each_copy(self, key: bytes, what: str, call: Callable[[KVPoolRoute, int, int], Awaitable[bool]],
                         reraise: tuple[type[TierFSError], ...] = (), grouped: bool = False,
                         ) -> tuple[KVPoolRoute, int, list[int], TierFSError | None]:
        """``call(route, target, stamp)`` on every copy (or fragment) of
        ``key`` a get could be served from, skipping a target the map calls
        down in pools whose puts skip it too. Returns the route, how many
        calls answered True, the targets that failed and the first error. A
        daemon whose newer map places the key elsewhere refuses
        (StaleVersionError): the map is refreshed and every copy tried again
        (``_MAP_TRIES`` maps). ``grouped``: outside ``replica:1`` pools,
        every call gets the group stamp (the latest of the group's
        positions: docs/kv.md, "Writers that skip a copy") instead of its
        copy's own."""
        for _ in range(_MAP_TRIES):
            route = await self.route()
            members, stamps = placement(route, key)
            if grouped and route.copies != 1:
                stamps = (max(stamps),) * len(stamps)
            hits, misplaced = 0, False
            failed: list[int] = []
            error: TierFSError | None = None
            for t, stamp in zip(members, stamps, strict=True):
                if route.copies != 1 and self.router.down(t):
                    continue
                try:
                    hits += bool(await call(route, t, stamp))
                except StaleVersionError:
                    misplaced = True
                    break
                except reraise:
                    raise
                except TierFSError as exc:
                    self._failed(t, exc)
                    failed.append(t)
                    error = error or exc
            if not misplaced:
                return route, hits, failed, error
            self._misplaced(1)
            await self.router.refresh(force=True)
        raise UnavailableError(f"KV {what} of {key!r} in pool {self.pool!r}: the daemons kept placing it elsewhere "
                               f"than this client's map after {_MAP_TRIES} refreshes (map version "
                               f"{self.router.version})")

    async def pin(self, key: bytes, kind: int, ttl_ms: int = 0) -> bool:
        """Pin (kind 1 soft, 2 hard) or unpin (0) every copy a get could be
        served from; True if any held the key. Copies on targets the map
        calls down are skipped, as by a delete. UnavailableError, rather than
        an answer, when it is not known to have taken: a pin that reached no
        copy holding the key while another failed (or, in an EC pool, pinned
        fewer than K fragments), an unpin that missed a copy. A daemon whose
        newer map places the key elsewhere refuses: the map is refreshed and
        the pin tried again (``_MAP_TRIES`` maps)."""
        what = "unpin" if kind == 0 else "pin"

        def call(r: KVPoolRoute, t: int, stamp: int) -> Awaitable[bool]:
            # Outside replica:1 the group stamp too: a pin that skips a copy
            # its map calls down is refused where the daemon's map says that
            # copy came back since (as for puts and deletes).
            group = max(placement(r, key)[1]) if r.copies != 1 else 0
            return self.data.kv_pin(t, r.pool_id, key, kind, ttl_ms, timeout=self.timeout, since=stamp, group=group)

        route, held, failed, error = await self._each_copy(key, what, call, reraise=(NoSpaceError,))
        enough = held >= (1 if route.copies else route.k)
        if failed and (kind == 0 or not enough):
            raise UnavailableError(
                f"KV {what} of {key!r} in pool {route.name!r} did not reach target(s) {failed}, so it is not "
                f"known to have taken ({held} reached held the key): {error}")
        return held > 0

    async def get(self, key: bytes, expiries: list[float] | None = None) -> bytes | None:
        """The value as ``bytes`` (any size), or None. ``expiries``: as for
        ``get_into``."""
        return await _timed(lambda ttls: self._get_bytes(key, ttls), expiries)

    async def _get_bytes(self, key: bytes, ttls: list[int]) -> bytes | None:
        route = await self._read_route(1)
        if route is None:
            return None
        if route.copies == 0:
            return await self._ec_get_bytes(route, key, ttls)

        def fetch(t: int, stamp: int, crcs: list[int]) -> Awaitable[bytes | None]:
            return self.data.kv_get(t, route.pool_id, key, timeout=self.timeout, ttls=ttls, since=stamp, crcs=crcs)

        return (await self._replica_get(route, key, fetch, len))[0]

    async def _ec_get_bytes(self, route: KVPoolRoute, key: bytes, ttls: list[int]) -> bytes | None:
        targets, stamps = placement(route, key)
        order = self._ec_order(targets)
        frag_ttl: dict[int, int] = {}

        async def one(j: int) -> tuple[int, bytes | None]:
            got: list[int] = []
            try:
                v = await self.data.kv_get(targets[j], route.pool_id, key, timeout=self.timeout, ttls=got,
                                           since=stamps[j])
            except TierFSError as exc:
                self._failed(targets[j], exc)
                return j, None
            frag_ttl[j] = got[-1]
            return j, v

        got: dict[int, tuple[_Tag, memoryview]] = {}
        pos = 0
        have, tag = 0, None
        while tag is None and _ec_could_agree(have, len(order) - pos, route.k):
            want = order[pos:pos + route.k - have]
            pos += len(want)
            for j, v in await asyncio.gather(*(one(j) for j in want)):
                if v is not None and (frag := _ec_fragment(v, j)) is not None:
                    got[j] = frag
            have, tag = _ec_agreeing(got, route.k)
        value = self._ec_decode(route, got, tag)
        if value is None and _judge_more(tag, pos, len(order)):
            # A wrong fragment among the K: the others too, then judged.
            for j, v in await asyncio.gather(*(one(j) for j in order[pos:])):
                if v is not None and (frag := _ec_fragment(v, j)) is not None:
                    got[j] = frag
            value = self._ec_decode(route, got, tag)
        if value is None:
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        self.counters.bytes_out += len(value)
        ttls.append(_soonest([frag_ttl[j] for j, (t, _) in got.items() if t == tag]))
        return bytes(value)

    def _ec_decode(self, route: KVPoolRoute, got: dict[int, tuple[_Tag, memoryview]],
                   tag: _Tag | None) -> memoryview | None:
        """The value whose ``tag`` K fragments of ``got`` carry, decoded and
        checked against its CRC32C (fragments of the first format carry
        none), or None."""
        if tag is None:
            return None
        fmt, size, crc = tag
        if not size:
            return memoryview(b"")
        codec = self._codec(route)
        f = codec.frag_size(size)
        frags = {j: v for j, (t, v) in got.items() if t == tag}
        if any(len(v) > f for v in frags.values()):
            return None  # not fragments of a value of this size: a miss
        value = memoryview(codec.decode(frags, f))[:size]
        if fmt == 2:
            from tierfs.net.protocol import crc32c

            if crc32c(value) != crc:
                # A fragment whose trailer agrees but whose bytes are wrong
                # (a misdirected or buggy write): any K of the others that
                # decode to the value's CRC32C, else a miss.
                self.counters.errors += 1
                for keep in _fewest_left_out(list(frags), route.k):
                    value = memoryview(codec.decode({j: frags[j] for j in keep}, f))[:size]
                    if crc32c(value) == crc:
                        self.counters.extra["wrong_fragments"] = self.counters.extra.get("wrong_fragments", 0) + 1
                        return value
                return None
        return value

    async def size_of(self, key: bytes, expiries: list[float] | None = None) -> int | None:
        """The object's size without its bytes (KV_GET with KV_SIZE_ONLY on a
        replica), or None. An EC pool keeps the size in each fragment's
        trailer: one fragment is fetched to read it. ``expiries``: as for
        ``get_into`` (for EC, the fragment's)."""
        return await _timed(lambda ttls: self._size_of(key, ttls), expiries)

    async def _size_of(self, key: bytes, ttls: list[int]) -> int | None:
        route = await self._read_route(1)
        if route is None:
            return None
        if route.copies == 0:
            return await self._ec_size(route, key, ttls)
        for t, stamp in self._read_pairs(route, key):
            try:
                n = await self.data.kv_size(t, route.pool_id, key, timeout=self.timeout, ttls=ttls, since=stamp)
            except TierFSError as exc:
                self._failed(t, exc)
                continue
            if n is not None:
                return n
        return None

    async def _ec_size(self, route: KVPoolRoute, key: bytes, ttls: list[int]) -> int | None:
        targets, _ = placement(route, key)
        for t, stamp in self._read_pairs(route, key):
            try:
                frag = await self.data.kv_get(t, route.pool_id, key, timeout=self.timeout, ttls=ttls, since=stamp)
            except TierFSError as exc:
                self._failed(t, exc)
                continue
            if frag is not None and (got := _ec_fragment(frag, targets.index(t))) is not None:
                return int(got[0][1])
        return None

    def stats(self) -> ClusterStats:
        return self.counters

    async def close(self) -> None:
        pass

    # ---- erasure-coded pools -----------------------------------------------------------

    def _codec(self, route: KVPoolRoute) -> Any:
        from tierfs.client.codec import Codec

        key = (route.k, route.m)
        c = _CODECS.get(key)
        if c is None:
            c = _CODECS[key] = Codec("ec", route.k, route.m)
        return c

    async def _ec_put(self, route: KVPoolRoute, keys: Sequence[bytes], bufs: Sequence[memoryview], *,
                      overwrite: bool, ttl_ms: int, moved: list[int]) -> list[bool]:
        """One pass of :meth:`batch_put` in an EC pool; the indexes of keys
        a daemon refused as misplaced go to ``moved``."""
        from tierfs.net.protocol import crc32c

        codec = self._codec(route)
        flags = KV_OVERWRITE if overwrite else 0
        out: list[bool] = []
        for idx, (key, buf) in enumerate(zip(keys, bufs, strict=True)):
            n = len(buf)
            if n >> _N_BITS:
                raise InvalidArgumentError(f"KV object of {n} bytes is too large for an EC pool")
            frame = int(self.data.limits.max_frame_bytes)
            if -(-n // route.k) + _TRAILER.size > frame:
                # Refused before the encode and the sends: each fragment
                # travels in one frame (max_object_bytes).
                raise InvalidArgumentError(
                    f"KV object of {n} bytes is too large for pool {route.name!r}: its {route.k} data "
                    f"fragments would pass the frame limit of {frame} bytes each (at most "
                    f"{route.k * (frame - _TRAILER.size)} bytes)")
            crc = crc32c(buf)
            if n:
                enc = bytearray(codec.encode_size(n))
                enc[:n] = buf
                frags: list[Any] = codec.encode(memoryview(enc), n, n)
            else:
                frags = [b""] * (route.k + route.m)
            targets, stamps = placement(route, key)
            grouped = flags | KV_GROUP | max(stamps) << KV_STAMP_SHIFT  # as in _copies_put
            items = []
            for j, frag in enumerate(frags):
                if self.router.down(targets[j]):
                    continue
                body = bytearray(len(frag) + _TRAILER.size)
                body[:len(frag)] = frag
                _TRAILER.pack_into(body, len(frag), crc, _ec_tail(n, j))
                items.append((targets[j], route.pool_id, key, memoryview(body), None, grouped, ttl_ms))
            res = await self.data.kv_put_batch(items, timeout=self._batch_deadline(items, 3))
            if any(isinstance(r, StaleVersionError) for r in res):
                moved.append(idx)
                out.append(False)
                continue
            ok = [r for r in res if not isinstance(r, TierFSError)]
            failed = []
            for it, r in zip(items, res, strict=True):
                if isinstance(r, TierFSError):
                    self._failed(it[0], r)
                    failed.append(it[0])
            # K+1 fragments, as the file path asks: one more failure survivable.
            # Only when the map already calls targets down is K enough (a
            # cache keeps taking puts with a node out).
            need = max(route.k, min(route.k + 1, route.k + route.m - (len(frags) - len(items))))
            if len(ok) < need:
                self.counters.put_failures += 1
                errs = [r for r in res if isinstance(r, TierFSError)]
                # Every daemon refused it for the same lasting reason (a
                # fragment larger than the pool's per-target budget, the pin
                # quota): that error, not "unavailable", which invites retries.
                lasting = (errs and isinstance(errs[0], (InvalidArgumentError, NoSpaceError))
                           and all(type(e) is type(errs[0]) for e in errs))
                cls = type(errs[0]) if lasting else UnavailableError
                exc = cls(f"KV put of {key!r} stored {len(ok)} of {route.k}+{route.m} fragments in pool "
                          f"{route.name!r}; at least {need} are needed" + (f" ({errs[0]})" if errs else ""))
                exc.batch_results = _ec_results(out, moved, len(keys))
                raise exc
            if overwrite and failed and not await self._drop_copies(route, key, failed):
                # K fragments of the previous value could still agree there.
                self.counters.put_failures += 1
                exc = UnavailableError(f"KV overwrite of {key!r} in pool {route.name!r} failed on target(s) "
                                       f"{failed}, and their fragment of the previous value could not be deleted")
                exc.batch_results = _ec_results(out, moved, len(keys))
                raise exc
            stored = any(ok)
            out.append(stored)
            if stored:
                self.counters.puts += 1
                self.counters.bytes_in += n
            else:
                self.counters.put_skipped += 1
        return out

    async def _ec_get(self, route: KVPoolRoute, keys: Sequence[bytes], dests: Sequence[memoryview],
                      expiries: list[float] | None = None, *, misfit_miss: bool = False) -> list[int | None]:
        out: list[int | None] = []
        for key, dest in zip(keys, dests, strict=True):
            try:
                out.append(await self._ec_get_one(route, key, dest, expiries))
            except InvalidArgumentError:
                if not misfit_miss:
                    raise
                self.counters.errors += 1
                out.append(None)
                if expiries is not None:
                    expiries.append(0.0)
        return out

    async def _ec_get_one(self, route: KVPoolRoute, key: bytes, dest: memoryview,
                          expiries: list[float] | None) -> int | None:
        """One key of :meth:`_ec_get`: its size, or None (a miss), with its
        expiry appended to ``expiries``."""
        frag_ttl: dict[int, int] = {}
        t0 = time.monotonic()
        targets, stamps = placement(route, key)
        cap = -(-len(dest) // route.k) + _TRAILER.size
        bufs = [memoryview(bytearray(cap)) for _ in targets]
        order = self._ec_order(targets)
        got: dict[int, tuple[_Tag, memoryview]] = {}
        pos = 0
        too_small = False
        have, tag = 0, None
        while tag is None and _ec_could_agree(have, len(order) - pos, route.k):
            # Fragments of different values of the key (an overwrite
            # that skipped a holder, a put that failed half-way) do not
            # count together: ask on until K of one value answered.
            want = order[pos:pos + route.k - have]
            pos += len(want)
            reqs = [(targets[j], route.pool_id, key, bufs[j], stamps[j]) for j in want]
            ttls: list[int] = []
            res = await self.data.kv_get_batch(reqs, timeout=self._batch_deadline(reqs, 3), ttls=ttls)
            for j, r, ttl in zip(want, res, ttls, strict=True):
                frag_ttl[j] = ttl
                if isinstance(r, InvalidArgumentError):
                    too_small = True
                elif isinstance(r, TierFSError):
                    self._failed(targets[j], r)
                elif r is not None and (frag := _ec_fragment(bufs[j][:r], j)) is not None:
                    got[j] = frag
            have, tag = _ec_agreeing(got, route.k)
        if too_small and tag is None:
            raise InvalidArgumentError(f"KV object {key!r} does not fit the {len(dest)}-byte buffer")
        value = self._ec_decode(route, got, tag)
        if value is None and _judge_more(tag, pos, len(order)):
            # A wrong fragment among the K: the others too, then judged.
            rest = order[pos:]
            reqs = [(targets[j], route.pool_id, key, bufs[j], stamps[j]) for j in rest]
            ttls = []
            res = await self.data.kv_get_batch(reqs, timeout=self._batch_deadline(reqs, 3), ttls=ttls)
            for j, r, ttl in zip(rest, res, ttls, strict=True):
                frag_ttl[j] = ttl
                if isinstance(r, TierFSError):
                    self._failed(targets[j], r)
                elif r is not None and (frag := _ec_fragment(bufs[j][:r], j)) is not None:
                    got[j] = frag
            value = self._ec_decode(route, got, tag)
        if value is None:
            # Too few fragments of any one value, or a decode that does
            # not match the value's CRC: a miss, never mixed bytes.
            self.counters.misses += 1
            if expiries is not None:
                expiries.append(0.0)
            return None
        size = len(value)
        if size > len(dest):
            raise InvalidArgumentError(f"KV object {key!r} of {size} bytes does not fit the {len(dest)}-byte "
                                       f"buffer")
        dest[:size] = value
        self.counters.hits += 1
        self.counters.bytes_out += size
        if expiries is not None:
            expiries.append(expiry_at(t0, _soonest([frag_ttl[j] for j, (t, _) in got.items() if t == tag])))
        return size


_CODECS: dict[tuple[int, int], Any] = {}

#: Deadlines of hits with a TTL a ClusterKVTier remembers for ``expiry_of``,
#: the oldest dropped first. A TierStack asks right after the hit, with no
#: await between, so the one it asks for is always there.
_EXPIRIES_KEPT = 4096


class ClusterKVTier(Tier):
    """A cluster KV pool behind the :class:`~tierfs.kv.tiers.Tier` interface.

    ``meta``: the meta addresses; ``pool``: the pool's name; ``config`` /
    ``options``: the :class:`~tierfs.client.AsyncClient` it opens.
    ``capacity``: the pool's total budget when the caller knows it; 0 takes
    it from the pool's definition at first use (the per-target budget,
    memory + disk, times the number of distinct targets in its groups).

    The tier may be built outside any event loop and used from several in
    turn (a test per ``asyncio.run``): its client is made lazily in the
    running loop, and a new one when the loop changes. The client goes with
    its loop: a keeper task, cancelled when the loop shuts down (as
    ``asyncio.run`` does) or by :meth:`close`, closes it there, since its
    connections cannot be closed from another loop.

    Counts: ``hits``, ``misses``, ``puts`` and bytes are this client's own,
    exact. ``used``, ``objects`` and ``evictions`` belong to the daemons (other
    clients share the pool, and each target evicts on its own); the client
    only sees what they last reported to meta, fetched by
    :meth:`refresh_usage` (at first use, then when asked). They lag, so
    ``exact_counts`` is False: the conformance suite checks only that they
    are plausible.
    """

    exact_counts = False

    def __init__(self, meta: Sequence[str] | str, pool: str, *, capacity: int = 0,
                 config: ClientConfig | None = None, name: str = "cluster", **options: Any) -> None:
        super().__init__(name)
        self.meta = meta
        self.pool = pool
        self.capacity = capacity
        self._fixed_capacity = capacity > 0
        self._config = config
        self._options = options
        #: one target's budget for the pool (memory + disk), 0 until known
        self.target_budget = 0
        self.counters = ClusterStats(name=name)
        self._usage = (0, 0, 0)  # objects, used, evictions, as last reported
        self._expiry: dict[bytes, float] = {}  # key -> deadline, from the last hits with a TTL
        self._client: AsyncClient | None = None
        self._tier: ClusterTier | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._closed = False

    async def _inner(self) -> ClusterTier:
        if self._closed:
            raise RuntimeError(f"tier {self.name} is closed")
        loop = asyncio.get_running_loop()
        if self._tier is not None and self._loop is loop:
            return self._tier
        from tierfs.client.client import AsyncClient

        # A previous loop's client was closed by its keeper when that loop ended.
        client = AsyncClient(self.meta, config=self._config, **self._options)
        _, data, router = client._parts()
        tier = ClusterTier(router, data, self.pool, timeout=client.config.kv_timeout,
                           min_bandwidth=client.config.kv_min_bandwidth,
                           verify_copies=client.config.kv_verify_copies,
                           require_witness=client.config.kv_require_witness)
        tier.counters = self.counters  # one set of counts across loops
        self._client, self._tier, self._loop = client, tier, loop
        self._keeper = loop.create_task(self._keep(client), name=f"kv tier {self.name}: client keeper")
        if not self.target_budget:
            await self.refresh_usage()
        return tier

    @staticmethod
    async def _keep(client: AsyncClient) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await client.close()

    async def refresh_usage(self) -> None:
        """Fetch the pool's definition (capacity) and the usage its targets
        last reported to meta (``used``, ``objects``, ``evictions``)."""
        await self._inner()
        assert self._client is not None
        r = await self._client.meta.list_kv_pools()
        p = next((p for p in r.pools if p.name == self.pool), None)
        if p is None:
            raise NotFoundError(f"no KV pool named {self.pool!r}")
        self.target_budget = p.target_memory + p.target_disk
        if not self._fixed_capacity:
            self.capacity = self.target_budget * len({t for g in p.groups for t in g.target_ids})
        us = [u for u in r.usage if u.pool_id == p.pool_id]
        # A pool with a disk budget keeps every object on disk (memory caches
        # the hot ones); a memory-only pool, in memory.
        used = sum(u.disk_used if p.target_disk else u.memory_used for u in us)
        self._usage = (sum(u.objects for u in us), used, sum(u.evictions for u in us))

    async def put(self, key: bytes, buf: memoryview, *, parent: bytes | None = None, expires: float = 0.0) -> bool:
        src = source_view(buf)
        key = check_key(key)
        tier = await self._inner()
        route = await tier.route()
        # An object past one target's budget (a fragment of it, in an EC
        # pool) can never be stored: not stored, as with any tier.
        if self.target_budget and -(-len(src) // (route.k or 1)) > self.target_budget:
            return False
        ttl_ms = 0
        if expires:
            # what is left, rounded down, counted from just before the send
            ttl_ms = int((expires - time.monotonic()) * 1000)
            if ttl_ms <= 0:
                return False
        try:
            return await tier.put(key, src, parent=parent, ttl_ms=ttl_ms)
        except InvalidArgumentError as exc:
            # The daemon's refusal of an object its watermark can never admit.
            if "can never fit" in str(exc):
                return False
            raise

    async def get_into(self, key: bytes, dest: memoryview) -> int | None:
        d = dest_view(dest)
        key = check_key(key)
        tier = await self._inner()
        expiries: list[float] = []
        try:
            n = await tier.get_into(key, d, expiries)
        except InvalidArgumentError:
            size = await tier.size_of(key)
            if size is not None and size > len(d):
                raise InvalidArgumentError(
                    f"destination of {len(d)} bytes is smaller than object {key!r} of {size} bytes") from None
            raise
        exp = self._expiry
        if expiries and expiries[0]:
            exp.pop(key, None)
            exp[key] = expiries[0]
            if len(exp) > _EXPIRIES_KEPT:
                del exp[next(iter(exp))]
        elif exp:
            exp.pop(key, None)
        return n

    def expiry_of(self, key: bytes) -> float:
        """The deadline the daemons gave with this client's last hit on
        ``key`` (0.0: none, or not known): what a TierStack promotes it with."""
        return self._expiry.get(key, 0.0)

    async def size_of(self, key: bytes) -> int | None:
        key = check_key(key)
        return await (await self._inner()).size_of(key)

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        ks = [check_key(k) for k in keys]
        if not ks:
            return []
        return await (await self._inner()).contains(ks)

    async def delete(self, key: bytes) -> bool:
        key = check_key(key)
        self._expiry.pop(key, None)
        return await (await self._inner()).delete(key)

    def stats(self) -> TierStats:
        c = self.counters
        objects, used, evictions = self._usage
        return TierStats(self.name, self.capacity, used, objects, c.hits, c.misses, evictions, c.puts,
                         c.bytes_in, c.bytes_out, self.promotions, self.demotions, self.corrupt)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        keeper, self._keeper = self._keeper, None
        self._client = self._tier = None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if keeper is not None and not keeper.done() and self._loop is running:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        self._loop = None
