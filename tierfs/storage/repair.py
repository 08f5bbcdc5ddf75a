"""Repair: reconstructing lost fragments onto this node's targets.

Two callers share :class:`Repairer`:

* the **rebuild worker** (:meth:`Repairer.run`): meta replaced a dead (or
  removed, or draining) target in a placement group by one of ours and
  lists ours in the group's ``rebuilding`` set. For every committed chunk of
  the group (``ListGroupChunks``) whose fragment is not on our target, we
  fetch fragments of the same chunk from the other members over the data
  plane and rebuild ours — by a plain copy from the replaced member when
  meta names it as the group's ``rebuild_source`` and it still answers (a
  drained node), otherwise by Reed-Solomon reconstruction from any K
  survivors with the client's codec (:mod:`tierfs.client.codec`). Then
  ``FinishRebuild`` takes us out of ``rebuilding``;
* the **scrubber** (:mod:`tierfs.storage.scrub`), for a fragment it found
  corrupt or missing.

Reconstruction fetches whole fragments (they are stored trimmed, see the
codec's docstring): the parity length is the chunk's ``P``; a rebuilt data
fragment is trimmed back to the bytes the chunk's logical length gives it.

Bandwidth is bounded by a token bucket over the bytes fetched from peers
(``rebuild_rate`` bytes/s). Reads and writes by clients go on meanwhile:
clients read around a rebuilding member (it answers NotFound for what it has
not rebuilt yet) and write new chunks to it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tierfs.errors import (
    CorruptError,
    InsufficientTargetsError,
    InvalidArgumentError,
    NotFoundError,
    TierFSError,
)
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine, crc32c

__all__ = ["GroupProgress", "RateLimiter", "Repairer"]

log = logging.getLogger("tierfs.storage.repair")


class RateLimiter:
    """A token bucket: :meth:`take` waits until ``n`` bytes fit in ``rate``
    bytes/s (bursts up to one second's worth). ``rate`` 0 = unlimited."""

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)
        self._tokens = self.rate
        self._last = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        if self.rate <= 0 or n <= 0:
            return
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            if self._tokens < 0:
                # Debt is paid by sleeping: the next caller starts from zero.
                await asyncio.sleep(-self._tokens / self.rate)
                self._tokens = 0.0
                self._last = time.monotonic()


@dataclass
class GroupProgress:
    """One rebuild of ``target_id`` in ``group_id`` (what status shows)."""

    group_id: int
    target_id: int
    total: int = 0
    done: int = 0
    bytes: int = 0
    state: str = "rebuilding"
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    finished: float = 0.0


@dataclass
class _File:
    """What reconstruction needs to know about one file."""

    kind: int
    k: int
    m: int
    chunk_size: int
    size: int
    groups: list[int]
    chunks: dict[int, int]
    writing: bool
    data_version: int


class Repairer:
    """Rebuilds fragments on this node's targets (see the module docstring).

    ``meta``: a :class:`tierfs.meta.MetaClient`; ``engines``: this node's
    targets (by id, looked up at call time so newly registered ids count)."""

    def __init__(self, meta: Any, engines: Any, *, rate: int = 0, concurrency: int = 4,
                 poll_interval: float = 2.0, request_timeout: float = 10.0) -> None:
        from tierfs.net import DataClient

        self.meta = meta
        self._engines = engines
        self.limiter = RateLimiter(rate)
        self.concurrency = max(1, concurrency)
        self.poll_interval = poll_interval
        self.request_timeout = request_timeout
        self.data = DataClient(transport="tcp", request_timeout=request_timeout)
        # Fragments rebuilt at once, over all groups (each fetches K peers).
        self._sem = asyncio.Semaphore(self.concurrency)
        self.cmap: Any = None
        self.groups: dict[int, list[int]] = {}
        self.rebuilding: dict[int, set[int]] = {}
        self.sources: dict[tuple[int, int], int] = {}  # (group, new target) -> replaced target
        self.target_state: dict[int, int] = {}
        self.progress: dict[tuple[int, int], GroupProgress] = {}
        self.counters: dict[str, int] = dict.fromkeys(
            ("fragments_rebuilt", "fragments_copied", "bytes_rebuilt", "bytes_fetched", "rebuild_errors",
             "groups_finished", "fetch_us", "decode_us", "write_us"), 0)

    @property
    def engines(self) -> dict[int, ChunkEngine]:
        src = self._engines() if callable(self._engines) else self._engines
        return {e.target_id: e for e in src if e.target_id}

    async def close(self) -> None:
        await self.data.close()

    # ---- cluster map ---------------------------------------------------------------

    async def refresh_map(self) -> None:
        from tierfs.proto.v1 import meta_pb2 as pb

        cmap = await self.meta.get_cluster_map()
        node_addr = {n.node_id: n.data_addr for n in cmap.nodes}
        node_up = {n.node_id: n.state == pb.NODE_STATE_ONLINE for n in cmap.nodes}
        self.target_state = {}
        for t in cmap.targets:
            if t.node_id in node_addr:
                self.data.set_route(t.target_id, node_addr[t.node_id])
            self.target_state[t.target_id] = t.state if node_up.get(t.node_id) else pb.TARGET_STATE_OFFLINE
        self.groups = {g.group_id: list(g.target_ids) for g in cmap.groups}
        self.rebuilding = {g.group_id: set(g.rebuilding) for g in cmap.groups if g.rebuilding}
        self.sources = {}
        for g in cmap.groups:
            for new, old in zip(g.rebuilding, getattr(g, "rebuild_sources", ()), strict=False):
                if old:
                    self.sources[(g.group_id, new)] = old
        self.cmap = cmap

    def readable(self, target: int) -> bool:
        from tierfs.proto.v1 import meta_pb2 as pb

        return self.target_state.get(target) in (pb.TARGET_STATE_ONLINE, pb.TARGET_STATE_READ_ONLY)

    async def file(self, inode: int, cache: dict[int, _File | None] | None = None) -> _File | None:
        """The layout, size and committed chunks of ``inode`` (None if it is
        gone or not a regular file)."""
        from tierfs.proto.v1 import meta_pb2 as pb

        if cache is not None and inode in cache:
            return cache[inode]
        try:
            info = await self.meta.stat(inode)
        except NotFoundError:
            info = None
        f: _File | None = None
        if info is not None and info.attr.type == pb.INODE_TYPE_FILE:
            lay = info.layout
            chunks = {r.first + i: r.version for r in info.chunks for i in range(r.count)}
            f = _File(kind=lay.kind, k=lay.data_shards, m=lay.parity_shards, chunk_size=lay.chunk_size,
                      size=info.attr.size, groups=list(lay.groups), chunks=chunks, writing=info.writing,
                      data_version=info.attr.data_version)
        if cache is not None:
            cache[inode] = f
        return f

    def _codec(self, k: int, m: int) -> Any:
        # Shared with the client's cache: building an ISA-L driver and its
        # header templates costs far more than one reconstruction.
        from tierfs.client.codec import codec_for
        from tierfs.proto.v1 import meta_pb2 as pb

        return codec_for(pb.Layout(kind=pb.REDUNDANCY_KIND_EC, data_shards=k, parity_shards=m))

    # ---- one fragment ---------------------------------------------------------------

    async def restore(self, eng: ChunkEngine, key: FragmentKey, f: _File, members: list[int], *,
                      source: int = 0) -> tuple[int, bool]:
        """Rebuild fragment ``key`` onto ``eng`` from the other ``members`` of
        its group (fragment j on ``members[j]``). Returns (bytes written,
        whether it was a plain copy). Raises InsufficientTargetsError when
        too few fragments could be fetched."""
        j = key.fragment
        replicated = f.kind == 2  # REDUNDANCY_KIND_REPLICA
        width = f.k + f.m
        if j >= width or len(members) != width:
            raise InvalidArgumentError(f"{key}: fragment index outside a group of {len(members)}")
        if source and source != eng.target_id:
            # A drained (still healthy) member: copy its fragment, no decode.
            with contextlib.suppress(TierFSError):
                data = await self.data.read(source, key, timeout=self.request_timeout)
                await self.limiter.take(len(data))
                self.counters["bytes_fetched"] += len(data)
                await eng.write(key, memoryview(data), crc32c(data))
                self.counters["fragments_copied"] += 1
                return len(data), True
        others = [i for i in range(width) if i != j and members[i] != eng.target_id]
        if replicated:
            errors: list[str] = []
            for i in sorted(others, key=lambda i: not self.readable(members[i])):
                other = FragmentKey(key.inode, key.chunk, i, key.version)
                try:
                    data = await self.data.read(members[i], other, timeout=self.request_timeout)
                except TierFSError as exc:
                    errors.append(f"copy {i} on target {members[i]}: {exc}")
                    continue
                await self.limiter.take(len(data))
                self.counters["bytes_fetched"] += len(data)
                await eng.write(key, memoryview(data), crc32c(data))
                return len(data), True
            raise InsufficientTargetsError(f"{key}: no copy readable: {'; '.join(errors)}")
        have: dict[int, bytes] = {}
        t0 = time.perf_counter()
        errs: dict[int, str] = {}
        # Readable members first, data fragments before parity.
        order = sorted(others, key=lambda i: (not self.readable(members[i]), i))
        pos = 0
        while len(have) < f.k and pos < len(order):
            pick = order[pos: pos + f.k - len(have)]
            pos += len(pick)
            res = await asyncio.gather(*(self.data.read(members[i], FragmentKey(key.inode, key.chunk, i, key.version),
                                                        timeout=self.request_timeout) for i in pick),
                                       return_exceptions=True)
            for i, r in zip(pick, res, strict=True):
                if isinstance(r, bytes):
                    have[i] = r
                elif isinstance(r, TierFSError):
                    errs[i] = f"{type(r).__name__}: {r}"
                else:
                    raise r  # type: ignore[misc]
        if len(have) < f.k:
            detail = "; ".join(f"fragment {i} on target {members[i]}: {e}" for i, e in sorted(errs.items()))
            raise InsufficientTargetsError(f"{key}: only {len(have)} of the {f.k} fragments needed: {detail}")
        fetched = sum(len(v) for v in have.values())
        await self.limiter.take(fetched)
        t1 = time.perf_counter()
        self.counters["bytes_fetched"] += fetched
        parity = [len(v) for i, v in have.items() if i >= f.k]
        p = max(parity) if parity else len(have.get(0, b""))
        if any(len(v) > p for v in have.values()):
            raise InvalidArgumentError(f"{key}: fragments longer than the parity ({p} bytes)")
        codec = self._codec(f.k, f.m)
        views = {i: memoryview(v) for i, v in have.items()}
        if p == 0:
            payload = memoryview(b"")
        else:
            try:
                payload = (await asyncio.to_thread(codec.reconstruct, views, p, [j]))[j]
            except TierFSError:
                raise
            except Exception as exc:  # pyeclib's own errors: bad input fragments
                raise CorruptError(f"{key}: reconstruction failed: {type(exc).__name__}: {exc}") from exc
        t2 = time.perf_counter()
        n = p
        if j < f.k:
            fsz = codec.frag_size(f.chunk_size)
            length = min(f.chunk_size, max(0, f.size - key.chunk * f.chunk_size)) if f.size else p * f.k
            n = max(0, min(length - j * fsz, p))
        out = payload[:n]
        await eng.write(key, out, crc32c(out))
        # Where a decode rebuild's time goes (Prometheus tierfs_repair_total).
        self.counters["fetch_us"] += int((t1 - t0) * 1e6)
        self.counters["decode_us"] += int((t2 - t1) * 1e6)
        self.counters["write_us"] += int((time.perf_counter() - t2) * 1e6)
        return n, False

    # ---- the rebuild worker ------------------------------------------------------

    async def group_chunks(self, group_id: int) -> list[tuple[int, int, int]]:
        """Every committed (inode, chunk, version) stored in ``group_id``."""
        out: list[tuple[int, int, int]] = []
        after = 0
        while True:
            reply = await self.meta.list_group_chunks(group_id, after_inode=after)
            out.extend((c.inode, c.chunk, c.version) for c in reply.chunks)
            if not reply.next_inode:
                return out
            after = reply.next_inode

    async def fill(self, group_id: int, target_id: int, prog: GroupProgress | None = None,
                   chunks: Iterable[tuple[int, int, int]] | None = None) -> tuple[int, list[str]]:
        """Rebuild every committed chunk's fragment of ``group_id`` that
        ``target_id`` (ours) lacks. Returns (fragments restored, errors)."""
        eng = self.engines.get(target_id)
        members = self.groups.get(group_id)
        if eng is None or members is None or target_id not in members:
            return 0, [f"target {target_id} is not ours or not in group {group_id}"]
        j = members.index(target_id)
        todo = list(chunks) if chunks is not None else await self.group_chunks(group_id)
        if prog is not None:
            prog.total = len(todo)
            prog.done = 0
        files: dict[int, _File | None] = {}
        errors: list[str] = []
        restored = 0
        sem = self._sem
        source = self.sources.get((group_id, target_id), 0)

        async def one(inode: int, chunk: int, version: int) -> None:
            nonlocal restored
            key = FragmentKey(inode, chunk, j, version)
            if key in eng:
                if prog is not None:
                    prog.done += 1
                return
            async with sem:
                f = await self.file(inode, files)
                if f is None or f.chunks.get(chunk) != version:
                    # Deleted or overwritten since the listing: nothing to restore.
                    if prog is not None:
                        prog.done += 1
                    return
                try:
                    n, _ = await self.restore(eng, key, f, members, source=source if self.readable(source) else 0)
                except TierFSError as exc:
                    self.counters["rebuild_errors"] += 1
                    errors.append(f"{key}: {exc}")
                    return
                restored += 1
                self.counters["fragments_rebuilt"] += 1
                self.counters["bytes_rebuilt"] += n
                if prog is not None:
                    prog.done += 1
                    prog.bytes += n

        await asyncio.gather(*(one(*c) for c in todo))
        return restored, errors

    async def rebuild_once(self) -> int:
        """One round: rebuild every group where one of our targets is listed
        as rebuilding, and tell meta about those finished. Returns the
        number of groups finished."""
        await self.refresh_map()
        ours = set(self.engines)
        jobs = [(gid, tid) for gid in sorted(self.rebuilding) for tid in sorted(self.rebuilding[gid] & ours)]
        # All groups at once: the shared semaphore bounds the fragments in
        # flight, and the work spreads over every group's peers.
        done = await asyncio.gather(*(self._rebuild_group(gid, tid) for gid, tid in jobs))
        return sum(done)

    async def _rebuild_group(self, gid: int, tid: int) -> bool:
        prog = self.progress.get((gid, tid))
        if prog is None or prog.state == "finished":
            prog = self.progress[(gid, tid)] = GroupProgress(gid, tid)
        prog.state = "rebuilding"
        try:
            _, errors = await self.fill(gid, tid, prog)
            if not errors:
                # Once more: chunks committed while the first pass ran (a
                # writer with an older map may have sent this position's
                # fragment to the replaced member). Present ones cost nothing.
                _, errors = await self.fill(gid, tid, prog)
        except TierFSError as exc:
            errors = [f"listing: {exc}"]
        if errors:
            prog.state, prog.error = "waiting", f"{len(errors)} fragments failed, e.g. {errors[0]}"
            log.warning("rebuild of group %d on target %d: %s", gid, tid, prog.error)
            return False
        try:
            await self.meta.finish_rebuild(gid, tid)
        except TierFSError as exc:
            prog.state, prog.error = "waiting", f"finish_rebuild: {exc}"
            return False
        prog.state, prog.error, prog.finished = "finished", "", time.monotonic()
        self.counters["groups_finished"] += 1
        log.info("rebuilt group %d on target %d: %d chunks, %d bytes in %.2fs", gid, tid, prog.total,
                 prog.bytes, prog.finished - prog.started)
        return True

    async def run(self) -> None:
        """The rebuild worker: poll the cluster map, rebuild, repeat."""
        while True:
            try:
                await self.rebuild_once()
            except TierFSError as exc:
                log.warning("rebuild round failed: %s", exc)
            except Exception:  # a bug must not stop the worker (nor the node's other loops)
                log.exception("rebuild round failed")
            await asyncio.sleep(self.poll_interval)

    def status(self) -> list[GroupProgress]:
        return [self.progress[k] for k in sorted(self.progress)]
