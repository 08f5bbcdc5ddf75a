"""The model-based checker of the KV store: seeded random walks of puts,
overwrites, deletes and gets on KV pools of every redundancy, against a
real cluster, with storage daemons killed, restarted, stopped (SIGSTOP: a
gray failure), resumed, and their object files corrupted on disk, EC
fragments and replica copies forged (rewritten with other bytes: under the
value's trailer, or with their own CRC32C), and the cluster grown by a
daemon now and then (the pools re-plan: keys move).

The KV store is a cache: any get may miss. What it must never do is
return wrong bytes. The model holds, for each key, the *contents* it may
serve (content ``c`` of a key is a deterministic byte string; most contents
of one key have the same length, so that a length cannot tell two of them
apart):

* a put without ``overwrite`` always writes the key's current content (keys
  are content-addressed in real use: a key means one value);
* an overwrite writes the next content.

A get may return a content put for the key before the one it is meant to
return (stale) only where no acknowledged overwrite or delete came between
(below). Since stop 30 placement stamps keep a copy that missed an
overwrite (skipped while down, or left behind by a key remapped while a
node was out and back) from being served (docs/kv.md, "Overwrites and map
changes"), and map leases (stop 33) and group stamps (stop 34) keep a
client whose map is older than a change from leaving the key's new group
behind. The walk counts stale reads (``stale``, each noted in
``stale_notes``): 199 in seeds 1-6 on the code before stamps.
It must never return bytes that match no content: two contents' fragments
decoded together, a corrupted object, another key's value.

Overwrites and deletes are stricter (since stop 37): once one is
acknowledged, a get that started after the acknowledgement may return only
a content put since (its attempt counts) or one some *unacknowledged* put
may still bring back (``maybe``): a put or overwrite that raised, or a
write-back put whose send failed or was left behind by a client the walk
replaced. Anything else is a ``superseded`` violation. A write-back put
followed by a delete of the same key was undone that way until the client
ordered them (docs/kv.md, "Writes").

Some puts and overwrites carry a TTL (0.3-2 s). A content put only with
TTLs, each acknowledged while no daemon was stopped, must not be served
once the last of those TTLs has run out (counted from when its put
returned, plus ``TTL_SLACK``): not by the cluster, not from a client's own
DRAM or SSD tier. A content also put without a TTL, or by a put that
failed or ran while a daemon was stopped (it may land later), has no
deadline.

A second client's gets race the walk's puts and overwrites all along
(:meth:`KVChecker.reader`), judged the same way. In half the walks (even
seeds) that client sets ``kv_require_witness``: forged bytes it returns are
a violation even from an unwitnessed hit.

A get that returns bytes matching no content of the key stops the walk, with
the seed and the op log (replay it with :meth:`KVChecker.run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.checker.walk import CheckerCluster, CheckFailed, ProcessFaults, meta_fault
from tierfs.client import Client
from tierfs.errors import TierFSError
from tierfs.meta import MetaClient

__all__ = ["POOLS", "KVChecker", "kv_random_ops", "setup_pools"]

Op = tuple[Any, ...]
KiB = 1024

#: name -> (redundancy, per-target memory budget, per-target disk budget).
#: Small budgets: the walk also runs into eviction.
POOLS: dict[str, tuple[str, int, int]] = {
    "kr1": ("replica:1", 256 * KiB, 2048 * KiB),
    "kr2": ("replica:2", 256 * KiB, 2048 * KiB),
    "kec": ("ec:4+2", 256 * KiB, 2048 * KiB),
    "kec21": ("ec:2+1", 0, 2048 * KiB),
}
KEYS = 12  # per pool
#: How long past a TTL's end (counted from the put's return) a get may still
#: see the object: the daemons start a TTL when the put reaches them.
TTL_SLACK = 0.5


def setup_pools(env: CheckerCluster) -> None:
    """Define the checker's pools (once per cluster) and wait until every
    storage daemon serves them."""
    from tests.kv.pools import pool_served

    async def define() -> None:
        async with MetaClient(env.meta, deadline=30) as mc:
            have = {p.name for p in (await mc.list_kv_pools()).pools}
            for name, (red, mem, disk) in POOLS.items():
                if name not in have:
                    await mc.create_kv_pool(name, redundancy=red, target_memory=mem, target_disk=disk)
    import asyncio

    asyncio.run(define())
    for name in POOLS:
        pool_served(env.meta, name, timeout=60)


def key_size(pool: str, key: int) -> int:
    base = (3 * KiB, 20 * KiB, 70 * KiB, 150 * KiB)[key % 4]
    return base if pool != "kr1" or key % 4 < 3 else 40 * KiB


def content(pool: str, key: int, c: int) -> bytes:
    """Content ``c`` of ``key``: a quarter of the contents have another
    length, the rest the key's own."""
    n = key_size(pool, key) + (1000 * (c % 3 + 1) if c % 4 == 3 else 0)
    seed = (hash_str(pool) * 1_000_003 + key) * 1009 + c
    return bytes(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


def hash_str(s: str) -> int:
    return sum((i + 1) * b for i, b in enumerate(s.encode()))




@dataclass
class KVChecker(ProcessFaults):
    env: CheckerCluster
    client: Client
    seed: int | None = None
    log: list[Op] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    log_dir: Path | None = None
    current: dict[tuple[str, int], int] = field(default_factory=dict)  # the content a put writes
    allowed: dict[tuple[str, int], set[int]] = field(default_factory=dict)  # current since the last acknowledged overwrite
    ever: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    #: (pool, key, content) -> when it must be gone; absent: put without a
    #: TTL at least once, or never put (a content with no deadline)
    deadline: dict[tuple[str, int, int], float] = field(default_factory=dict)
    untimed: set[tuple[str, int, int]] = field(default_factory=set)
    timing: set[tuple[str, int, int]] = field(default_factory=set)  # TTL puts in flight: no deadline yet
    old_clients: list[Client] = field(default_factory=list)
    # Where each stale read happened: the step, how, what it served and what
    # was allowed, and the steps since the last op that changed the map.
    stale_notes: list[str] = field(default_factory=list)
    #: Contents an unacknowledged put may still bring back at any time.
    maybe: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    #: Each key's last acknowledged overwrite or delete: (its number, which).
    settled: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)
    settles: int = 0
    #: Contents the walk's write-back client queued (landed unless its
    #: sends failed: ``wb_failed`` of them seen so far).
    wb_puts: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    wb_failed: int = 0
    #: Replica copies forged (stop 39): the forged bytes of each key. A get
    #: may serve forged bytes only where no other copy could vouch for the
    #: one it read: its client's ``unwitnessed`` count for the pool grew
    #: during that get, or the bytes came from the client's own local tiers
    #: (let in by such a get before; docs/kv.md, "Forged copies").
    forged: dict[tuple[str, int], set[bytes]] = field(default_factory=dict)
    #: ``id()`` of the clients with ``kv_require_witness`` (stop 40): for
    #: them an unwitnessed copy is a miss, so it excuses nothing.
    strict_clients: set[int] = field(default_factory=set)

    def kname(self, key: int) -> str:
        """A walk's own keys: walks on one cluster never see each other's."""
        return f"kv-walk-{self.seed}-{key}"

    # ---- running ------------------------------------------------------------------

    def run(self, ops: Iterator[Op] | Sequence[Op]) -> None:
        try:
            for op in ops:
                self.log.append(op)
                self.counts[op[0]] = self.counts.get(op[0], 0) + 1
                getattr(self, "op_" + op[0])(*op[1:])
                if self.violations:
                    break
            if not self.violations:
                self.finish()
        except CheckFailed:
            raise
        except Exception as exc:
            tb = "".join(traceback.format_exception(exc, limit=-6))
            self.violation("unexpected-error", f"the checker itself failed: {type(exc).__name__}: {exc}\n{tb}")
        finally:
            for c in [*self.old_clients, self.client]:
                for pool in POOLS:  # puts a daemon refused as misplaced, then put again
                    with contextlib.suppress(Exception):
                        cs = c.kv_pool(pool).stats()["cluster"]
                        n = int(cs.get("map_retries", 0))
                        self.counts["map_retries"] = self.counts.get("map_retries", 0) + n
                        self.counts[f"map_retries:{pool}"] = self.counts.get(f"map_retries:{pool}", 0) + n
                        # Replica gets: copies that disagreed (a miss), hits no other copy vouched for.
                        for what in ("disagreements", "unwitnessed"):
                            self.counts[what] = self.counts.get(what, 0) + int(cs.get(what, 0))
            for c in self.old_clients:
                with contextlib.suppress(Exception):
                    c.close()
        if self.violations:
            raise CheckFailed(self.report())

    def violation(self, kind: str, msg: str) -> None:
        self.violations.append(f"[{kind}] step {len(self.log)} {self.log[-1] if self.log else ''}: {msg}")
        self.counts["violation:" + kind] = self.counts.get("violation:" + kind, 0) + 1

    def report(self) -> str:
        path = ""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            f = self.log_dir / f"kv-walk-{self.seed}.json"
            f.write_text(json.dumps({"seed": self.seed, "ops": self.log, "violations": self.violations}))
            path = f" (op log: {f})"
        return (f"KV checker, seed {self.seed}, {len(self.log)} steps{path}:\n  " + "\n  ".join(self.violations)
                + f"\ncounts: {self.counts}")

    # ---- the model ------------------------------------------------------------------

    def _attempt(self, pk: tuple[str, int], c: int, ttl: bool = False) -> None:
        # before the put is sent: a racing get of it is judged untimed
        if ttl:
            self.timing.add((*pk, c))
        else:
            self.untimed.add((*pk, c))
        self.allowed.setdefault(pk, set()).add(c)
        self.ever.setdefault(pk, set()).add(c)

    def _settle(self, pk: tuple[str, int], how: str, now: set[int]) -> None:
        """An overwrite or delete of ``pk`` was acknowledged: ``now`` is what
        a get may return from here on (with what is put later, and the
        maybes)."""
        self._wb_settle()  # it waited for the key's write-back send: failed, that may land later
        self.allowed[pk] = now
        self.settles += 1
        self.settled[pk] = (self.settles, how)

    def _maybe(self, pk: tuple[str, int], c: int) -> None:
        """A put of content ``c`` that was not acknowledged: it may land at
        any time, even after a later delete."""
        self.maybe.setdefault(pk, set()).add(c)

    def _queued(self, pk: tuple[str, int], c: int) -> None:
        """A plain put through a write-back client: acknowledged once local,
        sent in the background."""
        if self._write_back(self.client):
            self.wb_puts.setdefault(pk, set()).add(c)

    @staticmethod
    def _write_back(client: Client) -> bool:
        return bool(client.config.kv_write_back and (client.config.kv_dram_bytes or client.config.kv_ssd_bytes))

    def _wb_settle(self, *, leaving: bool = False) -> None:
        """Count the write-back client's failed sends: if any failed since
        the last look (or the client is being replaced, its sends still in
        flight), every content it queued is only a maybe."""
        if not self.wb_puts:
            return
        failed = 0
        for pool in POOLS:
            with contextlib.suppress(Exception):
                failed += int(self.client.kv_pool(pool).stats().get("write_back_failed", 0))
        if leaving or failed > self.wb_failed:
            for pk, cs in self.wb_puts.items():
                self.maybe.setdefault(pk, set()).update(cs)
            self.wb_puts.clear()
        self.wb_failed = failed

    def _timed(self, pk: tuple[str, int], c: int, ttl: float, ok: bool) -> None:
        """A TTL put of content ``c`` returned (``ok``: acknowledged while no
        daemon was stopped); its deadline, unless it has none."""
        if not ok:
            self.untimed.add((*pk, c))
        else:
            end = time.monotonic() + ttl + TTL_SLACK
            self.deadline[(*pk, c)] = max(end, self.deadline.get((*pk, c), 0.0))
        self.timing.discard((*pk, c))  # after the deadline is set: a racing get checks in this order

    @staticmethod
    def _snap(client: Client | None, pool: str) -> tuple[int, int] | None:
        """What can excuse a forged copy's bytes, before and after one get:
        the client's unwitnessed cluster hits and its local tiers' hits in
        the pool (None: not a pool whose copies are forged)."""
        if client is None or POOLS[pool][0] in ("replica:1",) or POOLS[pool][0].startswith("ec:"):
            return None
        try:
            st = client.kv_pool(pool).stats()
            return int(st["cluster"].get("unwitnessed", 0)), sum(int(t.get("hits", 0)) for t in st["tiers"])
        except Exception:
            return None

    def _judge(self, pool: str, key: int, got: bytes | None, how: str, started: float | None = None,
               settled: tuple[int, str] | bool | None = True, client: Client | None = None,
               before: tuple[int, int] | None = None) -> None:
        """``settled``: the key's last acknowledged overwrite or delete when
        the get started (a racing reader's; True: the walk's own get, which
        starts after every op before it). ``client``: the one that got it
        (default: the walk's); ``before``: its ``_snap`` before the get."""
        if got is None:
            self.counts["miss"] = self.counts.get("miss", 0) + 1
            return
        self.counts["hit"] = self.counts.get("hit", 0) + 1
        pk = (pool, key)
        # Copies (a racing reader judges while the walk adds contents; a
        # content is added before its put is sent, so one a get returned is
        # in the copy taken after it).
        match = next((c for c in list(self.allowed.get(pk, ())) if got == content(pool, key, c)), None)
        stale = False
        if match is None:
            match = next((c for c in sorted(self.ever.get(pk, ())) if got == content(pool, key, c)), None)
            stale = match is not None
        if match is not None:
            self._judge_expiry(pool, key, match, how, started)
            if stale:
                self.counts["stale"] = self.counts.get("stale", 0) + 1
                d = self.settled.get(pk)
                if d is not None and (settled is True or settled == d) and match not in self.maybe.get(pk, ()):
                    self.violation("superseded", f"{how} of {pool}/{self.kname(key)} returned content {match} "
                                   f"after an acknowledged {d[1]} (#{d[0]}) left {sorted(self.allowed.get(pk, ()))}, "
                                   f"and no unacknowledged put may bring it back (maybe: "
                                   f"{sorted(self.maybe.get(pk, ()))})")
                changed = [i for i, op in enumerate(self.log) if op[0] in ("grow", "kill", "restart", "stop", "cont")]
                self.stale_notes.append(
                    f"step {len(self.log)} ({self.log[-1][0] if self.log else '-'}), {how} of "
                    f"{pool}/{self.kname(key)}: content {match}, allowed {sorted(self.allowed.get(pk, ()))}; "
                    f"last map-changing op: {self.log[changed[-1]] if changed else None} at step "
                    f"{changed[-1] + 1 if changed else None}")
            return
        ok = sorted(list(self.ever.get(pk, ())))
        if got in self.forged.get(pk, ()):
            who = self.client if client is None else client
            after = self._snap(who, pool)
            # A client with kv_require_witness turns an unwitnessed copy
            # into a miss: only its local tiers can excuse forged bytes.
            strict = id(who) in self.strict_clients
            if before is not None and after is not None and (
                    after[1] != before[1] or (after[0] != before[0] and not strict)):
                # No other copy could vouch for the one read: the gap docs/kv.md names.
                self.counts["forged_unwitnessed"] = self.counts.get("forged_unwitnessed", 0) + 1
                return
            self.violation("forged-served", f"{how} of {pool}/{self.kname(key)} returned the bytes of a forged "
                           f"copy, and it was neither an unwitnessed hit nor a hit of its client's local tiers "
                           f"(before {before}, after {after}"
                           f"{'; its client requires a witness' if strict else ''})")
            return
        self.violation("wrong-bytes", f"{how} of {pool}/{self.kname(key)} returned {len(got)} bytes matching no "
                       f"content ever put (contents {ok}, lengths {[len(content(pool, key, c)) for c in ok]}; "
                       f"{_describe(got, pool, key, set(ok))})")

    def _judge_expiry(self, pool: str, key: int, c: int, how: str, started: float | None) -> None:
        t = (pool, key, c)
        if t in self.timing or t in self.untimed:
            return
        end = self.deadline.get(t)
        if end is None or started is None:
            return
        self.counts["ttl-judged"] = self.counts.get("ttl-judged", 0) + 1
        if started <= end:
            return
        self.violation("expired", f"{how} of {pool}/{self.kname(key)} started {started - end + TTL_SLACK:.2f} s "
                       f"after the last TTL of content {c} ran out returned it")

    def reader(self, stop: threading.Event, seed: int) -> None:
        """Gets racing the walk's puts and overwrites, from a client of its
        own, until ``stop``: an overwrite racing a get must give the get one
        content or a miss. Errors are not judged here (the walk's own gets
        judge them); bytes are."""
        rng = random.Random(seed)
        pools = list(POOLS)
        # Half the walks' readers require a witness (kv_require_witness):
        # forged bytes they return are a violation, unwitnessed or not.
        strict = seed % 2 == 0
        with self.env.client(kv_require_witness=strict) as client:
            if strict:
                self.strict_clients.add(id(client))
            while not stop.is_set():
                pool, key = rng.choice(pools), rng.randrange(KEYS)
                started = time.monotonic()
                settled = self.settled.get((pool, key))
                before = self._snap(client, pool)
                try:
                    got = client.kv_pool(pool).get(self.kname(key))
                except TierFSError:
                    continue
                self.counts["raced"] = self.counts.get("raced", 0) + 1
                if got is not None:
                    self._judge(pool, key, got, "racing get", started, settled, client, before)
            if strict:  # the reader's gets that found no witness, and missed for it
                for pool in POOLS:
                    with contextlib.suppress(Exception):
                        n = int(client.kv_pool(pool).stats()["cluster"].get("unwitnessed_misses", 0))
                        self.counts["strict_misses"] = self.counts.get("strict_misses", 0) + n
                        self.counts[f"strict_misses:{pool}"] = n

    # ---- operations ------------------------------------------------------------------

    def op_put(self, pool: str, key: int) -> None:
        pk = (pool, key)
        c = self.current.setdefault(pk, 0)
        self._attempt(pk, c)
        try:
            self.client.kv_pool(pool).put(self.kname(key), content(pool, key, c))
        except TierFSError:
            self._maybe(pk, c)
            return
        self._queued(pk, c)

    def op_overwrite(self, pool: str, key: int) -> None:
        pk = (pool, key)
        c = self.current[pk] = self.current.get(pk, -1) + 1
        self._attempt(pk, c)
        try:
            self.client.kv_pool(pool).put(self.kname(key), content(pool, key, c), overwrite=True)
        except TierFSError:
            self.counts["put-failed"] = self.counts.get("put-failed", 0) + 1
            self._maybe(pk, c)
            return
        self._settle(pk, "overwrite", {c})

    def op_put_ttl(self, pool: str, key: int, ttl: float) -> None:
        """A put of the key's current content with a TTL."""
        pk = (pool, key)
        c = self.current.setdefault(pk, 0)
        self._attempt(pk, c, ttl=True)
        calm = not any(how == "stopped" for how in self.env.down.values())
        try:
            self.client.kv_pool(pool).put(self.kname(key), content(pool, key, c), ttl=ttl)
        except TierFSError:
            self._timed(pk, c, ttl, False)
            self._maybe(pk, c)
            return
        self._timed(pk, c, ttl, calm)

    def op_overwrite_ttl(self, pool: str, key: int, ttl: float) -> None:
        """An overwrite with a new content and a TTL."""
        pk = (pool, key)
        c = self.current[pk] = self.current.get(pk, -1) + 1
        self._attempt(pk, c, ttl=True)
        calm = not any(how == "stopped" for how in self.env.down.values())
        try:
            self.client.kv_pool(pool).put(self.kname(key), content(pool, key, c), overwrite=True, ttl=ttl)
        except TierFSError:
            self.counts["put-failed"] = self.counts.get("put-failed", 0) + 1
            self._timed(pk, c, ttl, False)
            self._maybe(pk, c)
            return
        self._timed(pk, c, ttl, calm)
        self._settle(pk, "overwrite", {c})

    def op_outlive(self) -> None:
        """Wait out the next TTL to run out (at most 3 s), then read its key
        (get, then a batch) through the walk's client: what the cluster or
        the client's own tiers still hold of it must not be that content."""
        now = time.monotonic()
        due = [(end, t) for t, end in self.deadline.items()
               if t not in self.untimed and now < end < now + 3.0]
        if not due:
            return
        end, (pool, key, _c) = min(due)
        while time.monotonic() <= end:
            time.sleep(0.05)
        self.op_get(pool, key)
        self.op_batch_get(pool, [key])

    def op_batch_put(self, pool: str, keys: list[int]) -> None:
        for k in keys:
            self._attempt((pool, k), self.current.setdefault((pool, k), 0))
        try:
            self.client.kv_pool(pool).batch_put([self.kname(k) for k in keys],
                                                [content(pool, k, self.current[(pool, k)]) for k in keys])
        except TierFSError:
            for k in keys:
                self._maybe((pool, k), self.current[(pool, k)])
            return
        for k in keys:
            self._queued((pool, k), self.current[(pool, k)])

    def op_delete(self, pool: str, key: int) -> None:
        # A delete that raised may have left copies (a cache may serve them:
        # they are still values put), so the allowed contents stay. One
        # acknowledged removed every copy a get could be served (docs/kv.md,
        # "Deletes"): an earlier content read after it is `stale`.
        try:
            self.client.kv_pool(pool).delete(self.kname(key))
        except TierFSError:
            self.counts["delete-failed"] = self.counts.get("delete-failed", 0) + 1
            return
        self._settle((pool, key), "delete", set())

    def op_get(self, pool: str, key: int) -> None:
        started = time.monotonic()
        before = self._snap(self.client, pool)
        try:
            got = self.client.kv_pool(pool).get(self.kname(key))
        except TierFSError as exc:
            self.violation("api", f"get raised {type(exc).__name__}: {exc} (a cache misses, it does not fail)")
            return
        self._judge(pool, key, got, "get", started, before=before)

    def op_get_into(self, pool: str, key: int) -> None:
        buf = bytearray(key_size(pool, key) + 4 * KiB)
        started = time.monotonic()
        before = self._snap(self.client, pool)
        try:
            n = self.client.kv_pool(pool).get_into(self.kname(key), buf)
        except TierFSError as exc:
            self.violation("api", f"get_into raised {type(exc).__name__}: {exc}")
            return
        self._judge(pool, key, None if n is None else bytes(buf[:n]), "get_into", started, before=before)

    def op_batch_get(self, pool: str, keys: list[int]) -> None:
        bufs = [bytearray(key_size(pool, k) + 4 * KiB) for k in keys]
        started = time.monotonic()
        before = self._snap(self.client, pool)
        try:
            got = self.client.kv_pool(pool).batch_get_into([self.kname(k) for k in keys], bufs)
        except TierFSError as exc:
            self.violation("api", f"batch_get_into raised {type(exc).__name__}: {exc}")
            return
        for k, n, b in zip(keys, got, bufs, strict=True):
            self._judge(pool, k, None if n is None else bytes(b[:n]), "batch_get_into", started, before=before)

    def op_corrupt(self, node: str, pick: int) -> None:
        """Flip a payload byte of one KV object file of ``node`` (the daemon
        must find it by its CRC: a miss or another copy, never the bytes)."""
        files = sorted(p for p in (self.env.cl.dir / node).rglob("kv/*/*/*")
                       if p.is_file() and p.parent.name != "tmp" and p.stat().st_size > 4096)
        if not files:
            return
        f = files[pick % len(files)]
        with contextlib.suppress(FileNotFoundError), open(f, "r+b") as fh:
            size = f.stat().st_size
            at = 4096 + (pick * 7919) % max(1, size - 4096)
            fh.seek(at)
            b = fh.read(1)
            if b:
                fh.seek(at)
                fh.write(bytes([b[0] ^ 0x5A]))

    def op_forge(self, pool: str, key: int, j: int) -> None:
        """Rewrite fragment ``j`` (modulo the width) of the key's object in an
        EC pool with other bytes under the same trailer (the value's CRC32C
        and length), as a misdirected or buggy write would leave it: neither
        the frame's CRC nor the trailer can tell. A get must decode around it
        or miss, never return it. In a replica pool (stop 39) copy ``j`` is
        rewritten with other bytes and their own CRC32C: a get must miss
        rather than serve it wherever another copy can vouch
        (``forged-served``); where none could, it is counted
        (``forged_unwitnessed``)."""
        if POOLS[pool][0] == "replica:1":
            return
        with contextlib.suppress(TierFSError):
            if asyncio.run(self._forge(pool, key, j)):
                self.counts["forged"] = self.counts.get("forged", 0) + 1

    async def _forge(self, pool: str, key: int, j: int) -> bool:
        from tierfs.client import AsyncClient
        from tierfs.kv.cluster import _TRAILER, placement
        from tierfs.net.protocol import KV_GROUP, KV_OVERWRITE, KV_STAMP_SHIFT

        name = self.kname(key).encode()
        async with AsyncClient(self.env.meta, request_timeout=2.0, connect_timeout=1.0) as c:
            kv = c.kv_pool(pool)
            await kv.get(name)  # the route and the pool's capability
            tier = kv.cluster
            route = await tier.route()
            targets, stamps = placement(route, name)
            j %= len(targets)
            frag = await tier.data.kv_get(targets[j], route.pool_id, name, timeout=2.0, since=stamps[j])
            if frag is not None and route.copies:
                pk = (pool, key)
                rng = np.random.default_rng([self.seed, key, j, len(self.log)])
                forged = rng.integers(0, 256, len(frag), dtype=np.uint8).tobytes()
                self.forged.setdefault(pk, set()).add(forged)  # before the write: a racing get may see it at once
                await tier.data.kv_put(targets[j], route.pool_id, name, memoryview(forged),
                                       flags=KV_OVERWRITE | KV_GROUP | max(stamps) << KV_STAMP_SHIFT)
                return True
            if frag is None or len(frag) <= _TRAILER.size:
                return False
            n = len(frag) - _TRAILER.size
            body = bytearray(frag)
            body[:n] = np.random.default_rng([self.seed, key, j, len(self.log)]).integers(0, 256, n, dtype=np.uint8).tobytes()
            if body == frag:
                return False
            await tier.data.kv_put(targets[j], route.pool_id, name, memoryview(body),
                                   flags=KV_OVERWRITE | KV_GROUP | max(stamps) << KV_STAMP_SHIFT)
            return True

    def op_grow(self) -> None:
        """One more storage daemon (``tierfs up --storage N+1``): the pools
        re-plan onto it, and keys move to other groups (a target may then
        hold a key's fragment for another position). The meta nemesis, if
        any, waits: registering a daemon is not what it tests."""
        with self.env.nemesis_paused():
            names = self.env.cl.grow(len(self.env.storage()) + 1)
            self.env.cl.start(names=names, timeout=60)
            self.env.wait_online(names)

    def op_fresh_client(self, local: bool = False) -> None:
        """A new client for the walk's next operations; with ``local``, one
        with its own small DRAM and SSD tiers (so that objects are demoted,
        evicted and promoted through them) and write-back half the time.
        Every third one keeps its cluster map for the rest of the walk
        (unless an error makes it look): its puts and gets meet the
        daemons' placement checks with a map older than theirs."""
        self._wb_settle(leaving=True)
        self.old_clients.append(self.client)
        n = len(self.old_clients)
        late: dict[str, Any] = {"map_max_age": 600.0} if n % 3 == 0 else {}
        self.counts["late_clients"] = self.counts.get("late_clients", 0) + bool(late)
        if not local:
            self.client = self.env.client(**late)
            return
        ssd = self.env.cl.dir / f"kv-walk-ssd-{self.seed}-{n}"
        self.client = Client(self.env.meta, request_timeout=2.0, connect_timeout=1.0, retries=2,
                             meta_deadline=30.0, kv_dram_bytes=512 * KiB, kv_ssd_bytes=1024 * KiB,
                             kv_ssd_path=str(ssd), kv_write_back=n % 2 == 0, **late)

    def finish(self) -> None:
        """Heal, then every key of every pool read back (each may miss),
        with the meta nemesis (if any) paused."""
        with self.env.nemesis_paused():
            self.env.heal()
            for pool in POOLS:
                for key in range(KEYS):
                    self.log.append(("get", pool, key))
                    self.op_get(pool, key)


def _describe(got: bytes, pool: str, key: int, ok: set[int]) -> str:
    for c in sorted(ok):
        want = content(pool, key, c)
        if len(want) == len(got):
            diff = sum(1 for a, b in zip(got, want, strict=True) if a != b)
            first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            return f"against content {c}: {diff} bytes differ, the first at {first}"
    return "no allowed content has that length"


def kv_random_ops(ck: KVChecker, rng: random.Random, steps: int, *, max_down: int = 2,
                  max_storage: int = 8) -> Iterator[Op]:
    """``steps`` operations drawn from ``rng``, looking at what is down."""
    pools = list(POOLS)
    for _ in range(steps):
        nodes = ck.env.storage()
        down = dict(ck.env.down)
        pool, key = rng.choice(pools), rng.randrange(KEYS)
        mf = meta_fault(ck.env, rng)
        if mf is not None:
            yield mf
            continue
        r = rng.random()
        if r < 0.19:
            yield ("put", pool, key)
        elif r < 0.22:
            yield ("put_ttl", pool, key, rng.choice((0.3, 0.8, 2.0)))
        elif r < 0.31:
            yield ("overwrite", pool, key)
        elif r < 0.34:
            yield ("overwrite_ttl", pool, key, rng.choice((0.3, 0.8, 2.0)))
        elif r < 0.40:
            yield ("batch_put", pool, sorted(rng.sample(range(KEYS), 4)))
        elif r < 0.44:
            yield ("delete", pool, key)
        elif r < 0.58:
            yield ("get", pool, key)
        elif r < 0.60:
            forgeable = [p for p, (red, _, _) in POOLS.items() if red != "replica:1"]
            yield ("forge", rng.choice(forgeable), key, rng.randrange(6))
        elif r < 0.70:
            yield ("get_into", pool, key)
        elif r < 0.78:
            yield ("batch_get", pool, sorted(rng.sample(range(KEYS), 5)))
        elif r < 0.80:
            yield ("corrupt", rng.choice(nodes), rng.randrange(1 << 30))
        elif r < 0.83:
            yield ("outlive",)
        elif r < 0.85:
            yield ("fresh_client", rng.random() < 0.6)
        elif r < 0.86 and len(nodes) < max_storage:
            yield ("grow",)
        elif down and (r < 0.93 or len(down) >= max_down):
            node = rng.choice(sorted(down))
            yield ("restart", node) if down[node] == "killed" else ("cont", node)
        elif len(down) < max_down:
            node = rng.choice([n for n in nodes if n not in down])
            yield ("kill", node) if rng.random() < 0.7 else ("stop", node)
        else:
            yield ("get", pool, key)


def run_walk(env: CheckerCluster, seed: int, steps: int, log_dir: Path | None = None,
             meta_nemesis: bool = False) -> KVChecker:
    """One walk; with ``meta_nemesis`` (three meta replicas), meta replicas
    are also killed from a thread at random moments while it runs
    (:meth:`CheckerCluster.start_meta_nemesis`)."""
    env.heal()
    client = env.client()
    ck = KVChecker(env, client, seed=seed, log_dir=log_dir)
    if seed % 2:
        ck.op_fresh_client(local=True)  # half the walks start with DRAM and SSD tiers of their own
    t0 = time.monotonic()
    stop = threading.Event()
    racing = threading.Thread(target=ck.reader, args=(stop, seed), name="kv-walk-reader", daemon=True)
    racing.start()
    if meta_nemesis:
        env.start_meta_nemesis(seed)
    try:
        ck.run(kv_random_ops(ck, random.Random(seed), steps))
    finally:
        env.stop_meta_nemesis()
        stop.set()
        racing.join(60)
        ck.counts["seconds"] = int(time.monotonic() - t0)
        with contextlib.suppress(Exception):
            ck.client.close()
    if ck.violations:  # the racing reader's, after the walk's last check
        raise CheckFailed(ck.report())
    return ck
