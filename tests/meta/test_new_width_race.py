"""A create of a new layout width while the cluster map moves, against real
``tierfs-meta`` replicas (the Rebalancer's top-up racing other commits)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.cluster import MetaCluster
from tierfs.errors import TierFSError
from tierfs.meta.client import MetaClient

#: between two label changes: ~20 map changes a second, far more than a
#: cluster sees (a busier map starves the top-up: every round goes stale)
PAUSE = 0.05
#: ... or this many times as long as the last label change took, if longer:
#: the map moves at a pace relative to meta's own. On a loaded machine (CI:
#: 2 cores, 2 workers) every commit and top-up round takes several times as
#: long while a fixed PAUSE does not, so the map was relatively as busy as
#: the one that starves the top-up, and a create failed.
PAUSE_PER_COMMIT = 2
WIDTHS = ["replica:2", "replica:4", "ec:3+2", "replica:1"]


async def _race(addrs: list[str]) -> dict[str, str]:
    async with MetaClient(addrs, deadline=20.0) as mc, MetaClient(addrs, deadline=20.0) as labeller:
        nodes = [(await mc.register_node(f"race-{i}", f"host{i}", f"127.0.0.1:{9100 + i}",
                                         [("/t", 1 << 40)])).node_id for i in range(5)]
        await mc.mkdir("/race")
        stop = asyncio.Event()
        labels = 0

        async def relabel() -> None:  # every label change moves the map version
            nonlocal labels
            while not stop.is_set():
                labels += 1
                t0 = time.monotonic()
                await labeller.label_node(nodes[0], f"r{labels % 2}")
                await asyncio.sleep(max(PAUSE, PAUSE_PER_COMMIT * (time.monotonic() - t0)))

        task = asyncio.create_task(relabel())
        out: dict[str, str] = {}
        try:
            while labels < 3:  # the map is moving
                await asyncio.sleep(0.05)
            for red in WIDTHS:
                try:
                    f = await mc.create(f"/race/{red.replace(':', '_')}", redundancy=red)
                    out[red] = f"ok {len(f.layout.groups)} groups"
                except TierFSError as exc:  # reported below, every width at once
                    out[red] = f"{type(exc).__name__}: {exc}"
        finally:
            stop.set()
            await task
        return out


@pytest.mark.timeout(120)
def test_creates_of_new_widths_while_the_map_moves(tmp_path: Path) -> None:
    """Each create of a width never used before makes the leader commit that
    width's groups first. With the map moving meanwhile (here node labels;
    in the field a `tierfs target rm` just before) those groups went stale
    and the top-up gave up: the create failed with the self-contradictory
    "layout replica:2 needs 2 online targets on distinct storage nodes, but
    only 5 node(s) have an online target" (4 of 4 widths here before the
    fix). The top-up plans again now, and every create succeeds."""
    with MetaCluster(tmp_path, 1, state_machine="meta") as c:
        c.wait_leader()
        out = asyncio.run(_race(c.addresses))
    assert all(v.startswith("ok") for v in out.values()), out
