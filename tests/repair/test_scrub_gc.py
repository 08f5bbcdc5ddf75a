"""Scrub and GC on a real local cluster: a flipped byte in a stored fragment
and a deleted fragment file are found and rebuilt by ``tierfs scrub``
(the fragment file is right again afterwards), orphan fragments planted in a
target are deleted, and a file removed while one of its nodes is down loses
its fragments on that node too once the node returns. The fragments of an
overwritten generation outlive the GC grace, so a reader that opened the
file before the overwrite still reads it, and go once the grace is over."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.repair.util import (
    digest,
    fragments,
    generations,
    grant_all,
    held_readers,
    map_now,
    random_bytes,
    start,
    wait_map,
    write_files,
)
from tierfs.cli.main import run
from tierfs.client import AsyncClient
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.net import DataClient
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.storage.api import FragmentKey


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cl = start(tmp_path / "c", n_storage=6)
    try:
        yield cl
    finally:
        cl.stop()


def _scrub(cl: LocalCluster, *extra: str, code: int = 0) -> dict:  # type: ignore[type-arg]
    out = io.StringIO()
    got = run(["scrub", "--json", "--meta", ",".join(cl.meta_addrs), *extra], stdout=out, stderr=io.StringIO())
    doc = json.loads(out.getvalue())
    assert got == code, doc
    return doc  # type: ignore[no-any-return]


def _scrub_text(cl: LocalCluster, *extra: str) -> tuple[int, str]:
    out = io.StringIO()
    code = run(["scrub", "--meta", ",".join(cl.meta_addrs), *extra], stdout=out, stderr=io.StringIO())
    return code, out.getvalue()


@pytest.mark.timeout(90)
def test_scrub_repairs_corrupt_and_missing_and_deletes_orphans(cluster: LocalCluster) -> None:
    async def write() -> dict[str, bytes]:
        async with AsyncClient(cluster.meta_addrs) as c:
            return await write_files(c, n=2)

    files = asyncio.run(write())
    frags = fragments(cluster)
    assert len(frags) >= 2 * 6 * 5  # 2 files x 6 chunks x 6 fragments
    clean = _scrub(cluster)
    assert clean["clean"], clean
    assert clean["total"]["fragments"] == len(frags)

    # 1) flip one payload byte of a fragment; 2) delete another fragment file;
    # 3) plant an orphan (a copy under an inode that does not exist) and a
    #    stale fragment (another generation of a real chunk).
    flipped, deleted = frags[3], frags[17]
    good_flipped, good_deleted = flipped.read_bytes(), deleted.read_bytes()
    deleted.unlink()
    # Only reported: the missing fragment is left, data at risk, so it
    # exits 1 and says so (until stop 44: exit 0, "found problems").
    code, text = _scrub_text(cluster, "--no-repair", "--keep-orphans")
    assert code == 1, text
    assert "scrub found problems it did not fix" in text and "not repaired (--no-repair)" in text, text
    # counted once: by its holder's check, not again by the group listing (until stop 44: twice)
    assert "0 corrupt, 1 missing, 0 mismatched not repaired" in text, text
    assert ": left (repair off: not rebuilt)" in text, text  # it said "kept" of what is not there
    assert not deleted.exists()
    raw = bytearray(good_flipped)
    raw[4096 + 100] ^= 0x40  # the header is the first 4 KiB; this is payload
    flipped.write_bytes(bytes(raw))
    # Both are well-formed fragments no file needs, written straight through
    # the data plane: one of an inode that does not exist, one of a real
    # chunk under a generation that was never committed.
    inode, chunk = int(frags[5].parent.name, 16), int(frags[5].name.split(".")[0], 16)
    ver = int(frags[5].name.split(".")[2], 16)
    node = frags[5].relative_to(cluster.dir).parts[0]

    async def plant() -> None:
        cmap = await map_now(cluster)
        addr = cluster.proc(node).addr
        node_ids = [n.node_id for n in cmap.nodes if n.data_addr == addr]
        tid = next(t.target_id for t in cmap.targets if t.node_id in node_ids)
        async with grant_all(DataClient(routes={tid: addr}), cluster) as dc:
            await dc.write(tid, FragmentKey(0xABCDEF, 0, 0, 1), b"orphan" * 1000)
            await dc.write(tid, FragmentKey(inode, chunk, 0, ver + 7), b"stale" * 1000)

    asyncio.run(plant())
    ghost = cluster.dir / node / "t0" / "frags" / "ef" / f"{0xABCDEF:016x}" / "0.0.1"
    stale = frags[5].parent / f"{chunk:x}.0.{ver + 7:x}"
    assert ghost.exists() and stale.exists()

    rep = _scrub(cluster)  # repairs everything it finds: exit 0
    t = rep["total"]
    assert t["corrupt"] == 1 and t["missing"] == 1 and t["repaired"] == 2, rep
    assert t["orphans"] == 1 and t["orphans_deleted"] == 1, rep
    assert t["stale"] == 1 and t["stale_deleted"] == 1, rep
    assert t["errors"] == 0 and t["mismatched"] == 0 and t["kept_young"] == 0
    assert t["chunks_verified"] == 2 * 6, rep  # every committed chunk, each by one node
    assert not rep["clean"] and rep["left"] == [], rep
    kinds = sorted((i["kind"], i["action"]) for n in rep["nodes"] for i in n.get("issues", []))
    assert kinds == [("corrupt", "repaired"), ("missing", "repaired"), ("orphan", "deleted"), ("stale", "deleted")]
    # The repaired fragment files are byte for byte what was first written.
    assert flipped.read_bytes() == good_flipped
    assert deleted.read_bytes() == good_deleted
    assert not ghost.exists() and not stale.exists()
    assert len(list(cluster.dir.glob("storage-*/t*/quarantine/*"))) == 1  # the corrupt copy, for inspection

    async def check() -> None:
        async with AsyncClient(cluster.meta_addrs) as c:
            for path, data in files.items():
                assert digest(await c.read_bytes(path)) == digest(data), path

    asyncio.run(check())
    again = _scrub(cluster)
    assert again["clean"], again


@pytest.mark.timeout(90)
def test_orphans_younger_than_the_grace_are_kept_and_not_problems(tmp_path: Path) -> None:
    """An orphan younger than ``orphan_grace`` (an upload in flight, as far
    as the node can tell) is kept and counted ``kept_young``: the pass is
    clean and exits 0. Until stop 44 it said "found problems"."""
    cl = start(tmp_path / "young", n_storage=3, storage_args=("--orphan-grace=3600",))
    try:
        async def plant() -> Path:
            cmap = await map_now(cl)
            addr = cl.proc("storage-0").addr
            node_ids = [n.node_id for n in cmap.nodes if n.data_addr == addr]
            tid = next(t.target_id for t in cmap.targets if t.node_id in node_ids)
            async with grant_all(DataClient(routes={tid: addr}), cl) as dc:
                await dc.write(tid, FragmentKey(0xABCDEF, 0, 0, 1), b"orphan" * 1000)
            return cl.dir / "storage-0" / "t0" / "frags" / "ef" / f"{0xABCDEF:016x}" / "0.0.1"

        ghost = asyncio.run(plant())
        assert ghost.exists()
        rep = _scrub(cl)
        t = rep["total"]
        assert t["orphans"] == 1 and t["kept_young"] == 1 and t["orphans_deleted"] == 0, t
        assert rep["clean"] and rep["left"] == [], rep
        code, text = _scrub_text(cl)
        assert code == 0 and "scrub clean in" in text and "1 stale fragment(s) or orphan(s) younger than" in text, text
        assert ghost.exists()
    finally:
        cl.stop()


@pytest.mark.timeout(90)
def test_a_fragment_listed_missing_but_on_disk_is_a_last_resort_source(cluster: LocalCluster) -> None:
    """A degraded write lists a position missing, yet its holder may have
    the fragment all the same (the write landed after the commit: the node
    was only slow). Two more fragments of the chunk are then lost, so K
    valid ones remain only counting that one. The repair took no source
    from a listed-missing position, so nothing could be rebuilt and the
    chunk stayed one loss from gone (the file checker soak, seed 8000:
    three repairing scrubs, each with errors). Now such positions are a
    last resort, and what they decode to is checked against the record's
    CRC32C as always."""
    data = random_bytes(300_000, 77)

    async def write() -> tuple[int, int]:
        async with AsyncClient(cluster.meta_addrs) as c:
            await c.mkdir("/lm")
            await c.set_layout("/lm", chunk_size=512 * 1024, redundancy="ec:4+2")
            await c.write_bytes("/lm/f", data)
            return (await c.stat("/lm/f")).inode, (await generations(cluster, "/lm/f"))[0]

    ino, gen = asyncio.run(write())
    by_pos = {int(p.name.split(".")[1], 16): p for p in fragments(cluster) if p.parent.name == f"{ino:016x}"}
    assert sorted(by_pos) == list(range(6))
    good = {j: p.read_bytes() for j, p in by_pos.items()}
    by_pos[2].unlink()
    by_pos[5].unlink()

    async def list_missing() -> None:
        async with MetaClient(cluster.meta_addrs) as mc:
            await mc.mark_fragments([pb.RepairItem(inode=ino, chunk=0, version=gen, fragment=1)], done=False)

    asyncio.run(list_missing())
    rep = _scrub(cluster)
    # This file's issues only: the module's cluster is shared, and a test
    # that ran before may have left repairs of its own for this scrub
    # (make test once counted a third missing fragment here).
    mine = [i for n in rep["nodes"] for i in n.get("issues", []) if i["inode"] == ino]
    repaired = {i["fragment"] for i in mine if i["kind"] == "missing" and i["action"] == "repaired"}
    assert {2, 5} <= repaired, rep
    assert {i["fragment"] for i in mine if i["kind"] == "missing"} <= {1, 2, 5}, rep
    assert by_pos[2].read_bytes() == good[2] and by_pos[5].read_bytes() == good[5]

    async def drained() -> bool:
        async with MetaClient(cluster.meta_addrs) as mc:
            return (await mc.list_repairs([], limit=1)).pending == 0

    end = time.monotonic() + 30
    while not asyncio.run(drained()):
        assert time.monotonic() < end, "position 1 still listed missing after 30 s"
        time.sleep(0.2)
    assert {j: p.read_bytes() for j, p in by_pos.items()} == good
    assert _scrub(cluster)["clean"]

    async def read() -> bytes:
        async with AsyncClient(cluster.meta_addrs) as c:
            return await c.read_bytes("/lm/f")

    assert digest(asyncio.run(read())) == digest(data)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_gc_reaches_a_node_that_was_down(cluster: LocalCluster, how: str) -> None:
    async def write() -> dict[str, bytes]:
        async with AsyncClient(cluster.meta_addrs) as c:
            return await write_files(c, n=1)

    asyncio.run(write())
    victim = "storage-2"
    before = fragments(cluster, victim)
    assert before, "the file should have fragments on every node of a 6-node ec:4+2 cluster"
    if how == "sigkill":
        cluster.kill(victim)
    else:
        cluster.kill(victim, signal.SIGSTOP)  # frozen: its sockets accept, nothing answers

    async def remove() -> None:
        async with AsyncClient(cluster.meta_addrs) as c:
            await c.rm("/d/f0")

    asyncio.run(remove())
    # Every live node deletes its fragments; the dead one cannot.
    end = time.monotonic() + 30
    while any(fragments(cluster, f"storage-{i}") for i in range(6) if i != 2):
        assert time.monotonic() < end, "live nodes did not garbage-collect the removed file"
        time.sleep(0.2)
    assert all(p.exists() for p in before)
    if how == "sigkill":
        cluster.start(names=[victim])
    else:
        cluster.kill(victim, signal.SIGCONT)
    end = time.monotonic() + 30
    while fragments(cluster, victim):
        assert time.monotonic() < end, f"{victim} kept the removed file's fragments after it came back"
        time.sleep(0.2)


@pytest.mark.timeout(90)
def test_background_scrub_repairs_a_flipped_byte(tmp_path: Path) -> None:
    cl = start(tmp_path / "bg", n_storage=6, storage_args=("--scrub-rate=64MiB", "--scrub-interval=1s"))
    try:
        async def write() -> dict[str, bytes]:
            async with AsyncClient(cl.meta_addrs) as c:
                return await write_files(c, n=1)

        files = asyncio.run(write())
        victim = fragments(cl)[7]
        good = victim.read_bytes()
        raw = bytearray(good)
        raw[4096 + 200] ^= 0x01  # payload (the header is the first 4 KiB)
        victim.write_bytes(bytes(raw))
        end = time.monotonic() + 30
        while not (victim.exists() and victim.read_bytes() == good):
            assert time.monotonic() < end, "the background scrub did not repair the fragment"
            time.sleep(0.2)
        assert len(list(cl.dir.glob("storage-*/t*/quarantine/*"))) == 1

        async def check() -> None:
            async with AsyncClient(cl.meta_addrs) as c:
                for path, data in files.items():
                    assert digest(await c.read_bytes(path)) == digest(data)

        asyncio.run(check())
    finally:
        cl.stop()


@pytest.mark.timeout(90)
def test_node_back_from_a_freeze_catches_up_on_degraded_writes(cluster: LocalCluster) -> None:
    async def write(seed: int) -> dict[str, bytes]:
        async with AsyncClient(cluster.meta_addrs) as c:
            await c.mkdir("/d", exist_ok=True)
            await c.set_layout("/d", chunk_size=128 * 1024, redundancy="ec:4+2")
            files = {"/d/f": random_bytes(700 * 1024, seed)}
            for path, data in files.items():
                await c.write_bytes(path, data)
            return files

    # New files need a healthy group (meta will not place one on a degraded
    # group), so the file exists before the freeze and is rewritten during it.
    asyncio.run(write(1))
    victim = "storage-2"
    addr = cluster.proc(victim).addr
    cluster.kill(victim, signal.SIGSTOP)
    try:
        def offline(m: Any) -> bool:
            node = next(n for n in m.nodes if n.data_addr == addr)
            return bool(node.state == pb.NODE_STATE_OFFLINE)

        asyncio.run(wait_map(cluster, offline, 30, f"{victim} to be marked offline"))

        files = asyncio.run(write(2))  # degraded: 5 of 6 fragments per chunk
        gens = asyncio.run(generations(cluster, "/d/f"))
        names = {f"{c:x}.{j:x}.{g:x}" for c, g in gens.items() for j in range(6)}  # of the new generations
        new = [f for f in fragments(cluster) if f.name in names]
        assert new and not [f for f in new if f.is_relative_to(cluster.dir / victim)]
    finally:
        cluster.kill(victim, signal.SIGCONT)
    # No scrub is asked for: the node notices it was away and rebuilds what
    # it missed from the other fragments.
    want = len(new) // 5
    end = time.monotonic() + 30
    while sorted(f.name for f in fragments(cluster, victim)) != sorted(names - {f.name for f in new}):
        assert time.monotonic() < end, f"{victim} holds {[f.name for f in fragments(cluster, victim)]}"
        time.sleep(0.2)
    # and every node's GC loop deletes the replaced generation (after the grace)
    while len(fragments(cluster)) != 6 * want:
        assert time.monotonic() < end, f"{len(fragments(cluster))} fragments on disk, want {6 * want}"
        time.sleep(0.2)
    rep = _scrub(cluster)
    assert rep["clean"], rep

    async def check() -> None:
        async with AsyncClient(cluster.meta_addrs) as c:
            for path, data in files.items():
                assert digest(await c.read_bytes(path)) == digest(data)

    asyncio.run(check())


@pytest.mark.timeout(120)
def test_old_generation_outlives_the_gc_grace_for_open_readers(tmp_path: Path) -> None:
    grace = 4.0
    cl = start(tmp_path / "c", n_storage=6, gc_grace=grace)
    try:
        async def main() -> None:
            async with AsyncClient(cl.meta_addrs) as c:
                await c.mkdir("/d")
                await c.set_layout("/d", chunk_size=128 * 1024, redundancy="ec:4+2")
                old, new = random_bytes(700 * 1024, 1), random_bytes(700 * 1024, 2)
                await c.write_bytes("/d/g", old)
                old_frags = set(fragments(cl))
                assert len(old_frags) == 6 * 6
                reader = await c.open("/d/g", "rb")
                t0 = time.monotonic()
                await c.write_bytes("/d/g", new)  # the old generation goes to GC, ready after the grace
                # Storage nodes poll GC every 0.3 s: for half the grace nothing old may go.
                while time.monotonic() < t0 + grace / 2:
                    assert old_frags <= set(fragments(cl)), "old fragments deleted within the grace"
                    await asyncio.sleep(0.2)
                assert digest(await reader.read()) == digest(old)  # opened before: the old bytes
                await reader.close()
                assert digest(await c.read_bytes("/d/g")) == digest(new)
                deadline = t0 + grace + 30
                while old_frags & set(fragments(cl)):
                    assert time.monotonic() < deadline, "old fragments never collected after the grace"
                    await asyncio.sleep(0.2)
                assert time.monotonic() - t0 >= grace
                assert len(fragments(cl)) == 6 * 6  # only the new generation is left

        asyncio.run(main())
    finally:
        cl.stop()


@pytest.mark.timeout(120)
def test_scrub_keeps_the_generations_open_readers_still_hold(tmp_path: Path) -> None:
    """A reader holds a file since overwritten, another one a file since
    removed: their fragments are stale fragments or orphans by the chunk
    records, but their GC grace runs. A repairing scrub (orphan grace 0
    here; by default 1 h, which a file that old passes at once) keeps them
    and counts them as waiting for GC, and both readers read the bytes they
    opened. Until stop 52 scrub deleted them: the reader of the removed file
    got GenerationGoneError, the other one silently read the new version."""
    cl = start(tmp_path / "c", n_storage=6, gc_grace=300)
    old = {"/s/a": random_bytes(700 * 1024, 1), "/s/b": random_bytes(500 * 1024 + 3, 2)}
    new = random_bytes(200 * 1024, 3)

    async def main() -> None:
        async with AsyncClient(cl.meta_addrs) as c:
            await c.mkdir("/s")
            await c.set_layout("/s", chunk_size=128 * 1024, redundancy="ec:4+2")
            async with held_readers(c, old, new) as held:
                await held.replace()
                on_disk = set(fragments(cl))
                doc = await asyncio.to_thread(_scrub, cl)
                t = doc["total"]
                assert t["waiting_gc"] == 6 * 6 + 4 * 6 and t["stale"] == t["orphans"] == 0, t
                assert doc["clean"], doc
                assert set(fragments(cl)) == on_disk
                await held.check()

    try:
        asyncio.run(main())
    finally:
        cl.stop()
