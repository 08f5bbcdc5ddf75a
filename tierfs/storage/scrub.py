"""The scrubber: verify every fragment of this node, check whole chunks,
repair, find stale fragments and orphans.

One pass (:meth:`Scrubber.scrub`) over every target of the node:

1. **verify**: re-read each fragment whole (header and payload CRC32C,
   :meth:`ChunkEngine.verify`) at ``rate`` bytes/s. A corrupt one is moved to
   ``quarantine/`` and, with ``repair``, rebuilt from the other fragments of
   its chunk (:class:`tierfs.storage.repair.Repairer`); one whose file
   vanished under the index counts as missing and is rebuilt the same way.
2. **missing**: for every placement group a target of ours belongs to (and
   is not being rebuilt: the rebuild worker owns those), every committed
   chunk must have our fragment of its committed *generation*
   (``ChunkRecord.generation``); the ones that do not (a file deleted by
   hand, writes that happened while the target was away), and the positions
   the chunk's record lists as missing (a degraded write, an earlier
   finding), are rebuilt and reported done to meta.
3. **whole chunks**: every committed chunk is checked whole by exactly one
   node per pass, the one holding the first readable position of the
   chunk's group (not listed missing, not being rebuilt): all its fragments
   are fetched, each must have the stored length the record gives it, the
   data must match the record's CRC32C and the parity the data re-encoded
   (:meth:`Repairer.check_chunk`). A fragment with valid CRCs of its own but
   the wrong content (the same key written twice with different bytes) is
   caught only here. The bad positions are reported to meta
   (``MarkFragments``, not done): readers stop asking them and the holder's
   repair-queue worker rebuilds them; ours are rebuilt at once.
4. **stale fragments and orphans**: a fragment of a live committed chunk
   whose generation is not the committed one (nor an upload of the file's
   open write session) is *stale*: an earlier upload of the chunk, never
   data. Any other fragment no file needs is an *orphan*: its inode is gone,
   its chunk was never committed (and it is not an open write's), or our
   target no longer holds that position of the chunk's group (it was
   replaced while away) and that position is not being rebuilt from us.
   Both are deleted once their file is older than ``orphan_grace`` (younger
   ones may belong to a write that meta has not seen yet). Fragments of
   generations still waiting for GC (replaced or removed less than
   gc_grace ago: a reader may hold them) are neither: kept, counted as
   ``waiting_gc``; GC deletes them.

The background loop runs a pass every ``scrub_interval`` at ``scrub_rate``
and, in between, deals within a second with fragments a read found corrupt
(the engine's *suspects*). ``tierfs scrub`` runs a pass on demand through the
node's control service and prints the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tierfs.chunk import ChunkRecord, session_version
from tierfs.errors import CorruptError, NotFoundError, TierFSError
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine, fragment_path
from tierfs.storage.repair import RateLimiter, Repairer, _File

__all__ = ["ScrubIssue", "ScrubReport", "Scrubber"]

log = logging.getLogger("tierfs.storage.scrub")

MAX_ISSUES = 1000

#: Report fields that say something is wrong (a pass with any is not clean).
PROBLEMS = ("corrupt", "missing", "orphans", "stale", "mismatched", "errors")


@dataclass
class ScrubIssue:
    target_id: int
    key: FragmentKey
    kind: str  # corrupt | missing | orphan | stale | mismatched | unchecked (its chunk could not be judged)
    action: str  # repaired | reported | deleted | kept | failed
    detail: str = ""


@dataclass
class ScrubReport:
    node_id: int = 0
    fragments: int = 0
    bytes: int = 0
    corrupt: int = 0
    missing: int = 0
    repaired: int = 0
    orphans: int = 0
    orphans_deleted: int = 0
    errors: int = 0
    seconds: float = 0.0
    issues: list[ScrubIssue] = field(default_factory=list)
    stale: int = 0
    stale_deleted: int = 0
    chunks_verified: int = 0
    mismatched: int = 0
    #: stale fragments and orphans kept because younger than orphan_grace
    kept_young: int = 0
    #: fragments of generations waiting for GC (an open reader may hold
    #: one): kept for GC, neither stale nor orphans
    waiting_gc: int = 0
    #: fragments found corrupt or missing by their own check this pass: the
    #: group listing that follows does not count them missing again (with
    #: repair off they stay quarantined, out of the index)
    found: set[FragmentKey] = field(default_factory=set)

    def add(self, issue: ScrubIssue) -> None:
        if len(self.issues) < MAX_ISSUES:
            self.issues.append(issue)

    @property
    def clean(self) -> bool:
        """Nothing wrong found: stale fragments and orphans younger than the
        orphan grace are expected (an upload in flight), not problems."""
        young = self.kept_young
        return not any(getattr(self, k) for k in PROBLEMS if k not in ("stale", "orphans")) \
            and self.stale + self.orphans <= young

    def to_pb(self) -> Any:
        from tierfs.proto.v1 import storage_control_pb2 as spb

        return spb.ScrubReport(
            node_id=self.node_id, fragments=self.fragments, bytes=self.bytes, corrupt=self.corrupt,
            missing=self.missing, repaired=self.repaired, orphans=self.orphans,
            orphans_deleted=self.orphans_deleted, errors=self.errors, seconds=self.seconds,
            stale=self.stale, stale_deleted=self.stale_deleted, chunks_verified=self.chunks_verified,
            mismatched=self.mismatched, kept_young=self.kept_young, waiting_gc=self.waiting_gc,
            issues=[spb.ScrubIssue(target_id=i.target_id, inode=i.key.inode, chunk=i.key.chunk,
                                   fragment=i.key.fragment, version=i.key.version, kind=i.kind,
                                   action=i.action, detail=i.detail) for i in self.issues])


class Scrubber:
    """Scrub passes over the targets a :class:`Repairer` knows."""

    def __init__(self, repairer: Repairer, *, orphan_grace: float = 3600.0, node_id: Any = None) -> None:
        self.repairer = repairer
        self.orphan_grace = orphan_grace
        self._node_id = node_id
        self.counters: dict[str, int] = dict.fromkeys(
            ("passes", "verified", "verified_bytes", "corrupt", "missing", "repaired", "orphans",
             "orphans_deleted", "stale", "stale_deleted", "chunks_verified", "mismatched", "errors", "kept_young",
             "waiting_gc",
             "catch_ups"), 0)

    @property
    def node_id(self) -> int:
        return int(self._node_id() if callable(self._node_id) else (self._node_id or 0))

    async def scrub(self, *, rate: int = 0, repair: bool = True, delete_orphans: bool = True) -> ScrubReport:
        """One full pass (see the module docstring). An on-demand pass may run
        alongside a (slow, throttled) background one rather than wait hours
        behind it: every step is idempotent (a fragment repaired or deleted
        twice ends the same)."""
        t0 = time.monotonic()
        rep = ScrubReport(node_id=self.node_id)
        r = self.repairer
        await r.refresh_map()
        limiter = RateLimiter(rate)
        files: dict[int, _File | None] = {}
        for tid, eng in sorted(r.engines.items()):
            await self._verify_target(eng, rep, limiter, files, repair)
            await self._chunks(tid, eng, rep, files, repair, limiter)
            # Fresh answers: a write may have begun since the steps above asked.
            await self._orphans(tid, eng, rep, {}, delete_orphans)
        rep.seconds = time.monotonic() - t0
        for k in ("corrupt", "missing", "repaired", "orphans", "orphans_deleted", "stale", "stale_deleted",
                  "chunks_verified", "mismatched", "errors", "kept_young", "waiting_gc"):
            self.counters[k] += getattr(rep, k)
        self.counters["verified"] += rep.fragments
        self.counters["verified_bytes"] += rep.bytes
        self.counters["passes"] += 1
        if not rep.clean:
            log.warning("scrub: %d fragments, %d corrupt, %d missing, %d repaired, %d stale, %d orphans (%d "
                        "deleted), %d of %d chunks mismatched, %d errors", rep.fragments, rep.corrupt, rep.missing,
                        rep.repaired, rep.stale, rep.orphans, rep.orphans_deleted + rep.stale_deleted,
                        rep.mismatched, rep.chunks_verified, rep.errors)
        return rep

    async def catch_up(self) -> ScrubReport:
        """Only the *missing* step, on every target: after this node was away
        (failed heartbeats, a freeze), chunks written meanwhile may lack our
        fragments (degraded writes); rebuild them now rather than at the next
        full pass. Never raises (logged)."""
        rep = ScrubReport(node_id=self.node_id)
        t0 = time.monotonic()
        try:
            r = self.repairer
            await r.refresh_map()
            files: dict[int, _File | None] = {}
            for tid, eng in sorted(r.engines.items()):
                await self._chunks(tid, eng, rep, files, True, None)
        except TierFSError as exc:
            log.warning("catch-up failed: %s", exc)
        except Exception:
            log.exception("catch-up failed")
        rep.seconds = time.monotonic() - t0
        for k in ("missing", "repaired", "errors"):
            self.counters[k] += getattr(rep, k)
        self.counters["catch_ups"] += 1
        if rep.missing:
            log.warning("catch-up: %d fragments missing, %d rebuilt, %d errors in %.2fs", rep.missing,
                        rep.repaired, rep.errors, rep.seconds)
        return rep

    # ---- the steps ------------------------------------------------------------------

    def _members(self, key: FragmentKey, f: _File) -> tuple[int, list[int]] | None:
        if not f.groups:
            return None
        gid = f.groups[key.chunk % len(f.groups)]
        members = self.repairer.groups.get(gid)
        return (gid, members) if members else None

    async def _repair(self, tid: int, eng: ChunkEngine, key: FragmentKey, kind: str, rep: ScrubReport,
                      files: dict[int, _File | None], repair: bool) -> None:
        if not repair:
            # A corrupt fragment is quarantined whatever the mode (out of
            # the index: it was said "kept"); a missing one stays missing.
            if kind == "corrupt":
                rep.add(ScrubIssue(tid, key, kind, "quarantined", "repair off: moved to quarantine/, not rebuilt"))
            else:
                rep.add(ScrubIssue(tid, key, kind, "left", "repair off: not rebuilt"))
            return
        r = self.repairer
        f = await r.file(key.inode, files)
        rec = f.committed(key) if f is not None else None
        if f is None or rec is None:
            rep.add(ScrubIssue(tid, key, kind, "kept", "not a committed fragment: nothing to restore"))
            return
        where = self._members(key, f)
        if where is None or where[1][key.fragment:key.fragment + 1] != [tid]:
            rep.add(ScrubIssue(tid, key, kind, "kept", "target no longer holds this position"))
            return
        try:
            await r.restore(eng, key, f, where[1])
        except TierFSError as exc:
            rep.errors += 1
            rep.add(ScrubIssue(tid, key, kind, "failed", f"{type(exc).__name__}: {exc}"))
            if key.fragment not in rec.missing:
                # Readers stop asking it, and the repair queue retries.
                with contextlib.suppress(TierFSError):
                    await r.mark([key], done=False)
            return
        if key.fragment in rec.missing:
            try:
                await r.mark([key], done=True)
            except TierFSError as exc:
                log.warning("scrub: reporting %s rebuilt failed (the repair queue will rebuild it again): %s",
                            key, exc)
        rep.repaired += 1
        rep.add(ScrubIssue(tid, key, kind, "repaired"))

    async def _check(self, tid: int, eng: ChunkEngine, key: FragmentKey, rep: ScrubReport,
                     files: dict[int, _File | None], repair: bool) -> int:
        """Verify one fragment; quarantine and repair it if bad. Returns the bytes read."""
        try:
            info = await eng.verify(key)
        except NotFoundError:
            if key not in eng:
                return 0  # deleted meanwhile (GC): fine
            # The index has it, the disk does not (deleted by hand, lost).
            with contextlib.suppress(TierFSError):
                await eng.quarantine(key, "fragment file missing")
            rep.missing += 1
            rep.found.add(key)
            await self._repair(tid, eng, key, "missing", rep, files, repair)
            return 0
        except CorruptError as exc:
            rep.corrupt += 1
            rep.found.add(key)
            await eng.quarantine(key, str(exc))
            await self._repair(tid, eng, key, "corrupt", rep, files, repair)
            return 0
        rep.fragments += 1
        rep.bytes += info.size
        return info.size

    async def _verify_target(self, eng: ChunkEngine, rep: ScrubReport, limiter: RateLimiter,
                             files: dict[int, _File | None], repair: bool) -> None:
        tid = eng.target_id
        for key in list(eng.keys()):
            try:
                n = await self._check(tid, eng, key, rep, files, repair)
            except TierFSError as exc:
                rep.errors += 1
                rep.add(ScrubIssue(tid, key, "corrupt", "failed", f"{type(exc).__name__}: {exc}"))
                continue
            await limiter.take(n)

    async def _chunks(self, tid: int, eng: ChunkEngine, rep: ScrubReport, files: dict[int, _File | None],
                      repair: bool, limiter: RateLimiter | None) -> None:
        """The *missing* step and, with a ``limiter``, the *whole chunks* step
        for every committed chunk of every group ``tid`` belongs to."""
        r = self.repairer
        for gid, members in sorted(r.groups.items()):
            rebuilding = r.rebuilding.get(gid, set())
            if tid not in members or tid in rebuilding:
                continue
            j = members.index(tid)
            try:
                chunks = await r.group_chunks(gid)
            except TierFSError as exc:
                rep.errors += 1
                log.warning("scrub: listing group %d failed: %s", gid, exc)
                continue
            for inode, chunk, version in chunks:
                key = FragmentKey(inode, chunk, j, version)
                try:
                    f = await r.file(inode, files)
                except TierFSError as exc:
                    rep.errors += 1
                    log.warning("scrub: stat of inode %d failed: %s", inode, exc)
                    continue
                rec = f.committed(key) if f is not None else None
                if f is None or rec is None:
                    continue  # changed since the listing
                if (key not in eng or j in rec.missing) and key not in rep.found:
                    rep.missing += 1
                    rep.found.add(key)
                    await self._repair(tid, eng, key, "missing", rep, files, repair)
                if limiter is None:
                    continue
                first = next((i for i in range(f.width) if i not in rec.missing and members[i] not in rebuilding
                              and r.readable(members[i])), None)
                if first == j:
                    await self._whole(tid, key, f, rec, members, rebuilding, rep, files, repair, limiter)

    async def _whole(self, tid: int, key: FragmentKey, f: _File, rec: ChunkRecord, members: list[int],
                     rebuilding: set[int], rep: ScrubReport, files: dict[int, _File | None], repair: bool,
                     limiter: RateLimiter) -> None:
        r = self.repairer
        try:
            check = await r.check_chunk(key, f, rec, members, skip=[i for i, t in enumerate(members)
                                                                     if t in rebuilding])
        except TierFSError as exc:
            rep.errors += 1
            rep.add(ScrubIssue(tid, key, "unchecked", "failed", f"whole-chunk check: {type(exc).__name__}: {exc}"))
            return
        await limiter.take(check.fetched)
        if check.error:
            rep.errors += 1
            # Not judged (too few fragments could be read): nothing is known
            # to be wrong with this one; until stop 46 it was called "mismatched".
            rep.add(ScrubIssue(tid, key, "unchecked", "failed", f"whole-chunk check: {check.error}"))
            return
        rep.chunks_verified += 1
        if not check.bad:
            return
        rep.mismatched += 1
        keys = {i: dataclasses.replace(key, fragment=i) for i in check.bad}
        if not repair:  # only report: meta is not told either (that starts the holders' repair)
            for i, why in sorted(check.bad.items()):
                rep.add(ScrubIssue(members[i], keys[i], "mismatched", "kept", f"{why}; repair off"))
            return
        try:
            await r.mark(keys.values(), done=False)
        except TierFSError as exc:
            rep.errors += 1
            for i, why in sorted(check.bad.items()):
                rep.add(ScrubIssue(members[i], keys[i], "mismatched", "failed",
                                   f"{why}; reporting it to meta failed: {exc}"))
            return
        # Ours are rebuilt now, from the good ones (the record as meta now has
        # it lists the bad ones missing); the other holders rebuild theirs
        # from the repair queue.
        f.chunks[key.chunk] = dataclasses.replace(rec, missing=tuple(sorted(set(rec.missing) | set(check.bad))))
        for i, why in sorted(check.bad.items()):
            eng = r.engines.get(members[i])
            rep.add(ScrubIssue(members[i], keys[i], "mismatched", "reported",
                               why if eng is not None else f"{why}; its holder rebuilds it"))
            if eng is not None:
                await self._repair(members[i], eng, keys[i], "mismatched", rep, files, repair)

    def _classify(self, tid: int, key: FragmentKey, f: _File | None) -> tuple[str, str]:
        """("", "") for a fragment a file needs, else ("orphan" | "stale", why)."""
        if f is None:
            return "orphan", "no such file"
        if key.fragment >= f.width:
            return "orphan", f"fragment index beyond the layout's {f.width}"
        rec = f.chunks.get(key.chunk)
        if rec is None or rec.generation != key.version:
            if f.writing and session_version(key.version) == f.data_version:
                return "", ""  # an upload of the open write session: may be committed yet
            if rec is not None:
                return "stale", (f"generation {key.version:#x}, the chunk's committed generation is "
                                 f"{rec.generation:#x}")
            return "orphan", f"chunk {key.chunk} is not committed and generation {key.version:#x} is no open write's"
        where = self._members(key, f)
        if where is None:
            return "orphan", "no placement group"
        gid, members = where
        if members[key.fragment] != tid:
            rb = self.repairer.rebuilding.get(gid, set())
            if members[key.fragment] in rb:
                return "", ""  # may still be the source of that position's rebuild
            return "orphan", f"position {key.fragment} of group {gid} is now target {members[key.fragment]}"
        return "", ""

    async def _waiting(self, tid: int) -> dict[FragmentKey, bool] | None:
        """Fragments of ``tid`` that meta's GC items account for (its
        ``ListGroupChunks`` with ``gc_holder``, every group), each with
        whether the item's grace is over: those GC still has to delete here,
        and those of items whose position ``tid`` now serves (a move's
        copy). Empty from a meta older than stop 52; None when meta could
        not say (nothing is deleted then)."""
        out: dict[FragmentKey, bool] = {}
        after = 0
        try:
            while True:
                reply = await self.repairer.meta.list_group_chunks(0, gc_holder=tid, after_gc_id=after)
                for c in reply.chunks:
                    out[FragmentKey(c.inode, c.chunk, c.fragment, c.version)] = c.gc_ready
                if not reply.next_gc_id:
                    return out
                after = reply.next_gc_id
        except NotFoundError:
            return {}  # "no placement group 0": a meta before stop 52
        except TierFSError as exc:
            log.warning("scrub: listing the generations waiting for GC on target %d failed: %s", tid, exc)
            return None

    async def _orphans(self, tid: int, eng: ChunkEngine, rep: ScrubReport, files: dict[int, _File | None],
                       delete: bool) -> None:
        r = self.repairer
        found: list[tuple[FragmentKey, str, str]] = []
        for key in list(eng.keys()):
            try:
                f = await r.file(key.inode, files)
            except TierFSError as exc:
                rep.errors += 1
                log.warning("scrub: stat of inode %d failed: %s", key.inode, exc)
                continue
            kind, why = self._classify(tid, key, f)
            if kind:
                found.append((key, kind, why))
        if not found:
            return
        # Asked after the records above were read: a generation they show
        # replaced (or a file they show gone) was queued for GC by the same
        # op, so its item is listed here while its grace runs. Until stop 52
        # scrub deleted those as stale or orphans once older than the orphan
        # grace: a reader still holding one (a handle on a file since
        # removed or overwritten) lost it.
        waiting = await self._waiting(tid)
        off = "deletion off"
        if waiting is None:
            rep.errors += 1
            delete, off = False, "not deleted: meta did not list the generations waiting for GC"
        now = time.time()
        for key, kind, why in found:
            ready = waiting.get(key) if waiting else None
            if ready is False:  # its grace runs: kept (GC's), not a finding
                rep.waiting_gc += 1
                continue
            if ready:
                # Garbage meta knows of, not a finding: GC deletes it where
                # its item names this target; a move's copy no item names
                # is deleted here (GC would find it gone: done all the same).
                if delete:
                    with contextlib.suppress(TierFSError):
                        await eng.delete(key)
                continue
            try:
                age = now - os.stat(fragment_path(eng.root, key)).st_mtime
            except FileNotFoundError:
                continue  # deleted meanwhile (by GC): nothing left to find
            if kind == "stale":
                rep.stale += 1
            else:
                rep.orphans += 1
            if age < self.orphan_grace:
                rep.kept_young += 1
                rep.add(ScrubIssue(tid, key, kind, "kept",
                                   f"{why}; {age:.0f}s old, younger than the orphan grace ({self.orphan_grace:.0f}s)"))
                continue
            if not delete:
                rep.add(ScrubIssue(tid, key, kind, "kept", f"{why}; {age:.0f}s old; {off}"))
                continue
            try:
                await eng.delete(key)
            except TierFSError as exc:
                rep.errors += 1
                rep.add(ScrubIssue(tid, key, kind, "failed", str(exc)))
                continue
            if kind == "stale":
                rep.stale_deleted += 1
            else:
                rep.orphans_deleted += 1
            rep.add(ScrubIssue(tid, key, kind, "deleted", why))

    # ---- background ------------------------------------------------------------------

    async def run(self, rate: int, interval: float, first_delay: float = 5.0) -> None:
        """Background scrubbing: a pass every ``interval`` at ``rate`` bytes/s;
        suspects (fragments a read found corrupt) are handled within a second."""
        next_pass = time.monotonic() + first_delay
        while True:
            if time.monotonic() >= next_pass:
                try:
                    await self.scrub(rate=rate, repair=True, delete_orphans=True)
                except TierFSError as exc:
                    log.warning("scrub pass failed: %s", exc)
                except Exception:  # a bug must not stop the node's other loops
                    log.exception("scrub pass failed")
                next_pass = time.monotonic() + interval
            await self._suspects()
            await asyncio.sleep(min(1.0, max(0.05, next_pass - time.monotonic())))

    async def _suspects(self) -> None:
        pending = [(tid, eng, key) for tid, eng in self.repairer.engines.items() for key in eng.suspects()]
        if not pending:
            return
        rep = ScrubReport(node_id=self.node_id)
        files: dict[int, _File | None] = {}
        try:
            await self.repairer.refresh_map()
            for tid, eng, key in pending:
                await self._check(tid, eng, key, rep, files, True)
        except TierFSError as exc:
            log.warning("scrub of suspects failed: %s", exc)
        except Exception:
            log.exception("scrub of suspects failed")
        for k in ("corrupt", "missing", "repaired", "errors"):
            self.counters[k] += getattr(rep, k)
