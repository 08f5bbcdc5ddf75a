"""The KV cluster tier with a storage daemon stalled (SIGSTOP: its
connections stay open and it never answers), as an inference engine meets
it: gets, batch gets and lookups of keys that are mostly absent (a cache
misses more than it hits). Clients here have a ``kv_timeout`` far longer
than the test's own timeout, so a call that waits on the stalled daemon
when the other copies or fragments could answer fails the test by timeout
(no timing assertion)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

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
from tierfs.kv.client import KV
from tierfs.local import LocalCluster

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
