"""The cluster tier (a KV pool on real storage daemons) through the tier
conformance suite, plus the size-only KV_GET it needs for ``size_of``.

One cluster (1 meta, 3 storage daemons) serves the whole module; every tier
the suite asks for is a fresh memory-only ``replica:1`` pool sized so the
pool's total budget is about the capacity asked for.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest

from tests.faults.harness import FAST_META
from tests.kv.conformance import MiB, TierConformance, TierFactory, pattern, run
from tierfs.errors import NotFoundError
from tierfs.kv.cluster import ClusterKVTier
from tierfs.kv.stack import TierStack
from tierfs.kv.tiers import DramTier
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.net import DataClient

pytestmark = pytest.mark.timeout(120)

_names = itertools.count()


async def _served(meta: list[str], name: str) -> int:
    """The number of distinct targets of pool ``name`` once every one of them
    serves it (reports usage for it), else 0."""
    async with MetaClient(meta) as mc:
        r = await mc.list_kv_pools()
    pool = next((p for p in r.pools if p.name == name), None)
    if pool is None or not pool.groups:
        return 0
    members = {t for g in pool.groups for t in g.target_ids}
    reporting = {u.target_id for u in r.usage if u.pool_id == pool.pool_id}
    return len(members) if members <= reporting else 0


def new_pool(cl: LocalCluster, capacity: int) -> tuple[str, int]:
    """A fresh memory-only replica:1 pool of about ``capacity`` bytes in all,
    once served: (name, its exact total budget)."""
    name = f"ct{next(_names)}"
    counts = cl.counts
    n_targets = counts["storage"] * counts["targets_per_node"]

    async def create() -> None:
        async with MetaClient(cl.meta_addrs) as mc:
            await mc.create_kv_pool(name, redundancy="replica:1", target_memory=-(-capacity // n_targets),
                                    target_disk=0)

    asyncio.run(create())
    end = time.monotonic() + 30
    while not (n := asyncio.run(_served(cl.meta_addrs, name))):
        if time.monotonic() > end:
            raise AssertionError(f"pool {name} not served within 30 s")
        time.sleep(0.1)
    return name, -(-capacity // n_targets) * n


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("ctier"), n_meta=1, n_storage=3, extra_meta_args=list(FAST_META))
    c.up(timeout=120)
    yield c
    c.stop()


def _remove_pools(cl: LocalCluster, names: list[str]) -> None:
    async def go() -> None:
        async with MetaClient(cl.meta_addrs) as mc:
            for n in names:
                await mc.remove_kv_pool(n)

    asyncio.run(go())


class TestClusterTier(TierConformance):
    capacity = 16 * MiB  # a 4 MiB object must fit one target's share (1/3)
    exact_counts = ClusterKVTier.exact_counts  # False: used/objects are the daemons', reported late

    @pytest.fixture
    def make_tier(self, cl: LocalCluster) -> Iterator[TierFactory]:
        pools: list[str] = []

        def make(cap: int) -> ClusterKVTier:
            name, total = new_pool(cl, cap)
            pools.append(name)
            return ClusterKVTier(cl.meta_addrs, name, capacity=total, kv_timeout=5.0, request_timeout=5.0)

        yield make
        _remove_pools(cl, pools)


# ---- what is particular to the cluster tier ----------------------------------------


@pytest.fixture
def pool(cl: LocalCluster) -> Iterator[str]:
    name, _ = new_pool(cl, 8 * MiB)
    yield name
    _remove_pools(cl, [name])


def test_size_only_get_answers_the_size_without_the_bytes(cl: LocalCluster, pool: str) -> None:
    tier = ClusterKVTier(cl.meta_addrs, pool)

    async def main() -> None:
        await tier.put(b"sized", memoryview(pattern(b"sized", 123_457)))
        await tier.put(b"empty", memoryview(b""))
        inner = await tier._inner()
        route = await inner.route()
        target = inner._targets(route, b"sized")[0]
        data: DataClient = inner.data
        assert await data.kv_size(target, route.pool_id, b"sized") == 123_457
        assert await data.kv_size(target, route.pool_id, b"never-put") is None
        t_empty = inner._targets(route, b"empty")[0]
        assert await data.kv_size(t_empty, route.pool_id, b"empty") == 0  # a hit of size 0, not a miss
        assert await tier.size_of(b"empty") == 0
        with pytest.raises(NotFoundError):
            await data.kv_size(target, 999_999, b"sized")
        await tier.close()

    run(main())


def test_a_tier_used_from_successive_loops_keeps_its_counts(cl: LocalCluster, pool: str) -> None:
    tier = ClusterKVTier(cl.meta_addrs, pool)

    async def first() -> None:
        assert await tier.put(b"a", memoryview(b"x" * 5000))

    async def second() -> None:
        out = bytearray(5000)
        assert await tier.get_into(b"a", memoryview(out)) == 5000 and out == b"x" * 5000

    run(first())
    run(second())  # a new loop: a new client, the same counts
    st = tier.stats()
    assert (st.puts, st.hits, st.bytes_in, st.bytes_out) == (1, 1, 5000, 5000)
    # capacity from the pool's definition: 8 MiB over 3 targets, rounded up
    assert st.capacity == -(-8 * MiB // 3) * 3
    run(tier.close())


def test_refresh_usage_reports_what_the_daemons_hold(cl: LocalCluster, pool: str) -> None:
    tier = ClusterKVTier(cl.meta_addrs, pool)

    async def main() -> None:
        for i in range(10):
            await tier.put(f"u{i}".encode(), memoryview(bytes(10_000)))
        end = time.monotonic() + 30
        while True:
            await tier.refresh_usage()
            st = tier.stats()
            if st.objects == 10:
                break
            assert time.monotonic() < end, f"usage never reached 10 objects: {st}"
            await asyncio.sleep(0.2)
        # memory charge: whole pages per object
        assert st.used >= 10 * 10_000 and st.used <= st.capacity
        await tier.close()

    run(main())


def test_as_the_bottom_of_a_write_through_stack(cl: LocalCluster, pool: str) -> None:
    async def main() -> None:
        bottom = ClusterKVTier(cl.meta_addrs, pool)
        stack = TierStack([DramTier(1 * MiB), bottom], write_back=False)
        keys = [f"s{i}".encode() for i in range(40)]
        for k in keys:
            await stack.put(k, memoryview(pattern(k, 100_000)))
        assert all(await bottom.contains(keys))  # DRAM holds ~10 of them: the rest come from the cluster
        out = bytearray(100_000)
        for k in keys:
            assert await stack.get_into(k, memoryview(out)) == 100_000 and out == pattern(k, 100_000)
        await stack.close()

    run(main())


def test_copies_that_disagree_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """Concurrent plain puts of other bytes make copies disagree at every
    get: one WARNING per get flooded the log (until stop 48). Now one line
    per interval, counting the others; the counter has every one."""
    import logging
    import types

    from tierfs.kv.cluster import ClusterTier

    tier = ClusterTier(None, None, "p", timeout=1.0)  # type: ignore[arg-type]

    async def no_drop(*_: object) -> None:
        return None

    tier._drop_copies = no_drop  # type: ignore[method-assign]
    route = types.SimpleNamespace(name="p", pool_id=1)

    async def go() -> None:
        for i in range(50):
            await tier._disagree(route, b"k%d" % i, [1, 2], 1, 2)  # type: ignore[arg-type]
        tier._disagree_quiet_until = 0.0  # the interval passed
        await tier._disagree(route, b"last", [1, 2], 1, 2)  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, logger="tierfs"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage() or "crc32c" in r.getMessage()]
    assert tier.counters.disagreements == 51
    assert len(lines) == 2 and "49 more since the last such line" in lines[1], lines
