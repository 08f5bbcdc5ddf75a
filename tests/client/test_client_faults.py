"""Real faults under the client: storage daemons SIGKILLed under reads (the
chunks decode around them, until too few are left: then a clear error, never
wrong data), and the meta leader SIGKILLed in the middle of a large write."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client.test_generations import _holder, _name
from tests.client.util import digest, random_bytes, start_cluster
from tierfs.client import AsyncClient, Client
from tierfs.errors import BusyError, InsufficientTargetsError, TierFSError, UnavailableError
from tierfs.local import LocalCluster
from tierfs.proto.v1 import meta_pb2 as pb

MiB = 1 << 20


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cl = start_cluster(tmp_path / "cl")
    yield cl
    cl.stop()


def _check_all(client: Client, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        assert digest(client.read_bytes(path)) == digest(data), path
        if len(data) > 3 * MiB:
            with client.open(path, "rb") as f:
                f.seek(MiB + 3)
                assert f.read(2 * MiB) == data[MiB + 3: 3 * MiB + 3]


@pytest.mark.timeout(180)
def test_reads_survive_two_dead_storage_daemons_and_fail_cleanly_at_three(own_cluster: LocalCluster) -> None:
    cl = own_cluster
    files: dict[str, bytes] = {}
    with Client(cl.meta_addrs, request_timeout=3.0, connect_timeout=1.0) as client:
        client.mkdir("/small")
        client.set_layout("/small", chunk_size=MiB)
        for i, n in enumerate([1, 1000, MiB - 1, 3 * MiB + 7, 11 * MiB + 5]):
            files[f"/small/f{i}"] = random_bytes(n, seed=i)
        files["/default.bin"] = random_bytes(40 * MiB + 3, seed=99)  # 4 MiB chunks
        for path, data in files.items():
            client.write_bytes(path, data)
        _check_all(client, files)

        cl.kill("storage-0")
        t0 = time.monotonic()
        _check_all(client, files)
        assert time.monotonic() - t0 < 60

        cl.kill("storage-3")
        _check_all(client, files)

        cl.kill("storage-5")  # three of six fragments gone: ec:4+2 cannot read any chunk
        for path in ("/small/f3", "/default.bin"):
            with pytest.raises((InsufficientTargetsError, UnavailableError)) as ei:
                client.read_bytes(path)
            assert "chunk" in str(ei.value)
        with client.open("/small/f4", "rb") as f, pytest.raises((InsufficientTargetsError, UnavailableError)):
            f.read(10)


def _leader(cl: LocalCluster) -> str:
    h = asyncio.run(cl.health())
    return str(next(m["name"] for m in h["meta"] if m["role"] == "leader"))


@pytest.mark.timeout(180)
def test_meta_leader_killed_during_large_write(own_cluster: LocalCluster) -> None:
    cl = own_cluster
    old = random_bytes(8 * MiB, seed=5)
    new = random_bytes(64 * MiB + 11, seed=6)
    with Client(cl.meta_addrs, request_timeout=5.0, lease_ms=6000) as client:
        client.write_bytes("/ckpt.bin", old)
        killed = ""
        outcome: str
        try:
            with client.open("/ckpt.bin", "r+b") as f:
                view = memoryview(new)
                step = 4 * MiB + 1
                for pos in range(0, len(new), step):
                    f.write(view[pos: pos + step])
                    if not killed and pos >= 16 * MiB:
                        killed = _leader(cl)
                        cl.kill(killed)
                        # Longer than the lease: the writer must keep renewing through the fail-over.
                        time.sleep(7.0)
            outcome = "committed"
        except TierFSError as exc:
            outcome = f"failed: {type(exc).__name__}: {exc}"
        assert killed
        got = client.read_bytes("/ckpt.bin")
        if outcome == "committed":
            assert digest(got) == digest(new)
        else:  # a clear error, and the file is still the old one, whole
            assert digest(got) == digest(old), outcome
        # The cluster keeps working for the next writer.
        client.write_bytes("/after.bin", b"after")
        assert client.read_bytes("/after.bin") == b"after"
    assert outcome == "committed", outcome


@pytest.mark.timeout(120)
def test_storage_daemon_killed_mid_write(own_cluster: LocalCluster) -> None:
    """A group member dies mid-write. By default the write is degraded: each
    chunk needs K+1 fragments, so it commits and reads back exactly. With
    ``min_write_fragments=K+M`` (every fragment) the write fails with a
    clear error after its retries, and the previous contents stay whole and
    readable (decoded around the dead daemon)."""
    cl = own_cluster
    old = random_bytes(6 * MiB + 1, seed=21)
    new = random_bytes(32 * MiB, seed=22)
    with Client(cl.meta_addrs, request_timeout=2.0, connect_timeout=1.0, retries=2) as client:
        client.write_bytes("/w.bin", old)
        client.write_bytes("/d.bin", old)
        with client.open("/d.bin", "r+b") as f:
            f.write(new[: 8 * MiB])
            f.flush()
            cl.kill("storage-2")
            f.write(new[8 * MiB:])
        assert digest(client.read_bytes("/d.bin")) == digest(new)
        assert client.aclient.degraded_writes > 0
    with Client(cl.meta_addrs, request_timeout=2.0, connect_timeout=1.0, retries=2,
                min_write_fragments=6) as client:
        with pytest.raises(TierFSError) as ei, client.open("/w.bin", "r+b") as f:
            f.write(new)
        assert isinstance(ei.value, UnavailableError | TimeoutError), ei.value
        assert "chunk" in str(ei.value) and "6 needed" in str(ei.value), ei.value
        assert digest(client.read_bytes("/w.bin")) == digest(old)
        st = client.stat("/w.bin")
        assert st.size == len(old) and not st.writing


@pytest.mark.timeout(120)
def test_stalled_storage_daemon_is_read_around(own_cluster: LocalCluster) -> None:
    """A daemon that stops answering (SIGSTOP: connections stay open, nothing
    comes back) costs one request timeout, then parity is used."""
    cl = own_cluster
    data = random_bytes(24 * MiB + 5, seed=31)
    with Client(cl.meta_addrs, request_timeout=1.0, connect_timeout=1.0) as client:
        client.write_bytes("/stall.bin", data)
        assert digest(client.read_bytes("/stall.bin")) == digest(data)  # connections open
        pid = cl.proc("storage-4").pid
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert digest(client.read_bytes("/stall.bin")) == digest(data)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert elapsed < 20, elapsed  # one timeout, not one per chunk


@pytest.mark.timeout(120)
def test_a_stalled_copy_is_hedged_when_every_copy_failed_just_now(own_cluster: LocalCluster) -> None:
    """Every copy of a replica:3 chunk failed a request within failed_ttl
    (the whole cluster stalled a moment ago), and the node of the copy read
    first stalls again: the read hedges to another copy after the hedge
    delay. Until stop 49 it hedged only to copies not failed just now, so
    it waited the whole request timeout (10 s through a FUSE mount)."""
    cl = own_cluster
    data = random_bytes(MiB, seed=77)
    with Client(cl.meta_addrs, request_timeout=10.0, connect_timeout=1.0, hedge_after=0.2) as client:
        client.mkdir("/r3")
        client.set_layout("/r3", redundancy="replica:3", chunk_size=MiB)
        client.write_bytes("/r3/f", data)
        assert digest(client.read_bytes("/r3/f")) == digest(data)  # connections open
        victim = _name(cl, client._run(_holder(client.aclient, "/r3/f", 0, 0)))  # chunk 0 reads copy 0 first
        router = client.aclient._parts()[2]
        pid = cl.proc(victim).pid
        os.kill(pid, signal.SIGSTOP)
        try:
            for t in list(router.state):
                router.mark_failed(t, factor=10.0)
            before = client.aclient.hedged
            assert digest(client.read_bytes("/r3/f")) == digest(data)
            assert client.aclient.hedged > before  # not the 10 s request timeout
        finally:
            os.kill(pid, signal.SIGCONT)


async def _group_targets(ac: AsyncClient, path: str, chunk: int) -> list[int]:
    """The target ids of ``chunk``'s group, by position."""
    info = await ac.meta.stat(path)
    cmap = await ac.meta.get_cluster_map()
    gid = info.layout.groups[chunk % len(info.layout.groups)]
    return list(next(g.target_ids for g in cmap.groups if g.group_id == gid))


@pytest.mark.timeout(60)
def test_a_stalled_member_is_hedged_while_the_others_are_only_marked_slow(own_cluster: LocalCluster) -> None:
    """A stalled node (SIGSTOP) whose slow mark has lapsed (slow_target_ttl,
    2 s) while the other members are marked slow (a busy host hedges healthy
    nodes too): the read hedges from it to the members that were only slow.
    Until stop 50 a replica read counted only usable copies as ones to hedge
    to, and an EC decode only fragments not yet asked: the read awaited the
    stalled node for the whole request timeout (10 s by default: one random
    read in a few hundred with a node stalled; here 120 s, past this test's
    timeout)."""
    cl = own_cluster
    data = random_bytes(4 * MiB, seed=78)
    with Client(cl.meta_addrs, request_timeout=120.0, connect_timeout=1.0, hedge_after=0.2,
                read_cache_bytes=0) as client:
        client.mkdir("/r3")
        client.set_layout("/r3", redundancy="replica:3", chunk_size=MiB)
        client.write_bytes("/r3/f", data)
        client.mkdir("/ec")
        client.set_layout("/ec", redundancy="ec:4+2", chunk_size=4 * MiB)  # 1 MiB fragments
        client.write_bytes("/ec/f", data)
        router = client.aclient._parts()[2]
        # Replica: chunk 0 reads copy 0 first; copies 1 and 2 only slow.
        # EC: the range lies in data fragments 0 and 1, only slow; the
        # decode asks fragments 2..5, fragment 2's node stalled.
        for path, stalled, slow, (a, b) in (("/r3/f", 0, (1, 2), (1000, 300_000)),
                                             ("/ec/f", 2, (0, 1), (1000, MiB + 5000))):
            assert digest(client.read_bytes(path)) == digest(data)  # connections open
            targets = client._run(_group_targets(client.aclient, path, 0))
            pid = cl.proc(_name(cl, client._run(_holder(client.aclient, path, 0, stalled)))).pid
            os.kill(pid, signal.SIGSTOP)
            try:
                for j in slow:
                    router.mark_slow(targets[j], 600.0)
                with client.open(path, "rb") as f:
                    f.seek(a)
                    assert f.read(b - a) == data[a:b], path
            finally:
                os.kill(pid, signal.SIGCONT)
                router._slow.clear()


@pytest.mark.timeout(60)
def test_a_write_gives_up_a_member_that_lagged_just_now_after_its_peers_time(own_cluster: LocalCluster) -> None:
    """A member stalled (SIGSTOP) and found lagging just now (marked slow by
    the write of an earlier chunk) before meta marks it offline: later chunk
    writes store the chunk degraded once the others are durable and it has
    lagged them three times their time. Until stop 50 each was given a
    quarter of the request timeout again (2.5 s by default per round of
    write_concurrency chunks: a 320 MiB DCP save took 13 s instead of 2 s);
    here 75 s, past this test's timeout."""
    cl = own_cluster
    data = random_bytes(4 * MiB, seed=51)
    with Client(cl.meta_addrs, request_timeout=300.0, connect_timeout=1.0) as client:
        client.mkdir("/ec")
        client.set_layout("/ec", redundancy="ec:4+2", chunk_size=MiB)
        client.write_bytes("/ec/a", data)
        victim = client._run(_holder(client.aclient, "/ec/a", 0, 0))
        cmap = client._run(client.aclient.meta.get_cluster_map())
        node = next(n.node_id for n in cmap.nodes if n.data_addr == victim)
        pid = cl.proc(_name(cl, victim)).pid
        router = client.aclient._parts()[2]
        os.kill(pid, signal.SIGSTOP)
        try:
            for t in cmap.targets:  # as a lagged write of the chunk before leaves them
                if t.node_id == node:
                    router.mark_slow(t.target_id, 600.0)
                    router.mark_write_lagged(t.target_id, 600.0)
            before = client.aclient.degraded_writes
            client.write_bytes("/ec/b", data)
            assert client.aclient.degraded_writes > before
        finally:
            os.kill(pid, signal.SIGCONT)
            router._slow.clear()
            router._write_lagged.clear()
        assert digest(client.read_bytes("/ec/b")) == digest(data)


@pytest.mark.timeout(150)
def test_a_write_stops_asking_a_stalled_member_once_the_map_shows_it_offline(own_cluster: LocalCluster) -> None:
    """ec:2+1 needs all three fragments (K+1). With a member stalled
    (SIGSTOP) and marked offline by meta, a write asked it once, then was
    retried against it twice more (retries x request_timeout per chunk,
    30 s by default through a FUSE close) until stop 49; now, once the map
    shows the member that just failed offline, the write fails after that
    attempt, with the same error."""
    cl = own_cluster
    with Client(cl.meta_addrs, request_timeout=2.0, connect_timeout=1.0, retries=3) as client:
        client.mkdir("/e21")
        client.set_layout("/e21", redundancy="ec:2+1", chunk_size=MiB)
        client.write_bytes("/e21/a", random_bytes(MiB, seed=5))
        victim = _name(cl, client._run(_holder(client.aclient, "/e21/a", 0, 0)))
        addr = cl.proc(victim).addr
        pid = cl.proc(victim).pid
        os.kill(pid, signal.SIGSTOP)
        try:
            async def offline() -> bool:
                cmap = await client.aclient.meta.get_cluster_map()
                return any(n.data_addr == addr and n.state != pb.NODE_STATE_ONLINE for n in cmap.nodes)

            deadline = time.monotonic() + 90
            while not client._run(offline()):
                assert time.monotonic() < deadline, "meta never marked the stalled node offline"
                time.sleep(0.2)
            with pytest.raises(UnavailableError) as ei:
                client.write_bytes("/e21/a", random_bytes(MiB, seed=6))
            assert "2 of 3 fragments durable, 3 needed, after 1 attempt:" in str(ei.value), str(ei.value)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert digest(client.read_bytes("/e21/a")) == digest(random_bytes(MiB, seed=5))  # the old bytes stand


@pytest.mark.timeout(150)
def test_reads_follow_a_group_member_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead storage node is replaced in its groups (meta, after
    ``replace_after``): the client refreshes its map, keeps reading the old
    files exactly (the new member holds nothing yet: read around it), and
    writes new files to the new member."""
    monkeypatch.setenv("TIERFS_META_HEARTBEAT_TIMEOUT", "2s")
    monkeypatch.setenv("TIERFS_META_REPLACE_AFTER", "1s")
    cl = start_cluster(tmp_path / "cl", n_storage=7)
    try:
        with Client(cl.meta_addrs, request_timeout=3.0, connect_timeout=1.0, map_max_age=0.5) as client:
            client.mkdir("/r")
            client.set_layout("/r", chunk_size=MiB, redundancy="ec:4+2")
            old = random_bytes(9 * MiB + 3, seed=41)
            client.write_bytes("/r/old.bin", old)

            async def group_members() -> dict[int, tuple[list[int], list[int]]]:
                cmap = await client.aclient.meta.get_cluster_map()
                return {g.group_id: (list(g.target_ids), list(g.rebuilding)) for g in cmap.groups}

            before = client._run(group_members())
            victim = "storage-1"
            cl.kill(victim)
            deadline = time.monotonic() + 60
            while True:
                now = client._run(group_members())
                if any(now.get(g, ([], []))[0] != m for g, (m, _) in before.items()):
                    break
                assert time.monotonic() < deadline, "meta never replaced the dead node's targets"
                time.sleep(0.2)
            assert digest(client.read_bytes("/r/old.bin")) == digest(old)
            new = random_bytes(5 * MiB + 1, seed=42)
            client.write_bytes("/r/new.bin", new)
            assert digest(client.read_bytes("/r/new.bin")) == digest(new)
            assert digest(client.read_bytes("/r/old.bin")) == digest(old)
    finally:
        cl.stop()


@pytest.mark.timeout(120)
def test_a_write_cancelled_while_meta_is_unreachable_returns_within_the_abort_deadline(
        own_cluster: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    """Cancelling a writer aborts its session, best effort: with every meta
    replica stalled (SIGSTOP) the abort gives up after ``abort_deadline``
    (2 s here), not after twice ``meta_deadline`` (20 s each) as it did. The
    file stays what it was, and once meta is back and the lease has run out,
    the next writer gets it."""
    cl = own_cluster
    old, new = random_bytes(5 * MiB + 3, seed=41), random_bytes(13 * MiB + 1, seed=42)
    metas = [cl.proc(p.name).pid for p in cl.procs if p.name.startswith("meta-")]
    assert len(metas) == 3

    async def go() -> float:
        async with AsyncClient(cl.meta_addrs, lease_ms=3000, abort_deadline=2.0, meta_deadline=20.0,
                               meta_attempt_timeout=3.0) as client:
            await client.write_bytes("/c.bin", old)
            flushed = asyncio.Event()

            async def writer() -> None:
                async with await client.open("/c.bin", "r+b") as f:
                    await f.write(new)
                    await f.flush()
                    flushed.set()
                    await asyncio.Event().wait()  # until cancelled

            task = asyncio.create_task(writer())
            await asyncio.wait_for(flushed.wait(), 60)
            for pid in metas:
                os.kill(pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 30)
                elapsed = time.monotonic() - t0
            finally:
                for pid in metas:
                    os.kill(pid, signal.SIGCONT)
            assert digest(await client.read_bytes("/c.bin")) == digest(old)
            # The session ends when its lease runs out: until then BusyError.
            deadline = time.monotonic() + 60
            while True:
                try:
                    await client.write_bytes("/c.bin", new)
                    break
                except BusyError:
                    assert time.monotonic() < deadline, "the aborted session never ended"
                    await asyncio.sleep(0.2)
            assert digest(await client.read_bytes("/c.bin")) == digest(new)
            return elapsed

    with caplog.at_level(logging.WARNING, logger="tierfs.client.file"):
        elapsed = asyncio.run(go())
    assert elapsed < 2.0 + 3.0, elapsed  # abort_deadline plus the cancelled sends' own wind-down
    assert any("could not be ended" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.timeout(180)
@pytest.mark.parametrize("redundancy", ["ec:1+1", "ec:2+1"])
def test_a_decode_never_gives_up_the_fragments_it_needs_for_a_dead_one(
        own_cluster: LocalCluster, redundancy: str) -> None:
    """Found by a new user: with a data fragment's node SIGKILLed, a chunk
    whose surviving fragments take longer to fetch than the hedge delay (64
    MiB chunks) was unreadable: the decode counted the dead fragment as a
    spare and hedged away the fragments it needed ("0 of the 1 fragments
    needed arrived"). Hedging is forced on every fetch here (2 ms)."""
    cl = own_cluster
    data = random_bytes(64 * MiB, seed=51)
    with Client(cl.meta_addrs, request_timeout=10.0, connect_timeout=1.0, hedge_after=0.002,
                hedge_min=0.001) as client:
        client.mkdir("/big")
        client.set_layout("/big", redundancy=redundancy, chunk_size=64 * MiB)
        client.write_bytes("/big/f", data)
        victim = next(p.name for p in cl.procs
                      if p.kind == "storage" and p.addr == client._run(_holder(client.aclient, "/big/f", 0, 0)))
        cl.kill(victim)
        for _ in range(3):  # the first read finds the node dead; the next ones know it
            assert digest(client.read_bytes("/big/f")) == digest(data)
