"""Rebalancing on a real local cluster: 4 storage nodes with data grow to 6
(``LocalCluster.grow``, what ``tierfs up --storage 6`` does); the leader's
rebalancer moves group members onto the new nodes by copy while a checker
writes new files and re-reads every acknowledged one. Afterwards every
target holds its share (within 10% of the mean by bytes on disk), the bytes
moved are close to the minimum, and the old members' nodes delete their
copies (group purges) before any scrub.

The body (:func:`grow_and_rebalance`) takes the cluster and a ``grow``
callable, so a multi-host fixture can run it too."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import wait_for
from tests.repair.util import META_FAST, random_bytes, start
from tests.scale.checker import LiveChecker
from tierfs.cli.repair import scrub_cluster
from tierfs.client import AsyncClient
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

KiB = 1024
CHUNK = 128 * KiB
REBALANCE = ("--rebalance=true", "--rebalance-interval=0.5", "--rebalance-max-moving=4")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    # 2 MiB/s of copy per node: the moves take seconds, the checker runs through them.
    cl = start(tmp_path / "c", n_storage=4, meta_args=(*META_FAST, *REBALANCE), storage_args=("--rebuild-rate=2MiB",))
    try:
        yield cl
    finally:
        cl.stop()


def disk_bytes(cl: LocalCluster, cmap: pb.ClusterMap) -> dict[int, int]:
    """Bytes of fragment files on each target's disk (target id -> bytes)."""
    out = {}
    for t in cmap.targets:
        root = Path(t.path) / "frags"
        out[t.target_id] = sum(p.stat().st_size for p in root.glob("*/*/*") if p.is_file())
    return out


async def rebalance_status(meta: list[str]) -> pb.RebalanceStatus:
    async with MetaClient(meta, deadline=10) as mc:
        return await mc.rebalance_status()


async def grow_and_rebalance(cl: Any, grow: Callable[[int], None], disk: Callable[[pb.ClusterMap], dict[int, int]],
                             *, timeout: float = 120.0) -> dict[str, Any]:
    meta = list(cl.meta_addrs)
    async with AsyncClient(meta) as c:
        await c.mkdir("/d", exist_ok=True)
        await c.set_layout("/d", chunk_size=CHUNK, redundancy="ec:2+1")
        # Files of 4 chunks each: with 4 groups of width 3, every group gets
        # the same bytes, so the ideal after growing to 6 is reachable.
        files = {f"/d/f{i}": random_bytes(4 * CHUNK, i) for i in range(12)}
        for path, data in files.items():
            await c.write_bytes(path, data)
        async with MetaClient(meta, deadline=10) as mc:
            before = await mc.get_cluster_map()
        st0 = await rebalance_status(meta)
        assert not st0.moves_in_flight

        ck = LiveChecker(meta, sizes=(8 * KiB, 40 * KiB))
        ck.files.update(files)
        await ck.start(c)
        t0 = time.monotonic()
        await asyncio.to_thread(grow, 6)
        grown = time.monotonic() - t0
        seen_moving = False
        end = time.monotonic() + timeout
        while True:
            st = await rebalance_status(meta)
            # A move may start and finish between two polls (seen under
            # load): one done since the grow counts as seen too.
            seen_moving |= st.moves_in_flight > 0 or st.moves_done > st0.moves_done
            if (seen_moving and st.moves_in_flight == 0 and st.moves_planned == 0
                    and st.targets == 6 and st.balance_max_over_mean <= 1.1):
                break
            assert time.monotonic() < end, f"rebalance not done after {timeout:.0f}s: {st}"
            await asyncio.sleep(0.3)
        seconds = time.monotonic() - t0
        await ck.stop()
        assert not ck.problems, ck.problems[:10]
        assert ck.reads > 0 and ck.writes > 0
        assert not await ck.verify_all(c)

        async with MetaClient(meta, deadline=10) as mc:
            after = await mc.get_cluster_map()
        assert len(after.targets) == 6 and not any(g.rebuilding for g in after.groups)
        # The old members' nodes delete their copies once gc_grace is over
        # (group purges), with no scrub: the bytes on disk are balanced
        # before any scrub runs (until stop 54 the old copies stayed until
        # a scrub pass, an hour apart by default, found them as orphans).
        purge_start = time.monotonic()
        purge_end = purge_start + 30
        while True:
            pending = (await rebalance_status(meta)).purges_pending
            on_disk = disk(after)
            mean = sum(on_disk.values()) / len(on_disk)
            if not pending and all(0.9 <= b / mean <= 1.1 for b in on_disk.values()):
                break
            assert time.monotonic() < purge_end, f"old copies not deleted: {pending} purges pending, {on_disk}"
            await asyncio.sleep(0.3)
        old_copies_gone = time.monotonic() - purge_start
        await scrub_cluster(meta, timeout=120)  # what else is left (the checker's aborted writes)
        again = await scrub_cluster(meta, timeout=120)
        assert again["total"]["orphans"] == 0 and again["clean"], again["total"]
        assert not await ck.verify_all(c)
        on_disk = disk(after)
        mean = sum(on_disk.values()) / len(on_disk)
        spread = {t: b / mean for t, b in on_disk.items()}
        assert all(0.9 <= s <= 1.1 for s in spread.values()), (spread, on_disk)
        # The minimum to move: what the new targets hold at the end, minus
        # what was written onto them directly (new files); compare with the
        # meta's count of bytes copied by finished moves.
        new_targets = {t.target_id for t in after.targets} - {t.target_id for t in before.targets}
        stored = sum(on_disk.values())
        minimum = stored * len(new_targets) / len(on_disk)
        return {"seconds": seconds, "grow_seconds": grown, "bytes_moved": st.bytes_moved, "moves": st.moves_done, "stored": stored,
                "minimum": minimum, "moved_over_minimum": st.bytes_moved / minimum, "spread": spread,
                "checker_reads": ck.reads, "checker_writes": ck.writes, "old_copies_gone_s": old_copies_gone}


@pytest.mark.timeout(180)
def test_grow_4_to_6_rebalances_with_no_unreadable_byte(cluster: LocalCluster) -> None:
    def grow(n: int) -> None:
        cluster.grow(n)
        cluster.up(timeout=90)

    r = asyncio.run(grow_and_rebalance(cluster, grow, lambda cmap: disk_bytes(cluster, cmap)))
    print("rebalance:", {k: v for k, v in r.items() if k != "spread"})
    # Close to the minimum (1/3 of the data for 2 nodes added to 4); the
    # checker's new files land on the new targets directly and count there.
    assert r["moved_over_minimum"] <= 1.3, r

    # The leader's Prometheus endpoint says the same as the status RPC.
    def leader_gauges() -> bool:
        for addr in cluster.metrics_addrs.values():
            m = _scrape(addr)
            if m.get(("tierfs_meta_role", (("role", "leader"),))) == 1.0:
                return (m.get(("tierfs_rebalance_moves_done", ())) == r["moves"]
                        and m.get(("tierfs_rebalance_bytes_moved", ())) == r["bytes_moved"]
                        and m.get(("tierfs_rebalance_moves_in_flight", ())) == 0
                        and m.get(("tierfs_rebalance_rule_violations", ())) == 0
                        and (m.get(("tierfs_rebalance_balance_max_over_mean", ())) or 0) >= 1.0)
        return False

    wait_for(leader_gauges, 20, "the leader's tierfs_rebalance_* gauges to show the finished rebalance")


def _scrape(addr: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}
