"""Meta robustness against real ``tierfs-meta`` replicas: an apply that fails
half-way changes nothing anywhere; a leader whose clock runs a day ahead
cannot freeze lease expiry or failure detection; heartbeats are not log
entries, and failure detection still works across a leader failover."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.cluster import MetaCluster, wait_for
from tests.meta.meta_helpers import Driver, register_async
from tierfs.errors import InternalError, TierFSError
from tierfs.meta.client import MetaClient
from tierfs.meta.state import MAX_CLOCK_STEP_NS, MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb

MARKER = "tierfs-test-fail-apply"
SEC = 10**9
DAY = 86400


async def until(cond: Callable[[], Awaitable[object]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


# --- a failing apply ----------------------------------------------------------------


def test_failing_apply_changes_nothing_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ops crafted to raise after they mutated (the test hook) leave the
    digest, clock and counters exactly as before; the same ops without the
    marker succeed and change the state."""
    monkeypatch.setenv("TIERFS_TEST_APPLY_FAIL_MARKER", MARKER)
    d = Driver(MetaStateMachine())
    d.register(nodes=6)
    d.do("mkdir", pb.MkdirRequest(loc=pb.Loc(path="/a")), pb.FileInfo)
    d.do("create", pb.CreateRequest(loc=pb.Loc(path="/a/f")), pb.FileInfo)
    before = d.sm.digest()
    clock = d.sm.clock
    d.advance(5)
    failing = [
        ("mkdir", pb.MkdirRequest(loc=pb.Loc(path=f"/a/{MARKER}"))),
        ("rename", pb.RenameRequest(src=pb.Loc(path="/a/f"), dst=pb.Loc(path=f"/{MARKER}"))),
        ("open_write", pb.OpenWriteRequest(loc=pb.Loc(path="/a/f"), owner=MARKER)),
        ("register_node", pb.RegisterNodeRequest(node_uuid=MARKER, hostname="h", data_addr="127.0.0.1:1",
                                                 targets=[pb.TargetSpec(path="/t", capacity=1 << 40)])),
    ]
    for kind, req in failing:
        with pytest.raises(InternalError, match="test hook"):
            d.do(kind, req, client="c1", rid=len(kind))
        assert d.sm.digest() == before, kind
        assert d.sm.clock == clock
    assert "c1" not in d.sm.requests  # not even remembered for dedup
    d.do("mkdir", pb.MkdirRequest(loc=pb.Loc(path="/a/ok")), pb.FileInfo)
    assert d.sm.digest() != before


async def _fail_and_check(c: MetaCluster, digest: str) -> None:
    async with MetaClient(c.addresses, deadline=20.0) as mc:
        regs = await register_async(mc, nodes=6)
        assert regs
        await mc.mkdir("/a")
        await mc.create("/a/f")
        await mc.mkdir("/b")
        base = c.wait_converged()
        assert base != digest
        st0 = await mc.digest()
        attempts = [
            mc.mkdir(f"/a/{MARKER}"),
            mc.rename("/a/f", f"/b/{MARKER}"),
            mc.open_write("/a/f", owner=MARKER),
            mc.register_node(MARKER, "host", "127.0.0.1:1", [("/t", 1 << 40)]),
        ]
        for coro in attempts:
            with pytest.raises(InternalError, match="test hook"):
                await coro
        final = c.wait_converged()
        assert final == base, "a failed apply changed the state"
        st1 = await mc.digest()
        assert st1.ops_applied >= st0.ops_applied + len(attempts)  # applied (and undone), not skipped
        await mc.rename("/a/f", "/b/g")
        assert c.wait_converged() != base


@pytest.mark.timeout(120)
def test_failing_apply_is_undone_on_every_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERFS_TEST_APPLY_FAIL_MARKER", MARKER)
    with MetaCluster(tmp_path, 3, state_machine="meta") as c:
        c.wait_leader()
        empty = c.wait_converged()
        asyncio.run(_fail_and_check(c, empty))


# --- a clock that jumps ahead ----------------------------------------------------------


class Beater:
    """Simulated storage nodes: a thread heartbeats ``alive`` every 0.3 s
    through its own MetaClient (following leader changes)."""

    def __init__(self, addrs: list[str], alive: set[int]) -> None:
        self.addrs, self.alive = addrs, alive
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        async with MetaClient(self.addrs, deadline=5.0) as mc:
            while not self.stop.is_set():
                for n in sorted(self.alive):
                    with contextlib.suppress(TierFSError):  # elections, stopped replicas
                        await mc.heartbeat(n, [])
                await asyncio.sleep(0.3)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def _make_leader(c: MetaCluster, want: int) -> None:
    """Stop the leader until ``want`` leads (the stopped one restarts as a follower)."""
    for _ in range(12):
        lead = c.wait_leader()
        if lead == want:
            return
        c.stop(lead)
        wait_for(lambda: c.leader() is not None, 20, "a new leader")
        c.start(lead)
    raise AssertionError(f"replica {want} never became leader")


@pytest.mark.timeout(240)
def test_leader_clock_a_day_ahead_does_not_freeze_time(tmp_path: Path) -> None:
    fast = 2
    args = ["--heartbeat-timeout", "3", "--lease-duration", "3", "--tick-interval", "0.2"]
    c = MetaCluster(tmp_path, 3, state_machine="meta", extra_args=args, start=False)
    c.replicas[fast].env["TIERFS_TEST_CLOCK_OFFSET"] = str(DAY)
    beater: Beater | None = None
    try:
        for i in range(3):
            c.start(i)
        lead = c.wait_leader()
        if lead == fast:  # the state clock must first be set by a correct leader
            c.stop(fast)
            wait_for(lambda: c.leader() is not None, 20, "a new leader")
            c.start(fast)

        async def correct_first() -> tuple[int, list[pb.RegisterNodeReply]]:
            async with MetaClient(c.addresses, deadline=20.0) as mc:
                regs = await register_async(mc, nodes=6)
                return (await mc.mkdir("/warm")).attr.mtime_ns, regs
        warm, regs = asyncio.run(correct_first())
        assert abs(warm - time.time_ns()) < 60 * SEC
        beater = Beater(c.addresses, {r.node_id for r in regs})

        _make_leader(c, fast)

        async def under_fast() -> int:
            async with MetaClient(c.addresses, deadline=20.0) as mc:
                async def all_online() -> bool:
                    return all(n.state == pb.NODE_STATE_ONLINE for n in (await mc.get_cluster_map()).nodes)
                await until(all_online, 20, "every node online")
                f = await mc.mkdir("/fast")
                await mc.create("/f")
                await mc.open_write("/f", owner="writer-under-fast-leader")
                return f.attr.mtime_ns
        fast_mtime = asyncio.run(under_fast())
        # One leadership moves the state clock at most MAX_CLOCK_STEP_NS
        # ahead, not a day.
        assert fast_mtime - time.time_ns() < MAX_CLOCK_STEP_NS + 60 * SEC, \
            f"state clock {(fast_mtime - time.time_ns()) / SEC:.0f}s ahead"

        c.stop(fast)
        wait_for(lambda: c.leader() is not None, 20, "a correct leader")
        beater.alive.discard(regs[5].node_id)  # node 6 dies with the fast leader

        async def under_correct() -> None:
            async with MetaClient(c.addresses, deadline=20.0) as mc:
                later = await mc.mkdir("/later")
                assert later.attr.mtime_ns >= fast_mtime  # never backwards

                async def lease_gone() -> bool:
                    return not (await mc.stat("/f")).writing
                await until(lease_gone, 20, "the lease taken under the fast leader to expire")
                await mc.create("/g")
                await mc.open_write("/g", owner="writer-under-correct-leader")

                async def g_gone() -> bool:
                    return not (await mc.stat("/g")).writing
                await until(g_gone, 20, "a lease taken under the correct leader to expire")

                async def dead_offline() -> bool:
                    nodes = {n.node_id: n.state for n in (await mc.get_cluster_map()).nodes}
                    return nodes[regs[5].node_id] == pb.NODE_STATE_OFFLINE
                await until(dead_offline, 20, "the silent storage node to go offline")
                nodes = {n.node_id: n.state for n in (await mc.get_cluster_map()).nodes}
                assert all(nodes[r.node_id] == pb.NODE_STATE_ONLINE for r in regs[:5]), nodes
        asyncio.run(under_correct())
        c.start(fast)
        c.wait_converged(timeout=60)
    finally:
        if beater is not None:
            beater.close()
        c.close()


# --- heartbeats are not log entries ---------------------------------------------------------


@pytest.mark.timeout(180)
def test_heartbeats_do_not_grow_the_log_and_failover_still_detects(tmp_path: Path) -> None:
    args = ["--heartbeat-timeout", "3", "--tick-interval", "0.2"]
    with MetaCluster(tmp_path, 3, state_machine="meta", extra_args=args) as c:
        c.wait_leader()

        async def main() -> None:
            async with MetaClient(c.addresses, deadline=20.0) as mc:
                regs = await register_async(mc, nodes=6)
                reports = {r.node_id: [pb.TargetReport(target_id=t.target_id, used=1000, capacity=1 << 40)
                                       for t in r.targets] for r in regs}
                for r in regs:  # the first report of usage is committed
                    await mc.heartbeat(r.node_id, reports[r.node_id])
                st0 = await mc.status()
                for _ in range(50):
                    for r in regs:
                        hb = await mc.heartbeat(r.node_id, reports[r.node_id])
                        assert hb.state == pb.NODE_STATE_ONLINE
                st1 = await mc.status()
                grown = st1.commit_index - st0.commit_index
                # A node whose beat comes late on a loaded host flaps offline and
                # back (a tick, a heartbeat), each followed by the default KV
                # pool's new groups (kv_groups): a flap costs 4 entries.
                assert grown <= 6, f"300 heartbeats added {grown} log entries"
                # Fresh usage is visible at once (the leader's memory) ...
                reports[regs[0].node_id][0].used = 5000
                await mc.heartbeat(regs[0].node_id, reports[regs[0].node_id])
                cmap = await mc.get_cluster_map()
                assert next(t.used for t in cmap.targets if t.target_id == reports[regs[0].node_id][0].target_id) \
                    == 5000
                # ... and a state change is committed at once.
                reports[regs[1].node_id][0].state = pb.TARGET_STATE_READ_ONLY
                await mc.heartbeat(regs[1].node_id, reports[regs[1].node_id])
                assert (await mc.status()).commit_index > st1.commit_index

                # Failover: the new leader knows no heartbeat times; the
                # nodes that keep beating stay online, the silent one goes
                # offline.
                old = c.leader()
                assert old is not None
                c.kill(old)
                stop = asyncio.Event()

                async def beat() -> None:
                    while not stop.is_set():
                        for r in regs[:5]:
                            await mc.heartbeat(r.node_id, reports[r.node_id])
                        await asyncio.sleep(0.3)
                beater = asyncio.create_task(beat())
                try:
                    async def silent_offline() -> bool:
                        nodes = {n.node_id: n.state for n in (await mc.get_cluster_map()).nodes}
                        return nodes[regs[5].node_id] == pb.NODE_STATE_OFFLINE
                    await until(silent_offline, 30, "the silent node to go offline under the new leader")
                    nodes = {n.node_id: n.state for n in (await mc.get_cluster_map()).nodes}
                    assert all(nodes[r.node_id] == pb.NODE_STATE_ONLINE for r in regs[:5]), nodes
                finally:
                    stop.set()
                    await beater
                c.start(old)
        asyncio.run(main())
        c.wait_converged(timeout=60)
