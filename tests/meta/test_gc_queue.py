"""The GC queue: the grace period (an item is listed only once the grace the
op carried has passed), pages that match a brute-force model of the queue,
a per-target index whose pages do not cost O(queue), and snapshots that keep
ready times (and restore older snapshots without them)."""

from __future__ import annotations

import json
import random
import time

import pytest
from meta_helpers import SEC, Driver, gen0

from tierfs.meta import MetaStateMachine
from tierfs.meta.gcqueue import GCEntry, GCQueue
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


def _overwrite(d: Driver, path: str, chunks: list[int]) -> None:
    d.write(path, 16 * MiB, chunks)


def test_item_is_listed_only_after_its_grace() -> None:
    d = Driver()
    d.register()
    d.create("/f")
    _overwrite(d, "/f", [0, 1])
    d.gc_grace_ms = 30_000
    t_commit = d.now
    _overwrite(d, "/f", [0])  # chunk 0's first version goes to GC, ready 30 s later
    (item,) = list(d.sm.gc.values())
    assert item.ready == t_commit + 30 * SEC
    assert d.sm.list_gc([]) == []
    assert d.sm.list_gc([], now_ns=t_commit + 30 * SEC - 1) == []
    rows = d.sm.list_gc([], now_ns=t_commit + 30 * SEC)  # the leader's clock: no op needed
    assert {(r.chunk, r.version) for r in rows} == {(0, gen0(1))} and len(rows) == 6
    # A later op moves the state clock past it too; a clock behind the state's
    # does not hide it again.
    d.advance(31)
    d.mkdir("/later")
    assert len(d.sm.list_gc([], now_ns=1)) == 6


def test_ready_times_never_go_backwards_when_the_grace_shrinks() -> None:
    d = Driver()
    d.register()
    d.create("/f")
    _overwrite(d, "/f", [0, 1, 2])
    d.gc_grace_ms = 300_000
    _overwrite(d, "/f", [0])
    d.advance(1)
    d.gc_grace_ms = 1_000
    _overwrite(d, "/f", [1])
    first, second = sorted(d.sm.gc.values(), key=lambda e: e.id)
    assert second.ready == first.ready  # not 1 s after the second op: the page stops at the first not ready
    assert d.sm.list_gc([], now_ns=d.now + 10 * SEC) == []


def _brute(q: dict[int, GCEntry], want: set[int], after: int, limit: int, now: int) -> list[tuple[int, int]]:
    """The old full-scan ListGC, plus readiness (ready times are monotone)."""
    out: list[tuple[int, int]] = []
    for gid in sorted(i for i in q if i > after):
        item = q[gid]
        if item.ready > now:
            break
        if len(out) >= limit:
            break
        out += [(gid, t) for t in sorted(item.pending) if t in want or not want]
    return out


def test_pages_match_a_brute_force_model() -> None:
    rng = random.Random(7)
    q = GCQueue()
    model: dict[int, GCEntry] = {}
    next_id, clock = 1, 0
    for step in range(4000):
        k = rng.random()
        if k < 0.45:
            clock += rng.randrange(3)
            members = rng.sample(range(1, 13), rng.randrange(0, 7))
            e = GCEntry(id=next_id, inode=1, chunk=next_id, version=1, group=1,
                        pending={t: j for j, t in enumerate(members)}, ready=clock + rng.choice((0, 5, 50)))
            q.add(e)
            if members:  # the queue drops an item no target holds
                model[next_id] = GCEntry(e.id, e.inode, e.chunk, e.version, e.group, dict(e.pending), e.ready)
            next_id += 1
        elif k < 0.85 and model:
            gid = rng.choice(list(model))
            t = rng.choice([*model[gid].pending, 99])
            assert q.ack(gid, t) == (t in model[gid].pending)
            model[gid].pending.pop(t, None)
            if not model[gid].pending:
                del model[gid]
        elif k < 0.87:
            gone = set(rng.sample(range(1, 13), 2))
            q.drop_targets(gone)
            for gid in list(model):
                for t in gone:
                    model[gid].pending.pop(t, None)
                if not model[gid].pending:
                    del model[gid]
        assert len(q) == len(model)
        if step % 7 == 0:
            want = set(rng.sample(range(1, 13), rng.randrange(0, 4)))
            after = rng.randrange(next_id + 1) if rng.random() < 0.5 else 0
            limit = rng.randrange(1, 30)
            now = clock + rng.randrange(-5, 60)
            got = [(e.id, t) for e, t in q.page(want, after, limit, now)]
            assert got == _brute(model, want, after, limit, now), (step, want, after, limit, now)


def test_a_page_for_one_target_does_not_scan_the_queue() -> None:
    """200k items waiting for other targets: paging through one target's few
    items (1000 polls) stays cheap. The old ListGC sorted the whole queue on
    every poll (tens of ms each at this size)."""
    d = Driver()
    sm = d.sm
    q = sm.gc
    for i in range(1, 200_001):
        q.add(GCEntry(id=i, inode=i, chunk=0, version=1, group=1, pending={1 + i % 50: 0, 51 + i % 50: 1}))
    for i in range(200_001, 200_041):
        q.add(GCEntry(id=i, inode=i, chunk=0, version=1, group=2, pending={500: 0}))
    t0 = time.perf_counter()
    for _ in range(1000):
        rows, after = [], 0
        while True:
            page = sm.list_gc([500], after_id=after, limit=10)
            if not page:
                break
            rows += page
            after = page[-1].id
        assert len(rows) == 40
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"1000 drains of one target's 40 items took {elapsed:.2f}s"
    # acks of the big targets are O(log n) each
    t0 = time.perf_counter()
    for i in range(1, 20_001):
        assert q.ack(i, 1 + i % 50)
    assert time.perf_counter() - t0 < 5.0
    assert len(q) == 200_040 and q.pending_on(500) == 40


def test_snapshot_keeps_ready_times_and_restores_older_snapshots() -> None:
    d = Driver()
    d.register()
    d.create("/f")
    _overwrite(d, "/f", [0, 1])
    d.gc_grace_ms = 60_000
    _overwrite(d, "/f", [0, 1])
    snap = d.sm.snapshot()
    other = MetaStateMachine()
    other.restore(snap)
    assert other.digest() == d.sm.digest()
    assert [e.ready for e in other.gc.values()] == [e.ready for e in d.sm.gc.values()]
    assert other.list_gc([], now_ns=d.now) == [] and len(other.list_gc([], now_ns=d.now + 60 * SEC)) == 12
    # A snapshot taken before ready times and the bounded dedup table existed
    # (GC items of six fields, "requests" sorted by client): items ready at once.
    doc = json.loads(snap)
    for e in doc["gc"]:
        del e[6]
    doc["requests"] = doc.pop("dedup")
    old = MetaStateMachine()
    old.restore(json.dumps(doc).encode())
    assert len(old.list_gc([])) == 12
    # ...and both keep agreeing as they apply the same ops
    d.gc_grace_ms = 0
    d.mkdir("/x")
    for sm in (other,):
        sm.apply(d.log[-1])
    assert other.digest() == d.sm.digest()


def test_removing_targets_drops_their_items_only() -> None:
    q = GCQueue()
    q.add(GCEntry(id=1, inode=1, chunk=0, version=1, group=1, pending={1: 0, 2: 1}))
    q.add(GCEntry(id=2, inode=1, chunk=1, version=1, group=1, pending={2: 0}))
    q.add(GCEntry(id=3, inode=1, chunk=2, version=1, group=1, pending={3: 0}))
    q.drop_targets({2})
    assert sorted(q) == [1, 3] and q.pending_on(2) == 0
    assert [(e.id, t) for e, t in q.page([], 0, 10, 0)] == [(1, 1), (3, 3)]
    with pytest.raises(ValueError):
        q.add(GCEntry(id=3, inode=1, chunk=3, version=1, group=1, pending={1: 0}))


def test_ack_request_through_the_state_machine() -> None:
    d = Driver()
    d.register()
    d.create("/f")
    _overwrite(d, "/f", [0])
    _overwrite(d, "/f", [0])
    rows = d.sm.list_gc([])
    acked = d.do("ack_gc", pb.AckGCRequest(acks=[pb.GCAck(id=r.id, target_id=r.target_id) for r in rows]),
                 pb.AckGCReply)
    assert acked.acked == len(rows) == 6 and len(d.sm.gc) == 0


def test_a_move_lists_the_generations_its_source_holds_while_their_grace_runs() -> None:
    """ListGroupChunks with gc_holder: the generations of one group that
    wait for GC and are still pending on that member, with its fragment
    index, paged by GC item id; ready ones (their grace over) and other
    groups' are left out (what a move copies, docs/rebalance.md)."""
    d = Driver()
    d.register()
    d.create("/f")
    d.write("/f", 256 * MiB, list(range(64)))
    d.gc_grace_ms = 30_000
    t0 = d.now
    d.write("/f", 256 * MiB, list(range(64)))
    rows = d.sm.list_gc([], now_ns=t0 + 30 * SEC)
    by_group: dict[int, set[tuple[int, int, int]]] = {}
    for r in rows:
        by_group.setdefault(r.group_id, set()).add((r.chunk, r.target_id, r.fragment))
    gid = next(g for g, s in sorted(by_group.items()) if len({c for c, _, _ in s}) >= 2)
    holder, frag = next((t, j) for c, t, j in sorted(by_group[gid]))
    want = sorted((r.chunk, r.id) for r in rows if r.group_id == gid and r.target_id == holder)
    assert len(want) >= 2
    reply = d.sm.list_group_chunks(gid, gc_holder=holder)
    assert sorted((c.chunk, c.gc_id) for c in reply.chunks) == want and reply.next_gc_id == 0
    assert {(c.inode, c.version, c.fragment) for c in reply.chunks} == {(rows[0].inode, gen0(1), frag)}
    # paging: one item a page
    got, after = [], 0
    while True:
        page = d.sm.list_group_chunks(gid, limit=1, gc_holder=holder, after_gc_id=after)
        got += [(c.chunk, c.gc_id) for c in page.chunks]
        if not page.next_gc_id:
            break
        after = page.next_gc_id
    assert sorted(got) == want
    # a target in no entry of the group, and the grace over: nothing
    assert not d.sm.list_group_chunks(gid, gc_holder=10_000).chunks
    assert not d.sm.list_group_chunks(gid, gc_holder=holder, now_ns=t0 + 30 * SEC).chunks
    # group 0: every group's, for scrub; a member now serving the position
    # (a move's new member) is listed too, at its own position
    mine = sorted((r.id, r.fragment) for r in rows if r.target_id == holder)
    every = d.sm.list_group_chunks(0, gc_holder=holder)
    assert sorted((c.gc_id, c.fragment) for c in every.chunks) == mine
    assert not any(c.gc_ready for c in every.chunks)
    # ... and once the grace is over, still (GC deletes them), marked ready
    later = d.sm.list_group_chunks(0, gc_holder=holder, now_ns=t0 + 30 * SEC)
    assert sorted((c.gc_id, c.fragment) for c in later.chunks) == mine and all(c.gc_ready for c in later.chunks)
    members = d.sm.groups[gid]
    pos = members.index(holder)
    members[pos] = 10_000  # (a move's end, by hand)
    moved = d.sm.list_group_chunks(0, gc_holder=10_000)
    assert sorted((c.gc_id, c.fragment) for c in moved.chunks) == [(i, pos) for _, i in want]
    # no item names the new member: once ready, scrub deletes its copy
    late = d.sm.list_group_chunks(0, gc_holder=10_000, now_ns=t0 + 30 * SEC)
    assert sorted((c.gc_id, c.fragment) for c in late.chunks) == [(i, pos) for _, i in want]
    assert all(c.gc_ready for c in late.chunks)
    members[pos] = holder
    # without gc_holder: the committed chunks, as before
    assert all(c.gc_id == 0 and c.version != gen0(1) for c in d.sm.list_group_chunks(gid).chunks)
