"""Permanent loss of a storage node, and faults during the rebuild that
follows (tierfs.storage.repair; docs/repair.md).

What they prove: after a node is SIGKILLed for good, meta replaces its
targets in every group and the survivors rebuild the lost fragments onto
the replacements with no manual step; once no group is rebuilding, every
acknowledged file reads back exactly, and the cluster again survives two
MORE node losses (so the rebuilt fragments are real, not decoded on the
fly). A replacement node SIGKILLed in the middle of its rebuild, then
restarted, resumes and finishes it; one hung (SIGSTOP) for a second
finishes it too; so does the rebuild when the meta leader is SIGKILLed in
the middle of it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tests.faults.harness import FaultCluster, Ledger, MiB, digest, random_bytes
from tierfs.client import Client
from tierfs.errors import TierFSError
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

#: offline after 1.5 s of silence; replaced 2 s later; ticks of 0.2 s.
META = ("--heartbeat-timeout=1.5", "--replace-after=2", "--tick-interval=0.2")
STORAGE = ("--heartbeat-interval=0.2", "--rebuild-interval=0.3", "--scrub-rate=0")


async def _map(fc: FaultCluster) -> pb.ClusterMap:
    async with MetaClient(fc.meta_addrs, deadline=10) as mc:
        return await mc.get_cluster_map()


def _targets_of(cmap: pb.ClusterMap, data_addr: str) -> set[int]:
    return {t for n in cmap.nodes if n.data_addr == data_addr for t in n.target_ids}


def _wait_rebuilt(fc: FaultCluster, dead_addr: str, timeout: float) -> tuple[float, pb.ClusterMap, bool]:
    """Wait until no group holds the dead node's targets and none is rebuilding.
    Returns (seconds, final map, whether a rebuild was ever seen in progress)."""
    t0 = time.monotonic()
    seen = False
    while True:
        cmap = asyncio.run(_map(fc))
        dead = _targets_of(cmap, dead_addr)
        rebuilding = any(g.rebuilding for g in cmap.groups)
        seen = seen or rebuilding
        if cmap.groups and not rebuilding and not any(dead.intersection(g.target_ids) for g in cmap.groups):
            return time.monotonic() - t0, cmap, seen
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not rebuilt after {timeout:.0f}s: {cmap}")
        time.sleep(0.1)


@pytest.fixture
def fc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    c = FaultCluster(tmp_path_factory.mktemp("rebuild"), n_storage=7, extra_meta_args=META,
                     extra_storage_args=STORAGE)
    yield c
    c.close()


def _write_set(client: Client, ledger: Ledger) -> None:
    client.mkdir("/rb")
    client.set_layout("/rb", chunk_size=MiB)
    for i in range(8):
        assert ledger.write(client, f"/rb/f{i}", random_bytes(5 * MiB + 333 * i, seed=700 + i)), ledger.errors


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", ["plain", "kill_replacement", "stop_replacement", "kill_meta_leader"])
def test_permanent_loss_rebuilds_and_survives_two_more(fc: FaultCluster, variant: str) -> None:
    ledger = Ledger()
    with fc.client(request_timeout=1.0, connect_timeout=1.0, retries=2) as client:
        _write_set(client, ledger)
        dead = "storage-2"
        dead_addr = fc.cl.proc(dead).addr
        before = asyncio.run(_map(fc))
        dead_targets = _targets_of(before, dead_addr)
        # Readers run through the kill and the rebuild: never a wrong byte.
        stop = threading.Event()
        wrong: list[str] = []
        reads = [0]

        def reader() -> None:
            while not stop.is_set():
                for path, data in list(ledger.acked.items()):
                    try:
                        got = client.read_bytes(path)
                    except TierFSError:
                        continue
                    if digest(got) != digest(data):
                        wrong.append(path)
                    reads[0] += 1

        t = threading.Thread(target=reader)
        t.start()
        t_kill = time.monotonic()
        try:
            fc.cl.kill(dead)
            killed_replacement = ""
            if variant in ("kill_replacement", "stop_replacement"):
                # The first group seen rebuilding: SIGKILL the node of its new member, then restart it.
                deadline = time.monotonic() + 30
                while not killed_replacement:
                    assert time.monotonic() < deadline, "no rebuild started"
                    cmap = asyncio.run(_map(fc))
                    new = {tid for g in cmap.groups for tid in g.rebuilding}
                    for n in cmap.nodes:
                        if new.intersection(n.target_ids):
                            killed_replacement = next(p.name for p in fc.cl.procs if p.addr == n.data_addr)
                            break
                    time.sleep(0.05)
                if variant == "kill_replacement":
                    fc.cl.kill(killed_replacement)
                    time.sleep(0.5)  # the fault lasts a while (not a synchronisation)
                    fc.cl.start(names=[killed_replacement], timeout=60)
                else:  # hung for a second, under the heartbeat timeout
                    fc.cl.kill(killed_replacement, signal.SIGSTOP)
                    time.sleep(1.0)
                    os.kill(fc.cl.proc(killed_replacement).pid, signal.SIGCONT)
            if variant == "kill_meta_leader":
                # Once a rebuild is under way, SIGKILL the meta leader (and
                # restart it): the workers finish against the new leader.
                deadline = time.monotonic() + 30
                while not any(g.rebuilding for g in asyncio.run(_map(fc)).groups):
                    assert time.monotonic() < deadline, "no rebuild started"
                    time.sleep(0.05)
                h = asyncio.run(fc.cl.health(deadline=8.0))
                leader = next(str(m["name"]) for m in h["meta"] if m["role"] == "leader")
                fc.cl.kill(leader)
                killed_replacement = f"meta leader {leader}"
                time.sleep(0.5)  # the fault lasts a while (not a synchronisation)
                fc.cl.start(names=[leader], timeout=60)
            _, cmap, seen = _wait_rebuilt(fc, dead_addr, 120)
            secs = time.monotonic() - t_kill
        finally:
            stop.set()
            t.join(60)
        assert not wrong, wrong
        assert reads[0] > 0
        assert not dead_targets.intersection(t for g in cmap.groups for t in g.target_ids)
        rebuilt_bytes = sum(len(d) for d in ledger.acked.values()) // 4  # ~one fragment in six per chunk, x1.5
        print(f"\n{variant}: rebuilt in {secs:.1f}s after the kill (seen in progress: {seen}; "
              f"replacement hit: {killed_replacement or '-'}); {reads[0]} reads during it, none wrong; "
              f"~{rebuilt_bytes / MiB:.0f} MiB of fragments to rebuild")
        ledger.verify(client)
        # Full redundancy again: two more nodes may go and everything still reads.
        # (A fresh client: one holding the pre-rebuild map keeps dialling the dead
        # node until its map ages out, map_max_age; see docs/reliability.md.)
        alive = [p.name for p in fc.cl.procs if p.kind == "storage" and p.name != dead]
        for name in (alive[0], alive[-1]):
            fc.cl.kill(name)
        with fc.client(request_timeout=1.0, connect_timeout=1.0) as fresh:
            ledger.verify(fresh)
        # Back: everything up (the dead node returns as a spare), new writes work.
        fc.restart_all()
        deadline = time.monotonic() + 30
        while not ledger.write(client, "/rb/after", random_bytes(3 * MiB, seed=9)):
            assert time.monotonic() < deadline, ledger.errors[-3:]
            time.sleep(0.3)
        ledger.verify(client)

