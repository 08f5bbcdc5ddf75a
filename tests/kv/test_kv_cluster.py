"""client.kv against a real cluster: 3 meta replicas and 4 storage daemons on
loopback, KV pools of each redundancy, real processes killed and restarted."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.faults.harness import FAST_META
from tests.kv.pools import define_pool, pool_served, wait_for
from tierfs.client import Client
from tierfs.errors import InvalidArgumentError, NoSpaceError, NotFoundError, UnavailableError
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(180)
KiB, MiB = 1 << 10, 1 << 20


def payload(key: str | bytes, n: int) -> bytes:
    """Deterministic bytes for a key: any mix-up between keys shows."""
    seed = int.from_bytes(key.encode() if isinstance(key, str) else key, "little") % (1 << 63)
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def create_pool(cl: LocalCluster, name: str, **kw: object) -> None:
    define_pool(cl.meta_addrs, name, **kw)


def pool_ready(client: Client, name: str) -> None:
    pool_served(client.config.meta, name)


#: Pools more than one test uses: each test makes sure of its own (the
#: tests of this module may run in any order, or on different workers).
SHARED_POOLS: dict[str, dict[str, object]] = {
    "two": {"redundancy": "replica:2", "target_memory": 8 * MiB, "target_disk": 16 * MiB},
    "disk": {"redundancy": "replica:1", "target_memory": 1 * MiB, "target_disk": 32 * MiB},
    "forge2": {"redundancy": "replica:2", "target_memory": 8 * MiB, "target_disk": 16 * MiB},
}


def shared_pool(cl: LocalCluster, client: Client, name: str) -> None:
    """Pool ``name`` of SHARED_POOLS, created if this is the first test to use it, and served."""
    async def exists() -> bool:
        async with MetaClient(cl.meta_addrs) as mc:
            return any(p.name == name for p in (await mc.list_kv_pools()).pools)

    if not asyncio.run(exists()):
        create_pool(cl, name, **SHARED_POOLS[name])
    pool_ready(client, name)


@contextlib.contextmanager
def kv_cluster(path: Path, n_storage: int) -> Iterator[LocalCluster]:
    """A running cluster for the KV tests (3 meta replicas with FAST_META,
    ``n_storage`` daemons), stopped at the end."""
    c = LocalCluster(path, n_storage=n_storage, extra_meta_args=list(FAST_META))
    try:
        c.up(timeout=120)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with kv_cluster(tmp_path_factory.mktemp("kv"), 4) as c:
        yield c


@pytest.fixture(scope="module")
def client(cl: LocalCluster) -> Iterator[Client]:
    with Client(cl.meta_addrs, kv_timeout=1.0, request_timeout=2.0) as c:
        pool_ready(c, "default")
        yield c


def restart(cl: LocalCluster, name: str) -> None:
    cl.start(names=[name], timeout=60)
    asyncio.run(cl.wait_healthy(60))


# ---- the API --------------------------------------------------------------------


def test_roundtrip_single_and_batched(client: Client) -> None:
    kv = client.kv
    v = payload("a", 300 * KiB)
    assert kv.put("a", v) is True
    assert kv.put("a", b"other bytes") is False  # content-addressed: a no-op
    assert kv.get("a") == v
    buf = bytearray(1 * MiB)
    assert kv.get_into("a", buf) == len(v) and bytes(buf[:len(v)]) == v
    assert kv.put(b"a", b"new", overwrite=True) is True and kv.get("a") == b"new"
    assert kv.exists("a") and not kv.exists("never-put")
    assert kv.get("never-put") is None and kv.get_into("never-put", buf) is None
    keys = [f"chain-{i}" for i in range(40)]
    vals = [payload(k, 1000 + 97 * i) for i, k in enumerate(keys)]
    assert kv.batch_put(keys, vals) == [True] * 40
    arrays = [np.zeros(8192, dtype=np.uint8) for _ in keys]
    got = kv.batch_get_into([*keys, "missing"], [*arrays, np.zeros(10, dtype=np.uint8)])
    assert got == [len(v) for v in vals] + [None]
    for a, v in zip(arrays, vals, strict=True):
        assert a[:len(v)].tobytes() == v
    assert kv.batch_contains(["chain-0", "nope", "chain-39"]) == [True, False, True]
    assert kv.batch_exists(keys) == 40
    assert kv.batch_exists([*keys[:5], "gap", *keys[5:]]) == 5
    assert kv.delete("chain-3") is True and kv.delete("chain-3") is False
    assert kv.batch_exists(keys) == 3
    st = kv.stats()
    assert st["cluster"]["hits"] >= 40 and st["cluster"]["puts"] >= 41


def test_empty_object_and_numpy_and_dtype(client: Client) -> None:
    kv = client.kv
    assert kv.put("empty", b"") is True
    assert kv.get("empty") == b"" and kv.get_into("empty", bytearray(4)) == 0
    arr = np.arange(1000, dtype=np.float32)
    kv.put("floats", arr)
    out = np.empty(1000, dtype=np.float32)
    assert kv.get_into("floats", out) == 4000 and np.array_equal(out, arr)
    kv.put("six", b"123456")
    with pytest.raises(InvalidArgumentError, match="whole number of 4-byte elements"):
        kv.get_into("six", np.zeros(4, dtype=np.float32))


def test_bad_input_is_refused_and_writes_nothing(client: Client) -> None:
    kv = client.kv
    with pytest.raises(InvalidArgumentError, match="empty KV key"):
        kv.put("", b"x")
    with pytest.raises(InvalidArgumentError, match="exceeds the limit of 512"):
        kv.put(b"k" * 513, b"x")
    with pytest.raises(InvalidArgumentError, match="not valid Unicode"):  # UnicodeEncodeError until stop 46
        kv.put("k\udcff", b"x")
    with pytest.raises(InvalidArgumentError, match="str or bytes"):
        kv.put(12, b"x")  # type: ignore[arg-type]
    kv.put("big", payload("big", 64 * KiB))
    small = bytearray(b"\xaa" * 1000)
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        kv.get_into("big", small)
    assert small == bytearray(b"\xaa" * 1000)  # nothing written
    with pytest.raises(InvalidArgumentError, match="read-only"):
        kv.get_into("big", bytes(1 << 17))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        kv.get_into("big", np.zeros((512, 512), dtype=np.uint8)[:, ::2])
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        kv.put("nc", np.zeros((64, 64), dtype=np.uint8)[::2])
    with pytest.raises(InvalidArgumentError, match="buffer protocol"):
        kv.put("obj", object())
    with pytest.raises(NotFoundError, match="unknown KV pool 'no-such-pool'"):
        client.kv_pool("no-such-pool").put("k", b"v")
    # TTLs: a number of seconds > 0 and at most ten years (NaN, infinity and
    # 0 were taken as "no TTL" or overflowed the header)
    for bad, match in ((0, "> 0"), (-1, "> 0"), (float("nan"), "> 0"), (float("inf"), "longest TTL"),
                       (1e20, "longest TTL"), ("5", "number of seconds")):
        with pytest.raises(InvalidArgumentError, match=match):
            kv.put("ttl-bad", b"v", ttl=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=match):
            kv.pin("big", ttl=bad)  # type: ignore[arg-type]
    # the daemon checks too, whatever a client sends
    async def raw_put(ttl_ms: int) -> None:
        tier = client.aclient.kv_pool("default").cluster
        route = await tier.route()
        t = tier._targets(route, b"ttl-bad")[0]
        await tier.data.kv_put(t, route.pool_id, b"ttl-bad", memoryview(b"v"), ttl_ms=ttl_ms)

    with pytest.raises(InvalidArgumentError, match="ten years"):
        client._run(raw_put((1 << 64) - 1))
    assert not kv.exists("nc") and not kv.exists("obj") and not kv.exists("ttl-bad")  # nothing was stored


# ---- pressure and eviction -------------------------------------------------------


def test_puts_at_three_times_capacity_all_succeed(cl: LocalCluster, client: Client) -> None:
    create_pool(cl, "small", redundancy="replica:1", target_memory=2 * MiB, target_disk=4 * MiB)
    pool_ready(client, "small")
    kv = client.kv_pool("small")
    size = 64 * KiB
    capacity = 4 * 4 * MiB  # 4 targets x disk budget
    n = 3 * capacity // size
    keys = [f"p{i}" for i in range(n)]
    for s in range(0, n, 16):
        assert all(isinstance(r, bool) for r in kv.batch_put(keys[s:s + 16], [payload(k, size) for k in keys[s:s + 16]]))
    # the most recent working set is there: the last 20 % of the capacity
    recent = keys[-(capacity // size) // 5:]
    bufs = [bytearray(size) for _ in recent]
    got = kv.batch_get_into(recent, bufs)
    assert got == [size] * len(recent)
    assert all(bytes(b) == payload(k, size) for k, b in zip(recent, bufs, strict=True))
    # and usage stays under the high watermark on every target
    async def usage() -> list[tuple[int, int, int]]:
        async with MetaClient(cl.meta_addrs) as mc:
            r = await mc.list_kv_pools()
        pid = next(p.pool_id for p in r.pools if p.name == "small")
        return [(u.target_id, u.disk_used, u.memory_used) for u in r.usage if u.pool_id == pid]
    rows = wait_for(lambda: [u for u in asyncio.run(usage()) if u[1] > 0] and asyncio.run(usage()), 15, "usage")
    for _, disk, mem in rows:
        assert disk <= 0.95 * 4 * MiB + size and mem <= 0.95 * 2 * MiB + size
    # every object that is there has the right bytes
    old = keys[: n // 3]
    bufs = [bytearray(size) for _ in old]
    for k, r, b in zip(old, kv.batch_get_into(old, bufs), bufs, strict=True):
        assert r is None or bytes(b) == payload(k, size)


def test_gets_racing_eviction_never_return_wrong_bytes(cl: LocalCluster, client: Client) -> None:
    create_pool(cl, "churn", redundancy="replica:1", target_memory=1 * MiB, target_disk=0)
    pool_ready(client, "churn")
    kv = client.kv_pool("churn")
    size = 32 * KiB
    stop = threading.Event()
    errors: list[str] = []
    checked = [0, 0]

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        buf = bytearray(size)
        while not stop.is_set():
            k = f"c{int(rng.integers(0, 600))}"
            n = kv.get_into(k, buf)
            if n is not None:
                checked[0] += 1
                if bytes(buf[:n]) != payload(k, size):
                    errors.append(k)
            else:
                checked[1] += 1

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        for s in range(0, 600, 20):
            ks = [f"c{i}" for i in range(s, s + 20)]
            kv.batch_put(ks, [payload(k, size) for k in ks])
        for _ in range(2):
            for s in range(0, 600, 20):
                ks = [f"c{i}" for i in range(s, s + 20)]
                kv.batch_put(ks, [payload(k, size) for k in ks])
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:5]
    assert checked[0] > 0 and checked[1] > 0  # both hits and evicted misses happened


# ---- failures ----------------------------------------------------------------------


def test_replica2_serves_with_one_daemon_down(cl: LocalCluster, client: Client) -> None:
    shared_pool(cl, client, "two")
    kv = client.kv_pool("two")
    keys = [f"r2-{i}" for i in range(60)]
    kv.batch_put(keys, [payload(k, 20 * KiB) for k in keys])
    cl.kill("storage-1")
    try:
        bufs = [bytearray(20 * KiB) for _ in keys]
        assert kv.batch_get_into(keys, bufs) == [20 * KiB] * 60
        assert all(bytes(b) == payload(k, 20 * KiB) for k, b in zip(keys, bufs, strict=True))
        assert kv.batch_exists(keys) == 60
    finally:
        restart(cl, "storage-1")


def test_replica1_dead_target_is_a_quick_miss_not_a_hang(cl: LocalCluster, client: Client) -> None:
    kv = client.kv
    keys = [f"r1-{i}" for i in range(40)]
    kv.batch_put(keys, [payload(k, 8 * KiB) for k in keys])
    cl.kill("storage-2")
    try:
        t0 = time.monotonic()
        bufs = [bytearray(8 * KiB) for _ in keys]
        got = kv.batch_get_into(keys, bufs)
        took = time.monotonic() - t0
        assert took < 10.0, f"took {took:.1f}s"
        assert None in got and any(g is not None for g in got)
        for k, g, b in zip(keys, got, bufs, strict=True):
            assert g is None or bytes(b) == payload(k, 8 * KiB)
    finally:
        restart(cl, "storage-2")


def _first_holders(cl: LocalCluster, pool: str, keys: list[str]) -> tuple[int, dict[str, int]]:
    """(the pool's group count, the target of copy 0 of each key), from
    one fresh cluster map."""
    from tierfs.kv.cluster import group_of

    async def get() -> tuple[int, dict[str, int]]:
        async with MetaClient(cl.meta_addrs) as mc:
            pools = await mc.list_kv_pools()
        p = next(p for p in pools.pools if p.name == pool)
        n = len(p.groups)
        return n, {k: int(p.groups[group_of(k.encode(), n)].target_ids[0]) for k in keys} if n else {}
    return asyncio.run(get())


def _target_ids(cl: LocalCluster, name: str) -> list[int]:
    async def get() -> list[int]:
        async with MetaClient(cl.meta_addrs) as mc:
            cmap = await mc.get_cluster_map()
        addr = cl.proc(name).addr
        return list(next(n for n in cmap.nodes if n.data_addr == addr).target_ids)
    return asyncio.run(get())


def test_a_node_leaving_remaps_only_its_share_of_keys(cl: LocalCluster, client: Client) -> None:
    """A storage node dies and the ``replica:1`` pool is re-planned without
    it: its members are replaced in place and the group count stays (the
    node is down, not removed: op format 3). Only the dead node's keys
    move, a quarter on 4 nodes; until format 3 the last group was dropped
    too and about half moved, and ``xxh3 % groups`` moved three quarters
    (99% on 100 nodes: docs/kv.md). Every key whose holder did not change
    is still found, and no other."""
    create_pool(cl, "spread", redundancy="replica:1", target_memory=8 * MiB)
    pool_ready(client, "spread")
    keys = [f"sp-{i}" for i in range(400)]
    n, before = _first_holders(cl, "spread", keys)
    assert n == 4
    with Client(cl.meta_addrs, kv_timeout=1.0, request_timeout=2.0) as c:
        c.kv_pool("spread").batch_put(keys, [payload(k, 2 * KiB) for k in keys])
    victim = "storage-1"
    theirs = set(before.values()) - {int(t) for t in _target_ids(cl, victim)}
    assert len(theirs) == 3
    cl.kill(victim)
    try:
        wait_for(lambda: set(_first_holders(cl, "spread", keys)[1].values()) <= theirs, 60,
                 "the pool re-planned without the victim")
        n_after, after = _first_holders(cl, "spread", keys)
        assert n_after == 4
        stayed = {k for k in keys if after[k] == before[k]}
        with Client(cl.meta_addrs, kv_timeout=1.0, request_timeout=2.0) as c:
            bufs = [bytearray(2 * KiB) for _ in keys]
            got = c.kv_pool("spread").batch_get_into(keys, bufs)
        found = {k for k, g in zip(keys, got, strict=True) if g is not None}
        assert found == stayed, (f"{len(found - stayed)} found that moved, "
                                 f"{len(stayed - found)} not found that stayed")
        assert all(bytes(b) == payload(k, 2 * KiB) for k, g, b in zip(keys, got, bufs, strict=True) if g)
        assert len(stayed) >= 0.6 * len(keys), f"only {len(stayed)} of {len(keys)} keys kept their holder"
    finally:
        restart(cl, victim)


def test_restart_keeps_objects_on_disk(cl: LocalCluster, client: Client) -> None:
    shared_pool(cl, client, "disk")
    kv = client.kv_pool("disk")
    keys = [f"d{i}" for i in range(80)]
    kv.batch_put(keys, [payload(k, 48 * KiB) for k in keys])
    for name in ("storage-0", "storage-3"):
        cl.kill(name)
        restart(cl, name)
    bufs = [bytearray(48 * KiB) for _ in keys]
    assert kv.batch_get_into(keys, bufs) == [48 * KiB] * 80
    assert all(bytes(b) == payload(k, 48 * KiB) for k, b in zip(keys, bufs, strict=True))


def test_corrupted_object_on_disk_is_a_miss_or_the_other_copy(cl: LocalCluster, client: Client) -> None:
    shared_pool(cl, client, "disk")
    shared_pool(cl, client, "two")
    kv1, kv2 = client.kv_pool("disk"), client.kv_pool("two")
    v = payload("rot", 100 * KiB)
    kv1.put("rot", v, overwrite=True)
    kv2.put("rot", v, overwrite=True)
    flipped = 0
    for f in Path(cl.dir).rglob("kv/*/**/*"):
        if f.is_file() and f.stat().st_size >= 100 * KiB and b"rot" in f.read_bytes()[-4096:] + f.read_bytes()[:4096]:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
            flipped += 1
    assert flipped >= 2, "did not find the object files"
    for name in ("storage-0", "storage-1", "storage-2", "storage-3"):  # drop the memory copies
        cl.kill(name)
        restart(cl, name)
    g1 = kv1.get("rot")
    assert g1 is None or g1 == v
    assert kv2.get("rot") in (None, v)


def test_meta_leader_killed_during_kv_load_loses_nothing(cl: LocalCluster, client: Client) -> None:
    shared_pool(cl, client, "two")
    kv = client.kv_pool("two")
    keys = [f"lead-{i}" for i in range(200)]
    done = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            for s in range(0, 200, 10):
                ks = keys[s:s + 10]
                kv.batch_put(ks, [payload(k, 16 * KiB) for k in ks])
                bufs = [bytearray(16 * KiB) for _ in ks]
                assert kv.batch_get_into(ks, bufs) == [16 * KiB] * 10
                time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=load)
    t.start()
    health = asyncio.run(cl.health())
    leader = next(r["name"] for r in health["meta"] if r["role"] == "leader")
    cl.kill(leader)
    t.join(120)
    assert done.is_set() and not errors, errors
    restart(cl, leader)
    bufs = [bytearray(16 * KiB) for _ in keys]
    assert kv.batch_get_into(keys, bufs) == [16 * KiB] * 200
    assert all(bytes(b) == payload(k, 16 * KiB) for k, b in zip(keys, bufs, strict=True))


def test_sigkill_during_puts_and_gets_leaves_no_wrong_bytes(cl: LocalCluster, client: Client) -> None:
    shared_pool(cl, client, "two")
    kv = client.kv_pool("two")
    stop = threading.Event()
    wrong: list[str] = []
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        buf = bytearray(24 * KiB)
        while not stop.is_set():
            k = f"kill-{int(rng.integers(0, 300))}"
            try:
                if rng.random() < 0.5:
                    kv.put(k, payload(k, 24 * KiB))
                else:
                    n = kv.get_into(k, buf)
                    if n is not None and bytes(buf[:n]) != payload(k, 24 * KiB):
                        wrong.append(k)
            except Exception as exc:
                errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        cl.kill("storage-0")
        time.sleep(0.5)
        restart(cl, "storage-0")
        cl.kill("storage-3")
        time.sleep(0.5)
        restart(cl, "storage-3")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not wrong, wrong[:5]


def test_a_batch_with_a_too_small_buffer_raises_in_every_pool(cl: LocalCluster, client: Client) -> None:
    """A destination smaller than its object raises, naming the key, in a
    batch as for one key, in replica and EC pools alike, and writes
    nothing. Until stop 44 a replica pool's batch of two or more keys
    answered it as a miss (a new user's find). A batch given one str is
    refused instead of taken as one key per character; an EC object too
    large for the frames is refused before anything is sent."""
    shared_pool(cl, client, "two")
    create_pool(cl, "ecsmall", redundancy="ec:2+1", target_memory=8 * MiB, target_disk=16 * MiB)
    pool_ready(client, "ecsmall")
    for name in ("two", "ecsmall"):
        kv = client.kv_pool(name)
        keys = [f"{name}-small-{i}" for i in range(3)]
        kv.batch_put(keys, [payload(k, 20 * KiB) for k in keys], overwrite=True)
        bufs = [bytearray(b"\xaa" * (10 * KiB)) for _ in keys]
        with pytest.raises(InvalidArgumentError, match=f"{keys[0]}.*does not fit") as ei:
            kv.batch_get_into(keys, bufs)
        assert str(ei.value).count("KV object") == 1, str(ei.value)  # it said so twice until stop 49
        assert all(b == bytearray(b"\xaa" * (10 * KiB)) for b in bufs)
        # engines ask for a misfit to be that key's miss, not the batch's error
        mixed = [bytearray(20 * KiB), bytearray(b"\xaa" * (10 * KiB)), bytearray(20 * KiB)]
        assert kv.batch_get_into(keys, mixed, misfit="miss") == [20 * KiB, None, 20 * KiB]
        assert mixed[1] == bytearray(b"\xaa" * (10 * KiB)) and bytes(mixed[2]) == payload(keys[2], 20 * KiB)
        assert kv.batch_get_into(keys, [bytearray(20 * KiB) for _ in keys]) == [20 * KiB] * 3
        with pytest.raises(InvalidArgumentError, match="sequence of keys, not one str"):
            kv.batch_put("ab", [b"1", b"2"])
        assert kv.batch_contains(["a", "b"]) == [False, False]
    big = memoryview(bytearray((256 << 20) + 1))  # over 2 x (128 MiB frame - trailer)
    with pytest.raises(InvalidArgumentError, match="would pass the frame limit"):  # before the sends: its own message
        client.kv_pool("ecsmall").put("too-big", big)
    assert client.kv_pool("ecsmall").exists("too-big") is False


def test_ec_pool_roundtrip_and_degraded(cl: LocalCluster) -> None:
    # A client of its own: the shared one may still skip a target an
    # earlier test killed and restarted (failed_target_ttl), and a get that
    # skips it as well as the one killed here has too few fragments.
    create_pool(cl, "ec", redundancy="ec:2+1", target_memory=8 * MiB, target_disk=16 * MiB)
    with Client(cl.meta_addrs, kv_timeout=1.0, request_timeout=2.0) as client:
        pool_ready(client, "ec")
        kv = client.kv_pool("ec")
        sizes = [1, 1000, 64 * KiB + 3, 1 * MiB]
        keys = [f"ec-{n}" for n in sizes]
        kv.batch_put(keys, [payload(k, n) for k, n in zip(keys, sizes, strict=True)])
        for k, n in zip(keys, sizes, strict=True):
            assert kv.get(k) == payload(k, n)
            buf = bytearray(2 * MiB)
            assert kv.get_into(k, buf) == n and bytes(buf[:n]) == payload(k, n)
        cl.kill("storage-1")
        try:
            for k, n in zip(keys, sizes, strict=True):
                assert kv.get(k) == payload(k, n)
        finally:
            restart(cl, "storage-1")


def test_ttl_expires(client: Client) -> None:
    kv = client.kv
    kv.put("short", b"lived", ttl=0.3)
    assert kv.get("short") == b"lived"
    wait_for(lambda: kv.get("short") is None, 10, "the TTL to expire")


def test_pins(cl: LocalCluster, client: Client) -> None:
    create_pool(cl, "pinned", redundancy="replica:1", target_memory=512 * KiB, target_disk=0,
                pin_quota=256 * KiB)
    pool_ready(client, "pinned")
    kv = client.kv_pool("pinned")
    kv.put("keep", payload("keep", 32 * KiB), pin="hard")
    assert kv.pin("keep", hard=True)
    for i in range(200):  # 12x the memory budget of the target
        kv.put(f"fill-{i}", payload(f"fill-{i}", 32 * KiB))
    assert kv.get("keep") == payload("keep", 32 * KiB)
    assert kv.unpin("keep")
    assert not kv.pin("not-there")


def test_a_batch_put_that_raises_says_which_keys_it_stored(cl: LocalCluster, client: Client) -> None:
    """A batch put past the pin quota raises for one key, but the others
    went out too: those stored stay (hard-pinned, on the quota). The error
    says so and gives each key's outcome; before, it named the one key, and
    the caller could not tell the batch from a put that changed nothing."""
    for name, redundancy in (("pinq1", "replica:1"), ("pinq2", "replica:2")):
        create_pool(cl, name, redundancy=redundancy, target_memory=1 * MiB, target_disk=0, pin_quota=64 * KiB)
        pool_ready(client, name)
        kv = client.kv_pool(name)
        keys = [f"{name}-{i}" for i in range(16)]  # 16 x 24 KiB: more than 4 targets' quotas of 64 KiB
        with pytest.raises(NoSpaceError) as err:
            kv.batch_put(keys, [payload(k, 24 * KiB) for k in keys], pin="hard")
        results = err.value.batch_results
        assert results is not None and len(results) == 16
        assert "batch of 16 keys" in str(err.value)
        got = [kv.get(k) for k in keys]
        for k, r, g in zip(keys, results, got, strict=True):
            assert (r is True) == (g is not None), (k, r)
            if g is not None:
                assert g == payload(k, 24 * KiB)
        assert 0 < sum(r is True for r in results) < 16
        assert f"{sum(r is True for r in results)} stored" in str(err.value)


def test_a_put_no_copy_took_names_every_copys_answer(cl: LocalCluster, client: Client) -> None:
    """replica:2, one copy's daemon just killed (meta does not know yet),
    the other out of room: the put's error names both answers, whichever
    was sent first. Until stop 49 it gave the first one only: "cannot
    connect" (the real reason, no room, hidden), or NoSpace (the dead copy
    hidden), by the order of the group's members."""
    create_pool(cl, "r2full", redundancy="replica:2", target_memory=256 * KiB, target_disk=0,
                pin_quota=200 * KiB)
    pool_ready(client, "r2full")
    kv = client.kv_pool("r2full")
    for i in range(40):  # every target's pin quota filled: nothing there can be evicted
        with contextlib.suppress(NoSpaceError):
            kv.put(f"r2pin-{i}", payload(f"r2pin-{i}", 50 * KiB), pin="hard")
    cl.kill("storage-3")
    try:
        with Client(cl.meta_addrs, kv_timeout=1.0, request_timeout=2.0) as c:
            kv = c.kv_pool("r2full")
            errs: list[Exception] = []
            with pytest.raises(InvalidArgumentError, match="can never fit"):  # the request itself: that first
                kv.put("r2full-huge", payload("r2full-huge", 1 * MiB))
            for i in range(12):
                try:
                    kv.put(f"r2full-{i}", payload(f"r2full-{i}", 100 * KiB))
                except (NoSpaceError, UnavailableError) as exc:
                    errs.append(exc)
            assert len(errs) == 12, errs  # 100 KiB fits in no target's unpinned room
            mixed = [e for e in errs if isinstance(e, UnavailableError)]
            assert mixed, errs  # some key has a copy on the dead daemon
            for e in mixed:
                text = str(e)
                assert "target" in text and "room" in text.lower() and "connect" in text.lower(), text
    finally:
        restart(cl, "storage-3")


def test_fresh_clients_see_each_others_objects(cl: LocalCluster, client: Client) -> None:
    client.kv.put("shared-prefix", b"system prompt")
    with Client(cl.meta_addrs) as other:
        assert other.kv.get("shared-prefix") == b"system prompt"
        assert other.kv.batch_exists(["shared-prefix"]) == 1


def test_large_batch_deadline_grows_with_its_bytes(cl: LocalCluster, client: Client) -> None:
    """A batch's deadline is kv_timeout plus its bytes at kv_min_bandwidth:
    64 MiB moves in one batch under a 10 ms kv_timeout, where a flat
    deadline (kv_min_bandwidth=0) cuts the same batch off (misses)."""
    pool_ready(client, "default")
    keys = [f"deadline-{i}" for i in range(4)]
    bufs = [payload(k, 16 * MiB) for k in keys]
    for k in keys:  # with the usual deadline (a 10 ms one timed out under load)
        client.kv.delete(k)
    with Client(cl.meta_addrs, kv_timeout=0.01, kv_min_bandwidth=0) as flat:
        flat.kv.exists("warm-up")  # the map and connections, outside the timed requests
        with pytest.raises(UnavailableError, match="reached no target"):
            flat.kv.batch_put(keys, bufs)
    # Other keys from here: the daemons may still store the flat batch after
    # its client gave up (a put may wait for a map change to take effect).
    keys = [f"deadline-scaled-{i}" for i in range(4)]
    for k in keys:
        client.kv.delete(k)
    with Client(cl.meta_addrs, kv_timeout=0.01) as scaled:
        scaled.kv.exists("warm-up")
        assert scaled.kv.batch_put(keys, bufs) == [True] * 4
        dests = [bytearray(16 * MiB) for _ in keys]
        assert scaled.kv.batch_get_into(keys, dests) == [16 * MiB] * 4
        assert all(bytes(d) == b for d, b in zip(dests, bufs, strict=True))
    with Client(cl.meta_addrs, kv_timeout=0.01, kv_min_bandwidth=0) as flat:
        flat.kv.exists("warm-up")
        dests = [bytearray(16 * MiB) for _ in keys]
        assert flat.kv.batch_get_into(keys, dests) != [16 * MiB] * 4, "a flat 10 ms deadline moved 64 MiB"


def _holders(cl: LocalCluster, pool: str, key: str) -> list[str]:
    """The storage daemon of each position (fragment j, or copy j) of ``key``
    in ``pool``."""
    from tierfs.kv.cluster import group_of

    async def get() -> list[str]:
        async with MetaClient(cl.meta_addrs) as mc:
            pools = await mc.list_kv_pools()
            cmap = await mc.get_cluster_map()
        p = next(p for p in pools.pools if p.name == pool)
        g = p.groups[group_of(key.encode(), len(p.groups))]
        names = []
        for tid in g.target_ids:
            node = next(t.node_id for t in cmap.targets if t.target_id == tid)
            addr = next(n.data_addr for n in cmap.nodes if n.node_id == node)
            names.append(next(pr.name for pr in cl.procs if pr.addr == addr))
        return names
    return asyncio.run(get())


def overwrite_while_down(cl: LocalCluster, victim: str, overwrite: Callable[[], object],
                         check: Callable[[], bool] | None = None) -> None:
    """SIGKILL ``victim``; once the map calls it down, ``overwrite`` (tried
    again while it raises UnavailableError: the client's map does not call
    it down yet), then ``check`` must hold; then ``victim`` is restarted."""
    cl.kill(victim)
    try:
        wait_for(lambda: _target_state(cl, victim) in (pb.TARGET_STATE_OFFLINE, pb.TARGET_STATE_FAILED), 60,
                 f"the map to call {victim} down")

        def attempt() -> bool:
            try:
                overwrite()
                return True
            except UnavailableError:
                return False
        wait_for(attempt, 30, "the overwrite")
        assert check is None or check()
    finally:
        restart(cl, victim)


def _target_state(cl: LocalCluster, name: str) -> int:
    async def get() -> int:
        async with MetaClient(cl.meta_addrs) as mc:
            cmap = await mc.get_cluster_map()
        addr = cl.proc(name).addr
        node = next(n for n in cmap.nodes if n.data_addr == addr)
        return int(next(t.state for t in cmap.targets if t.target_id == node.target_ids[0]))
    return asyncio.run(get())


def test_ec_overwrite_with_a_fragment_holder_down_never_mixes_versions(cl: LocalCluster, client: Client) -> None:
    """An overwrite while the holder of fragment 0 is down (the map says so:
    the put skips it and is acknowledged with K+M-1 fragments), then that
    holder comes back with its fragment of the old value. Both values have
    the same length, so the length in the trailers cannot tell them apart:
    a get must return the new value or a miss, never old and new fragments
    decoded together."""
    create_pool(cl, "ecv", redundancy="ec:2+1", target_memory=8 * MiB, target_disk=16 * MiB)
    pool_ready(client, "ecv")
    kv = client.kv_pool("ecv")
    key, n = "ecv-key", 96 * KiB
    old, new = b"\x01" * n, b"\x02" * n
    kv.put(key, old)
    assert kv.get(key) == old
    first = _holders(cl, "ecv", key)[0]
    overwrite_while_down(cl, first, lambda: kv.put(key, new, overwrite=True), lambda: kv.get(key) == new)
    with Client(cl.meta_addrs) as fresh:  # no memory of failures: asks fragment 0 first
        wait_for(lambda: _target_state(cl, first) == pb.TARGET_STATE_ONLINE, 60, f"{first} back online")
        for got in (fresh.kv_pool("ecv").get(key), kv.get(key)):
            assert got in (None, new), f"mixed or stale value: {got[:4]!r}...{got[-4:]!r}"
        buf = bytearray(n)
        got_n = fresh.kv_pool("ecv").get_into(key, buf)
        assert got_n is None or bytes(buf) == new, f"get_into: {bytes(buf[:4])!r}...{bytes(buf[-4:])!r}"


def test_ec_fragments_of_the_first_format_are_still_read(cl: LocalCluster, client: Client) -> None:
    """Fragments as the first format stored them (the value's length alone
    in an 8-byte trailer: a cluster written before the version tag) are
    still read; fragments of the two formats never decode together."""
    import struct

    from tierfs.client import AsyncClient
    from tierfs.kv.cluster import placement
    from tierfs.net.protocol import KV_OVERWRITE, KV_STAMP_SHIFT

    create_pool(cl, "ecl", redundancy="ec:2+1", target_memory=8 * MiB, target_disk=16 * MiB)
    pool_ready(client, "ecl")

    async def main() -> None:
        async with AsyncClient(cl.meta_addrs) as c:
            kv = c.kv_pool("ecl")
            tier = kv.cluster
            route = await tier.route()
            codec = tier._codec(route)
            key, n = b"legacy-key", 50_001
            value = payload("legacy-key", n)
            enc = bytearray(codec.encode_size(n))
            enc[:n] = value
            # with this release's placement stamps (a writer of the first
            # format sent none: its objects are misses where the map has stamps)
            targets, stamps = placement(route, key)
            for j, frag in enumerate(codec.encode(memoryview(enc), n, n)):
                body = bytes(frag) + struct.pack("<Q", n)
                await tier.data.kv_put(targets[j], route.pool_id, key, memoryview(body),
                                       flags=KV_OVERWRITE | stamps[j] << KV_STAMP_SHIFT)
            assert await kv.get(key) == value
            buf = bytearray(n)
            assert await kv.get_into(key, buf) == n and bytes(buf) == value
            assert await tier.size_of(key) == n
            # the new format's fragment 0 next to the old format's others
            other = bytes(reversed(value))
            assert await kv.put(key, other, overwrite=True)
            await tier.data.kv_put(targets[1], route.pool_id, key,
                                   memoryview(bytes(codec.encode(memoryview(enc), n, n)[1]) + struct.pack("<Q", n)),
                                   flags=KV_OVERWRITE | stamps[1] << KV_STAMP_SHIFT)
            assert await kv.get(key) == other  # fragments 0 and 2: the old one is left out
    asyncio.run(main())


def test_ec_a_wrong_fragment_with_a_right_trailer_is_left_out(cl: LocalCluster, client: Client) -> None:
    """A fragment rewritten with other bytes but the value's trailer (a
    misdirected or buggy write): the first K fragments fetched decode to a
    value whose CRC32C is not the trailer's. That was a miss for as long as
    the object lived (and engines that test presence before storing never
    store it again). Now the other fragments are fetched too, and any K that
    decode to the CRC32C give the value; with too few good ones, a miss,
    never wrong bytes."""
    from tierfs.client import AsyncClient
    from tierfs.kv.cluster import _TRAILER, _ec_tail, placement
    from tierfs.net.protocol import KV_OVERWRITE, KV_STAMP_SHIFT, crc32c

    create_pool(cl, "ecw", redundancy="ec:2+1", target_memory=8 * MiB, target_disk=16 * MiB)
    pool_ready(client, "ecw")

    async def main() -> None:
        async with AsyncClient(cl.meta_addrs) as c:
            kv = c.kv_pool("ecw")
            tier = kv.cluster
            route = await tier.route()
            codec = tier._codec(route)
            key, n = b"wrong-frag", 70_001
            value = payload("wrong-frag", n)
            assert await kv.put(key, value, overwrite=True)
            targets, stamps = placement(route, key)

            async def forge(j: int) -> None:
                size = len(codec.encode(memoryview(bytearray(codec.encode_size(n))), n, n)[j])
                body = bytearray(os.urandom(size) + bytes(_TRAILER.size))
                _TRAILER.pack_into(body, size, crc32c(value), _ec_tail(n, j))
                await tier.data.kv_put(targets[j], route.pool_id, key, memoryview(body),
                                       flags=KV_OVERWRITE | stamps[j] << KV_STAMP_SHIFT)

            await forge(0)  # among the first K asked
            assert await kv.get(key) == value
            buf = bytearray(n)
            assert await kv.get_into(key, buf) == n and bytes(buf) == value
            assert tier.counters.extra.get("wrong_fragments", 0) >= 2
            await forge(1)  # two of three wrong: a miss, not their bytes
            assert await kv.get(key) is None
            assert await kv.get_into(key, bytearray(n)) is None
    asyncio.run(main())


def test_judging_a_wrong_ec_fragment_tries_leaving_out_one_position_first() -> None:
    """Once K agreeing fragments decode to the wrong CRC32C, a get tries
    K-subsets of what it fetched until one decodes right. They come fewest
    left out first: with one wrong fragment among N, one without it within
    N tries, whichever position it is; before stop 41 they came in
    lexicographic order, and a wrong fragment 0 of ec:16+4 took 3,877 decodes.
    Every K-subset still comes once (none tried twice), so two wrong ones
    are found too."""
    from tierfs.kv.cluster import _fewest_left_out

    for k, m in ((2, 1), (4, 2), (8, 4), (16, 4)):
        n = k + m
        subsets = list(_fewest_left_out(range(n), k))
        assert sorted(subsets) == sorted(itertools.combinations(range(n), k))  # each once, all of them
        for bad in range(n):
            tries = next(i for i, keep in enumerate(subsets, 1) if bad not in keep)
            assert tries <= n, (k, m, bad, tries)
        if m >= 2:
            worst = max(next(i for i, keep in enumerate(subsets, 1) if not set(keep) & set(two))
                        for two in itertools.combinations(range(n), 2))
            assert worst <= n + n * (n - 1) // 2
    assert list(_fewest_left_out([5, 1, 3], 3)) == []  # exactly K: nothing else to try


@pytest.mark.parametrize("form", ["get", "get_into", "batch_get_into"])
def test_a_forged_replica_copy_is_never_served_while_another_copy_answers(cl: LocalCluster, client: Client,
                                                                          form: str) -> None:
    """replica:2: one copy of a key rewritten with other bytes and its own
    CRC32C (a misdirected or buggy write) passes every check of its own.
    Each form of get compares the copy it reads with the other copy's
    stored CRC32C (``kv_verify_copies``), or with a CRC32C the client knows
    the key's value to have (it put it, or two copies agreed): a copy that
    differs is a miss, never the forged bytes, and both copies are dropped
    (``contains`` says so, and the next put stores the key afresh). Until
    stop 39 the forged copy was served whenever it was the one read. With
    the check off the forged bytes come back: the test can tell."""
    from tierfs.client import AsyncClient
    from tierfs.kv.cluster import placement
    from tierfs.net.protocol import KV_OVERWRITE, KV_STAMP_SHIFT

    shared_pool(cl, client, "forge2")

    async def get(kv: Any, key: bytes, n: int) -> bytes | None:
        if form == "get":
            return await kv.get(key)
        buf = bytearray(n)
        got = await (kv.get_into(key, buf) if form == "get_into" else kv.batch_get_into([key], [buf]))
        got = got[0] if isinstance(got, list) else got
        return None if got is None else bytes(buf[:got])

    async def main() -> None:
        async with AsyncClient(cl.meta_addrs) as c, AsyncClient(cl.meta_addrs, kv_verify_copies=False) as unchecked:
            kv, raw = c.kv_pool("forge2"), unchecked.kv_pool("forge2")
            tier = kv.cluster
            route = await tier.route()
            n = 50_000
            keys = [f"forged-{form}-{i}".encode() for i in range(2)]
            for key in keys:
                assert await kv.put(key, payload(key, n), overwrite=True)
                assert await get(kv, key, n) == payload(key, n)
            assert tier.counters.disagreements == 0 and tier.counters.unwitnessed == 0

            async def forge(key: bytes, first: bool) -> None:
                """Forge the copy a get reads first, or the other one."""
                targets, stamps = placement(route, key)
                at = targets.index(tier._read_order(targets)[0])
                at = at if first else 1 - at
                await tier.data.kv_put(targets[at], route.pool_id, key, memoryview(os.urandom(n)),
                                       flags=KV_OVERWRITE | stamps[at] << KV_STAMP_SHIFT)

            # The copy read first is forged: it differs from the CRC32C this
            # client put, and the other copy, asked then, says so too.
            await forge(keys[0], first=True)
            assert await get(raw, keys[0], n) not in (None, payload(keys[0], n))  # unchecked: forged bytes
            assert await get(kv, keys[0], n) is None, "the forged copy's bytes were served"
            assert tier.counters.disagreements == 1
            assert await kv.exists(keys[0]) is False  # both copies dropped
            assert await kv.put(keys[0], payload(keys[0], n))  # stored afresh
            assert await get(kv, keys[0], n) == payload(keys[0], n)

            # The other copy is forged: this client reads the right one (its
            # CRC32C is the one it put); a client that knows nothing of the
            # key asks the other copy alongside, and the two disagree.
            await forge(keys[1], first=False)
            assert await get(kv, keys[1], n) == payload(keys[1], n) and tier.counters.disagreements == 1
            async with AsyncClient(cl.meta_addrs) as fresh:
                kv2 = fresh.kv_pool("forge2")
                assert await get(kv2, keys[1], n) is None
                assert kv2.cluster.counters.disagreements == 1 and await kv2.exists(keys[1]) is False
    asyncio.run(main())


def test_with_kv_require_witness_a_copy_no_other_copy_vouches_for_is_a_miss(cl: LocalCluster,
                                                                             client: Client) -> None:
    """replica:2, one copy forged and the other gone (evicted apart, or its
    daemon down): nothing can contradict the forged copy, and a client with
    the default settings serves it (an unwitnessed hit: the gap docs/kv.md
    names). With ``kv_require_witness`` every form of get is a miss instead,
    while a key whose CRC32C the client knows (it put the value) is still a
    hit with no witness. Such a client's ``batch_contains`` and
    ``batch_exists`` agree with its gets (they used to say present): an
    engine is not told of blocks its load then misses."""
    from tierfs.client import AsyncClient
    from tierfs.kv.cluster import placement
    from tierfs.net.protocol import KV_OVERWRITE, KV_STAMP_SHIFT

    shared_pool(cl, client, "forge2")

    async def main() -> None:
        n = 30_000
        key, own, both, split = b"strict-forged", b"strict-own", b"strict-both", b"strict-split"
        async with AsyncClient(cl.meta_addrs) as writer:
            kv = writer.kv_pool("forge2")
            tier = kv.cluster
            route = await tier.route()
            for k in (key, both, split):
                assert await kv.put(k, payload(k, n), overwrite=True)
            for k in (key, split):  # copy 0 forged
                targets, stamps = placement(route, k)
                await tier.data.kv_put(targets[0], route.pool_id, k, memoryview(os.urandom(n)),
                                       flags=KV_OVERWRITE | stamps[0] << KV_STAMP_SHIFT)
            targets, stamps = placement(route, key)
            assert await tier.data.kv_delete(targets[1], route.pool_id, key, since=stamps[1])
        async with AsyncClient(cl.meta_addrs) as lax:
            assert await lax.kv_pool("forge2").batch_contains([key]) == [True]
            got = await lax.kv_pool("forge2").get(key)
            assert got is not None and got != payload(key, n)  # the forged bytes: the gap
            assert lax.kv_pool("forge2").cluster.counters.unwitnessed == 1
        async with AsyncClient(cl.meta_addrs, kv_require_witness=True) as strict:
            kv = strict.kv_pool("forge2")
            # Presence as its gets will find it: the forged copy with no
            # witness and the two copies that differ are absent; two copies
            # that agree are present.
            assert await kv.batch_contains([key, both, split]) == [False, True, False]
            assert await kv.batch_exists([both, key, split]) == 1  # the leading keys present
            assert await kv.get(both) == payload(both, n)
            assert await kv.get(split) is None  # the copies disagree: a miss
            buf = bytearray(n)
            assert await kv.get(key) is None
            assert await kv.get_into(key, buf) is None
            assert await kv.batch_get_into([key], [buf]) == [None]
            st = kv.cluster.counters
            assert st.unwitnessed == 3 and st.unwitnessed_misses == 3 and st.disagreements == 1
            # A value this client put: its CRC32C is known, no witness needed.
            assert await kv.put(own, payload(own, n), overwrite=True)
            targets, stamps = placement(await kv.cluster.route(), own)
            assert await kv.cluster.data.kv_delete(targets[1], route.pool_id, own, since=stamps[1])
            assert await kv.batch_contains([own]) == [True]
            assert await kv.get(own) == payload(own, n)
            assert st.unwitnessed_misses == 3
    asyncio.run(main())


@pytest.mark.parametrize("write_back", [False, True])
def test_overwrite_through_local_tiers_reads_the_new_value(cl: LocalCluster, client: Client, tmp_path: Path,
                                                           write_back: bool) -> None:
    """A client with its own DRAM and SSD tiers overwrites a key it holds
    locally: its next gets (every form) return the new value, not the one
    its local tiers kept. A new client's first get sees it too."""
    key = f"local-ow-{write_back}"
    old, new = payload(key, 40 * KiB), bytes(reversed(payload(key, 40 * KiB)))
    with Client(cl.meta_addrs, kv_dram_bytes=4 * MiB, kv_ssd_bytes=8 * MiB, kv_ssd_path=str(tmp_path / "ssd"),
                kv_write_back=write_back) as c:
        kv = c.kv
        kv.put(key, old)
        kv.flush()
        assert kv.get(key) == old
        assert kv.put(key, new, overwrite=True)
        kv.flush()
        assert kv.get(key) == new
        buf = bytearray(40 * KiB)
        assert kv.get_into(key, buf) == 40 * KiB and bytes(buf) == new
        bufs = [bytearray(40 * KiB)]
        assert kv.batch_get_into([key], bufs) == [40 * KiB] and bytes(bufs[0]) == new
    with Client(cl.meta_addrs) as other:  # a map as fresh as the writer's (the module's client may hold an older one)
        assert other.kv.get(key) == new


def test_local_tier_counters_count_the_misses_of_get(cl: LocalCluster, client: Client, tmp_path: Path) -> None:
    """``get`` looks in the local tiers by size first: a key they do not
    hold is a miss in each (they counted none: kv stats said 0 misses of
    40 gets all answered by the cluster), and the copy it fills in is the
    next get's hit."""
    client.kv.put("ctr-1", payload("ctr-1", 8 * KiB))
    with Client(cl.meta_addrs, kv_dram_bytes=4 * MiB, kv_ssd_bytes=8 * MiB,
                kv_ssd_path=str(tmp_path / "ssd")) as c:
        def counts() -> dict[str, tuple[int, int]]:
            return {t["name"]: (t["hits"], t["misses"]) for t in c.kv.stats()["tiers"]}

        assert counts() == {"dram": (0, 0), "ssd": (0, 0)}
        assert c.kv.get("ctr-1") == payload("ctr-1", 8 * KiB)  # from the cluster, filled in locally
        assert counts() == {"dram": (0, 1), "ssd": (0, 1)}
        assert c.kv.get("ctr-1") == payload("ctr-1", 8 * KiB)
        assert counts() == {"dram": (1, 1), "ssd": (0, 1)}
        assert c.kv.get("ctr-absent") is None
        assert counts() == {"dram": (1, 2), "ssd": (0, 2)}


def test_a_delete_after_a_write_back_put_is_not_undone_by_it(cl: LocalCluster, tmp_path: Path) -> None:
    """A write-back client puts a large object and deletes it at once. The
    put returned when the object was local; its send to the cluster was
    still on its way when the delete ran, and on a client's second
    connection the small delete overtook it, so the put landed after the
    acknowledged delete and every client got the object back (KV checker
    soak, seed 82: reads of a deleted key, most likely this). The delete
    now waits for the key's write-back send. Before: 3 of 6 such deletes
    undone at 16 MiB. Then a prefetch racing a delete: what it fetched
    before the delete must not be filled into the local tiers after it
    (before: 3 of 6 deleted objects still served to the deleting client)."""
    size = 16 * MiB
    create_pool(cl, "wbdel", redundancy="replica:1", target_memory=4 * MiB, target_disk=160 * MiB)
    keys = [f"wbdel-{i}" for i in range(8)]
    with Client(cl.meta_addrs, kv_dram_bytes=3 * size, kv_write_back=True, kv_write_back_bytes=3 * size) as c, \
            Client(cl.meta_addrs) as other:
        pool_ready(c, "wbdel")
        kv = c.kv_pool("wbdel")
        existed = []
        for k in keys:
            kv.put(k, payload(k, size))
            existed.append(kv.delete(k))
        kv.flush()
        assert existed == [True] * len(keys), "a delete ran before its key's write-back put reached the cluster"
        assert kv.stats()["write_back_waits"] >= 1
        back = [k for k in keys if other.kv_pool("wbdel").get(k) is not None or kv.get(k) is not None]
        assert back == [], f"{len(back)} of {len(keys)} acknowledged deletes undone by an earlier write-back put"

        # A prefetch racing a delete: what it fetched is not filled in after the drop.
        for k in keys[:6]:
            assert other.kv_pool("wbdel").put(k, payload(k, size))
        for k in keys[:6]:
            kv.prefetch([k])
            assert kv.delete(k)
        kv.flush()
        kept = [k for k in keys[:6] if kv.get(k) is not None]
        assert kept == [], f"{len(kept)} of 6 deleted objects filled into the local tiers by a prefetch"


def test_get_into_through_local_tiers_fills_them_and_checks_the_dtype(cl: LocalCluster, client: Client,
                                                                      tmp_path: Path) -> None:
    """``get_into`` of one object by a client with a DRAM tier (its own path
    for a plain byte buffer): a local miss is fetched from the cluster and
    fills the tier, so the next get is served locally; a typed buffer whose
    element the object is not a whole number of is refused, as by
    ``batch_get_into``."""
    key = "local-get-into"
    value = payload(key, 24 * KiB)
    assert client.kv.put(key, value)
    client.kv.put("local-get-into-six", b"123456")
    with Client(cl.meta_addrs, kv_dram_bytes=4 * MiB) as c:
        kv = c.kv
        buf = bytearray(32 * KiB)
        assert kv.get_into(key, buf) == 24 * KiB and bytes(buf[:24 * KiB]) == value
        hits = kv.stats()["cluster"]["hits"]
        assert hits >= 1
        view = memoryview(bytearray(24 * KiB))
        assert kv.get_into(key, view) == 24 * KiB and bytes(view) == value
        assert kv.stats()["cluster"]["hits"] == hits  # served by the DRAM tier
        assert kv.get_into("local-get-into-none", bytearray(8)) is None
        assert kv.get_into("local-get-into-six", memoryview(bytearray(8))) == 6
        with pytest.raises(InvalidArgumentError, match="whole number of 4-byte elements"):
            kv.get_into("local-get-into-six", memoryview(np.zeros(4, dtype=np.float32)))


@pytest.mark.parametrize("pool", ["default", "ttl-ec"])
def test_local_tiers_drop_an_object_when_its_cluster_ttl_runs_out(cl: LocalCluster, client: Client, tmp_path: Path,
                                                                  pool: str) -> None:
    """A client with DRAM and SSD tiers keeps a copy of an object with a TTL
    no longer than the cluster keeps it, whether it put the object itself or
    fetched one another client put (the daemons' answer carries the time the
    object has left). Before, its gets went on returning the expired value
    from its own tiers."""
    if pool != "default":
        create_pool(cl, pool, redundancy="ec:2+1", target_memory=8 * MiB, target_disk=16 * MiB)
        pool_ready(client, pool)
    mine, theirs, kept = f"ttl-mine-{pool}", f"ttl-theirs-{pool}", f"ttl-kept-{pool}"
    other = client.kv_pool(pool)  # no local tiers
    with Client(cl.meta_addrs, kv_dram_bytes=4 * MiB, kv_ssd_bytes=8 * MiB, kv_ssd_path=str(tmp_path / "ssd"),
                kv_timeout=1.0, request_timeout=2.0) as c:
        kv = c.kv_pool(pool)
        ttl = 3.0
        deadline = time.monotonic() + ttl  # no later than either put's own
        other.put(theirs, payload(theirs, 30 * KiB), ttl=ttl)
        kv.put(mine, payload(mine, 30 * KiB), ttl=ttl)
        assert kv.put(kept, payload(kept, 30 * KiB))
        # Each check that a TTL object is there holds only if it ran before
        # the deadline (a heavily loaded machine could take the test past it).
        got = kv.get(theirs)  # now in the local tiers too
        assert got == payload(theirs, 30 * KiB) or time.monotonic() >= deadline
        bufs = [bytearray(30 * KiB) for _ in range(3)]
        sizes = kv.batch_get_into([mine, theirs, kept], bufs)
        assert sizes == [30 * KiB] * 3 or (sizes[2] == 30 * KiB and time.monotonic() >= deadline)
        hits = kv.stats()["cluster"]["hits"]
        # the three are served locally now: no request reaches the cluster
        got2 = (kv.get(mine), kv.get(theirs))
        if time.monotonic() < deadline:
            assert got2 == (payload(mine, 30 * KiB), payload(theirs, 30 * KiB))
            assert kv.stats()["cluster"]["hits"] == hits
        wait_for(lambda: other.get(mine) is None and other.get(theirs) is None, 20, "the cluster's TTLs to run out")
        assert kv.get(mine) is None and kv.get(theirs) is None
        assert kv.batch_get_into([mine, theirs, kept], bufs) == [None, None, 30 * KiB]
        assert bytes(bufs[2]) == payload(kept, 30 * KiB)
        assert kv.batch_exists([kept, mine]) == 1


def test_reads_with_no_map_while_meta_is_down_are_misses(cl: LocalCluster, client: Client) -> None:
    """A client that has no map of the pool yet while meta cannot be reached
    (found by the KV checker with meta faults: a fresh client's batch get
    raised UnavailableError "no leader elected"): its reads are misses, as
    when a node is down, since an engine recomputes a miss while an error
    fails its request. Its writes say the store is unavailable. Last in the
    module: it stops every meta replica."""
    value = payload("nomap-1", 5000)
    # Put by a client with the current map (the module's may be older than
    # the earlier tests' node restarts: its put could land where a current
    # map does not look, a miss that is not what this test is about).
    with Client(cl.meta_addrs, kv_timeout=1.0, request_timeout=2.0) as current:
        current.kv.put("nomap-1", value)
    metas = [p.name for p in cl.procs if p.kind == "meta"]
    for name in metas:
        cl.kill(name)
    try:
        with Client(cl.meta_addrs, kv_timeout=1.0, request_timeout=2.0, meta_deadline=2.0) as fresh:
            kv = fresh.kv
            assert kv.get("nomap-1") is None
            assert kv.get_into("nomap-1", bytearray(5000)) is None
            assert kv.batch_get_into(["nomap-1", "nomap-2"], [bytearray(5000), bytearray(10)]) == [None, None]
            assert kv.exists("nomap-1") is False
            assert fresh.kv.stats()["cluster"]["no_map"] >= 5
            with pytest.raises(UnavailableError):
                kv.put("nomap-2", b"x")
    finally:
        cl.start(names=metas, timeout=60)
        asyncio.run(cl.wait_healthy(60))
    # Meta back: a fresh client gets its map and works, and what was put
    # before is still there: no node was marked offline after the outage, so
    # the pool's groups were not re-planned (docs/meta.md, "Data model", heartbeats).
    # The outage outlasted the daemons' KV map leases: their gets are misses
    # until a heartbeat renews them (docs/kv.md, "Map leases").
    with Client(cl.meta_addrs, kv_timeout=1.0, request_timeout=2.0) as fresh:
        wait_for(lambda: fresh.kv.get("nomap-1") == value, 20.0, "the daemons' leases renewed after the outage")
        again = payload("nomap-3", 7000)
        fresh.kv.put("nomap-3", again)
        assert fresh.kv.get("nomap-3") == again


@pytest.mark.parametrize("redundancy", ["replica:2", "ec:2+1"])
def test_a_pool_removed_while_in_use_gives_misses_and_puts_say_so_by_name(cl: LocalCluster,
                                                                           redundancy: str) -> None:
    """`kv pool rm` under a client that has the pool mapped: its gets are
    misses, and a put raises NotFoundError naming the pool (it said "no KV
    pool 2 on target 1" in a replica pool, and "stored 0 of 2+1 fragments"
    in an EC pool). Defined again, the name works again."""
    name = "gone-" + redundancy.replace(":", "").replace("+", "")
    create_pool(cl, name, redundancy=redundancy, target_memory=16 * MiB)
    pool_served(cl.meta_addrs, name)
    with Client(cl.meta_addrs) as c:
        kv = c.kv_pool(name)
        assert kv.put("k", payload("k", 4 * KiB))
        assert kv.get("k") == payload("k", 4 * KiB)

        async def rm() -> None:
            async with MetaClient(cl.meta_addrs) as mc:
                await mc.remove_kv_pool(name)

        asyncio.run(rm())
        # the daemons drop it when their map says so: until then a get may still hit
        wait_for(lambda: kv.get("k") is None, 20, "the removed pool's object to be a miss")
        assert kv.batch_get_into(["k"], [bytearray(4 * KiB)]) == [None]
        with pytest.raises(NotFoundError, match=f"KV pool '{name}' was removed|unknown KV pool '{name}'"):
            kv.put("k2", b"x" * 100)
        with pytest.raises(NotFoundError, match=f"KV pool '{name}' was removed|unknown KV pool '{name}'"):
            kv.batch_put(["k3", "k4"], [b"x" * 100, b"y" * 100])
    create_pool(cl, name, redundancy=redundancy, target_memory=16 * MiB)
    pool_served(cl.meta_addrs, name)
    with Client(cl.meta_addrs) as c:
        assert c.kv_pool(name).put("k", b"again") and c.kv_pool(name).get("k") == b"again"


def test_local_tiers_never_read_otherwise_than_the_cluster(cl: LocalCluster, client: Client, tmp_path: Path) -> None:
    """A client's DRAM and SSD tiers hold only what the cluster holds for
    the key. Each of these read, until stop 46, the value the cluster did
    not take, while every other client read the cluster's:
    a put that raised (the value can never fit the pool); a put without
    overwrite that returned False (the key held another value); a pool
    removed and made again under the same name (the old pool's object); and
    a key near 512 bytes was refused with local tiers (the pool's name
    counted against the limit)."""
    from tierfs.errors import InvalidArgumentError

    name = "localtruth"
    create_pool(cl, name, redundancy="replica:1", target_memory=256 * KiB)
    pool_served(cl.meta_addrs, name)
    with Client(cl.meta_addrs, kv_dram_bytes=4 * MiB, kv_ssd_bytes=8 * MiB,
                kv_ssd_path=str(tmp_path / "ssd")) as a, Client(cl.meta_addrs) as b:
        ka, kb = a.kv_pool(name), b.kv_pool(name)
        assert kb.put("k", b"O" * 1000)
        with pytest.raises(InvalidArgumentError, match="can never fit"):
            ka.put("k", b"N" * 300_000, overwrite=True)
        assert ka.get("k") == kb.get("k") == b"O" * 1000
        assert ka.put("k", b"X" * 1000) is False  # held already: a no-op
        assert ka.get("k") == b"O" * 1000
        long_key = "L" * 512
        assert ka.put(long_key, b"long") and ka.get(long_key) == b"long" and kb.get(long_key) == b"long"

        async def remake() -> None:
            async with MetaClient(cl.meta_addrs) as mc:
                await mc.remove_kv_pool(name)
                await mc.create_kv_pool(name, redundancy="replica:1", target_memory=256 * KiB)

        assert ka.get("k") == b"O" * 1000  # in a's local tiers now
        asyncio.run(remake())
        pool_served(cl.meta_addrs, name)
        # once a's map has the new pool (a local hit asks nothing of the
        # cluster, so a's map is refreshed here as any cluster call would)
        a._run(a.aclient._parts()[2].refresh(force=True))
        assert ka.get("k") is None and kb.get("k") is None


def test_local_tiers_follow_this_clients_acknowledged_writes(cl: LocalCluster) -> None:
    """Found by a new user (stop 47), each a value this client read after
    its own acknowledged write said otherwise:
    - a fresh client's first put cached under pool id 0 (no map yet), a
      copy its later overwrite and delete never reached, read again once
      the pool was removed;
    - a put without overwrite of a key the cluster no longer held (another
      client deleted it) stored the new value in the cluster, while this
      client's DRAM tier kept serving the old one.
    (A fill or demotion still being written when this client overwrites or
    deletes the key: tests/kv/test_tiers.py,
    test_ssd_write_in_flight_is_undone_by_a_delete_or_a_newer_put.)"""
    name = "ownwrites"
    create_pool(cl, name, redundancy="replica:1", target_memory=64 * MiB)
    pool_served(cl.meta_addrs, name)
    with Client(cl.meta_addrs, kv_dram_bytes=4 * MiB) as a, Client(cl.meta_addrs) as b:
        ka, kb = a.kv_pool(name), b.kv_pool(name)
        assert ka.put("first", b"1" * 100)  # this client's first call: no map before it
        local = a.aclient._kv_local().tiers[0].keys()  # type: ignore[union-attr]
        pid = a.aclient._parts()[2].kv_pools[name].pool_id
        assert local and all(k.startswith(f"{name}\0{pid}\0".encode()) for k in local), (local, pid)
        assert ka.put("first", b"2" * 100, overwrite=True) and ka.get("first") == b"2" * 100
        assert ka.delete("first") and ka.get("first") is None

        assert ka.put("k", b"O" * 1000)
        assert kb.delete("k")
        assert ka.put("k", b"N" * 1000)  # the cluster had none: it stores this one
        assert kb.get("k") == b"N" * 1000
        assert ka.get("k") == b"N" * 1000  # the old value until stop 47
        assert ka.put("k", b"X" * 1000) is False  # the cluster keeps N: so does a
        assert ka.get("k") == b"N" * 1000
        # A local tier's error names the caller's key, not the local one (pool name and id before it)
        from tierfs.errors import InvalidArgumentError

        for call in (lambda: ka.get_into("k", bytearray(10)), lambda: ka.batch_get_into(["k"], [bytearray(10)])):
            with pytest.raises(InvalidArgumentError) as ei:
                call()
            assert "b'k'" in str(ei.value) and "\\x00" not in str(ei.value), ei.value

        # An overwrite too big for a's 4 MiB DRAM tier, and a get of a's that
        # reads the old value from the cluster while it runs: the old value
        # must not be filled in after the overwrite is acknowledged.
        async def race(i: int) -> tuple[Any, Any]:
            kv = a.aclient.kv_pool(name)
            key = f"ow{i}"
            return key, await asyncio.gather(kv.put(key, b"N" * (5 << 20), overwrite=True), kv.get(key))

        stale = 0
        for i in range(8):
            assert kb.put(f"ow{i}", b"O" * 4096)
            key, (ok, during) = a._run(race(i))
            assert ok and during in (None, b"O" * 4096, b"N" * (5 << 20))
            after = ka.get(key)
            stale += after is not None and after != b"N" * (5 << 20)
        assert stale == 0, f"{stale} of 8 gets after an acknowledged overwrite read the old value"


def test_an_overwrite_evicted_locally_before_it_is_acknowledged_is_not_undone_by_a_fill(cl: LocalCluster) -> None:
    """Found by a new user (stop 48): an overwrite the DRAM tier took, and
    evicted again (another put of the same client) while the cluster put
    ran; a get of that client's meanwhile missed locally, read the old
    value from the cluster and filled it in. Once the overwrite was
    acknowledged that client went on reading the value it had replaced
    (8 of 8 before the fix), while every other client read the new one."""
    name = "ownevict"
    create_pool(cl, name, redundancy="replica:1", target_memory=64 * MiB)
    pool_served(cl.meta_addrs, name)
    with Client(cl.meta_addrs, kv_dram_bytes=4 * MiB) as a, Client(cl.meta_addrs) as b:
        ka, kb = a.kv_pool(name), b.kv_pool(name)
        new, other = b"N" * (2 * MiB), b"F" * (3 * MiB)

        async def race(i: int) -> list[Any]:
            kv = a.aclient.kv_pool(name)
            # the second put evicts the first's local copy (4 MiB of DRAM)
            return await asyncio.gather(kv.put(f"ev{i}", new, overwrite=True),
                                        kv.put(f"fill{i}", other, overwrite=True), kv.get(f"ev{i}"))

        stale = 0
        for i in range(8):
            assert kb.put(f"ev{i}", b"O" * 4096, overwrite=True)
            ok, ok2, during = a._run(race(i))
            assert ok and ok2 and during in (None, b"O" * 4096, new)
            assert kb.get(f"ev{i}") == new
            after = ka.get(f"ev{i}")
            stale += after is not None and after != new
        assert stale == 0, f"{stale} of 8 gets after an acknowledged overwrite read the old value"
