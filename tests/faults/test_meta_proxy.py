"""Faults on the client's path to meta (gRPC), through TCP fault proxies in
front of every meta replica; Raft between the replicas and the storage
daemons' heartbeats are untouched.

Routing: each replica still binds 127.0.0.1:G, but the peers know its gRPC
address as 127.0.0.2:G (the ``--peer RAFT=GRPC`` flag), so the leader hints
in NotLeader answers point at the proxies too; the client only knows the
proxies.

What it proves: metadata calls ride through added latency and connection
resets (retried on a new connection or another replica); with the gRPC
paths to the leader and one follower stalled (the leader itself healthy) the
client moves to the last replica after one attempt timeout per call and the
write commits (a follower hands mutations to the leader over Raft); when the
paths are back everything acknowledged reads back exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.faults.harness import PROXY_HOST, FaultCluster, Ledger, MiB, random_bytes
from tests.faults.proxy import FaultProxy
from tierfs.local import LocalCluster

META = ("meta-0", "meta-1", "meta-2")


def _advertise_meta_via_proxy(cl: LocalCluster) -> None:
    for m in META:
        grpc = cl.proc(m).addr
        proxied = f"{PROXY_HOST}:{grpc.rpartition(':')[2]}"
        for p in cl.procs:
            if p.kind == "meta":
                p.argv = [a.replace(f"={grpc}", f"={proxied}") if a.startswith("--peer=") else a for a in p.argv]


@pytest.fixture(scope="module")
def fc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FaultCluster, dict[str, FaultProxy]]]:
    c = FaultCluster(tmp_path_factory.mktemp("metaproxy"), plan_hook=_advertise_meta_via_proxy)
    proxies: dict[str, FaultProxy] = {}
    try:
        for m in META:
            host, _, port = c.cl.proc(m).addr.rpartition(":")
            proxies[m] = FaultProxy((PROXY_HOST, int(port)), (host, int(port)))
        yield c, proxies
    finally:
        for px in proxies.values():
            px.close()
        c.close()


def _leader(fc: FaultCluster) -> str:
    h = asyncio.run(fc.cl.health(deadline=8.0))
    return next(str(m["name"]) for m in h["meta"] if m["role"] == "leader")


@pytest.mark.timeout(150)
def test_meta_path_delay_reset_and_stalled_leader(fc: tuple[FaultCluster, dict[str, FaultProxy]]) -> None:
    c, proxies = fc
    addrs = [f"{PROXY_HOST}:{c.cl.proc(m).addr.rpartition(':')[2]}" for m in META]
    ledger = Ledger()
    from tierfs.client import Client

    with Client(addrs, request_timeout=2.0, meta_deadline=8.0, meta_attempt_timeout=1.5) as client:
        client.mkdir("/mp")
        client.set_layout("/mp", chunk_size=MiB)
        assert ledger.write(client, "/mp/a", random_bytes(3 * MiB, seed=1))
        if client.aclient.meta.leader not in addrs:
            # Replicas register their own --grpc-addr in the replicated state and
            # NotLeader hints carry it, so the client walked around the proxies.
            pytest.skip(f"the client follows leader hints to {client.aclient.meta.leader}, past the proxies: "
                        "tierfs-meta has no option to advertise a gRPC address other than the one it binds")

        # 1. latency on every meta path: slower, never wrong
        for px in proxies.values():
            px.set("delay", delay=0.05)
        t0 = time.monotonic()
        assert ledger.write(client, "/mp/b", random_bytes(2 * MiB + 5, seed=2))
        ledger.verify(client)
        slow = time.monotonic() - t0

        # 2. every open meta connection reset, then passing again: calls reconnect
        for px in proxies.values():
            px.set("pass")
            px.reset_all()
        assert ledger.write(client, "/mp/c", random_bytes(MiB, seed=3))
        ledger.verify(client)

        # 3. the leader's gRPC path and one follower's stall (Raft is fine: the
        #    leader stays leader): the client gives up on each after one attempt
        #    timeout and lands on the last replica, which forwards the mutations
        lead = _leader(c)
        stalled = [lead, next(m for m in META if m != lead)]
        for m in stalled:
            proxies[m].set("stall")
        t0 = time.monotonic()
        ok = ledger.write(client, "/mp/d", random_bytes(2 * MiB, seed=4))
        took = time.monotonic() - t0
        for m in stalled:
            proxies[m].set("pass")
        print(f"\nmeta paths +50 ms: write+verify {slow:.2f}s; {stalled} stalled (leader first): write "
              f"{'committed' if ok else 'failed: ' + ledger.errors[-1][:160]} after {took:.1f}s; "
              f"proxy connections {[(m, p.stats.accepted) for m, p in proxies.items()]}")
        assert ok, ledger.errors[-1]
        assert took < 8.0 * 3, took  # within the meta deadline of each of its calls
        assert slow > 0.1, "the delayed proxies were not on the client's path"
        # 4. path back: the same path takes a write, everything exact, cluster healthy
        deadline = time.monotonic() + 30
        while not ledger.write(client, "/mp/d", random_bytes(2 * MiB, seed=5)):
            assert time.monotonic() < deadline, ledger.errors[-3:]
            time.sleep(0.3)
        ledger.verify(client)
    asyncio.run(c.cl.wait_healthy(30))
