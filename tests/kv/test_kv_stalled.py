"""The KV cluster tier with a storage daemon stalled (SIGSTOP: its
connections stay open and it never answers), as an inference engine meets
it: gets, batch gets and lookups of keys that are mostly absent (a cache
misses more than it hits). Clients here have a ``kv_timeout`` far longer
than the test's own timeout, so a call that waits on the stalled daemon
when the other copies or fragments could answer fails the test by timeout
(no timing assertion)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kv.pools import wait_for
from tests.kv.test_kv_cluster import (
    _holders,
    _target_ids,
    create_pool,
    kv_cluster,
    payload,
    pool_ready,
)
from tierfs.client import Client
from tierfs.errors import UnavailableError
from tierfs.kv.client import KV
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient

KiB, MiB = 1 << 10, 1 << 20
#: Longer than any test's timeout: an unhedged wait on the stalled daemon fails the test.
LONG = 600.0


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with kv_cluster(tmp_path_factory.mktemp("kvstall"), 3) as c:
        yield c


def _check_reads(kv: KV, present: dict[str, bytes], absent: list[str]) -> None:
    """Every read of ``present`` returns its bytes, every read of ``absent`` a miss."""
    for k in absent:
        assert kv.get(k) is None
        assert kv.get_into(k, bytearray(MiB)) is None
    for k, v in present.items():
        assert kv.get(k) == v
        buf = bytearray(MiB)
        assert kv.get_into(k, buf) == len(v) and bytes(buf[:len(v)]) == v
    keys = [k for pair in zip(absent, present, strict=False) for k in pair]
    bufs = [bytearray(MiB) for _ in keys]
    got = kv.batch_get_into(keys, bufs)
    for k, b, n in zip(keys, bufs, got, strict=True):
        if k in present:
            assert n == len(present[k]) and bytes(b[:n]) == present[k], k
        else:
            assert n is None, k
    assert kv.batch_contains(keys) == [k in present for k in keys]


@pytest.mark.timeout(180)
def test_ec_gets_of_absent_keys_do_not_wait_on_a_stalled_fragment_holder(cl: LocalCluster) -> None:
    """``ec:2+1`` on three nodes, one daemon stalled. A get of an absent
    key finds it on neither live fragment holder: the third fragment alone
    cannot make K = 2, so it is a miss at once. Until this change the get
    asked the stalled daemon too (an EC get's order kept a target that had
    just failed, or that the map calls down, last but still in it), and
    each absent key cost the whole ``kv_timeout`` (2 s by default; a batch
    of 8 keys took 14 s), for as long as the daemon stayed stalled."""
    create_pool(cl, "ecst", redundancy="ec:2+1", target_memory=16 * MiB, target_disk=32 * MiB)
    with Client(cl.meta_addrs, kv_timeout=LONG, request_timeout=2.0) as client:
        pool_ready(client, "ecst")
        kv = client.kv_pool("ecst")
        present = {f"ecst-{i}": payload(f"ecst-{i}", 256 * KiB + i) for i in range(8)}
        absent = [f"ecst-absent-{i}" for i in range(8)]
        assert kv.batch_put(list(present), list(present.values())) == [True] * len(present)
        _check_reads(kv, present, absent)  # connections open, nothing stalled
        victim = _holders(cl, "ecst", next(iter(present)))[0]
        target = _target_ids(cl, victim)[0]
        router = client.aclient._parts()[2]
        pid = cl.kill(victim, signal.SIGSTOP)
        try:
            # As if a request to it had just timed out (with LONG, the
            # first would take that long): the target failed just now.
            router.mark_failed(target, factor=100.0)
            _check_reads(kv, present, absent)
            # Then called down by the map (meta's heartbeat timeout, 3 s here).
            def down() -> bool:
                client._run(router.refresh(force=True))
                return router.down(target)
            wait_for(down, 60, "the map to call the stalled daemon down")
            router.mark_ok(target)
            _check_reads(kv, present, absent)
        finally:
            os.kill(pid, signal.SIGCONT)


def _groups_of(cl: LocalCluster, pool: str, keys: list[str]) -> dict[str, list[int]]:
    """Each key's group members (target ids, copy 0 first), from one map."""
    from tierfs.kv.cluster import group_of

    async def get() -> dict[str, list[int]]:
        async with MetaClient(cl.meta_addrs) as mc:
            pools = await mc.list_kv_pools()
        p = next(p for p in pools.pools if p.name == pool)
        return {k: list(p.groups[group_of(k.encode(), len(p.groups))].target_ids) for k in keys}
    return asyncio.run(get())


def _replica2_pool(cl: LocalCluster, pool: str, victim: str) -> tuple[int, dict[str, list[int]]]:
    """A fresh ``replica:2`` pool on a healthy cluster: the target of daemon
    ``victim`` (to be stalled) and the group members of 300 keys
    ``<pool>-<i>``."""
    asyncio.run(cl.wait_healthy(120))
    create_pool(cl, pool, redundancy="replica:2", target_memory=16 * MiB, target_disk=32 * MiB)
    names = [f"{pool}-{i}" for i in range(300)]
    return _target_ids(cl, victim)[0], _groups_of(cl, pool, names)


@pytest.mark.timeout(180)
def test_a_batch_read_asks_a_stalled_copy_once(cl: LocalCluster) -> None:
    """``replica:2``, one daemon stalled and not yet known to the client: a
    batch get (and a batch lookup) of keys stored with the stalled daemon's
    copy first, and of absent keys whose second copy it holds. The first
    round waits out the stalled copy (one ``kv_timeout``, the documented
    cost); the absent keys, missed on their live copy, must not ask it
    again in the next round. Until this change the order made at the start
    held, and the call waited a second ``kv_timeout`` on the same daemon."""
    asyncio.run(cl.wait_healthy(120))  # a daemon stalled by the test before may be coming back
    create_pool(cl, "r2st", redundancy="replica:2", target_memory=16 * MiB, target_disk=32 * MiB)
    with Client(cl.meta_addrs, request_timeout=2.0) as writer:
        pool_ready(writer, "r2st")
        names = [f"r2st-{i}" for i in range(300)]
        groups = _groups_of(cl, "r2st", names)
        victim = "storage-1"
        stalled = _target_ids(cl, victim)[0]
        first = [k for k in names if groups[k][0] == stalled][:6]
        second = [k for k in names if groups[k][1] == stalled][:6]
        assert len(first) == 6 and len(second) == 6, groups
        present = {k: payload(k, 64 * KiB + i) for i, k in enumerate(first)}
        assert writer.kv_pool("r2st").batch_put(list(present), list(present.values())) == [True] * 6
    with Client(cl.meta_addrs, kv_timeout=3.0, request_timeout=2.0) as client:
        kv = client.kv_pool("r2st")
        assert kv.batch_contains(first + second) == [True] * 6 + [False] * 6  # connections open
        asked = _spy_stalled(client, stalled, ("get", "exists"))
        router = client.aclient._parts()[2]
        pid = cl.kill(victim, signal.SIGSTOP)
        try:
            keys = first + second
            bufs = [bytearray(MiB) for _ in keys]
            got = kv.batch_get_into(keys, bufs)
            assert got == [len(present[k]) for k in first] + [None] * 6
            assert all(bytes(b[:n]) == present[k] for k, b, n in zip(first, bufs, got, strict=False))
            assert asked.count("get") == len(first), asked  # once per key of its first round, no more
            router.mark_ok(stalled)  # forgotten: a lookup meets it afresh
            asked.clear()
            assert kv.batch_contains(keys) == [True] * 6 + [False] * 6
            assert asked == ["exists"], asked
        finally:
            os.kill(pid, signal.SIGCONT)


#: label -> the data client's methods it counts (name, whether its first
#: argument is a batch of items whose first field is the target)
_SPIED = {
    "get": (("kv_get_batch", True),),
    "get1": (("kv_get_into", False), ("kv_get", False)),
    "exists": (("kv_exists", False),),
    "crcs": (("kv_crcs", False),),
    "put": (("kv_put_batch", True), ("kv_put", False)),
}


def _spy_stalled(client: Client, stalled: int, what: tuple[str, ...] = ("get", "exists", "crcs")) -> list[str]:
    """The requests ``client`` sends to target ``stalled`` from now on, of
    the kinds ``what`` names: "get" per key of a batch get, "exists" per
    KV_EXISTS, "crcs" per KV_EXISTS with CRCs (a witness, or a
    ``kv_require_witness`` lookup), "put" per copy put, "get1" per
    single-key get."""
    data = client.aclient._parts()[1]
    asked: list[str] = []

    def spy(label: str, name: str, batch: bool) -> None:
        real = getattr(data, name)

        async def counted(first: Any, *a: Any, **kw: Any) -> Any:
            if batch:
                asked.extend(label for it in first if it[0] == stalled)
            elif first == stalled:
                asked.append(label)
            return await real(first, *a, **kw)

        setattr(data, name, counted)

    for label in what:
        for name, batch in _SPIED[label]:
            spy(label, name, batch)
    return asked


@pytest.mark.timeout(240)
def test_a_stalled_target_is_asked_one_part_of_a_large_batch(cl: LocalCluster) -> None:
    """``replica:2``, one daemon stalled, batches of more keys on it than
    one KV_EXISTS carries (MAX_KV_EXISTS_KEYS). A batch get whose first
    round waits out the stalled daemon (keys with their first copy on it)
    also asks it, as witness, of thousands of keys whose second copy it
    holds; a lookup asks it of thousands of keys whose first copy it holds
    (with ``kv_require_witness``, every copy's CRC32C). Each must send it
    one part and, when that times out, not the next: until this change the
    parts went one after another, each with a whole ``kv_timeout`` (the
    witness wait after a round that had waited one out is another whole
    ``kv_timeout``), and a batch get or lookup of 4,200 such keys took two
    ``kv_timeout``s instead of the documented one."""
    from tierfs.net.protocol import MAX_KV_EXISTS_KEYS

    # The daemon the test before stalled may be coming back: a pool planned
    # meanwhile can be re-planned under the test, and each key's copies with it.
    asyncio.run(cl.wait_healthy(120))
    create_pool(cl, "r2big", redundancy="replica:2", target_memory=16 * MiB, target_disk=32 * MiB)
    victim = "storage-1"
    stalled = _target_ids(cl, victim)[0]
    names = [f"r2big-{i}" for i in range(16000)]
    groups = _groups_of(cl, "r2big", names)
    first = [k for k in names if groups[k][0] == stalled]
    second = [k for k in names if groups[k][1] == stalled]
    live = [k for k in names if stalled not in groups[k]]
    n = MAX_KV_EXISTS_KEYS + 100
    assert len(first) >= n + 6 and len(second) >= n and live, (len(first), len(second))
    present = {k: payload(k, 16 * KiB + i) for i, k in enumerate(first[:6] + live[:1])}
    with Client(cl.meta_addrs, request_timeout=2.0) as writer:
        pool_ready(writer, "r2big")
        assert writer.kv_pool("r2big").batch_put(list(present), list(present.values())) == [True] * 7
    with Client(cl.meta_addrs, kv_timeout=3.0, request_timeout=2.0) as client, \
            Client(cl.meta_addrs, kv_timeout=3.0, request_timeout=2.0, kv_require_witness=True) as strict:
        for c in (client, strict):  # maps fetched, connections open
            assert c.kv_pool("r2big").batch_contains(list(present)) == [True] * 7
        asked, asked_strict = _spy_stalled(client, stalled), _spy_stalled(strict, stalled)
        router = client.aclient._parts()[2]
        kv = client.kv_pool("r2big")
        pid = cl.kill(victim, signal.SIGSTOP)
        try:
            keys = list(present) + second[:n]
            bufs = [bytearray(32 * KiB) for _ in keys]
            got = kv.batch_get_into(keys, bufs)
            assert got == [len(v) for v in present.values()] + [None] * n
            assert all(bytes(b[:g]) == v for b, g, v in zip(bufs, got, present.values(), strict=False))
            assert asked.count("get") == 6 and asked.count("crcs") == 1, (asked.count("get"), asked.count("crcs"))
            router.mark_ok(stalled)  # forgotten: a lookup meets it afresh
            asked.clear()
            assert kv.batch_contains(first[6:6 + n]) == [False] * n
            assert asked == ["exists"], asked
            assert strict.kv_pool("r2big").batch_contains(first[6:6 + n]) == [False] * n
            assert asked_strict == ["crcs"], asked_strict
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(240)
def test_plain_puts_skip_a_copy_that_just_stalled(cl: LocalCluster) -> None:
    """``replica:2``, one daemon stalled, and a client whose map does not
    call it down (the map takes a heartbeat timeout and its age to). The
    first plain put into a group with the stalled copy waits out one
    ``kv_timeout`` and marks it failed; later plain puts of unpinned values
    skip it (the reached copy gets the group stamp; the skipped one lacks
    the key, like an evicted copy), are acknowledged, and read back right,
    stalled and after it resumes. Until this change each of them waited a
    whole ``kv_timeout`` on it, put after put. An overwrite and a pinned put
    still ask it: the stamp fencing of a skipped copy needs the map's word."""
    victim = "storage-1"
    stalled, groups = _replica2_pool(cl, "r2put", victim)
    with_stalled = [k for k in groups if stalled in groups[k]]
    assert len(with_stalled) >= 10, groups
    values = {k: payload(k, 32 * KiB + i) for i, k in enumerate(with_stalled[:10])}
    keys = list(values)
    with Client(cl.meta_addrs, kv_timeout=3.0, request_timeout=2.0, map_max_age=600.0,
                failed_target_ttl=120.0) as client:
        pool_ready(client, "r2put")
        kv = client.kv_pool("r2put")
        assert kv.batch_contains(keys) == [False] * len(keys)  # map fetched, connections open
        asked = _spy_stalled(client, stalled, ("put",))
        router = client.aclient._parts()[2]
        pid = cl.kill(victim, signal.SIGSTOP)
        try:
            assert kv.put(keys[0], values[keys[0]]) is True  # waits out the stalled copy once
            assert asked == ["put"] and router.failed_recently(stalled), asked
            assert not router.down(stalled)
            asked.clear()
            for k in keys[1:6]:
                assert kv.put(k, values[k]) is True, k
            assert kv.batch_put(keys[6:8], [values[k] for k in keys[6:8]]) == [True, True]
            assert asked == [], asked  # the stalled copy was asked nothing more
            assert not router.down(stalled)  # skipped as failed, not as down
            for k in keys[:8]:
                assert kv.get(k) == values[k], k
            # An overwrite and a pinned put still ask it (their semantics
            # are unchanged: a skipped copy is fenced only by the map).
            # (It raises: its copy could not be deleted either, so it is not acknowledged.)
            with contextlib.suppress(UnavailableError):
                kv.put(keys[8], values[keys[8]], overwrite=True)
            assert asked.count("put") >= 1, asked
            asked.clear()
            assert kv.put(keys[9], values[keys[9]], pin="soft", pin_ttl=60.0) is True
            assert asked.count("put") >= 1, asked
        finally:
            os.kill(pid, signal.SIGCONT)
        asyncio.run(cl.wait_healthy(120))
    with Client(cl.meta_addrs, kv_timeout=3.0, request_timeout=2.0) as reader:
        kv = reader.kv_pool("r2put")
        for k in keys[:8]:
            assert kv.get(k) == values[k], k
        bufs = [bytearray(64 * KiB) for _ in keys[:8]]
        got = kv.batch_get_into(keys[:8], bufs)
        assert got == [len(values[k]) for k in keys[:8]]
        assert all(bytes(b[:n]) == values[k] for b, n, k in zip(bufs, got, keys, strict=False))


@pytest.mark.timeout(240)
def test_a_timed_out_copy_is_passed_over_until_the_map_can_call_it_down(cl: LocalCluster) -> None:
    """``replica:2``, one daemon stalled, a client with a short
    ``failed_target_ttl`` and a map it does not refresh. A get whose first
    copy is on the stalled daemon waits out one ``kv_timeout``; the target
    is then passed over four times ``failed_target_ttl`` (as the file
    client does after a timeout), not once: with the plain ttl (5 s by
    default) a get a few seconds later waited out a second ``kv_timeout``
    before meta's heartbeat timeout (10 s) called the daemon down."""
    victim = "storage-2"
    stalled, groups = _replica2_pool(cl, "r2ttl", victim)
    first = [k for k in groups if groups[k][0] == stalled]
    assert len(first) >= 4, groups
    values = {k: payload(k, 16 * KiB + i) for i, k in enumerate(first[:4])}
    with Client(cl.meta_addrs, request_timeout=2.0) as writer:
        pool_ready(writer, "r2ttl")
        assert writer.kv_pool("r2ttl").batch_put(list(values), list(values.values())) == [True] * 4
    ttl = 3.0
    with Client(cl.meta_addrs, kv_timeout=2.0, request_timeout=2.0, map_max_age=600.0,
                failed_target_ttl=ttl) as client:
        kv = client.kv_pool("r2ttl")
        assert kv.batch_contains(list(values)) == [True] * 4  # map fetched, connections open
        router = client.aclient._parts()[2]
        asked = _spy_stalled(client, stalled, ("get", "get1"))
        pid = cl.kill(victim, signal.SIGSTOP)
        try:
            k0 = first[0]
            assert kv.get(k0) == values[k0]  # waits out the stalled first copy once
            assert asked == ["get1"], asked
            assert router.failed_recently(stalled)
            time.sleep(ttl + 1.0)  # past the plain ttl, well inside four times it
            assert router.failed_recently(stalled)
            asked.clear()
            for k in first[1:4]:
                assert kv.get(k) == values[k], k
            assert asked == [], asked
        finally:
            os.kill(pid, signal.SIGCONT)
        asyncio.run(cl.wait_healthy(120))
