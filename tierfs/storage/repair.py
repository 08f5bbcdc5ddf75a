"""Repair: reconstructing lost fragments onto this node's targets.

Three callers share :class:`Repairer`:

* the **rebuild worker** (:meth:`Repairer.run`): meta replaced a dead (or
  removed, or draining) target in a placement group by one of ours and
  lists ours in the group's ``rebuilding`` set. For every committed chunk of
  the group (``ListGroupChunks``) whose fragment is not on our target, or
  whose position the chunk's record lists as missing, we fetch fragments of
  the same chunk from the other members over the data plane and rebuild
  ours — by a plain copy from the replaced member when meta names it as the
  group's ``rebuild_source`` and it still answers (a drained node),
  otherwise by Reed-Solomon reconstruction from any K survivors with the
  client's codec (:mod:`tierfs.client.codec`). Then ``FinishRebuild`` takes
  us out of ``rebuilding``;
* the **repair-queue worker** (:meth:`Repairer.run_queue`): meta lists the
  fragment positions of committed chunks known missing or bad (a degraded
  write records the positions it could not store at commit; the scrubber
  reports the ones it finds bad) with the member that must rebuild them.
  We rebuild ours — always, even when a file of that key exists, since it
  may be the bad one — and report them done (``MarkFragments``);
* the **scrubber** (:mod:`tierfs.storage.scrub`), for a fragment it found
  corrupt, missing or inconsistent with its chunk.

Everything is driven by the chunk's record in meta
(:class:`tierfs.chunk.ChunkRecord`): only fragments of the committed
*generation* are fetched, every fetched fragment must have the stored length
the record's ``length`` gives it (:func:`tierfs.chunk.fragment_size`), the
positions in the record's ``missing`` list are never used as sources, and
before anything is written the chunk's K data fragments (fetched or
reconstructed) must match the record's CRC32C (:func:`tierfs.chunk.chunk_crc`;
a replica copy: its own CRC32C). A rebuilt fragment is written at its stored
length, never trimmed to the file's current size or valid bytes (a truncate
does not rewrite fragments: a trimmed rebuild would no longer match its
parity).

Bandwidth is bounded by a token bucket over the bytes fetched from peers
(``rebuild_rate`` bytes/s). Reads and writes by clients go on meanwhile:
clients read around a rebuilding member (it answers NotFound for what it has
not rebuilt yet) and write new chunks to it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import ssl
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierfs.chunk import (
    ChunkRecord,
    chunk_crc,
    chunk_crc_of,
    chunk_records,
    crc32c,
    fragment_size,
    parity_size,
)
from tierfs.errors import (
    CorruptError,
    InsufficientTargetsError,
    InvalidArgumentError,
    NotFoundError,
    TierFSError,
)
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine, TargetState

__all__ = ["ChunkCheck", "GroupProgress", "RateLimiter", "Repairer", "WrongLengthError", "find_bad_fragments",
           "rebuild_in_place", "reencode_chunk", "solve_chunk"]

log = logging.getLogger("tierfs.storage.repair")

#: Repair-queue items asked for per round (meta caps a page at 10,000).
QUEUE_PAGE = 1000
#: At most this many unrebuildable chunks are kept for RepairStatus.
MAX_UNREBUILDABLE = 100


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
    """What reconstruction needs to know about one file: its layout and the
    records of its committed chunks (index -> :class:`ChunkRecord`)."""

    kind: int
    k: int
    m: int
    chunk_size: int
    size: int
    groups: list[int]
    chunks: dict[int, ChunkRecord]
    writing: bool
    data_version: int

    @property
    def replicated(self) -> bool:
        return self.kind == 2  # REDUNDANCY_KIND_REPLICA

    @property
    def width(self) -> int:
        return self.k + self.m

    def sizes(self, rec: ChunkRecord) -> list[int]:
        """The stored length of every fragment of a chunk with record ``rec``."""
        return [fragment_size(j, self.k, self.chunk_size, rec.length, replicated=self.replicated)
                for j in range(self.width)]

    def committed(self, key: FragmentKey) -> ChunkRecord | None:
        """The chunk's record if ``key`` names its committed generation."""
        rec = self.chunks.get(key.chunk)
        return rec if rec is not None and rec.generation == key.version else None


class WrongLengthError(CorruptError):
    """A fragment of the committed generation whose stored length is not the
    one its chunk's record gives it."""


@dataclass
class ChunkCheck:
    """The verdict of a whole-chunk check (:meth:`Repairer.check_chunk`)."""

    #: Positions whose fragment reads (its own CRC32C holds) but has the
    #: wrong content or length: only a whole-chunk check can tell.
    bad: dict[int, str] = field(default_factory=dict)
    #: Positions not judged: the target is down or did not answer, or the
    #: fragment is absent or fails its own CRC32C (its holder's scrub steps
    #: find and rebuild those).
    unchecked: dict[int, str] = field(default_factory=dict)
    #: Why the chunk could not be judged at all ('' when it was).
    error: str = ""
    fetched: int = 0


def _codec(k: int, m: int) -> Any:
    # Shared with the client's cache: building an ISA-L driver and its
    # header templates costs far more than one reconstruction.
    from tierfs.client.codec import codec_for
    from tierfs.proto.v1 import meta_pb2 as pb

    return codec_for(pb.Layout(kind=pb.REDUNDANCY_KIND_EC, data_shards=k, parity_shards=m))


# ---- the chunk math (CPU-bound: callers run it in a worker thread) ---------------


def _reconstruct_into(f: _File, srcs: dict[int, memoryview], outs: dict[int, memoryview]) -> None:
    """Fragments ``outs`` (index -> writable buffer of the chunk's parity
    size) from the K fragments ``srcs`` (each zero-extended to that size):
    ISA-L in place (:mod:`tierfs.isal`, the code pyeclib's backend
    computes), pyeclib where ISA-L cannot be loaded. Bad input: CorruptError."""
    from tierfs import isal

    try:
        if isal.available():
            isal.rebuild_into(f.k, f.m, srcs, outs)
            return
        p = next(iter(outs.values())).nbytes
        got = _codec(f.k, f.m).reconstruct(srcs, p, sorted(outs))
        for i, v in outs.items():
            v[:] = got[i]
    except TierFSError:
        raise
    except Exception as exc:  # pyeclib's or ISA-L's own errors: bad input fragments
        raise CorruptError(f"reconstruction failed: {type(exc).__name__}: {exc}") from exc


def _rebuilt(f: _File, rec: ChunkRecord, srcs: dict[int, memoryview],
             outs: dict[int, memoryview]) -> dict[int, memoryview]:
    """:func:`_reconstruct_into`, then each rebuilt fragment at its stored
    length; past it the chunk is zeros, or the sources disagree with one
    another (CorruptError)."""
    sizes = f.sizes(rec)
    _reconstruct_into(f, srcs, outs)
    out: dict[int, memoryview] = {}
    for i, v in outs.items():
        if v[sizes[i]:] != bytes(v.nbytes - sizes[i]):
            raise CorruptError(f"fragment {i} rebuilt from {sorted(srcs)} has data past its stored "
                               f"length {sizes[i]}")
        out[i] = v[: sizes[i]]
    return out


def _check_chunk_crc(rec: ChunkRecord, crc: int, used: Sequence[int]) -> None:
    """The chunk's data (from fragments ``used``) must match the record's CRC32C."""
    if crc != rec.crc:
        raise CorruptError(f"data fragments (from {list(used)}) have crc32c {crc:#010x}, the chunk record "
                           f"{rec.crc:#010x}")


def solve_chunk(f: _File, rec: ChunkRecord, have: dict[int, bytes] | dict[int, memoryview],
                want: Iterable[int] = ()) -> dict[int, memoryview]:
    """Every data fragment of the chunk, plus ``want``, at their stored
    lengths, from the K fragments of ``have`` that come first (data before
    parity); raises CorruptError unless the data match the record's CRC32C."""
    k = f.k
    out = {i: memoryview(v) for i, v in have.items()}
    need = sorted(({i for i in range(k)} | set(want)) - set(out))
    used = list(range(k))
    if need:
        if len(out) < k:
            raise InsufficientTargetsError(f"{len(out)} fragments, {k} needed")
        p = parity_size(k, f.chunk_size, rec.length)
        used = sorted(out)[:k]
        srcs: dict[int, memoryview] = {}
        for i in used:
            v = out[i]
            if v.nbytes != p:  # a shorter data fragment, zero-extended
                b = memoryview(bytearray(p))
                b[: min(v.nbytes, p)] = v[:p]
                v = b
            srcs[i] = v
        out.update(_rebuilt(f, rec, srcs, {i: memoryview(bytearray(p)) for i in need}))
    _check_chunk_crc(rec, chunk_crc(out[i] for i in range(k)), used)
    return out


def rebuild_in_place(f: _File, rec: ChunkRecord, have: dict[int, memoryview], crcs: dict[int, int],
                     room: dict[int, memoryview], outs: dict[int, memoryview], j: int) -> tuple[memoryview, int]:
    """Fragment ``j`` of the chunk (at its stored length) and its CRC32C from
    the fetched fragments ``have`` (the K first: data before parity) and
    their CRC32Cs ``crcs``, without copies: each source lies at the start of
    its buffer in ``room`` (at least the parity size long; a shorter data
    fragment is zero-extended there), and the fragments rebuilt (``j`` and
    any data fragment not fetched) go into ``outs`` (index -> buffer of at
    least the parity size). The check is :func:`solve_chunk`'s: the data
    fragments' CRC32Cs (fetched ones as the data plane checked them on
    arrival, rebuilt ones computed here) must combine to the record's, or
    CorruptError and nothing to write."""
    k = f.k
    sizes = f.sizes(rec)
    if j in have:
        raise InvalidArgumentError(f"fragment {j} is one of the sources")
    if len(have) < k:
        raise InsufficientTargetsError(f"{len(have)} fragments, {k} needed")
    p = parity_size(k, f.chunk_size, rec.length)
    used = sorted(have)[:k]
    need = sorted(({i for i in range(k)} | {j}) - set(have))
    if sorted(outs) != need:
        raise InvalidArgumentError(f"buffers for {sorted(outs)} given, {need} to rebuild")
    srcs: dict[int, memoryview] = {}
    for i in used:
        b = room[i]
        if sizes[i] < p:
            b[sizes[i]:p] = bytes(p - sizes[i])
        srcs[i] = b[:p]
    got = _rebuilt(f, rec, srcs, {i: outs[i][:p] for i in need})
    crc = {i: crcs[i] for i in used}
    for i, v in got.items():
        crc[i] = crc32c(v)
    _check_chunk_crc(rec, chunk_crc_of((crc[i], sizes[i]) for i in range(k)), used)
    return got[j], crc[j]


def reencode_chunk(f: _File, rec: ChunkRecord, data: dict[int, memoryview]) -> list[memoryview]:
    """All fragments of a chunk re-encoded from its K data fragments."""
    codec = _codec(f.k, f.m)
    frag = codec.frag_size(f.chunk_size)
    buf = bytearray(codec.encode_size(f.chunk_size))
    for i in range(f.k):
        buf[i * frag: i * frag + len(data[i])] = data[i]
    return list(codec.encode(memoryview(buf), rec.length, f.chunk_size))


def find_bad_fragments(f: _File, rec: ChunkRecord, have: dict[int, bytes]) -> dict[int, str] | None:
    """Positions of ``have`` that differ from the chunk the others
    decode to (matching the record's CRC32C), fewest first; None if no
    subset of K or more does."""
    for r in range(len(have) - f.k + 1):
        for left_out in itertools.combinations(sorted(have), r):
            rest = {i: v for i, v in have.items() if i not in left_out}
            try:
                data = solve_chunk(f, rec, rest)
            except (CorruptError, InsufficientTargetsError):
                continue
            right = reencode_chunk(f, rec, data)
            bad = {i: "differs from the chunk the other fragments decode to (crc32c checked)"
                   for i, v in have.items() if memoryview(v) != right[i]}
            if len(bad) <= r:  # the left-out ones, or fewer: a consistent explanation
                return bad
    return None


class Repairer:
    """Rebuilds fragments on this node's targets (see the module docstring).

    ``meta``: a :class:`tierfs.meta.MetaClient`; ``engines``: this node's
    targets (by id, looked up at call time so newly registered ids count)."""

    def __init__(self, meta: Any, engines: Any, *, rate: int = 0, concurrency: int = 16,
                 poll_interval: float = 2.0, request_timeout: float = 10.0,
                 tls: ssl.SSLContext | None = None) -> None:
        from tierfs.net import DataClient

        self.meta = meta
        self._engines = engines
        self.limiter = RateLimiter(rate)
        self.concurrency = max(1, concurrency)
        self.poll_interval = poll_interval
        self.request_timeout = request_timeout
        # tls: this daemon's client context (its CA, its certificate) for peers' TLS data ports.
        self.data = DataClient(transport="tcp", request_timeout=request_timeout, tls=tls)
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
             "groups_finished", "fetch_us", "decode_us", "write_us", "crc_mismatches", "queue_rounds",
             "queue_rebuilt", "queue_errors", "wrong_sources", "gc_waiting_copied",
             "gc_waiting_corrupt"), 0)
        #: The repair queue as last seen: positions pending cluster-wide, and
        #: the last error of an item of ours ('' if the last round had none).
        self.queue_pending = 0
        self.queue_error = ""
        #: (inode, chunk, generation) -> why: chunks of ours the last queue
        #: round could not rebuild because too few fragments could be read
        #: (``tierfs status`` lists them: lost unless a holder comes back).
        self.unrebuildable: dict[tuple[int, int, int], str] = {}
        self._wake = asyncio.Event()
        self._rebuild_wake = asyncio.Event()

    @property
    def engines(self) -> dict[int, ChunkEngine]:
        src = self._engines() if callable(self._engines) else self._engines
        return {e.target_id: e for e in src if e.target_id}

    async def close(self) -> None:
        await self.data.close()

    # ---- cluster map ---------------------------------------------------------------

    async def refresh_map(self) -> None:
        from tierfs.proto.v1 import meta_pb2 as pb

        # Meta answers "unchanged" (a few bytes) when our version is current:
        # every worker polls it (each rebuild_interval), busy or not.
        cmap = await self.meta.get_cluster_map(known_version=int(self.cmap.version) if self.cmap is not None else 0)
        if cmap.unchanged and self.cmap is not None:
            return
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
        """The layout, size and committed chunk records of ``inode`` (None if
        it is gone or not a regular file)."""
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
            f = _File(kind=lay.kind, k=lay.data_shards, m=lay.parity_shards, chunk_size=lay.chunk_size,
                      size=info.attr.size, groups=list(lay.groups), chunks=chunk_records(info),
                      writing=info.writing, data_version=info.attr.data_version)
        if cache is not None:
            cache[inode] = f
        return f

    async def load_files(self, inodes: Iterable[int], cache: dict[int, _File | None]) -> None:
        """:meth:`file` of every inode not in ``cache`` yet, a few at once:
        one meta round trip per file, before its chunks are rebuilt in
        parallel (which would otherwise each miss the cache and ask)."""
        sem = asyncio.Semaphore(8)

        async def one(ino: int) -> None:
            async with sem:
                await self.file(ino, cache)

        await asyncio.gather(*(one(i) for i in sorted(set(inodes)) if i not in cache))

    # ---- fetching and solving one chunk -------------------------------------------

    async def _fetch(self, key: FragmentKey, members: Sequence[int], positions: Iterable[int],
                     sizes: Sequence[int]) -> tuple[dict[int, bytes], dict[int, TierFSError]]:
        """Fragments ``positions`` of ``key``'s chunk and generation, each
        checked against the stored length its record gives it."""
        pos = list(positions)
        res = await asyncio.gather(
            *(self.data.read(members[i], FragmentKey(key.inode, key.chunk, i, key.version),
                             timeout=self.request_timeout) for i in pos),
            return_exceptions=True)
        have: dict[int, bytes] = {}
        errs: dict[int, TierFSError] = {}
        for i, r in zip(pos, res, strict=True):
            if isinstance(r, bytes):
                self.counters["bytes_fetched"] += len(r)
                if len(r) == sizes[i]:
                    have[i] = r
                else:
                    errs[i] = WrongLengthError(f"{len(r)} bytes, its chunk record gives it {sizes[i]}")
            elif isinstance(r, TierFSError):
                errs[i] = r
            else:
                raise r  # type: ignore[misc]
        return have, errs

    async def _fetch_pooled(self, eng: ChunkEngine, key: FragmentKey, where: dict[int, int], sizes: Sequence[int],
                            held: list[memoryview], *, room: int = 0, crcs: dict[int, int] | None = None,
                            rooms: dict[int, memoryview] | None = None,
                            ) -> tuple[dict[int, memoryview], dict[int, TierFSError]]:
        """Fragments of ``key``'s chunk and generation (position -> target
        in ``where``) read straight into buffers of ``eng``'s pool, all in one
        batch (one frame train per peer), each checked against its stored
        length: one byte more than that is asked, so a longer fragment is
        caught too. Every buffer is appended to ``held`` (each at least
        ``room`` bytes long); the caller releases them (``eng.release``) once
        it is done with the views. ``crcs`` gets the CRC32C of each fragment
        fetched (checked by the data plane on arrival), ``rooms`` its whole
        buffer."""
        pos = list(where)
        bufs = [eng.alloc(max(sizes[i] + 1, room)) for i in pos]
        held.extend(bufs)
        got_crcs: list[int] = []
        res = await self.data.read_batch(
            [(where[i], FragmentKey(key.inode, key.chunk, i, key.version), b[:sizes[i] + 1], 0)
             for i, b in zip(pos, bufs, strict=True)],
            timeout=self.request_timeout, crcs=got_crcs)
        have: dict[int, memoryview] = {}
        errs: dict[int, TierFSError] = {}
        for n, (i, b, r) in enumerate(zip(pos, bufs, res, strict=True)):
            if isinstance(r, int):
                self.counters["bytes_fetched"] += min(r, sizes[i])
                if r == sizes[i]:
                    have[i] = b[:r]
                    if crcs is not None:
                        crcs[i] = got_crcs[n] if r else 0
                    if rooms is not None:
                        rooms[i] = b
                else:
                    got = f"more than {sizes[i]}" if r > sizes[i] else str(r)
                    errs[i] = WrongLengthError(f"{got} bytes, its chunk record gives it {sizes[i]}")
            elif isinstance(r, TierFSError):
                errs[i] = r
            else:
                raise r
        return have, errs

    async def check_chunk(self, key: FragmentKey, f: _File, rec: ChunkRecord, members: Sequence[int],
                          skip: Iterable[int] = ()) -> ChunkCheck:
        """Fetch every fragment of the chunk ``key`` names (its committed
        generation; the position in ``key`` is ignored) and judge them
        together: each must have its stored length, the data must match the
        record's CRC32C and the parity must be the data re-encoded. Which
        positions are wrong is found by leaving fragments out until the rest
        decode to the recorded CRC32C. Positions in the record's missing
        list and in ``skip`` (members being rebuilt) are not asked."""
        out = ChunkCheck()
        sizes = f.sizes(rec)
        excluded = set(rec.missing) | set(skip)
        ask = [i for i in range(f.width) if i not in excluded and self.readable(members[i])]
        for i in range(f.width):
            if i not in excluded and i not in ask:
                out.unchecked[i] = f"target {members[i]} is not readable"
        have, errs = await self._fetch(key, members, ask, sizes)
        out.fetched = sum(len(v) for v in have.values())
        for i, e in errs.items():
            if isinstance(e, WrongLengthError):
                out.bad[i] = str(e)
            else:
                out.unchecked[i] = f"{type(e).__name__}: {e}"
        if f.replicated:
            for i, v in have.items():
                c = crc32c(v)
                if c != rec.crc:
                    out.bad[i] = f"copy has crc32c {c:#010x}, the chunk record {rec.crc:#010x}"
            if not have:
                out.error = "no copy could be read"
            return out
        if len(have) < f.k:
            out.error = f"only {len(have)} of the {f.k} fragments needed to judge it could be read"
            return out
        verdict = await asyncio.to_thread(find_bad_fragments, f, rec, have)
        if verdict is None:
            out.error = (f"no {f.k} of the fragments {sorted(have)} decode to the recorded crc32c "
                         f"{rec.crc:#010x}: cannot tell which are bad")
        else:
            out.bad.update(verdict)
        return out

    # ---- one fragment ---------------------------------------------------------------

    async def restore(self, eng: ChunkEngine, key: FragmentKey, f: _File, members: list[int], *,
                      source: int = 0) -> tuple[int, bool]:
        """Rebuild fragment ``key`` (of its chunk's committed generation) onto
        ``eng`` from the other ``members`` of its group (fragment j on
        ``members[j]``), at the stored length the chunk's record gives it.
        Returns (bytes written, whether it was a plain copy). Raises
        InsufficientTargetsError when too few fragments could be fetched and
        CorruptError (writing nothing) when what they decode to does not
        match the record's CRC32C."""
        j = key.fragment
        width = f.width
        if j >= width or len(members) != width:
            raise InvalidArgumentError(f"{key}: fragment index outside a group of {len(members)}")
        rec = f.committed(key)
        if rec is None:
            raise InvalidArgumentError(f"{key}: not the committed generation of its chunk")
        sizes = f.sizes(rec)
        if source and source != eng.target_id and j not in rec.missing:
            # A drained (still healthy) member: copy its fragment, no decode.
            # The pooled buffer goes to the engine as is (no copy).
            held: list[memoryview] = []
            try:
                with contextlib.suppress(TierFSError):
                    got, _ = await self._fetch_pooled(eng, key, {j: source}, sizes, held)
                    data = got.get(j)
                    if data is not None:
                        await self.limiter.take(len(data))
                        c = await asyncio.to_thread(crc32c, data)
                        if not f.replicated or c == rec.crc:
                            await eng.write(key, data, c)
                            self.counters["fragments_copied"] += 1
                            return len(data), True
            finally:
                for b in held:
                    eng.release(b)
        skip = set(rec.missing) | {j}
        others = [i for i in range(width) if i not in skip and members[i] != eng.target_id]
        # Readable members first, data fragments before parity.
        order = sorted(others, key=lambda i: (not self.readable(members[i]), i))
        # Last, only when the others are too few: positions listed missing,
        # whose holders may have the fragment all the same (a write that
        # landed after the degraded commit, a node back with its disk). Safe:
        # what the sources decode to (a copy, for replicas) is checked
        # against the record's CRC32C before anything is written.
        late = [i for i in sorted(set(rec.missing) - {j}) if i < width and members[i] != eng.target_id]
        order += sorted(late, key=lambda i: (not self.readable(members[i]), i))
        if f.replicated:
            return await self._restore_copy(eng, key, rec, members, order, sizes[j])
        have: dict[int, memoryview] = {}
        crcs: dict[int, int] = {}
        rooms: dict[int, memoryview] = {}
        p = parity_size(f.k, f.chunk_size, rec.length)
        t0 = time.perf_counter()
        errs: dict[int, TierFSError] = {}
        pos = 0
        mismatch: CorruptError | None = None
        bufs: list[memoryview] = []
        outs: dict[int, memoryview] = {}
        try:
            while len(have) < f.k and pos < len(order):
                pick = order[pos: pos + f.k - len(have)]
                pos += len(pick)
                # Each buffer has room for the parity size: a short data
                # fragment is zero-extended in place for the decode.
                got, bad = await self._fetch_pooled(eng, key, {i: members[i] for i in pick}, sizes, bufs,
                                                    room=p, crcs=crcs, rooms=rooms)
                have.update(got)
                errs.update(bad)
            if len(have) < f.k:
                detail = "; ".join(f"fragment {i} on target {members[i]}: {type(e).__name__}: {e}"
                                   for i, e in sorted(errs.items()))
                raise InsufficientTargetsError(f"{key}: only {len(have)} of the {f.k} fragments needed: {detail}")
            await self.limiter.take(sum(len(v) for v in have.values()))
            # Rebuilt fragments land in pooled buffers too (fresh memory is
            # slow to touch); the engine writes fragment j's as it is.
            outs = {i: eng.alloc(p) for i in sorted(({*range(f.k)} | {j}) - set(have))}
            t1 = time.perf_counter()
            work = asyncio.ensure_future(asyncio.to_thread(rebuild_in_place, f, rec, have, crcs, rooms, outs, j))
            try:
                # Decode (only the missing fragments, in place), the chunk
                # CRC check and the payload's CRC in one worker-thread hop
                # (the loop keeps the other fetches going).
                payload, crc = await asyncio.shield(work)
            except asyncio.CancelledError:
                # The thread still reads and writes these buffers: they go
                # back to the pool only once it is done.
                held = [*bufs, *outs.values()]
                bufs.clear()
                outs = {}

                def give_back(w: asyncio.Future[tuple[memoryview, int]]) -> None:
                    if not w.cancelled():
                        w.exception()  # retrieved: nobody waits for it any more
                    for b in held:
                        eng.release(b)

                work.add_done_callback(give_back)
                raise
            except CorruptError as exc:
                self.counters["crc_mismatches"] += 1
                if len(order) <= f.k:
                    raise CorruptError(f"{key}: {exc}; nothing written") from exc
                mismatch = exc  # more candidates than K: judge them all (below)
            finally:
                # The rebuilt payload has its own buffer: the sources can go back now.
                have.clear()
                rooms.clear()
                for b in bufs:
                    eng.release(b)
                bufs.clear()
            t2 = time.perf_counter()
            if mismatch is None:
                await eng.write(key, payload, crc)
        finally:
            for b in bufs:
                eng.release(b)
            for b in outs.values():
                eng.release(b)
        if mismatch is not None:
            return await self._restore_judged(eng, key, f, rec, members, order, sizes, mismatch)
        # Where a decode rebuild's time goes (Prometheus tierfs_repair_total).
        self.counters["fetch_us"] += int((t1 - t0) * 1e6)
        self.counters["decode_us"] += int((t2 - t1) * 1e6)
        self.counters["write_us"] += int((time.perf_counter() - t2) * 1e6)
        return len(payload), False

    async def _restore_judged(self, eng: ChunkEngine, key: FragmentKey, f: _File, rec: ChunkRecord,
                              members: list[int], order: list[int], sizes: Sequence[int],
                              mismatch: CorruptError) -> tuple[int, bool]:
        """The K sources decoded to a chunk that does not match the record, so
        one of them is wrong although its own CRC32C held. As the read path
        does (``Client._heal_chunk``) and the whole-chunk scrub: fetch every
        candidate, find the ones that differ from what the others decode to
        (fewest first), rebuild fragment ``key`` from the rest and report the
        wrong ones to meta (their holders rebuild them from the repair
        queue). No K of them decoding to the record's CRC32C: CorruptError,
        nothing written. Before this, the repair gave up at the first K and
        its queue retried the same K for ever, although a good rebuild was
        possible (docs/repair.md, "Sources")."""
        j = key.fragment
        have, errs = await self._fetch(key, members, order, sizes)
        await self.limiter.take(sum(len(v) for v in have.values()))
        verdict = await asyncio.to_thread(find_bad_fragments, f, rec, have) if len(have) > f.k else None
        if verdict is None:
            detail = "; ".join(f"fragment {i} on target {members[i]}: {type(e).__name__}: {e}"
                               for i, e in sorted(errs.items()))
            raise CorruptError(f"{key}: {mismatch}; and no {f.k} of the fragments {sorted(have)} decode to the "
                               f"record's crc32c {rec.crc:#010x}: nothing written" + (f" ({detail})" if detail else ""))
        good = {i: v for i, v in have.items() if i not in verdict}
        out = await asyncio.to_thread(solve_chunk, f, rec, good, [j])
        payload = out[j]
        await eng.write(key, payload, crc32c(payload))
        self.counters["wrong_sources"] += len(verdict)
        log.warning("%s: rebuilt from %s; fragment(s) %s differ from what the others decode to (their own "
                    "crc32c held): reported for repair", key, sorted(good)[: f.k],
                    ", ".join(f"{i} on target {members[i]}" for i in sorted(verdict)))
        if verdict:
            try:
                await self.mark([dataclasses.replace(key, fragment=i) for i in sorted(verdict)], done=False)
            except TierFSError as exc:  # the whole-chunk scrub finds them again
                log.warning("%s: reporting the wrong fragments failed: %s", key, exc)
        return len(payload), False

    async def _restore_copy(self, eng: ChunkEngine, key: FragmentKey, rec: ChunkRecord, members: list[int],
                            order: list[int], size: int) -> tuple[int, bool]:
        """A replica: the first other copy whose CRC32C is the record's."""
        errors: list[str] = []
        wrong = False
        for i in order:
            other = FragmentKey(key.inode, key.chunk, i, key.version)
            try:
                data = await self.data.read(members[i], other, timeout=self.request_timeout)
            except TierFSError as exc:
                errors.append(f"copy {i} on target {members[i]}: {exc}")
                continue
            await self.limiter.take(len(data))
            self.counters["bytes_fetched"] += len(data)
            c = crc32c(data)
            if len(data) != size or c != rec.crc:
                wrong = True
                self.counters["crc_mismatches"] += 1
                errors.append(f"copy {i} on target {members[i]}: {len(data)} bytes, crc32c {c:#010x}; the chunk "
                              f"record gives {size} bytes, {rec.crc:#010x}")
                continue
            await eng.write(key, memoryview(data), c)
            return len(data), True
        raise (CorruptError if wrong else InsufficientTargetsError)(
            f"{key}: no good copy readable: {'; '.join(errors)}; nothing written")

    # ---- reporting to the repair queue -------------------------------------------

    async def mark(self, keys: Iterable[FragmentKey], *, done: bool) -> int:
        """Tell meta that these fragments (of their committed generations) were
        rebuilt (``done``) or are missing or bad (the holder's repair-queue
        worker then rebuilds them, and readers stop asking them)."""
        from tierfs.proto.v1 import meta_pb2 as pb

        items = [pb.RepairItem(inode=k.inode, chunk=k.chunk, version=k.version, fragment=k.fragment) for k in keys]
        if not items:
            return 0
        return int(await self.meta.mark_fragments(items, done=done))

    # ---- the repair-queue worker ---------------------------------------------------

    def wake(self) -> None:
        """Run a repair-queue round now (start, heartbeats resuming)."""
        self._wake.set()

    async def queue_once(self, limit: int = QUEUE_PAGE) -> tuple[int, int]:
        """One round of the repair queue: rebuild every fragment position of
        ours that meta lists as missing or bad (always, even if a file of the
        key exists: it may be the bad one), then report them done. Groups
        where our target is being rebuilt are left to the rebuild worker,
        which treats listed positions the same way. Returns (rebuilt,
        failed)."""
        await self.refresh_map()
        # A full (READ_ONLY) target is left alone: rebuilding onto it would
        # eat its reserve; its items wait until space returns.
        ours = {t: e for t, e in self.engines.items() if e.state() != TargetState.READ_ONLY}
        if not ours:
            return 0, 0
        reply = await self.meta.list_repairs(sorted(ours), limit=limit)
        self.queue_pending = int(reply.pending)
        self.counters["queue_rounds"] += 1
        files: dict[int, _File | None] = {}
        await self.load_files((int(it.inode) for it in reply.items), files)
        done: list[FragmentKey] = []
        failed: list[str] = []
        lost: dict[tuple[int, int, int], str] = {}

        async def one(it: Any) -> None:
            eng = ours.get(int(it.target_id))
            members = self.groups.get(int(it.group_id))
            if eng is None or members is None or members[it.fragment: it.fragment + 1] != [eng.target_id]:
                return  # the map moved since meta answered: next round
            if eng.target_id in self.rebuilding.get(int(it.group_id), ()):
                return
            key = FragmentKey(int(it.inode), int(it.chunk), int(it.fragment), int(it.version))
            async with self._sem:
                try:
                    f = await self.file(key.inode, files)
                    if f is None or f.committed(key) is None:
                        return  # rewritten or deleted since: meta drops the item itself
                    n, _ = await self.restore(eng, key, f, members)
                except TierFSError as exc:
                    self.counters["queue_errors"] += 1
                    failed.append(f"{key} on target {eng.target_id}: {type(exc).__name__}: {exc}")
                    if isinstance(exc, InsufficientTargetsError) and len(lost) < MAX_UNREBUILDABLE:
                        lost[(key.inode, key.chunk, key.version)] = str(exc)
                    return
            done.append(key)
            self.counters["queue_rebuilt"] += 1
            self.counters["fragments_rebuilt"] += 1
            self.counters["bytes_rebuilt"] += n

        await asyncio.gather(*(one(it) for it in reply.items))
        if done:
            await self.mark(done, done=True)
            self.queue_pending = max(0, self.queue_pending - len(done))
            log.info("repair queue: rebuilt %d fragments", len(done))
        self.queue_error = failed[0] if failed else ""
        self.unrebuildable = lost
        if failed:
            log.warning("repair queue: %d fragments failed (retried next round), e.g. %s", len(failed), failed[0])
        return len(done), len(failed)

    async def run_queue(self, interval: float) -> None:
        """The repair-queue worker: a round at once, then every ``interval``
        or when woken (:meth:`wake`); at once again after a full page that
        made progress."""
        while True:
            self._wake.clear()
            again = False
            try:
                rebuilt, _ = await self.queue_once()
                again = rebuilt >= QUEUE_PAGE
            except TierFSError as exc:
                self.counters["queue_errors"] += 1
                self.queue_error = f"{type(exc).__name__}: {exc}"
                log.warning("repair-queue round failed: %s", exc)
            except Exception:  # a bug must not stop the worker (nor the node's other loops)
                log.exception("repair-queue round failed")
            if not again:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), interval)

    # ---- the rebuild worker ------------------------------------------------------

    async def group_chunks(self, group_id: int) -> list[tuple[int, int, int]]:
        """Every committed (inode, chunk, generation) stored in ``group_id``."""
        out: list[tuple[int, int, int]] = []
        after = 0
        while True:
            reply = await self.meta.list_group_chunks(group_id, after_inode=after)
            out.extend((c.inode, c.chunk, c.version) for c in reply.chunks)
            if not reply.next_inode:
                return out
            after = reply.next_inode

    async def fill(self, group_id: int, target_id: int, prog: GroupProgress | None = None,
                   chunks: Iterable[tuple[int, int, int]] | None = None, *,
                   recheck: bool = False) -> tuple[int, list[str]]:
        """Rebuild every committed chunk's fragment of ``group_id`` that
        ``target_id`` (ours) lacks, or holds at a position the chunk's record
        lists as missing (then reported done). Returns (fragments restored,
        errors).

        ``recheck``: a second pass over a group ``prog`` already counted
        (see :meth:`_rebuild_group`): its chunks done so far stay done, so
        the progress shown never goes back (until stop 49 it restarted at
        0 of the total while keeping the bytes written: "0/34 chunks,
        4.1 MiB written" for a copy nearly finished). Without it the
        counts start at 0, the bytes too."""
        eng = self.engines.get(target_id)
        members = self.groups.get(group_id)
        if eng is None or members is None or target_id not in members:
            return 0, [f"target {target_id} is not ours or not in group {group_id}"]
        j = members.index(target_id)
        todo = list(chunks) if chunks is not None else await self.group_chunks(group_id)
        base = 0
        if prog is not None:
            if recheck:
                # Every chunk of this pass counted again from 0, shown as the
                # larger of that and what the first pass finished: never back.
                base = prog.done
                prog.total = max(prog.total, len(todo))
            else:  # a round's first pass (after a failed round too): counted afresh, bytes included
                prog.total, prog.bytes = len(todo), 0
            prog.done = base
        counted = 0

        def count(n: int = 0) -> None:
            nonlocal counted
            counted += 1
            if prog is not None:
                prog.done = max(base, counted)
                prog.bytes += n
        files: dict[int, _File | None] = {}
        await self.load_files((c[0] for c in todo), files)
        errors: list[str] = []
        listed: list[FragmentKey] = []
        restored = 0
        sem = self._sem
        source = self.sources.get((group_id, target_id), 0)

        async def one(inode: int, chunk: int, version: int) -> None:
            nonlocal restored
            key = FragmentKey(inode, chunk, j, version)
            async with sem:
                f = await self.file(inode, files)
                rec = f.committed(key) if f is not None else None
                if f is None or rec is None or (key in eng and j not in rec.missing):
                    # Present, or deleted or overwritten since the listing.
                    count()
                    return
                try:
                    n, _ = await self.restore(eng, key, f, members, source=source if self.readable(source) else 0)
                except TierFSError as exc:
                    self.counters["rebuild_errors"] += 1
                    errors.append(f"{key}: {exc}")
                    return
                if j in rec.missing:
                    listed.append(key)
                restored += 1
                self.counters["fragments_rebuilt"] += 1
                self.counters["bytes_rebuilt"] += n
                count(n)

        await asyncio.gather(*(one(*c) for c in todo))
        if listed:
            try:
                await self.mark(listed, done=True)
            except TierFSError as exc:
                errors.append(f"reporting {len(listed)} rebuilt fragments to meta: {exc}")
        return restored, errors

    async def waiting_chunks(self, group_id: int, holder: int) -> list[tuple[int, int, int, int]]:
        """(inode, chunk, generation, fragment index) of the generations of
        ``group_id`` waiting for GC whose fragment ``holder`` still holds.
        Empty from a meta older than stop 52 (it lists committed chunks,
        with no GC item id, instead)."""
        out: list[tuple[int, int, int, int]] = []
        after = 0
        while True:
            reply = await self.meta.list_group_chunks(group_id, gc_holder=holder, after_gc_id=after)
            if any(not c.gc_id for c in reply.chunks):
                return []
            out.extend((c.inode, c.chunk, c.version, c.fragment) for c in reply.chunks)
            if not reply.next_gc_id:
                return out
            after = reply.next_gc_id

    async def copy_waiting(self, group_id: int, target_id: int, source: int) -> tuple[int, list[str]]:
        """Copy onto ``target_id`` (ours, a move's new member) from ``source``
        (the member it replaces) the fragments of the group's generations
        that wait for GC: replaced, truncated away or removed less than
        gc_grace ago. A reader that still holds one (a handle open on a file
        since overwritten, or removed) reads it from the group's members;
        without this copy it found none once the move finished
        (GenerationGoneError; the soak's find at stop 51). No decode: these
        generations have no chunk record left to check one against, so a
        plain copy, whose bytes the data plane checked against the source's
        stored CRC32C. A fragment the source does not have (never stored
        there, deleted meanwhile) or holds corrupt is skipped; other
        errors are returned (the move waits and tries again next round, or
        until GC lets the generation go). The copy is deleted as a stale fragment or orphan by
        scrub, after ``orphan_grace`` (its GC item names the old members
        only). Returns (fragments copied, errors)."""
        eng = self.engines.get(target_id)
        members = self.groups.get(group_id)
        if eng is None or members is None or target_id not in members:
            return 0, [f"target {target_id} is not ours or not in group {group_id}"]
        j = members.index(target_id)
        todo = [(ino, c, v) for ino, c, v, frag in await self.waiting_chunks(group_id, source) if frag == j]
        errors: list[str] = []
        copied = 0

        async def one(inode: int, chunk: int, version: int) -> None:
            nonlocal copied
            key = FragmentKey(inode, chunk, j, version)
            if key in eng:
                return
            async with self._sem:
                try:
                    data = await self.data.read(source, key, timeout=self.request_timeout)
                except NotFoundError:
                    return
                except CorruptError as exc:
                    # The source's copy is damaged: there is nothing to copy
                    # (a reader decodes around it, or fails, as it would
                    # have there). Retrying held the move until GC let the
                    # generation go, gc_grace later (the soak at stop 53).
                    self.counters["gc_waiting_corrupt"] += 1
                    log.warning("move of group %d onto target %d: %s waiting for GC is corrupt on target %d, "
                                "not copied: %s", group_id, target_id, key, source, exc)
                    return
                except TierFSError as exc:
                    errors.append(f"{key} waiting for GC, from target {source}: {exc}")
                    return
                await self.limiter.take(len(data))
                self.counters["bytes_fetched"] += len(data)
                try:
                    await eng.write(key, memoryview(data), await asyncio.to_thread(crc32c, data))
                except TierFSError as exc:
                    errors.append(f"{key} waiting for GC: {exc}")
                    return
                copied += 1
                self.counters["gc_waiting_copied"] += 1

        await asyncio.gather(*(one(*t) for t in todo))
        return copied, errors

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
                # fragment to the replaced member). Present ones cost one stat per file.
                _, errors = await self.fill(gid, tid, prog, recheck=True)
            source = self.sources.get((gid, tid), 0)
            if not errors and source and self.readable(source):
                # A move (the member it replaces still answers): the
                # generations readers may still hold come along too.
                _, errors = await self.copy_waiting(gid, tid, source)
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

    def map_changed(self) -> None:
        """The cluster map changed (the daemon's map watch saw it): look
        for groups to rebuild now rather than at the next poll."""
        self._rebuild_wake.set()

    async def run(self) -> None:
        """The rebuild worker: read the cluster map, rebuild, repeat every
        ``poll_interval`` or at once when the map changes (:meth:`map_changed`)."""
        while True:
            self._rebuild_wake.clear()
            try:
                await self.rebuild_once()
            except TierFSError as exc:
                log.warning("rebuild round failed: %s", exc)
            except Exception:  # a bug must not stop the worker (nor the node's other loops)
                log.exception("rebuild round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rebuild_wake.wait(), self.poll_interval)

    def status(self) -> list[GroupProgress]:
        return [self.progress[k] for k in sorted(self.progress)]
