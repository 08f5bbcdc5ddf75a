"""A Raft journal corrupt in the middle: the replica refuses to start (naming
the file and offset) instead of silently dropping every later entry, and
``--journal-recovery resync`` rebuilds it from its peers."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from tests.cluster import MetaCluster, wait_for
from tierfs.errors import CorruptError
from tierfs.meta.client import MetaClient
from tierfs.meta.journal import DurableJournal, JournalCorruptError

_HDR = struct.Struct("<II")
_MAGIC_LEN = 8


def record_offsets(path: Path) -> list[int]:
    data = path.read_bytes()
    pos, out = _MAGIC_LEN, []
    while pos + _HDR.size <= len(data):
        length, _ = _HDR.unpack_from(data, pos)
        out.append(pos)
        pos += _HDR.size + length
    return out


def flip_payload_byte(path: Path, record_offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[record_offset + _HDR.size + 3] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.timeout(30)
def test_middle_corruption_refuses_torn_tail_is_cut(tmp_path: Path) -> None:
    j = DurableJournal(tmp_path)
    for i in range(1, 21):
        j.add(b"cmd%03d" % i, i, 1)
        j.sync()
    j.close()
    path = tmp_path / DurableJournal.FILE
    good = path.read_bytes()
    offs = record_offsets(path)
    mid = offs[len(offs) // 2]
    flip_payload_byte(path, mid)
    with pytest.raises(JournalCorruptError) as ei:
        DurableJournal(tmp_path)
    assert ei.value.offset == mid
    assert str(path) in str(ei.value) and f"byte {mid}" in str(ei.value)
    assert isinstance(ei.value, CorruptError)
    assert path.read_bytes() == bytearray(good[:mid + 11]) + bytes([good[mid + 11] ^ 0xFF]) + good[mid + 12:], \
        "a refused open must not change the file"
    # The same damage in the last record is a torn tail: cut, the rest kept.
    path.write_bytes(good)
    flip_payload_byte(path, offs[-1])
    k = DurableJournal(tmp_path)
    assert [e[1] for e in k] == list(range(1, 20))
    k.close()
    # A half-written last record (short) as well.
    path.write_bytes(good[: offs[-1] + 5])
    k = DurableJournal(tmp_path)
    assert [e[1] for e in k] == list(range(1, 20))
    k.close()


async def _mkdirs(addrs: list[str], names: list[str]) -> None:
    async with MetaClient(addrs, deadline=30.0) as mc:
        for n in names:
            await mc.mkdir(n)


@pytest.mark.timeout(180)
def test_corrupt_replica_refuses_then_resyncs_from_peers(tmp_path: Path) -> None:
    with MetaCluster(tmp_path, 3, state_machine="meta") as c:
        c.wait_leader()
        asyncio.run(_mkdirs(c.addresses, [f"/a{i}" for i in range(60)]))
        c.wait_converged()
        victim = next(i for i in range(3) if i != c.leader())
        c.stop(victim)
        path = c.replicas[victim].data_dir / DurableJournal.FILE
        offs = record_offsets(path)
        assert len(offs) > 40
        bad = offs[len(offs) // 2]
        flip_payload_byte(path, bad)
        # More writes while it is down: it must get them from its peers.
        asyncio.run(_mkdirs(c.addresses, [f"/b{i}" for i in range(30)]))

        with pytest.raises(AssertionError, match="exited"):
            c.start(victim, timeout=30)
        c.stop(victim)  # reap the exited process
        log = c.log(victim)
        assert "corrupt in the middle" in log and str(path) in log and f"byte {bad}" in log, log[-2000:]
        assert "--journal-recovery resync" in log

        c.replicas[victim].extra_args = ["--journal-recovery", "resync"]
        c.start(victim)
        digest = c.wait_converged(timeout=60)
        aside = [p for p in c.replicas[victim].data_dir.iterdir() if p.name.startswith("corrupt-")]
        assert len(aside) == 1 and (aside[0] / DurableJournal.FILE).exists()
        assert f"byte {bad}" in (aside[0] / "REASON").read_text()
        # It is a full member again: it survives a restart without the flag
        # and the cluster keeps agreeing.
        c.replicas[victim].extra_args = []
        c.restart(victim)
        asyncio.run(_mkdirs(c.addresses, ["/c"]))
        assert c.wait_converged(timeout=60) != digest
        wait_for(lambda: c.status(victim).raft.ready, 30, "the recovered replica to be ready")


async def _force_snapshot(addr: str) -> None:
    async with MetaClient([addr], deadline=30.0) as mc:
        await mc.force_snapshot(addr=addr)


@pytest.mark.timeout(180)
def test_a_compacted_journal_without_its_snapshot_refuses_then_resyncs(tmp_path: Path) -> None:
    """A replica whose journal was compacted into a snapshot, and whose
    snapshot.bin is then lost, must not start: its journal begins thousands
    of entries in, so it replayed nothing, sat at the empty namespace with a
    log that looked up to date (applied index 1 for ever, its digest apart
    from the others', `tierfs status` healthy) and could be elected."""
    with MetaCluster(tmp_path, 3, state_machine="meta") as c:
        c.wait_leader()
        asyncio.run(_mkdirs(c.addresses, [f"/a{i}" for i in range(20)]))
        c.wait_converged()
        victim = next(i for i in range(3) if i != c.leader())
        asyncio.run(_force_snapshot(c.addresses[victim]))
        wait_for(lambda: c.status(victim).raft.snapshots >= 1, 90, "the victim's snapshot")
        asyncio.run(_mkdirs(c.addresses, ["/after-snapshot"]))
        c.wait_converged()
        c.stop(victim)
        snap = c.replicas[victim].data_dir / "snapshot.bin"
        assert snap.exists()
        snap.unlink()

        with pytest.raises(AssertionError, match="exited"):
            c.start(victim, timeout=30)
        c.stop(victim)  # reap the exited process
        log = c.log(victim)
        assert "folded into a snapshot that is gone" in log and "--journal-recovery resync" in log, log[-2000:]

        c.replicas[victim].extra_args = ["--journal-recovery", "resync"]
        c.start(victim)
        c.wait_converged(timeout=60)
        aside = [p for p in c.replicas[victim].data_dir.iterdir() if p.name.startswith("corrupt-")]
        assert len(aside) == 1 and (aside[0] / DurableJournal.FILE).exists()


@pytest.mark.timeout(180)
def test_a_corrupt_snapshot_names_the_way_to_recover(tmp_path: Path) -> None:
    with MetaCluster(tmp_path, 3, state_machine="meta") as c:
        c.wait_leader()
        asyncio.run(_mkdirs(c.addresses, [f"/a{i}" for i in range(5)]))
        victim = next(i for i in range(3) if i != c.leader())
        asyncio.run(_force_snapshot(c.addresses[victim]))
        wait_for(lambda: c.status(victim).raft.snapshots >= 1, 90, "the victim's snapshot")
        c.stop(victim)
        snap = c.replicas[victim].data_dir / "snapshot.bin"
        data = bytearray(snap.read_bytes())
        data[len(data) // 2] ^= 0x01
        snap.write_bytes(bytes(data))
        with pytest.raises(AssertionError, match="exited"):
            c.start(victim, timeout=30)
        c.stop(victim)
        log = c.log(victim)
        assert "snapshot checksum mismatch" in log and "--journal-recovery resync" in log, log[-2000:]
