"""Chunk records in the meta state machine: generations per upload, the
commit rules, truncate's valid length, and the repair queue (issue 8)."""

from __future__ import annotations

import pytest
from meta_helpers import Driver, gen0, recs, ups

from tierfs.chunk import generation
from tierfs.errors import InvalidArgumentError
from tierfs.meta import MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def d() -> Driver:
    drv = Driver()
    drv.register(nodes=6, targets=1)
    return drv


def _open(d: Driver, path: str) -> pb.OpenWriteReply:
    return d.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path=path), owner="t"), pb.OpenWriteReply)


def _commit(d: Driver, s: pb.OpenWriteReply, size: int, chunks: list[pb.ChunkRecord]) -> pb.FileInfo:
    return d.do("commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=size, chunks=chunks),
                pb.FileInfo)


def _gc(d: Driver) -> set[tuple[int, int, int]]:
    return {(i.inode, i.chunk, i.version) for i in d.sm.list_gc([])}


def test_every_upload_is_its_own_generation_and_the_others_go_to_gc(d: Driver) -> None:
    ino = d.create("/y").attr.inode
    s = _open(d, "/y")
    # Chunk 0 sent twice in the session (flush, then more writes): both
    # uploads are told to meta; only the committed one survives.
    g0, g1 = generation(s.data_version, 0), generation(s.data_version, 1)
    d.do("renew_lease", pb.RenewLeaseRequest(session_id=s.session_id, uploads=[
        pb.ChunkUpload(index=0, generation=g0), pb.ChunkUpload(index=0, generation=g1)]), pb.RenewLeaseReply)
    info = _commit(d, s, 2000, [pb.ChunkRecord(index=0, generation=g1, length=2000, crc32c=0xABC, missing=[0])])
    (r,) = info.chunks
    assert (r.index, r.generation, r.length, r.valid, r.crc32c, list(r.missing)) == (0, g1, 2000, 2000, 0xABC, [0])
    assert _gc(d) == {(ino, 0, g0)}  # the first upload is stale: collected, never data
    # Uploads no renewal reported (the writer closes between renewals) come
    # with the commit and are collected too.
    s = _open(d, "/y")
    h0, h1 = generation(s.data_version, 0), generation(s.data_version, 1)
    d.do("commit_write", pb.CommitWriteRequest(
        session_id=s.session_id, size=2000, chunks=[pb.ChunkRecord(index=0, generation=h1, length=2000)],
        uploads=[pb.ChunkUpload(index=0, generation=h0), pb.ChunkUpload(index=0, generation=h1)]), pb.FileInfo)
    assert _gc(d) == {(ino, 0, g0), (ino, 0, g1), (ino, 0, h0)}


def test_commit_refuses_bad_records_and_changes_nothing(d: Driver) -> None:
    d.create("/f")
    s = _open(d, "/f")
    digest = d.sm.digest()
    other = generation(s.data_version + 1, 0)
    bad = [
        ([pb.ChunkRecord(index=0, generation=other, length=10)], "does not belong to write session"),
        ([pb.ChunkRecord(index=0, generation=gen0(s.data_version), length=0)], "length 0"),
        ([pb.ChunkRecord(index=0, generation=gen0(s.data_version), length=5 * MiB)], "length"),
        (recs(s.data_version, [0, 0], length=10), "listed twice"),
        (recs(s.data_version, [0], length=10, missing=(6,)), "missing fragment list"),
        (recs(s.data_version, [0], length=10, missing=(0, 0)), "missing fragment list"),
        (recs(s.data_version, [0], length=10, missing=(0, 1, 2)), "needs at least 4"),
    ]
    for chunks, msg in bad:
        with pytest.raises(InvalidArgumentError, match=msg):
            _commit(d, s, 10, chunks)
        assert d.sm.digest() == digest
    with pytest.raises(InvalidArgumentError, match="does not belong"):
        d.do("renew_lease", pb.RenewLeaseRequest(session_id=s.session_id, uploads=ups(s.data_version + 1, [0])))
    assert d.sm.digest() == digest
    _commit(d, s, 10, recs(s.data_version, [0], length=10, missing=(0, 1)))  # K of K+M: the floor


def test_truncate_cuts_the_tail_valid_length_and_growing_reads_zeros(d: Driver) -> None:
    d.create("/s")
    s = _open(d, "/s")
    _commit(d, s, 3000, recs(s.data_version, [0], length=3000))
    info = d.do("truncate", pb.TruncateRequest(loc=pb.Loc(path="/s"), size=6), pb.FileInfo)
    assert [(r.length, r.valid) for r in info.chunks] == [(3000, 6)]
    info = d.do("truncate", pb.TruncateRequest(loc=pb.Loc(path="/s"), size=3000), pb.FileInfo)
    # Grown again: the fragments still hold 3000 bytes (their parity needs
    # them), but only 6 are data.
    assert info.attr.size == 3000 and [(r.length, r.valid) for r in info.chunks] == [(3000, 6)]
    # A truncate at a chunk boundary keeps the whole chunk before it.
    f = d.create("/big").attr.inode
    s = _open(d, "/big")
    _commit(d, s, 3 * 4 * MiB, recs(s.data_version, [0, 1, 2], length=4 * MiB))
    info = d.do("truncate", pb.TruncateRequest(loc=pb.Loc(path="/big"), size=4 * MiB), pb.FileInfo)
    assert [(r.index, r.valid) for r in info.chunks] == [(0, 4 * MiB)]
    assert {(i, c) for i, c, _ in _gc(d)} == {(f, 1), (f, 2)}


def test_repair_queue_lists_missing_positions_by_member_and_clears(d: Driver) -> None:
    f = d.create("/r")
    ino = f.attr.inode
    s = _open(d, "/r")
    _commit(d, s, 2 * 4 * MiB, recs(s.data_version, [0], length=4 * MiB, missing=(0,))
            + recs(s.data_version, [1], length=4 * MiB, missing=(2, 5)))
    members = {g.group_id: list(g.target_ids) for g in d.sm.cluster_map().groups}
    groups = list(f.layout.groups)
    want = {(0, 0, members[groups[0]][0]), (1, 2, members[groups[1 % len(groups)]][2]),
            (1, 5, members[groups[1 % len(groups)]][5])}
    got = d.sm.list_repairs([])
    assert got.pending == 3 and {(i.chunk, i.fragment, i.target_id) for i in got.items} == want
    assert all(i.version == gen0(s.data_version) and i.inode == ino for i in got.items)
    t = members[groups[0]][0]
    mine = d.sm.list_repairs([t])
    assert {(i.chunk, i.fragment, i.target_id) for i in mine.items} == {w for w in want if w[2] == t}
    # snapshots carry the records; the queue is rebuilt from them
    other = MetaStateMachine()
    other.restore(d.sm.snapshot())
    assert other.digest() == d.sm.digest() and other.list_repairs([]) == d.sm.list_repairs([])
    # a stale report (another generation) changes nothing; a real one does
    item = got.items[0]
    stale = pb.RepairItem(inode=ino, chunk=item.chunk, version=item.version + 1, fragment=item.fragment)
    r = d.do("mark_fragments", pb.MarkFragmentsRequest(items=[stale], done=True), pb.MarkFragmentsReply)
    assert r.changed == 0 and d.sm.list_repairs([]).pending == 3
    r = d.do("mark_fragments", pb.MarkFragmentsRequest(items=list(got.items), done=True), pb.MarkFragmentsReply)
    assert r.changed == 3 and d.sm.list_repairs([]).pending == 0 and not d.sm.degraded
    assert all(not c.missing for c in d.stat("/r").chunks)
    # a scrub finding adds a position back
    bad = pb.RepairItem(inode=ino, chunk=0, version=gen0(s.data_version), fragment=3)
    r = d.do("mark_fragments", pb.MarkFragmentsRequest(items=[bad], done=False), pb.MarkFragmentsReply)
    assert r.changed == 1 and [(i.chunk, i.fragment) for i in d.sm.list_repairs([]).items] == [(0, 3)]
    with pytest.raises(InvalidArgumentError, match="outside the layout"):
        d.do("mark_fragments", pb.MarkFragmentsRequest(items=[pb.RepairItem(
            inode=ino, chunk=0, version=gen0(s.data_version), fragment=9)], done=False))
    # unlink empties the queue of its chunks
    d.do("unlink", pb.UnlinkRequest(loc=pb.Loc(path="/r")))
    assert d.sm.list_repairs([]).pending == 0 and not d.sm.degraded


def test_renewals_stage_records_and_the_commit_publishes_them(d: Driver) -> None:
    ino = d.create("/st").attr.inode
    s = _open(d, "/st")
    g = gen0(s.data_version)
    d.do("renew_lease", pb.RenewLeaseRequest(session_id=s.session_id, chunks=recs(s.data_version, [0, 1, 2])),
         pb.RenewLeaseReply)
    assert not d.stat("/st").chunks  # staged, not published
    # a later record of chunk 1 (its second upload) replaces the staged one
    g1 = generation(s.data_version, 1)
    d.do("renew_lease", pb.RenewLeaseRequest(session_id=s.session_id, chunks=[
        pb.ChunkRecord(index=1, generation=g1, length=MiB)]), pb.RenewLeaseReply)
    snap = MetaStateMachine()
    snap.restore(d.sm.snapshot())  # staged records survive a snapshot
    assert snap.digest() == d.sm.digest()
    info = _commit(d, s, 3 * 4 * MiB, recs(s.data_version, [3])[:0])
    assert [(r.index, r.generation) for r in info.chunks] == [(0, g), (1, g1), (2, g)]
    assert _gc(d) == {(ino, 1, g)}  # the replaced staged upload
    # staged records past the committed size are refused, changing nothing
    s = _open(d, "/st")
    d.do("renew_lease", pb.RenewLeaseRequest(session_id=s.session_id, chunks=recs(s.data_version, [5])),
         pb.RenewLeaseReply)
    digest = d.sm.digest()
    with pytest.raises(InvalidArgumentError, match="beyond the file size"):
        _commit(d, s, 4 * MiB, [])
    assert d.sm.digest() == digest


def test_a_conditional_unlink_removes_only_the_empty_file_it_names(d: Driver) -> None:
    """What a failed writer uses to remove the file it created (and nothing
    made or written since): ``expect_inode`` and ``only_if_empty``. Each
    refusal is BUSY and changes nothing."""
    from tierfs.errors import BusyError, error_from_code

    def unlink(path: str, **cond: object) -> pb.MetaResult:
        return pb.MetaResult.FromString(d.raw("unlink", pb.UnlinkRequest(loc=pb.Loc(path=path), **cond)))

    f = d.create("/c").attr.inode
    other = d.create("/other").attr.inode
    for cond in ({"expect_inode": other}, {"expect_inode": other, "only_if_empty": True}):
        before = d.sm.digest()
        res = unlink("/c", **cond)
        assert isinstance(error_from_code(res.error.code, res.error.message), BusyError), res
        assert d.sm.digest() == before
    s = _open(d, "/c")  # a live writer: not "empty without a writer"
    before = d.sm.digest()
    assert unlink("/c", expect_inode=f, only_if_empty=True).error.code
    assert d.sm.digest() == before
    d.do("commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=MiB, chunks=recs(s.data_version, [0])),
         pb.FileInfo)
    before = d.sm.digest()
    assert unlink("/c", expect_inode=f, only_if_empty=True).error.code  # it has bytes now
    assert d.sm.digest() == before
    d.create("/e")
    e = d.stat("/e").attr.inode
    assert unlink("/e", expect_inode=e, only_if_empty=True).error.code == 0
    assert not d.sm.inodes.get(e)
    assert unlink("/c", expect_inode=f).error.code == 0  # the inode alone: bytes and all
