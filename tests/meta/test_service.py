"""The gRPC MetaService and MetaClient on real sockets (127.0.0.1:0):
typed calls end to end, leader-hint following, retries and the
cluster-unreachable error, retry deduplication, the leader's periodic tick,
and status/digest/membership RPCs."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from meta_helpers import SEC, Clock, gen0, meta_server, recs, register_async, run

from tierfs.errors import (
    BusyError,
    DirectoryNotEmptyError,
    InvalidArgumentError,
    NotFoundError,
    NotLeaderError,
    TimeoutError_,
    UnavailableError,
    UnsupportedError,
)
from tierfs.meta import (
    LocalReplicator,
    MetaClient,
    MetaStateMachine,
    ReplicaStatus,
    add_meta_service,
)
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


def dead_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def wait_for(cond: object, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        if await cond():  # type: ignore[operator]
            return
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


class Follower(LocalReplicator):
    """A replica that is not the leader: what RaftReplicator does on a
    follower (refuse with the leader's address), so the client's hint
    following is exercised over real gRPC."""

    def __init__(self, leader: str) -> None:
        super().__init__(MetaStateMachine(), addr="follower")
        self.leader = leader
        self.refused = 0

    async def submit(self, op: bytes, timeout: float) -> bytes:
        self.refused += 1
        raise NotLeaderError(leader=self.leader)

    async def read_barrier(self, timeout: float) -> None:
        self.refused += 1
        raise NotLeaderError(leader=self.leader)

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(id="follower", role="follower", leader=self.leader)


class RefusesThenHangs(Follower):
    """Answers "not the leader" once, then never again (a follower whose
    replies stop: a loaded machine, a partition)."""

    async def submit(self, op: bytes, timeout: float) -> bytes:
        if self.refused:
            await asyncio.sleep(60)
        return await super().submit(op, timeout)


class LosesReplies(LocalReplicator):
    """Commits the op, then fails the first ``n`` replies (a leader that
    crashed after committing): the client must retry without applying twice."""

    def __init__(self, n: int) -> None:
        super().__init__(MetaStateMachine())
        self.n = n

    async def submit(self, op: bytes, timeout: float) -> bytes:
        out = await super().submit(op, timeout)
        if self.n > 0:
            self.n -= 1
            raise TimeoutError_("reply lost")
        return out


async def _server(replicator: LocalReplicator) -> AsyncIterator[str]:
    server = grpc.aio.server()
    add_meta_service(server, replicator)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def test_end_to_end_namespace_and_sessions() -> None:
    async def main() -> None:
        clock = Clock()
        async with meta_server(clock=clock, gc_grace=60.0) as (mc, _svc, _addr):
            await register_async(mc)
            cmap = await mc.get_cluster_map()
            assert len(cmap.groups) == 12 and (await mc.get_cluster_map(cmap.version)).unchanged
            await mc.mkdir("/ckpt")
            lay = await mc.set_layout("/ckpt", chunk_size=MiB, redundancy="ec:4+2", stripe_width=4)
            assert lay.chunk_size == MiB and lay.stripe_width == 4
            f = await mc.create("/ckpt/rank0")
            assert f.layout.chunk_size == MiB and len(f.layout.groups) == 4
            assert (await mc.get_layout("/ckpt/rank0")).groups == f.layout.groups
            s = await mc.open_write("/ckpt/rank0", owner="rank0", map_version=cmap.version)
            with pytest.raises(BusyError):
                await mc.open_write(f.attr.inode, owner="rank1")
            assert (await mc.renew_lease(s.session_id, [(0, gen0(s.data_version))])) > 0
            assert (await mc.stat("/ckpt/rank0")).attr.size == 0
            info = await mc.commit_write(s.session_id, 3 * MiB, recs(s.data_version, [0, 1, 2]))
            assert info.attr.size == 3 * MiB
            assert (await mc.lookup((await mc.stat("/ckpt")).attr.inode, "rank0")).attr.size == 3 * MiB
            s2 = await mc.open_write("/ckpt/rank0")
            await mc.commit_write(s2.session_id, 3 * MiB, recs(s2.data_version, [2]))
            # The replaced version stays readable for the grace period; after
            # it the item is listed with no op in between (an idle cluster).
            clock.now += 59 * 10**9
            assert await mc.list_gc([]) == []
            clock.now += 1 * 10**9
            gc = await mc.list_gc([])
            assert {(i.chunk, i.version) for i in gc} == {(2, gen0(s.data_version))} and len(gc) == 6
            assert await mc.ack_gc([(i.id, i.target_id) for i in gc]) == 6
            assert await mc.list_gc([]) == []
            gch = await mc.list_group_chunks(f.layout.groups[2])
            assert [(c.chunk, c.version) for c in gch.chunks] == [(2, gen0(s2.data_version))] and gch.next_inode == 0
            with pytest.raises(InvalidArgumentError):
                await mc.finish_rebuild(f.layout.groups[0], 1)
            s3 = await mc.open_write("/ckpt/rank0")
            await mc.abort_write(s3.session_id, [(5, gen0(s3.data_version))])
            await mc.truncate("/ckpt/rank0", MiB)
            clock.now += 60 * 10**9
            assert len({i.chunk for i in await mc.list_gc([])}) == 3  # 5 aborted, 1 and 2 truncated
            await mc.symlink("/latest", "/ckpt/rank0")
            assert await mc.readlink("/latest") == "/ckpt/rank0"
            a = await mc.setattr("/ckpt/rank0", mode=0o600, uid=7, gid=8, mtime_ns=123)
            assert (a.attr.mode, a.attr.uid, a.attr.gid, a.attr.mtime_ns) == (0o600, 7, 8, 123)
            await mc.rename("/ckpt/rank0", "/ckpt/rank0.done")
            for i in range(7):
                await mc.create(f"/ckpt/x{i}")
            names = [e.name async for e in mc.iterdir("/ckpt", page=3)]
            assert names == sorted(["rank0.done"] + [f"x{i}" for i in range(7)])
            page = await mc.readdir("/ckpt", limit=5)
            assert len(page.entries) == 5 and page.next_cursor == "x3"
            with pytest.raises(DirectoryNotEmptyError):
                await mc.rmdir("/ckpt")
            await mc.unlink("/latest")
            with pytest.raises(NotFoundError):
                await mc.stat("/latest")
            st = await mc.status()
            assert st.role == "standalone" and st.commit_index > 0
            dg = await mc.digest()
            assert len(dg.digest) == 64 and dg.applied_index == st.commit_index
            with pytest.raises(UnsupportedError):
                await mc.add_member("127.0.0.1:1", "127.0.0.1:2")
            with pytest.raises(UnsupportedError):
                await mc.remove_member("127.0.0.1:1", "127.0.0.1:2")
    run(main())


def test_client_follows_leader_hint_and_skips_dead_replicas() -> None:
    async def main() -> None:
        leader = LocalReplicator(MetaStateMachine(), addr="leader")
        agen = _server(leader)
        laddr = await agen.__anext__()
        follower = Follower(laddr)
        fgen = _server(follower)
        faddr = await fgen.__anext__()
        try:
            async with MetaClient([dead_addr(), faddr], deadline=10.0, attempt_timeout=1.0) as mc:
                await mc.mkdir("/a")
                assert mc.leader == laddr and follower.refused == 1
                assert (await mc.stat("/a")).attr.type == pb.INODE_TYPE_DIRECTORY
                assert follower.refused == 1  # the hint stuck: later calls go straight to the leader
                # status/digest can be asked of one replica (answered locally, no leader needed)
                assert (await mc.status(addr=faddr)).role == "follower"
                assert (await mc.digest(addr=faddr)).digest == MetaStateMachine().digest()
                assert (await mc.digest()).digest == leader.state_machine.digest()
        finally:
            await fgen.aclose()
            await agen.aclose()
    run(main())


def test_unreachable_error_keeps_what_the_replica_said() -> None:
    """The call's last attempt, cut short by the call's deadline, times out:
    the error still reports the follower's "not the leader" from before
    (it used to say only "deadline exceeded")."""
    async def main() -> None:
        fol = RefusesThenHangs("")
        fgen = _server(fol)
        faddr = await fgen.__anext__()
        try:
            async with MetaClient([faddr], deadline=1.5) as mc:
                with pytest.raises(UnavailableError, match=f"no meta leader: {faddr} answers, but knows no leader that answers"
                                   ) as ei:
                    await mc.mkdir("/x")
                assert "cluster unreachable" in str(ei.value)
                # The attempt that timed out had less than an attempt's time
                # (the call's deadline cut it short): that does not mark the
                # replica as down for the calls that follow.
                assert not mc._is_unreachable(faddr)
            assert fol.refused == 1
        finally:
            await fgen.aclose()
    run(main())


def test_unreachable_cluster_error_names_every_replica() -> None:
    async def main() -> None:
        a, b = dead_addr(), dead_addr()
        async with MetaClient([a, b], deadline=1.0, attempt_timeout=0.3) as mc:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(UnavailableError) as ei:
                await mc.stat("/")
            assert loop.time() - t0 < 5.0
            assert "cluster unreachable" in str(ei.value) and a in str(ei.value) and b in str(ei.value)
            assert isinstance(ei.value, ConnectionError)
        # a follower that never learns a leader: same error, no endless loop
        fol = Follower("")
        fgen = _server(fol)
        faddr = await fgen.__anext__()
        try:
            # A deadline several attempts long even on a loaded machine.
            async with MetaClient([faddr], deadline=3.0) as mc:
                with pytest.raises(UnavailableError, match="no meta leader"):
                    await mc.mkdir("/x")
                assert fol.refused >= 2  # it retried with backoff
            # With the other replicas down, the one that answered is the
            # news: until stop 49 the error gave the last refused
            # connection ("Connection refused ... is the cluster running?").
            a, b = dead_addr(), dead_addr()
            async with MetaClient([faddr, a, b], deadline=3.0, attempt_timeout=0.3) as mc:
                with pytest.raises(UnavailableError) as ei:
                    await mc.mkdir("/x")
                msg = str(ei.value)
                assert f"no meta leader: {faddr} answers, but knows no leader that answers" in msg and a in msg and b in msg, msg
        finally:
            await fgen.aclose()
    run(main())


def test_retry_after_lost_reply_is_not_applied_twice() -> None:
    async def main() -> None:
        rep = LosesReplies(0)
        gen = _server(rep)
        addr = await gen.__anext__()
        try:
            async with MetaClient([addr], deadline=10.0) as mc:
                await register_async(mc)
                rep.n = 1
                f = await mc.create("/once")  # committed, reply lost, retried: the first result comes back
                assert f.attr.inode == (await mc.stat("/once")).attr.inode
                rep.n = 2
                await mc.unlink("/once")  # would be NotFound if applied twice
                rep.n = 1
                s = await mc.open_write(await _mk(mc, "/w"))
                sm = rep.state_machine
                assert isinstance(sm, MetaStateMachine) and len(sm.sessions) == 1 and s.data_version == 1
        finally:
            await gen.aclose()
    run(main())


async def _mk(mc: MetaClient, path: str) -> str:
    await mc.create(path)
    return path


def test_leader_tick_expires_heartbeats_and_leases() -> None:
    async def main() -> None:
        clock = Clock()
        async with meta_server(clock=clock, heartbeat_timeout=5.0, lease_duration=3.0,
                               tick_interval=0.02) as (mc, svc, _addr):
            regs = await register_async(mc)
            await mc.create("/f")
            s = await mc.open_write("/f")
            assert s.lease_expiry_ns == clock.now + 3 * SEC
            await svc.start()
            await svc.start()  # idempotent
            clock.now += 4 * SEC  # lease runs out; heartbeats not yet
            for r in regs:
                await mc.heartbeat(r.node_id, [pb.TargetReport(target_id=t.target_id, used=1) for t in r.targets])

            async def session_gone() -> bool:
                return not (await mc.stat("/f")).writing
            await wait_for(session_gone)
            clock.now += 6 * SEC  # every node is now silent for longer than heartbeat_timeout

            async def all_offline() -> bool:
                cmap = await mc.get_cluster_map()
                return all(n.state == pb.NODE_STATE_OFFLINE for n in cmap.nodes)
            await wait_for(all_offline)
            hb = await mc.heartbeat(regs[0].node_id, [])
            assert hb.state == pb.NODE_STATE_ONLINE
            await svc.stop()
    run(main())


def test_idle_leader_writes_no_ticks() -> None:
    async def main() -> None:
        clock = Clock()
        async with meta_server(clock=clock, heartbeat_timeout=5.0) as (mc, svc, _addr):
            regs = await register_async(mc, nodes=1)
            idx = (await mc.status()).commit_index
            assert not await svc.tick()  # nothing to expire: no log entry
            assert (await mc.status()).commit_index == idx
            clock.now += 6 * SEC
            assert await svc.tick()
            assert (await mc.get_cluster_map()).nodes[0].state == pb.NODE_STATE_OFFLINE
            assert not await svc.tick()
            assert await svc.tick(force=True)
            await mc.heartbeat(regs[0].node_id, [])
    run(main())


def test_a_new_leader_marks_used_figures_it_has_not_been_told() -> None:
    """Right after a failover the new leader's map carried the committed
    `used` of every target, up to `usage_interval` (30 s) old, as if fresh:
    `make run`'s status showed 0 B on three targets holding 128.5 MiB each.
    The map now marks such figures (`used_unreported`) until the node's
    first heartbeat reaches this leader, and `tierfs df` / `status` show
    them with a `*` and a note."""
    from tierfs.cli.main import UNREPORTED_NOTE, _df_text
    from tierfs.cli.usage import df

    async def go() -> None:
        async with meta_server() as (mc, svc, _addr):
            regs = await register_async(mc, nodes=2, targets=1)
            (n0, t0), (n1, t1) = [(r.node_id, r.targets[0].target_id) for r in regs]

            def used(cmap: pb.ClusterMap) -> dict[int, tuple[int, bool]]:
                return {t.target_id: (t.used, t.used_unreported) for t in cmap.targets}

            assert used(await mc.get_cluster_map()) == {t0: (0, True), t1: (0, True)}
            await mc.heartbeat(n0, [pb.TargetReport(target_id=t0, used=7000, capacity=1 << 40)])
            assert used(await mc.get_cluster_map()) == {t0: (7000, False), t1: (0, True)}
            # A second servicer over the same state: a new leader, which has the
            # committed figures (no usage committed yet: 0) and no heartbeats.
            server = grpc.aio.server()
            add_meta_service(server, LocalReplicator(svc.state))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                async with MetaClient([f"127.0.0.1:{port}"], deadline=5.0) as mc2:
                    assert used(await mc2.get_cluster_map()) == {t0: (0, True), t1: (0, True)}
                    text = _df_text(await df([f"127.0.0.1:{port}"]), True)
                    assert UNREPORTED_NOTE in text and text.count("0 B*") >= 2, text
                    await mc2.heartbeat(n0, [pb.TargetReport(target_id=t0, used=7000, capacity=1 << 40)])
                    await mc2.heartbeat(n1, [pb.TargetReport(target_id=t1, used=9000, capacity=1 << 40)])
                    assert used(await mc2.get_cluster_map()) == {t0: (7000, False), t1: (9000, False)}
                    text = _df_text(await df([f"127.0.0.1:{port}"]), True)
                    assert UNREPORTED_NOTE not in text and "*" not in text, text
            finally:
                await server.stop(None)

    run(go())
