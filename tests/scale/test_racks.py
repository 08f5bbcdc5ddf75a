"""Failure domains on a real local cluster of 8 storage nodes in 6 racks
(``--rack``): one rack of 3 nodes and five of one. Node-only placement puts
two or three members of some ec:4+2 group in the big rack, so losing that
rack (every daemon SIGKILLed) loses data; the rack rule keeps one member
per rack and every file reads back. A label change (`tierfs node label`)
that puts two members of a group in one rack makes the rebalancer move one.

The bodies take the cluster (``meta_addrs``) and a ``kill_rack`` callable,
so a multi-host fixture can run them too."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.repair.util import META_FAST, STORAGE_FAST, random_bytes
from tierfs.cli.main import run
from tierfs.client import AsyncClient
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

KiB = 1024
RACKS = ["big", "big", "big", "r1", "r2", "r3", "r4", "r5"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cl = LocalCluster(tmp_path_factory.mktemp("racks") / "c", n_meta=1, n_storage=len(RACKS), racks=RACKS,
                      extra_meta_args=[*META_FAST, "--rebalance=true", "--rebalance-interval=0.5"], gc_grace=0.5,
                      extra_storage_args=list(STORAGE_FAST))
    cl.up(timeout=120)
    try:
        yield cl
    finally:
        cl.stop()


def rack_members(cmap: pb.ClusterMap) -> dict[int, Counter[str]]:
    """group id -> members per rack."""
    node_rack = {n.node_id: n.rack or f"node-{n.node_id}" for n in cmap.nodes}
    t_rack = {t.target_id: node_rack[t.node_id] for t in cmap.targets}
    return {g.group_id: Counter(t_rack[t] for t in g.target_ids) for g in cmap.groups}


async def settle(meta: list[str], timeout: float = 60.0) -> pb.RebalanceStatus:
    """Wait until the rebalancer has nothing planned or moving (the groups
    made while the nodes registered one by one get evened out at start)."""
    end = time.monotonic() + timeout
    async with MetaClient(meta, deadline=10) as mc:
        while True:
            st = await mc.rebalance_status()
            if not st.moves_in_flight and not st.moves_planned:
                return st
            assert time.monotonic() < end, f"rebalance still busy after {timeout:.0f}s: {st}"
            await asyncio.sleep(0.3)


async def _files(meta: list[str]) -> dict[str, bytes]:
    await settle(meta)
    async with AsyncClient(meta) as c:
        await c.mkdir("/racks", exist_ok=True)
        await c.set_layout("/racks", chunk_size=64 * KiB, redundancy="ec:4+2")
        files = {f"/racks/f{i}": random_bytes(300 * KiB + i * 777, 100 + i) for i in range(6)}
        for path, data in files.items():
            await c.write_bytes(path, data)
        return files


async def rack_loss(cl: Any, kill_rack: Callable[[str], None], rack: str) -> None:
    meta = list(cl.meta_addrs)
    files = await _files(meta)
    await settle(meta)  # no copy in flight from the rack about to go
    async with MetaClient(meta, deadline=10) as mc:
        cmap = await mc.get_cluster_map()
        st = await mc.rebalance_status()
    assert sorted(n.rack for n in cmap.nodes) == sorted(RACKS)
    wide = [g for g in cmap.groups if g.width == 6]
    assert wide and all(max(c.values()) == 1 for g, c in rack_members(cmap).items()
                        if g in {w.group_id for w in wide}), rack_members(cmap)
    assert st.failure_domain == "failure domain: rack (6 racks)" and st.rule_violations == 0, st
    kill_rack(rack)
    async with AsyncClient(meta) as c:
        for path, data in files.items():
            assert await c.read_bytes(path) == data, path


@pytest.mark.timeout(150)
def test_losing_a_rack_keeps_every_ec42_file_readable(cluster: LocalCluster) -> None:
    def kill_rack(rack: str) -> None:
        for i, r in enumerate(RACKS):
            if r == rack:
                cluster.kill(f"storage-{i}")

    try:
        asyncio.run(rack_loss(cluster, kill_rack, "big"))
    finally:
        cluster.up(timeout=90)  # the rack back, for the next test


def _cli(cl: LocalCluster, *args: str) -> Any:
    out, err = io.StringIO(), io.StringIO()
    code = run([*args, "--json", "--meta", ",".join(cl.meta_addrs)], stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue()) if out.getvalue().strip() else None


async def label_moves(cl: Any, label: Callable[[int, str], None], timeout: float = 90.0) -> None:
    meta = list(cl.meta_addrs)
    files = await _files(meta)
    async with MetaClient(meta, deadline=10) as mc:
        cmap = await mc.get_cluster_map()
        by_rack: dict[str, list[int]] = {}
        for n in sorted(cmap.nodes, key=lambda n: n.node_id):
            by_rack.setdefault(n.rack, []).append(n.node_id)
        # A seventh rack (one node of the big one), then r1's node joins
        # r2: still 6 racks, and every group holding both nodes breaks the rule.
        await asyncio.to_thread(label, by_rack["big"][0], "r6")
        await asyncio.to_thread(label, by_rack["r1"][0], "r2")
        cmap = await mc.get_cluster_map()
        assert any(c["r2"] == 2 for c in rack_members(cmap).values())
        end = time.monotonic() + timeout
        while True:
            st = await mc.rebalance_status()
            cmap = await mc.get_cluster_map()
            if st.rule_violations == 0 and not any(g.rebuilding for g in cmap.groups):
                break
            assert time.monotonic() < end, f"groups still break the rack rule after {timeout:.0f}s: {st}"
            await asyncio.sleep(0.3)
        assert all(max(c.values()) == 1 for c in rack_members(cmap).values()), rack_members(cmap)
        assert st.moves_done > 0
    async with AsyncClient(meta) as c:
        for path, data in files.items():
            assert await c.read_bytes(path) == data, path


@pytest.mark.timeout(150)
def test_label_change_moves_groups_that_break_the_rule(cluster: LocalCluster) -> None:
    def label(node: int, rack: str) -> None:
        assert _cli(cluster, "node", "label", str(node), "--rack", rack) == {"node": node, "rack": rack}

    asyncio.run(label_moves(cluster, label))
    st = _cli(cluster, "rebalance", "status")
    assert st["rule_violations"] == 0 and st["done"], st
