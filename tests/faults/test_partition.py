"""A network partition of one storage node, for real (network namespaces,
tests/faults/netns.py): the node keeps running but nothing reaches it and
its heartbeats cannot leave.

What it proves: reads complete with exact bytes, within a bound, while one
node of every group is unreachable; meta marks the node offline after its
heartbeat timeout, writes are refused with a clear error (every fragment
must be stored; nothing partial appears); after the partition heals the node
is online again without any manual step, writes succeed and every
acknowledged byte reads back exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import FaultCluster, Ledger, MiB, random_bytes, wait_addr_state
from tests.faults.netns import NetnsNode


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
        assert not ledger.write(client, "/p/during", random_bytes(2 * MiB, seed=1))
        print(f"\npartition: verify 24 MiB took {first:.2f}s then {second:.2f}s; "
              f"meta marked the node offline {offline_after:.1f}s after that; write refused: {ledger.errors[-1]}")
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
