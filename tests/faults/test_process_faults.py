"""Process faults on a real cluster: storage daemons SIGKILLed and SIGSTOPed
(hung) in the middle of reads and writes, then brought back; the meta
leader SIGKILLed during a large write, then restarted.

What they prove: reads in flight complete with exact bytes while one node
of every group dies or hangs; a write that loses a group member commits
degraded (K+1 fragments) or fails with an error and leaves no partial
file; once the node is back (restart or SIGCONT) the cluster is healthy
again without any manual step, takes writes, and every acknowledged byte
reads back exactly. (Permanent loss and rebuild:
docs/repair.md; the client-level kill tests are in tests/client.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tests.faults.harness import FaultCluster, Ledger, MiB, digest, random_bytes, wait_node_state
from tierfs.client import Client
from tierfs.errors import TierFSError


@pytest.fixture(scope="module")
def fc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    c = FaultCluster(tmp_path_factory.mktemp("proc"))
    yield c
    c.close()


@pytest.fixture
def healthy(fc: FaultCluster) -> Iterator[FaultCluster]:
    """Every test starts and must end with all nodes up and online."""
    fc.restart_all()
    yield fc
    for p in fc.cl.procs:
        if p.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
    fc.restart_all()


def _reader(client: Client, path: str, want: bytes, stop: threading.Event, errors: list[str],
            count: list[int]) -> None:
    while not stop.is_set():
        try:
            got = client.read_bytes(path)
        except TierFSError as exc:  # an error is allowed; wrong bytes are not
            errors.append(f"error: {exc}")
            continue
        if digest(got) != digest(want):
            errors.append("WRONG BYTES")
        count[0] += 1


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_node_fault_during_reads_then_back(healthy: FaultCluster, sig: int) -> None:
    fc = healthy
    name = "storage-1"
    ledger = Ledger()
    with fc.client(request_timeout=1.0) as client:
        d = f"/rd-{sig}"
        client.mkdir(d)
        client.set_layout(d, chunk_size=MiB)
        for i in range(3):
            assert ledger.write(client, f"{d}/f{i}", random_bytes(9 * MiB + i, seed=10 + i))
        big = f"{d}/f0"
        # 1. mid-read of one file: half read, node dies/hangs, the rest reads exact
        with client.open(big, "rb") as f:
            first = f.read(4 * MiB + 3)
            fc.cl.kill(name, sig)
            rest = f.read()
        assert digest(first + rest) == digest(ledger.acked[big])
        # 2. concurrent readers while the node is down
        stop = threading.Event()
        errors: list[str] = []
        count = [0]
        threads = [threading.Thread(target=_reader, args=(client, p, ledger.acked[p], stop, errors, count))
                   for p in sorted(ledger.acked)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while count[0] < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
        assert "WRONG BYTES" not in errors
        assert count[0] >= 6, (count, errors[:3])
        # 3. degraded writes (docs/client.md): with one member gone a rewrite
        # commits with K+1 fragments; the node catches up when it returns
        assert ledger.write(client, f"{d}/f1", random_bytes(2 * MiB, seed=77)), ledger.errors
        assert client.aclient.degraded_writes > 0
        # 4. the node comes back: healthy, writable, everything exact
        if sig == signal.SIGSTOP:
            os.kill(fc.cl.proc(name).pid, signal.SIGCONT)
        else:
            fc.cl.start(names=[name], timeout=60)
        asyncio.run(fc.cl.wait_healthy(60))
        assert ledger.write(client, f"{d}/during", random_bytes(2 * MiB, seed=78))
        ledger.verify(client)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_node_fault_during_writes_then_back(healthy: FaultCluster, sig: int) -> None:
    """Writes running in a thread while a node dies/hangs: each one commits
    whole or fails; after the node returns all acked files are exact."""
    fc = healthy
    name = "storage-4"
    ledger = Ledger()
    with fc.client(request_timeout=1.0, retries=2) as client:
        d = f"/wr-{sig}"
        client.mkdir(d)
        client.set_layout(d, chunk_size=MiB)
        done = threading.Event()

        def writer() -> None:
            i = 0
            while not done.is_set() and i < 40:
                ledger.write(client, f"{d}/f{i % 6}", random_bytes(3 * MiB + i, seed=1000 + i))
                i += 1

        t = threading.Thread(target=writer)
        t.start()
        deadline = time.monotonic() + 30
        while len(ledger.acked) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        fc.cl.kill(name, sig)
        n_before = len(ledger.acked) + len(ledger.failed)
        deadline = time.monotonic() + 30
        while len(ledger.acked) + len(ledger.failed) < n_before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        if sig == signal.SIGSTOP:
            os.kill(fc.cl.proc(name).pid, signal.SIGCONT)
        else:
            fc.cl.start(names=[name], timeout=60)
        done.set()
        t.join(60)
        assert not t.is_alive()
        asyncio.run(fc.cl.wait_healthy(60))
        # Overlap shows as a failed write or, mostly, a degraded one (K+1 fragments).
        assert ledger.failed or client.aclient.degraded_writes, "no write overlapped the fault"
        print(f"\n{signal.Signals(sig).name}: {len(ledger.acked)} files acked, {len(ledger.failed)} failed")
        ledger.verify(client)
        for path in list(ledger.failed):
            assert ledger.write(client, path, random_bytes(MiB, seed=5)), path
        ledger.verify(client)


def _leader(fc: FaultCluster) -> str:
    h = asyncio.run(fc.cl.health())
    return str(next(m["name"] for m in h["meta"] if m["role"] == "leader"))


@pytest.mark.timeout(150)
def test_meta_leader_killed_during_large_write_then_restarted(healthy: FaultCluster) -> None:
    fc = healthy
    ledger = Ledger()
    data = random_bytes(48 * MiB + 3, seed=55)
    with fc.client(request_timeout=5.0, lease_ms=6000) as client:
        assert ledger.write(client, "/meta-small", b"x" * 1000)
        killed = ""
        try:
            with client.open("/meta-big", "wb") as f:
                view = memoryview(data)
                for pos in range(0, len(data), 4 * MiB):
                    f.write(view[pos: pos + 4 * MiB])
                    if not killed and pos >= 12 * MiB:
                        killed = _leader(fc)
                        fc.cl.kill(killed)
            ledger.acked["/meta-big"] = data
        except TierFSError as exc:
            ledger.failed["/meta-big"] = None
            print(f"\nlarge write failed over leader kill: {exc}")
        assert killed
        ledger.verify(client)
        fc.cl.start(names=[killed], timeout=60)
        asyncio.run(fc.cl.wait_healthy(60))
        wait_node_state(fc.cl, "storage-0", "online")
        assert ledger.write(client, "/meta-after", random_bytes(5 * MiB, seed=56))
        ledger.verify(client)
    assert "/meta-big" in ledger.acked, "a leader fail-over must not fail a write (lease renewals ride through)"


#: How long every meta replica stays down in the whole-meta outage test:
#: long enough that gRPC's default reconnect backoff (1 s x1.6 per failed
#: attempt) would leave the daemons' channels idle for seconds after meta is
#: back - longer than the 3 s heartbeat timeout of these clusters.
OUTAGE = 12.0


@pytest.mark.timeout(150)
def test_nodes_stay_online_through_a_long_whole_meta_outage(healthy: FaultCluster) -> None:
    """Every meta replica SIGKILLed for 12 s, then restarted: the storage
    daemons, beating all along, must reach the new leader within its grace.
    Before, their channels' reconnect backoff kept them away for up to 6 s
    and the new leader marked every node offline at once: file groups went
    degraded and the KV pool's groups were re-planned, so every cached
    value was lost (docs/meta.md, "Data model", heartbeats)."""
    from tests.kv.pools import pool_served
    from tierfs.meta import MetaClient

    fc = healthy
    data = random_bytes(3 * MiB + 5, seed=57)
    value = random_bytes(20_000, seed=58)

    async def cluster_map() -> tuple[int, dict[int, int]]:
        async with MetaClient(fc.meta_addrs, deadline=10.0) as mc:
            m = await mc.get_cluster_map()
        return m.version, {n.node_id: n.state for n in m.nodes}

    with fc.client(request_timeout=5.0) as client:
        pool_served(client.config.meta, "default")
        client.write_bytes("/outage", data)
        client.kv.put("outage-key", value)
    version, nodes = asyncio.run(cluster_map())
    assert set(nodes.values()) == {1}, nodes  # NODE_STATE_ONLINE

    metas = [p.name for p in fc.cl.procs if p.kind == "meta"]
    for name in metas:
        fc.cl.kill(name)
    time.sleep(OUTAGE)  # the outage itself: the daemons' heartbeats fail meanwhile
    fc.cl.start(names=metas, timeout=60)
    asyncio.run(fc.cl.wait_healthy(60))
    elected = time.monotonic()  # at the latest
    # Past the new leader's grace (2 x 3 s) and one more timeout: nobody
    # may have gone offline, nothing re-planned.
    while time.monotonic() < elected + 10.0:
        now_version, now_nodes = asyncio.run(cluster_map())
        assert set(now_nodes.values()) == {1}, f"nodes marked offline after the outage: {now_nodes}"
        time.sleep(0.5)
    assert now_version == version, f"map moved {version} -> {now_version} though no node left"
    with fc.client(request_timeout=5.0) as client:
        assert client.read_bytes("/outage") == data
        assert client.kv.get("outage-key") == value
