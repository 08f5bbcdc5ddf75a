"""KV map leases (docs/kv.md, "Map leases"), on a real cluster: a storage
daemon cut off from meta while clients still reach it.

Its map stops following meta, and so does the map of a client that keeps
its map (``map_max_age`` 600 s). Meta marks the daemon offline and re-plans
its ``replica:1`` group onto another target, where a writer with the new
map overwrites the keys. Then the late client puts, gets and deletes those
keys with its old map: every request goes to the cut-off daemon, whose own
map agrees with the client's, so the placement checks of stop 30-32 pass.
Before leases (626a168) it served the value from before the overwrite (12
of 15 late gets) and acknowledged the puts and deletes, which readers with
the current map never saw (7 of 7 overwrites unseen, 8 of 8 deletes
undone).
With leases the daemon acts on stamped requests only while a heartbeat
found its map current within the lease, so each of those requests is
refused or a miss, and nothing it acknowledges is hidden from readers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import FAST_META
from tests.faults.proxy import FaultProxy
from tests.kv.pools import wait_for
from tests.kv.test_kv_cluster import _holders, _target_state, create_pool, payload, pool_ready
from tierfs.client import Client
from tierfs.errors import TierFSError
from tierfs.local import LocalCluster
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(240)
KiB, MiB = 1 << 10, 1 << 20
VICTIM = "storage-0"
PROXY_HOST = "127.0.0.2"


@pytest.fixture
def cut(tmp_path: Path) -> Iterator[tuple[LocalCluster, FaultProxy]]:
    """One meta replica (no leader hints to bypass the proxy) and three
    storage daemons; ``storage-0`` reaches meta only through a fault proxy."""
    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=3, extra_meta_args=list(FAST_META))
    host, _, port = cl.meta_addrs[0].rpartition(":")
    px = FaultProxy((PROXY_HOST, 0), (host, int(port)))
    try:
        argv = cl.proc(VICTIM).argv
        argv[:] = [a for a in argv if not a.startswith("--meta=")] + [f"--meta={PROXY_HOST}:{px.address[1]}"]
        cl.up(timeout=120)
        yield cl, px
    finally:
        try:
            cl.stop()
        finally:
            px.close()


def test_a_daemon_cut_off_from_meta_acts_on_no_old_map(cut: tuple[LocalCluster, FaultProxy]) -> None:
    cl, px = cut
    create_pool(cl, "lease", redundancy="replica:1", target_memory=4 * MiB, target_disk=16 * MiB)
    opts: dict[str, Any] = {"kv_timeout": 1.0, "request_timeout": 2.0}
    with Client(cl.meta_addrs, map_max_age=600.0, **opts) as late:
        pool_ready(late, "lease")
        lk = late.kv_pool("lease")
        keys = [f"lease-{i}" for i in range(48)]
        first = {k: payload(k, 8 * KiB) for k in keys}
        lk.batch_put(keys, [first[k] for k in keys])  # the late client's map is from here
        theirs = [k for k in keys if _holders(cl, "lease", k)[0] == VICTIM]
        assert len(theirs) >= 4, "too few keys on the victim"
        assert all(lk.get(k) == first[k] for k in theirs)

        px.set("reset")  # the victim's heartbeats and map fetches fail from here
        wait_for(lambda: _target_state(cl, VICTIM) != pb.TARGET_STATE_ONLINE, 60, "the victim marked offline")
        wait_for(lambda: all(_holders(cl, "lease", k)[0] != VICTIM for k in theirs), 60,
                 "the group re-planned without the victim")
        second = {k: bytes(reversed(first[k])) for k in theirs}
        with Client(cl.meta_addrs, **opts) as writer:
            writer.kv_pool("lease").batch_put(theirs, [second[k] for k in theirs], overwrite=True)

        # The late client's map still sends every request to the victim.
        third = {k: payload(k + "-third", 8 * KiB) for k in theirs}
        acked_puts = []
        for k in theirs[: len(theirs) // 2]:
            try:
                if lk.put(k, third[k], overwrite=True):
                    acked_puts.append(k)
            except TierFSError:
                pass  # not acknowledged: either value may be read
        served = [k for k in theirs if lk.get(k) == first[k]]
        acked_deletes = []
        for k in theirs[len(theirs) // 2:]:
            try:
                lk.delete(k)
                acked_deletes.append(k)
            except TierFSError:
                pass

        with Client(cl.meta_addrs, **opts) as reader:
            rk = reader.kv_pool("lease")
            unseen = [k for k in acked_puts if rk.get(k) != third[k]]
            undone = [k for k in acked_deletes if rk.get(k) is not None]
            assert (served, unseen, undone) == ([], [], []), (
                f"{len(served)} of {len(theirs)} late gets returned the value from before the overwrite; "
                f"{len(unseen)} of {len(acked_puts)} acknowledged late overwrites unseen by readers; "
                f"{len(undone)} of {len(acked_deletes)} acknowledged late deletes undone for readers")
            # Keys not written since keep the writer's value.
            for k in theirs:
                if k not in acked_puts and k not in acked_deletes:
                    assert rk.get(k) in (second[k], third[k], None)

    px.set("pass")  # healed: the victim heartbeats again and renews its lease
    wait_for(lambda: _target_state(cl, VICTIM) == pb.TARGET_STATE_ONLINE, 60, f"{VICTIM} back online")
    with Client(cl.meta_addrs, **opts) as fresh:
        fk = fresh.kv_pool("lease")
        k = "lease-after"
        wait_for(lambda: fk.put(k, payload(k, 4 * KiB)) is not None and fk.get(k) == payload(k, 4 * KiB), 30,
                 "puts and gets work again")
