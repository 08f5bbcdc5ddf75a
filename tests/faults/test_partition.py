"""Network partitions, for real (network namespaces, tests/faults/netns.py):
one storage node, and the meta leader, each cut off while it keeps running.

What it proves: reads complete with exact bytes, within a bound, while one
node of every group is unreachable; meta marks the node offline after its
heartbeat timeout, and a new file written meanwhile commits degraded (K+1
of K+M fragments, the unreachable position skipped); after the partition
heals the node is online again without any manual step, writes succeed and
every acknowledged byte reads back exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faults.harness import FaultCluster, Ledger, MiB, random_bytes, wait_addr_state
from tests.faults.netns import NetnsNode
from tierfs.local import LocalCluster


@pytest.fixture
def partitioned(tmp_path: Path) -> Iterator[tuple[FaultCluster, NetnsNode]]:
    with NetnsNode.create(subnet=71) as nn:
        fc = FaultCluster(tmp_path / "cl", n_storage=5, host=nn.host_ip)
        try:
            nn.start_storage(tmp_path / "cl" / "storage-ns", fc.meta_addrs)
            wait_addr_state(fc.meta_addrs, nn.data_addr, "online", 30)
            yield fc, nn
        finally:
            try:
                nn.stop_storage()
            finally:
                fc.close()


@pytest.mark.timeout(150)
def test_partitioned_storage_node_then_heal(partitioned: tuple[FaultCluster, NetnsNode]) -> None:
    fc, nn = partitioned
    ledger = Ledger()
    with fc.client(request_timeout=1.0, connect_timeout=1.0, retries=2) as client:
        client.mkdir("/p")
        client.set_layout("/p", chunk_size=MiB)
        for i in range(4):
            assert ledger.write(client, f"/p/f{i}", random_bytes(6 * MiB + i, seed=600 + i)), ledger.errors
        ledger.verify(client)

        nn.partition()
        assert not nn.reachable(nn.ready["port"], timeout=0.5)
        t0 = time.monotonic()
        ledger.verify(client)
        first = time.monotonic() - t0
        t0 = time.monotonic()
        ledger.verify(client)
        second = time.monotonic() - t0
        offline_after = wait_addr_state(fc.meta_addrs, nn.data_addr, "offline", 30)
        degraded0 = client.aclient.degraded_writes
        assert ledger.write(client, "/p/during", random_bytes(2 * MiB, seed=1)), ledger.errors
        assert client.aclient.degraded_writes > degraded0
        print(f"\npartition: verify 24 MiB took {first:.2f}s then {second:.2f}s; "
              f"meta marked the node offline {offline_after:.1f}s after that; a new file committed degraded")
        assert first < 30 and second < 30

        nn.heal()
        back = wait_addr_state(fc.meta_addrs, nn.data_addr, "online", 30)
        print(f"healed: node online again after {back:.1f}s")
        deadline = time.monotonic() + 30
        while not ledger.write(client, "/p/during", random_bytes(2 * MiB, seed=2)):
            assert time.monotonic() < deadline, ledger.errors[-3:]
            time.sleep(0.3)
        ledger.verify(client)
    asyncio.run(fc.cl.wait_healthy(30))


def _leader(fc: FaultCluster) -> str:
    # A deadline above MetaClient's 3 s attempt timeout: a partitioned replica
    # tried first must leave time to ask the others.
    h = asyncio.run(fc.cl.health(deadline=8.0))
    return next((str(m["name"]) for m in h["meta"] if m["role"] == "leader"), "")


def _move_meta0(nn: NetnsNode) -> Callable[[LocalCluster], None]:
    """Plan hook: meta-0's Raft, gRPC and metrics addresses move to the
    namespace side (it cannot bind an address of ours)."""

    def hook(cl: LocalCluster) -> None:
        m0 = cl.proc("meta-0")
        keys = [k for k in ("raft", "metrics") if m0.extra.get(k)]
        moves = {a: a.replace(nn.host_ip, nn.ns_ip) for a in (m0.addr, *(m0.extra[k] for k in keys))}
        for p in cl.procs:
            for old, new in moves.items():
                p.argv = [arg.replace(old, new) for arg in p.argv]
        m0.addr = moves[m0.addr]
        for k in keys:
            m0.extra[k] = moves[m0.extra[k]]

    return hook


@pytest.mark.timeout(180)
def test_partitioned_meta_leader_during_large_write_then_heal(tmp_path: Path) -> None:
    """The meta leader (meta-0, alone in its namespace) is cut off in the
    middle of a large write: the other two replicas elect a leader, the
    writer's lease renewals and its commit go there, the write commits
    whole; after heal meta-0 rejoins as a follower and the cluster is
    healthy, everything exact."""
    with NetnsNode.create(subnet=72) as nn:
        fc = FaultCluster(tmp_path / "cl", host=nn.host_ip,
                          python=str(nn.python_wrapper(tmp_path / "py-in-netns", "--node-id=meta-0")),
                          plan_hook=_move_meta0(nn))
        try:
            # Make meta-0 the leader: kill whichever replica leads until it is.
            deadline = time.monotonic() + 90
            while (lead := _leader(fc)) != "meta-0":
                assert time.monotonic() < deadline, "meta-0 never became the leader"
                if lead:
                    fc.cl.kill(lead)
                    fc.cl.start(names=[lead], timeout=60)
                asyncio.run(fc.cl.wait_healthy(60))
            ledger = Ledger()
            data = random_bytes(40 * MiB + 9, seed=73)
            # A partitioned leader costs a renewal one meta attempt timeout (3 s) plus
            # the election; a 3 s lease expires in that window (seen), 6 s does not.
            with fc.client(request_timeout=5.0, lease_ms=6000) as client:
                client.mkdir("/m")
                assert ledger.write(client, "/m/small", b"s" * 5000)
                cut = 0.0
                with client.open("/m/big", "wb") as f:
                    view = memoryview(data)
                    for pos in range(0, len(data), 4 * MiB):
                        f.write(view[pos: pos + 4 * MiB])
                        if not cut and pos >= 12 * MiB:
                            nn.partition()
                            cut = time.monotonic()
                            # Longer than the lease: renewals must reach the new leader.
                            time.sleep(7.0)
                ledger.acked["/m/big"] = data
                committed = time.monotonic() - cut
                new = _leader(fc)
                assert new in ("meta-1", "meta-2"), new
                ledger.verify(client)
                assert ledger.write(client, "/m/during", random_bytes(3 * MiB, seed=74))
                nn.heal()
                deadline = time.monotonic() + 60
                while True:
                    h = asyncio.run(fc.cl.health(deadline=8.0))
                    roles = {m["name"]: m["role"] for m in h["meta"]}
                    if roles.get("meta-0") == "follower":
                        break
                    assert time.monotonic() < deadline, roles
                    time.sleep(0.2)
                asyncio.run(fc.cl.wait_healthy(60))
                print(f"\nmeta leader partitioned mid-write: committed {committed:.1f}s after the cut; "
                      f"new leader {new}; after heal: {roles}")
                assert ledger.write(client, "/m/after", random_bytes(MiB, seed=75))
                ledger.verify(client)
        finally:
            fc.close()
