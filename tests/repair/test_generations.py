"""Generations on a real local cluster: the storage side (repair queue,
rebuild, whole-chunk scrub) against the regressions of issue 8.

* A degraded re-upload in one write session: the node that missed the
  second upload of a chunk comes back holding the first one's fragment (its
  CRC holds, its generation is stale). Reads never use it, meta records the
  position missing at commit, the node's repair-queue worker rebuilds it at
  once, and ``tierfs scrub`` counts the stale fragments and never calls the
  cluster clean while they or the missing position exist.
* A rebuild after a truncate writes every fragment at the length its
  chunk's record gives it (never trimmed to the current size), so the
  rebuilt fragments are byte for byte the old ones and decode with parity.
* A fragment whose file is replaced by a well-formed one of the same key
  (its own CRC32C valid) but other content, or another length, is found by
  the whole-chunk check, reported to meta and rebuilt by its holder.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.repair.util import KiB, grant_all, map_now, random_bytes, start, wait_map
from tierfs.cli.main import run
from tierfs.client import Client
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.net import DataClient
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.storage.api import FragmentKey


@pytest.fixture
def six(tmp_path: Path) -> Iterator[LocalCluster]:
    # Every ec:4+2 group spans all six nodes: a dead one is never replaced.
    # GC polls once at start and then hourly, so stale fragments stay on disk
    # for the scrub to find whatever meta's GC queue holds.
    cl = start(tmp_path / "c", n_storage=6, storage_args=("--gc-interval=1h",))
    try:
        yield cl
    finally:
        cl.stop()


def _scrub(cl: LocalCluster, *extra: str, code: int | None = 0) -> dict[str, Any]:
    """``tierfs scrub --json``; its exit code must be ``code`` (None: 1
    exactly when the pass left something to fix, ``left``)."""
    out = io.StringIO()
    got = run(["scrub", "--json", "--meta", ",".join(cl.meta_addrs), *extra], stdout=out, stderr=io.StringIO())
    doc: dict[str, Any] = json.loads(out.getvalue())
    assert got == (code if code is not None else int(bool(doc["left"]))), doc
    return doc


async def _info(cl: LocalCluster, path: str) -> pb.FileInfo:
    async with MetaClient(cl.meta_addrs, deadline=10) as mc:
        return await mc.stat(path)


def _members(cmap: pb.ClusterMap, info: pb.FileInfo, chunk: int) -> list[int]:
    gid = info.layout.groups[chunk % len(info.layout.groups)]
    return list(next(g for g in cmap.groups if g.group_id == gid).target_ids)


def _proc_of(cl: LocalCluster, cmap: pb.ClusterMap, target: int) -> str:
    node = next(t.node_id for t in cmap.targets if t.target_id == target)
    addr = next(n.data_addr for n in cmap.nodes if n.node_id == node)
    return next(p.name for p in cl.procs if p.kind == "storage" and p.addr == addr)


async def _read_fragments(cl: LocalCluster, info: pb.FileInfo, chunk: int) -> dict[int, bytes]:
    """Position -> stored payload of the chunk's committed generation, read
    over the data plane from the group's current members (absent ones and
    those of dead nodes left out)."""
    cmap = await map_now(cl)
    members = _members(cmap, info, chunk)
    gen = next(r.generation for r in info.chunks if r.index == chunk)
    addr = {n.node_id: n.data_addr for n in cmap.nodes}
    routes = {t.target_id: addr[t.node_id] for t in cmap.targets if t.target_id in members}
    out: dict[int, bytes] = {}
    async with grant_all(DataClient(routes=routes, request_timeout=2.0, connect_timeout=1.0), cl) as dc:
        for j, t in enumerate(members):
            try:
                out[j] = await dc.read(t, FragmentKey(info.attr.inode, chunk, j, gen))
            except Exception:
                continue
    return out


async def _queue_rebuilt(cl: LocalCluster, name: str) -> int:
    """Fragments the repair-queue worker of storage daemon ``name`` rebuilt."""
    from tierfs.cli.repair import _control
    from tierfs.proto.v1 import storage_control_pb2 as spb

    cmap = await map_now(cl)
    node = next(n for n in cmap.nodes if n.data_addr == cl.proc(name).addr)
    reply = await _control(node.control_addr, "RepairStatus", spb.RepairStatusRequest(), 5.0)
    return int(reply.queue_rebuilt)


def _generation_files(cl: LocalCluster, inode: int, gen: int) -> list[Path]:
    """Fragment files of ``inode`` of generation ``gen`` on every node's disk."""
    return sorted(p for p in cl.dir.glob(f"storage-*/t*/frags/*/{inode:016x}/*")
                  if p.is_file() and p.name.split(".")[2] == f"{gen:x}")


def _wait_whole(cl: LocalCluster, path: str, timeout: float) -> pb.FileInfo:
    """Until no chunk record of ``path`` lists a missing position."""
    end = time.monotonic() + timeout
    while True:
        info = asyncio.run(_info(cl, path))
        if not any(r.missing for r in info.chunks):
            return info
        assert time.monotonic() < end, f"{path}: records still list missing fragments: {list(info.chunks)}"
        time.sleep(0.2)


@pytest.mark.timeout(120)
def test_degraded_reupload_is_repaired_and_its_first_upload_left_to_gc(six: LocalCluster) -> None:
    cl = six
    a, b = b"A" * 1000, b"B" * 1000
    with Client(cl.meta_addrs, request_timeout=1.0, retries=2) as c:
        c.set_layout("/", chunk_size=64 * KiB, redundancy="ec:4+2")
        f = c.open("/y", "wb")
        f.write(a)
        f.flush()  # the first upload of chunk 0: all six fragments
        info = asyncio.run(_info(cl, "/y"))
        cmap = asyncio.run(map_now(cl))
        holder = _proc_of(cl, cmap, _members(cmap, info, 0)[0])
        addr = cl.proc(holder).addr
        cl.kill(holder)
        asyncio.run(wait_map(cl, lambda m: any(n.data_addr == addr and n.state == pb.NODE_STATE_OFFLINE
                                               for n in m.nodes), 30, f"{holder} to be offline"))
        f.write(b)
        f.close()  # the second upload: five fragments, acknowledged
        assert c.stat("/y").size == 2000
        assert c.read_bytes("/y") == a + b

    info = asyncio.run(_info(cl, "/y"))
    (rec,) = info.chunks
    assert list(rec.missing) == [0], rec  # recorded at commit: repair can start at once
    g0, g1 = rec.generation - 1, rec.generation  # the first and the second upload
    old = _generation_files(cl, info.attr.inode, g0)
    on_holder = [p for p in old if p.is_relative_to(cl.dir / holder)]
    assert [p.name for p in on_holder] == [f"0.0.{g0:x}"], old
    live_stale = len(old) - len(on_holder)
    assert live_stale >= 1

    # Before the repair, with the holder down: a position known missing, a
    # node unscrubbed. The first upload's fragments on the live nodes are
    # stale by the chunk record, but meta's GC queue holds them (the commit
    # told it): GC's, not findings (until stop 52 counted as stale).
    rep = _scrub(cl, "--no-repair", "--keep-orphans", code=1)  # data at risk: exit 1
    assert not rep["clean"], rep
    assert "1 node(s) not scrubbed" in rep["left"] and "1 fragment position(s) awaiting rebuild" in rep["left"], rep
    assert rep["total"]["stale"] == 0 and rep["total"]["waiting_gc"] in (0, live_stale), rep["total"]
    assert len(_generation_files(cl, info.attr.inode, g0)) == len(old)  # nothing deleted
    assert rep["total"]["repairs_pending"] == 1 and rep["offline_nodes"], rep
    assert rep["total"]["chunks_verified"] == 1 and rep["total"]["mismatched"] == 0, rep["total"]

    cl.start(names=[holder])
    with Client(cl.meta_addrs, request_timeout=1.0) as c:
        assert c.read_bytes("/y") == a + b  # never the returning node's stale fragment
    # No scrub asked for: the restarted node's repair-queue worker rebuilds it.
    info = _wait_whole(cl, "/y", 30)
    assert info.chunks[0].generation == g1
    assert asyncio.run(_queue_rebuilt(cl, holder)) == 1
    frags = asyncio.run(_read_fragments(cl, info, 0))
    assert frags[0] == a + b, "the rebuilt fragment 0 holds the chunk's first 2000 bytes"

    cmap = asyncio.run(map_now(cl))
    others = [_proc_of(cl, cmap, t) for t in _members(cmap, info, 0)[1:3]]
    for name in others:
        cl.kill(name)
    with Client(cl.meta_addrs, request_timeout=1.0) as c:
        assert c.read_bytes("/y") == a + b  # 4 of 6 left, the rebuilt one among them
    cl.start(names=others)
    asyncio.run(cl.wait_healthy(60))

    # The first upload was told to meta with the commit, so GC deletes its
    # fragments once the grace is over; what GC has not reached yet (it
    # polls hourly here) the scrub deletes, as garbage meta knows of: not
    # a finding. The returning holder's copy too.
    rep = _scrub(cl)
    t = rep["total"]
    assert t["stale"] == t["orphans"] == 0, t
    assert t["missing"] == 0 and t["mismatched"] == 0 and t["chunks_verified"] == 1, t
    assert rep["clean"], rep
    deadline = time.monotonic() + 30
    while _generation_files(cl, info.attr.inode, g0):
        assert time.monotonic() < deadline, "stale fragments neither collected nor scrubbed away"
        time.sleep(0.2)
    again = _scrub(cl)
    assert again["clean"], again
    with Client(cl.meta_addrs, request_timeout=1.0) as c:
        assert c.read_bytes("/y") == a + b


def _target_rm(cl: LocalCluster, info: pb.FileInfo, j: int) -> None:
    """``tierfs target rm`` the member at position ``j`` of chunk 0's group;
    wait until it is rebuilt elsewhere."""
    gone = _members(asyncio.run(map_now(cl)), info, 0)[j]
    assert run(["target", "rm", str(gone), "--meta", ",".join(cl.meta_addrs)], stdout=io.StringIO(),
               stderr=io.StringIO()) == 0
    asyncio.run(wait_map(cl, lambda m: all(gone not in g.target_ids and not g.rebuilding for g in m.groups),
                         60, f"target {gone}'s groups to be rebuilt"))


@pytest.mark.timeout(180)
def test_rebuild_after_truncate_keeps_fragments_at_their_recorded_length(tmp_path: Path) -> None:
    # Eight nodes: two spares for two replacements of a six-wide group.
    cl = start(tmp_path / "c", n_storage=8)
    try:
        with Client(cl.meta_addrs, request_timeout=1.0) as c:
            c.mkdir("/t")
            c.set_layout("/t", chunk_size=64 * KiB, redundancy="ec:4+2")
            c.write_bytes("/t/s", b"SECRET" * 500)
            c.truncate("/t/s", 6)
            assert c.read_bytes("/t/s") == b"SECRET"
        info = asyncio.run(_info(cl, "/t/s"))
        (rec,) = info.chunks
        assert (rec.length, rec.valid) == (3000, 6), rec  # the truncate rewrote nothing
        before = asyncio.run(_read_fragments(cl, info, 0))
        assert [len(before[j]) for j in range(6)] == [3000, 0, 0, 0, 3000, 3000]

        # While the file is 6 bytes long, rebuild data fragment 0 elsewhere
        # (trimmed to the file size it would no longer match its parity),
        # then parity fragment 4 (rebuilt from the data, the new 0 among them).
        _target_rm(cl, info, 0)
        _target_rm(cl, info, 4)
        after = asyncio.run(_read_fragments(cl, info, 0))
        assert after == before, "rebuilt fragments differ from the ones they replace"
        rep = _scrub(cl)
        assert rep["total"]["mismatched"] == 0 and rep["total"]["chunks_verified"] == 1, rep["total"]

        with Client(cl.meta_addrs, request_timeout=1.0) as c:
            c.truncate("/t/s", 3000)
            assert c.read_bytes("/t/s") == b"SECRET" + bytes(2994)
        # Degraded: fragment 0 and parity 5 gone, so the reader decodes from
        # 1, 2, 3 and the rebuilt parity 4, checked against the chunk's CRC32C.
        cmap = asyncio.run(map_now(cl))
        members = _members(cmap, info, 0)
        for t in (members[0], members[5]):
            cl.kill(_proc_of(cl, cmap, t))
        with Client(cl.meta_addrs, request_timeout=1.0) as c:
            assert c.read_bytes("/t/s") == b"SECRET" + bytes(2994)
    finally:
        cl.stop()


@pytest.mark.timeout(120)
def test_whole_chunk_scrub_finds_a_wrong_but_crc_valid_fragment(six: LocalCluster) -> None:
    cl = six
    data = random_bytes(3 * 64 * KiB, 7)
    with Client(cl.meta_addrs, request_timeout=1.0) as c:
        c.mkdir("/w")
        c.set_layout("/w", chunk_size=64 * KiB, redundancy="ec:4+2")
        c.write_bytes("/w/f", data)
    info = asyncio.run(_info(cl, "/w/f"))
    good = {i: asyncio.run(_read_fragments(cl, info, i)) for i in range(3)}
    assert all(len(g) == 6 for g in good.values())
    clean = _scrub(cl)
    assert clean["clean"] and clean["total"]["chunks_verified"] == 3, clean

    # Well-formed fragment files, written through the data plane under the
    # committed key: a data fragment with other bytes (chunk 0), a parity
    # fragment with other bytes (chunk 1), a data fragment cut short (chunk 2).
    bad = {(0, 1): os.urandom(16 * KiB), (1, 5): os.urandom(16 * KiB), (2, 2): good[2][2][: 8 * KiB]}

    async def plant() -> None:
        cmap = await map_now(cl)
        addr = {n.node_id: n.data_addr for n in cmap.nodes}
        routes = {t.target_id: addr[t.node_id] for t in cmap.targets}
        async with grant_all(DataClient(routes=routes), cl) as dc:
            for (chunk, j), payload in bad.items():
                gen = next(r.generation for r in info.chunks if r.index == chunk)
                await dc.write(_members(cmap, info, chunk)[j], FragmentKey(info.attr.inode, chunk, j, gen), payload)

    asyncio.run(plant())
    # Handed to their holders' repair queues: exit 1 while the queue still
    # holds them when the pass ends ("awaiting rebuild"), 0 if they were
    # rebuilt by then.
    rep = _scrub(cl, code=None)
    assert all("awaiting rebuild" in x for x in rep["left"]), rep
    t = rep["total"]
    assert t["mismatched"] == 3 and t["chunks_verified"] == 3, t
    assert t["corrupt"] == 0 and t["errors"] == 0, rep
    assert not rep["clean"]
    found = sorted((i["chunk"], i["fragment"]) for n in rep["nodes"] for i in n.get("issues", [])
                   if i["kind"] == "mismatched" and i["action"] == "reported")
    assert found == sorted(bad), rep
    # The holders rebuild them (the checker's own at once, the others from
    # the repair queue); then every fragment is what was first written.
    _wait_whole(cl, "/w/f", 30)
    assert {i: asyncio.run(_read_fragments(cl, info, i)) for i in range(3)} == good
    again = _scrub(cl)
    assert again["clean"], again
    with Client(cl.meta_addrs, request_timeout=1.0) as c:
        assert c.read_bytes("/w/f") == data


@pytest.mark.timeout(120)
def test_repair_finds_a_wrong_source_among_more_than_k(six: LocalCluster) -> None:
    """A fragment is lost (its file gone, its position listed missing) while
    another fragment of the chunk is wrong although its own CRC32C holds.
    The repair's first K sources include the wrong one, so they decode to a
    chunk that does not match the record. The repair gave up there (nothing
    written) and its queue retried the same K sources forever, although the
    fifth fragment made a good rebuild possible; the read path already
    judged all fragments in that case (``_heal_chunk``). Now the repair
    does the same: it fetches every candidate, leaves out the ones that
    differ from what the others decode to, rebuilds the lost fragment and
    reports the wrong one, which its holder then rebuilds."""
    cl = six
    data = random_bytes(64 * KiB, 11)
    with Client(cl.meta_addrs, request_timeout=1.0) as c:
        c.mkdir("/v")
        c.set_layout("/v", chunk_size=64 * KiB, redundancy="ec:4+2")
        c.write_bytes("/v/f", data)
    info = asyncio.run(_info(cl, "/v/f"))
    ino, gen = info.attr.inode, info.chunks[0].generation
    good = asyncio.run(_read_fragments(cl, info, 0))
    assert sorted(good) == list(range(6))

    async def plant_and_lose() -> None:
        cmap = await map_now(cl)
        members = _members(cmap, info, 0)
        addr = {n.node_id: n.data_addr for n in cmap.nodes}
        routes = {t.target_id: addr[t.node_id] for t in cmap.targets}
        async with grant_all(DataClient(routes=routes), cl) as dc:
            await dc.write(members[1], FragmentKey(ino, 0, 1, gen), os.urandom(16 * KiB))
        (lost,) = [p for p in _generation_files(cl, ino, gen) if int(p.name.split(".")[1], 16) == 3]
        lost.unlink()
        async with MetaClient(cl.meta_addrs) as mc:
            await mc.mark_fragments([pb.RepairItem(inode=ino, chunk=0, version=gen, fragment=3)], done=False)

    asyncio.run(plant_and_lose())
    # Position 3 is rebuilt from 0, 2, 4 and 5; position 1, reported, is
    # then rebuilt by its holder: every fragment is what was first written.
    _wait_whole(cl, "/v/f", 40)
    end = time.monotonic() + 30
    while (now := asyncio.run(_read_fragments(cl, info, 0))) != good:
        assert time.monotonic() < end, f"fragments differ from those written: {sorted(j for j in good if now.get(j) != good[j])}"
        time.sleep(0.2)
    assert _scrub(cl)["clean"]
    with Client(cl.meta_addrs, request_timeout=1.0) as c:
        assert c.read_bytes("/v/f") == data


@pytest.mark.timeout(120)
def test_status_names_a_chunk_too_few_fragments_survive_to_rebuild(six: LocalCluster) -> None:
    """Three of a 4+2 chunk's fragments deleted from disk: the scrub finds
    them missing, the holders' repair queues cannot rebuild them, and
    ``tierfs status`` says which chunk is lost instead of "awaiting repair"
    alone (until stop 47 it said only that, for ever). A read fails naming
    every position's cause; never wrong bytes."""
    from tierfs.cli.cluster import cluster_status
    from tierfs.cli.main import render_status
    from tierfs.errors import InsufficientTargetsError

    cl = six
    body = random_bytes(200 * KiB, 47)
    with Client(cl.meta_addrs, request_timeout=1.0) as c:
        c.set_layout("/", chunk_size=64 * KiB, redundancy="ec:4+2")
        c.write_bytes("/lost", body)
        c.write_bytes("/kept", b"k" * 1000)
    info = asyncio.run(_info(cl, "/lost"))
    ino, gen = info.attr.inode, info.chunks[0].generation
    frags = [p for p in _generation_files(cl, ino, gen) if p.name.startswith("0.")]
    assert len(frags) == 6, frags
    for p in frags[:3]:
        p.unlink()
    rep = _scrub(cl, code=1)
    assert rep["total"]["missing"] == 3 and rep["total"]["repaired"] == 0, rep["total"]

    deadline = time.monotonic() + 60
    while True:
        st = asyncio.run(cluster_status(cl.meta_addrs))
        lost = (st.get("repair_failures") or {}).get("unrebuildable", [])
        if lost:
            break
        assert time.monotonic() < deadline, st.get("repair_failures")
        time.sleep(0.5)
    assert [(u["inode"], u["chunk"], u["generation"]) for u in lost] == [(ino, 0, gen)], lost
    assert "only 3 of the 4 fragments needed" in lost[0]["detail"], lost
    assert not st["healthy"] and st["repairs_pending"] == 3, st
    text = render_status(st)
    assert "DATA AT RISK: 1 chunk(s) cannot be rebuilt" in text and f"inode {ino} chunk 0" in text, text

    with Client(cl.meta_addrs, request_timeout=1.0) as c:
        with pytest.raises(InsufficientTargetsError) as ei:
            c.read_bytes("/lost")
        assert "being rebuilt" not in str(ei.value) and "recorded as not stored" in str(ei.value), ei.value
        with c.open("/lost") as f:  # the other chunks still read back whole
            f.seek(64 * KiB)
            assert f.read() == body[64 * KiB:]
        assert c.read_bytes("/kept") == b"k" * 1000
