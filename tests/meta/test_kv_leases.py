"""KV map leases on the meta side (docs/kv.md, "Map leases"): what a
heartbeat answer grants, and when a map change takes effect
(``kv_published``), on a real gRPC MetaService with a driven clock. The
daemons' side runs on real clusters in tests/kv/test_kv_map_leases.py."""

from __future__ import annotations

import asyncio

from meta_helpers import SEC, Clock, meta_server, register_async, run

from tierfs.meta.service import LEASE_DRIFT, LEASE_MARGIN_NS


def _lapse(lease_s: float) -> int:
    """How long meta counts a lease granted now as running, plus 1 ns."""
    return int(lease_s * SEC * (1 + LEASE_DRIFT)) + LEASE_MARGIN_NS + 1


def test_a_change_takes_effect_once_every_leased_node_has_it_or_its_lease_ran_out() -> None:
    async def main() -> None:
        clock = Clock()
        async with meta_server(clock=clock, heartbeat_timeout=10.0, kv_lease=5.0) as (mc, _svc, _):
            regs = await register_async(mc, nodes=3, targets=1)
            v1 = (await mc.get_cluster_map()).version
            # Nodes this leader has not heard from hold a change back for a
            # lease from its start (an earlier leader may have granted one).
            hb = await mc.heartbeat(regs[0].node_id, [], kv_map_version=v1)
            assert hb.kv_lease_ms == 5000 and hb.kv_lease_granted and hb.map_version == v1 and hb.kv_published == 0
            for r in regs:
                hb = await mc.heartbeat(r.node_id, [], kv_map_version=v1)
            assert hb.kv_published == v1  # every node has reported v1

            await mc.create_kv_pool("p", target_memory=1 << 20)  # a map change
            v2 = (await mc.get_cluster_map()).version
            assert v2 > v1
            hb = await mc.heartbeat(regs[0].node_id, [], kv_map_version=v1)
            assert hb.map_version == v2 and hb.kv_published == v1
            await mc.heartbeat(regs[0].node_id, [], kv_map_version=v2)
            hb = await mc.heartbeat(regs[1].node_id, [], kv_map_version=v2)
            assert hb.kv_published == v1, "node 2 still holds a lease on v1"

            # Node 2 goes silent: its lease, granted at its last heartbeat,
            # runs out, and the change takes effect without it.
            clock.now += _lapse(5.0) - 2 * SEC
            hb = await mc.heartbeat(regs[0].node_id, [], kv_map_version=v2)
            assert hb.kv_published == v1
            clock.now += 2 * SEC
            hb = await mc.heartbeat(regs[0].node_id, [], kv_map_version=v2)
            assert hb.kv_published == v2

            # A node of a release before leases is neither granted one nor
            # waited for.
            await mc.create_kv_pool("q", target_memory=1 << 20)
            v3 = (await mc.get_cluster_map()).version
            old = await mc.heartbeat(regs[2].node_id, [])
            assert old.kv_lease_ms == 0
            await mc.heartbeat(regs[1].node_id, [], kv_map_version=v3)
            hb = await mc.heartbeat(regs[0].node_id, [], kv_map_version=v3)
            assert hb.kv_published == v3

    run(main())


def test_a_node_that_does_not_apply_the_map_it_was_told_loses_its_lease() -> None:
    """A node that keeps beating but never applies the newer map meta names
    (it cannot fetch it) is granted no lease after that answer, so the change
    takes effect one lease later instead of never."""
    async def main() -> None:
        clock = Clock()
        async with meta_server(clock=clock, heartbeat_timeout=10.0, kv_lease=5.0) as (mc, _svc, _):
            regs = await register_async(mc, nodes=2, targets=1)
            clock.now += _lapse(5.0)  # past the new leader's wait for nodes it has not heard from
            v1 = (await mc.get_cluster_map()).version
            for r in regs:
                assert (await mc.heartbeat(r.node_id, [], kv_map_version=v1)).kv_lease_granted
            await mc.create_kv_pool("p", target_memory=1 << 20)
            v2 = (await mc.get_cluster_map()).version
            stuck, good = regs[0].node_id, regs[1].node_id
            hb = await mc.heartbeat(stuck, [], kv_map_version=v1)
            assert hb.kv_lease_granted and hb.map_version == v2  # it had applied what it was told (v1)
            assert (await mc.heartbeat(good, [], kv_map_version=v1)).kv_lease_granted
            assert (await mc.heartbeat(good, [], kv_map_version=v2)).kv_lease_granted
            for _ in range(8):  # beating every second, never applying v2
                clock.now += SEC
                hb = await mc.heartbeat(stuck, [], kv_map_version=v1)
                assert not hb.kv_lease_granted and hb.kv_lease_ms == 5000
                hb = await mc.heartbeat(good, [], kv_map_version=v2)
                assert hb.kv_lease_granted
            assert hb.kv_published == v2  # the stuck node's last lease ran out

    run(main())


def test_a_node_back_on_an_older_map_holds_the_change_back_again() -> None:
    """Once every node has the current map the leader answers it without
    looking at every node again (kv_published is kept), but a node that
    then reports an older map (a daemon restarted from an older map file)
    holds publication back to that map at once, as before the memo."""
    async def main() -> None:
        clock = Clock()
        async with meta_server(clock=clock, heartbeat_timeout=10.0, kv_lease=5.0) as (mc, svc, _):
            regs = await register_async(mc, nodes=3, targets=1)
            clock.now += _lapse(5.0)
            v1 = (await mc.get_cluster_map()).version
            await mc.create_kv_pool("p", target_memory=1 << 20)
            v2 = (await mc.get_cluster_map()).version
            for _ in range(3):
                for r in regs:
                    hb = await mc.heartbeat(r.node_id, [], kv_map_version=v2)
                    assert hb.kv_published == v2
            assert svc._kv_pub_memo is not None and svc._kv_pub_memo[1] == v2
            hb = await mc.heartbeat(regs[1].node_id, [], kv_map_version=v1)
            assert hb.kv_published == v1  # its lease granted on v2 still runs
            hb = await mc.heartbeat(regs[0].node_id, [], kv_map_version=v2)
            assert hb.kv_published == v1
            hb = await mc.heartbeat(regs[1].node_id, [], kv_map_version=v2)
            assert hb.kv_published == v2

    run(main())


def test_the_lease_is_no_longer_than_heartbeat_timeout_and_zero_turns_it_off() -> None:
    async def main() -> None:
        clock = Clock()
        async with meta_server(clock=clock, heartbeat_timeout=3.0, kv_lease=5.0) as (mc, _svc, _):
            regs = await register_async(mc, nodes=1, targets=1)
            v = (await mc.get_cluster_map()).version
            assert (await mc.heartbeat(regs[0].node_id, [], kv_map_version=v)).kv_lease_ms == 3000
        async with meta_server(clock=clock, kv_lease=0.0) as (mc, _svc, _):
            regs = await register_async(mc, nodes=2, targets=1)
            v = (await mc.get_cluster_map()).version
            hb = await mc.heartbeat(regs[0].node_id, [], kv_map_version=v - 1)
            assert hb.kv_lease_ms == 0 and hb.kv_published == v  # nothing is held back

    run(main())


def test_a_map_watch_returns_when_the_map_changes_or_its_wait_ends() -> None:
    """GetClusterMap with ``wait_ms``: how storage daemons learn a change in
    a round trip rather than at their next heartbeat."""
    async def main() -> None:
        async with meta_server() as (mc, _svc, _):
            await register_async(mc, nodes=1, targets=1)
            v = (await mc.get_cluster_map()).version
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert (await mc.get_cluster_map(v, wait=0.3)).unchanged
            assert loop.time() - t0 >= 0.3  # held for the wait, nothing changed
            watch = asyncio.ensure_future(mc.get_cluster_map(v, wait=5.0))
            await asyncio.sleep(0.2)
            assert not watch.done()
            t0 = loop.time()
            await mc.create_kv_pool("w", target_memory=1 << 20)
            got = await asyncio.wait_for(watch, 5.0)
            assert not got.unchanged and got.version > v and any(p.name == "w" for p in got.kv_pools)
            assert loop.time() - t0 < 2.0  # woken by the change, not the end of the wait

    run(main())
