"""The client's routing cache: the cluster map (groups -> targets -> node
addresses and states) fetched from meta, refreshed when it turns out stale.

Chunk ``i`` of a file lives in group ``layout.groups[i % len]``; fragment
``j`` on that group's ``target_ids[j]``: computed here, no metadata call per
chunk. A refresh happens on a miss (unknown group or target), after errors
that may mean the map moved (a fragment not found, a target unreachable),
and is rate-limited by ``min_interval`` unless forced by a miss. Targets
that failed a request recently are remembered for ``failed_ttl`` seconds so
that later chunks go straight to parity instead of waiting for the same
timeout again; a target whose fetch was hedged (it lagged) is remembered
the same way (``mark_slow``). A map older than ``max_age`` is re-checked on the next use
(a cheap call when nothing changed), so targets that come back are used
again.
"""

from __future__ import annotations

import asyncio
import time

from tierfs.errors import NotFoundError, StaleVersionError, TierFSError
from tierfs.kv.placement import KVPoolRoute
from tierfs.meta.client import MetaClient
from tierfs.net import DataClient
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["KVPoolRoute", "Router"]


_READABLE = (pb.TARGET_STATE_ONLINE, pb.TARGET_STATE_READ_ONLY)


class Router:
    def __init__(self, meta: MetaClient, data: DataClient, *, min_interval: float = 0.5,
                 failed_ttl: float = 5.0, max_age: float = 10.0) -> None:
        self.meta = meta
        self.data = data
        self.min_interval = min_interval
        self.failed_ttl = failed_ttl
        self.max_age = max_age
        self.version = 0
        self.groups: dict[int, tuple[int, ...]] = {}
        self.state: dict[int, int] = {}
        self._failed: dict[int, float] = {}
        self._slow: dict[int, float] = {}
        #: targets a write gave up for lagging (after a quarter of the
        #: request timeout): see :meth:`write_lagged`
        self._write_lagged: dict[int, float] = {}
        self._full: dict[int, float] = {}
        # group id -> {member still being rebuilt: the member it replaced
        # when that one is still readable, else 0}
        self.rebuilding: dict[int, dict[int, int]] = {}
        #: KV pools by name, from the map's ``kv_pools``.
        self.kv_pools: dict[str, KVPoolRoute] = {}
        self._lock = asyncio.Lock()
        self._last = -1e9
        self._bg: asyncio.Task[None] | None = None

    async def refresh(self, *, force: bool = False) -> bool:
        """Fetch the map if it may have changed; True if the version moved."""
        before = self.version
        async with self._lock:
            if self.version != before:
                return True  # someone refreshed while we waited
            now = time.monotonic()
            if not force and self.version and now - self._last < self.min_interval:
                return False
            self._last = now
            cmap = await self.meta.get_cluster_map(known_version=self.version)
            if cmap.unchanged:
                return False
            self._apply(cmap)
            return self.version != before

    def _apply(self, cmap: pb.ClusterMap) -> None:
        addr = {n.node_id: n.data_addr for n in cmap.nodes}
        node_state = {n.node_id: n.state for n in cmap.nodes}
        state: dict[int, int] = {}
        for t in cmap.targets:
            a = addr.get(t.node_id)
            if a:
                self.data.set_route(t.target_id, a)
            online = node_state.get(t.node_id) == pb.NODE_STATE_ONLINE
            state[t.target_id] = t.state if online else pb.TARGET_STATE_OFFLINE
        self.state = state
        self.groups = {g.group_id: tuple(g.target_ids) for g in cmap.groups}
        self.rebuilding = {
            g.group_id: {t: (g.rebuild_sources[i] if i < len(g.rebuild_sources) else 0)
                         for i, t in enumerate(g.rebuilding)}
            for g in cmap.groups if g.rebuilding}
        up = {t.target_id: t.up_since for t in cmap.targets if getattr(t, "up_since", 0)}
        self.kv_pools = {p.name: KVPoolRoute.of(p, up) for p in getattr(cmap, "kv_pools", ())}
        self.version = cmap.version

    async def kv_pool(self, name: str) -> KVPoolRoute:
        """The route of KV pool ``name`` (refreshing the map on a miss, and in
        the background when it is old: the KV data path never waits on meta
        while it has a map)."""
        got = self.kv_pools.get(name)
        if got is not None:
            if time.monotonic() - self._last > self.max_age and self._bg is None:
                self._bg = asyncio.get_running_loop().create_task(self._refresh_quietly())
            return got
        await self.refresh(force=True)
        got = self.kv_pools.get(name)
        if got is None:
            known = ", ".join(sorted(self.kv_pools)) or "none"
            raise NotFoundError(f"unknown KV pool {name!r} (pools: {known})")
        return got

    async def targets(self, group_id: int) -> tuple[int, ...]:
        """The ordered targets of a placement group (refreshing on a miss)."""
        got = self.groups.get(group_id)
        if got is not None and time.monotonic() - self._last > self.max_age and self._bg is None:
            # In the background: a read must not wait on meta while the map it has still routes.
            self._bg = asyncio.get_running_loop().create_task(self._refresh_quietly())
        if got is None:
            await self.refresh(force=True)
            got = self.groups.get(group_id)
            if got is None:
                raise StaleVersionError(f"placement group {group_id} is not in cluster map version {self.version}")
        return got

    def read_targets(self, group_id: int, targets: tuple[int, ...]) -> tuple[tuple[int, ...], frozenset[int]]:
        """Where to *read* each fragment of a group: a member still being
        rebuilt does not hold every fragment yet, so its position is read
        from the member it replaced when that one is still readable (a
        drained node), else it is returned in the second set (decode around
        it). Writes always go to ``targets``."""
        rb = self.rebuilding.get(group_id)
        if not rb:
            return targets, frozenset()
        out = list(targets)
        missing: set[int] = set()
        for j, t in enumerate(targets):
            if t in rb:
                src = rb[t]
                if src and self.usable(src):
                    out[j] = src
                else:
                    missing.add(j)
        return tuple(out), frozenset(missing)

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except TierFSError:
            pass  # meta unreachable for now; tried again after max_age
        finally:
            self._bg = None

    async def close(self) -> None:
        t, self._bg = self._bg, None
        if t is not None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)

    def usable(self, target: int) -> bool:
        """Worth reading from now: readable in the map, not failed and not
        found slow just now."""
        if self.state.get(target) not in _READABLE:
            return False
        return not self.failed_recently(target) and not self._within(self._slow, target)

    def only_slow(self, target: int) -> bool:
        """Not usable only because it was found slow just now (readable in
        the map, not failed): it may well answer, so a read that gives up a
        stalled target may hedge to it."""
        return (self.state.get(target) in _READABLE and not self.failed_recently(target)
                and self._within(self._slow, target))

    def failed_recently(self, target: int) -> bool:
        """A request to it failed within ``failed_ttl`` (slowness aside)."""
        return self._within(self._failed, target)

    @staticmethod
    def _within(table: dict[int, float], target: int) -> bool:
        until = table.get(target)
        if until is None:
            return False
        if time.monotonic() >= until:
            del table[target]
            return False
        return True

    def mark_failed(self, target: int, *, factor: float = 1.0) -> None:
        if self.failed_ttl > 0:
            self._failed[target] = time.monotonic() + self.failed_ttl * factor

    def mark_slow(self, target: int, ttl: float) -> None:
        """A fetch from ``target`` was hedged (it lagged the others): read
        around it for ``ttl`` seconds (parity first), like a failed one.
        Writes still go to it."""
        if ttl > 0:
            self._slow[target] = time.monotonic() + ttl

    def mark_write_lagged(self, target: int, ttl: float) -> None:
        """A write gave up on ``target`` after waiting it out (a stalled
        node, most likely): later writes give it only their peers' time."""
        if ttl > 0:
            self._write_lagged[target] = time.monotonic() + ttl

    def write_lagged(self, target: int) -> bool:
        """A write gave up on it within the mark's ttl. Unlike
        :meth:`usable`, a read hedge (tens of milliseconds behind on a busy
        host) does not set it: a write still waits for a merely busy node."""
        return self._within(self._write_lagged, target)

    def down(self, target: int) -> bool:
        """Offline (or failed) in the cluster map: a write skips it."""
        return self.state.get(target) in (pb.TARGET_STATE_OFFLINE, pb.TARGET_STATE_FAILED)

    def write_skip(self, target: int) -> str:
        """Why a write skips ``target`` ('' if it does not): offline or
        failed in the map, READ_ONLY (full: still read) in the map, or
        answered NoSpace within ``failed_ttl`` (before the map says so)."""
        st = self.state.get(target)
        if st in (pb.TARGET_STATE_OFFLINE, pb.TARGET_STATE_FAILED):
            return "offline in the cluster map"
        if st == pb.TARGET_STATE_READ_ONLY:
            return "read-only (full) in the cluster map"
        if self._within(self._full, target):
            return "full (it answered NoSpace just now)"
        return ""

    def mark_full(self, target: int) -> None:
        """``target`` answered NoSpace: writes skip it for ``failed_ttl``
        (its daemon reports READ_ONLY to meta meanwhile)."""
        self._full[target] = time.monotonic() + max(self.failed_ttl, 1.0)

    def mark_ok(self, target: int) -> None:
        # Not the slow mark: a slow node does answer, only late.
        self._failed.pop(target, None)
