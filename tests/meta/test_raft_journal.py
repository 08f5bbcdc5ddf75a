"""DurableJournal and snapshot files: the on-disk format, in-process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierfs.errors import CorruptError
from tierfs.meta.journal import DurableJournal, SnapshotFile, read_snapshot, write_snapshot


def _reopen(d: Path, **kw: object) -> DurableJournal:
    return DurableJournal(d, **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_entries_term_vote_and_commit_survive_reopen(tmp_path: Path) -> None:
    j = DurableJournal(tmp_path)
    for i in range(1, 11):
        j.add(b"cmd%d" % i, i, 1 if i < 6 else 2)
    j.setCurrentTerm(2, "127.0.0.1:1")
    j.setRaftCommitIndex(7)
    j.sync()
    j.deleteEntriesFrom(8)  # drops idx 9, 10
    j.add(b"new9", 9, 3)
    j.setCurrentTerm(3, None)
    j.sync(force_commit=True)
    j.close()

    k = _reopen(tmp_path)
    assert [e[1] for e in k] == list(range(1, 10))
    assert k[-1] == (b"new9", 9, 3)
    assert k[4] == (b"cmd5", 5, 1)
    assert k.getCurrentTerm() == 3 and k.getVotedForNodeId() is None
    assert k.getRaftCommitIndex() == 7
    k.close()


@pytest.mark.timeout(30)
def test_nothing_reaches_disk_before_sync_and_everything_after(tmp_path: Path) -> None:
    """The write-before-ack rule at the file level: a buffered entry is not in
    the file; after sync() it is (read back through a separate open)."""
    j = DurableJournal(tmp_path)
    size0 = os.path.getsize(j.path)
    j.add(b"x" * 100, 1, 1)
    assert os.path.getsize(j.path) == size0
    syncs = j.syncs
    j.sync()
    assert j.syncs == syncs + 1
    assert b"x" * 100 in j.path.read_bytes()
    j.sync()  # nothing pending: no extra fdatasync
    assert j.syncs == syncs + 1
    j.close()


@pytest.mark.timeout(30)
def test_torn_tail_is_cut(tmp_path: Path) -> None:
    j = DurableJournal(tmp_path)
    for i in range(1, 6):
        j.add(b"e%d" % i + b"." * 100, i, 1)
    j.sync()
    j.close()
    data = j.path.read_bytes()
    j.path.write_bytes(data[:-50])  # a crash in the middle of entry 5's record
    k = _reopen(tmp_path)
    assert [e[1] for e in k] == [1, 2, 3, 4]
    k.add(b"e5b", 5, 2)
    k.close()
    m = _reopen(tmp_path)
    assert m[-1] == (b"e5b", 5, 2)
    m.close()


@pytest.mark.timeout(30)
def test_compaction_rewrites_and_anchor_drops_folded_prefix(tmp_path: Path) -> None:
    j = DurableJournal(tmp_path)
    for i in range(1, 101):
        j.add(b"e%d" % i, i, 1)
    j.sync()
    big = os.path.getsize(j.path)
    j.deleteEntriesTo(90)  # keep idx 91..100
    j.sync()
    assert os.path.getsize(j.path) < big / 4
    j.close()
    k = _reopen(tmp_path)
    assert [e[1] for e in k] == list(range(91, 101))
    k.close()

    # A crash after a snapshot at 95 was written but before compaction: the
    # anchor (94, 1, 95, 1) drops 91..93 on open and keeps the tail.
    k = _reopen(tmp_path, anchor=(94, 1, 95, 1))
    assert [e[1] for e in k] == list(range(94, 101))
    k.close()
    # An anchor that does not match the journal (a diverged snapshot) changes nothing.
    k = _reopen(tmp_path, anchor=(96, 7, 97, 7))
    assert [e[1] for e in k] == list(range(94, 101))
    k.close()


@pytest.mark.timeout(30)
def test_not_a_journal_is_refused(tmp_path: Path) -> None:
    (tmp_path / DurableJournal.FILE).write_bytes(b"garbage")
    with pytest.raises(CorruptError):
        DurableJournal(tmp_path)


@pytest.mark.timeout(30)
def test_snapshot_roundtrip_and_checksum(tmp_path: Path) -> None:
    p = tmp_path / "snap"
    snap = SnapshotFile(last=(b"c2", 12, 3), prev=(b"c1", 11, 3), members=["a:1", "b:2"],
                        addr_map={"a:1": "a:9"}, state=b"\x00state" * 100)
    write_snapshot(p, snap)
    back = read_snapshot(p)
    assert back.last == snap.last and back.prev == snap.prev
    assert back.members == snap.members and back.addr_map == snap.addr_map
    assert back.state == snap.state and back.anchor == (11, 3, 12, 3)
    raw = bytearray(p.read_bytes())
    raw[-5] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptError):
        read_snapshot(p)
