"""Faults on the client's path to meta (gRPC), through TCP fault proxies in
front of every meta replica; Raft between the replicas and the storage
daemons' heartbeats are untouched.

Routing: each replica still binds 127.0.0.1:G, but advertises 127.0.0.2:G
(``--advertise-grpc-addr``, and the peers' ``--peer RAFT=GRPC``), so the
leader hints in NotLeader answers point at the proxies too; the client only
knows the proxies.

What it proves: metadata calls ride through added latency and connection
resets (retried on a new connection or another replica); with one
follower's gRPC path stalled the client moves on after one attempt timeout
and the write commits; with the leader's path stalled (the leader itself
healthy) a write fails with UnavailableError after the meta deadline and
leaves nothing behind, because followers answer NotLeader instead of
forwarding; when the paths are back everything acknowledged reads back
exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from tests.faults.harness import PROXY_HOST, FaultCluster, Ledger, MiB, random_bytes
from tests.faults.proxy import FaultProxy
from tierfs.local import LocalCluster

META = ("meta-0", "meta-1", "meta-2")


def _meta_behind_proxies(proxies: dict[str, FaultProxy]) -> Callable[[LocalCluster], None]:
    """A plan hook: every replica advertises 127.0.0.2:G, and a pass-through
    proxy listens there before anything starts (storage daemons follow the
    leader hints while they register)."""

    def hook(cl: LocalCluster) -> None:
        for m in META:
            grpc = cl.proc(m).addr
            host, _, port = grpc.rpartition(":")
            proxied = f"{PROXY_HOST}:{port}"
            for p in cl.procs:
                if p.kind == "meta":
                    p.argv = [a.replace(f"={grpc}", f"={proxied}") if a.startswith("--peer=") else a
                              for a in p.argv]
            cl.proc(m).argv.append(f"--advertise-grpc-addr={proxied}")
            proxies[m] = FaultProxy((PROXY_HOST, int(port)), (host, int(port)))

    return hook


@pytest.fixture(scope="module")
def fc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FaultCluster, dict[str, FaultProxy]]]:
    proxies: dict[str, FaultProxy] = {}
    try:
        c = FaultCluster(tmp_path_factory.mktemp("metaproxy"), plan_hook=_meta_behind_proxies(proxies))
        try:
            yield c, proxies
        finally:
            c.close()
    finally:
        for px in proxies.values():
            px.close()


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
        # Leader hints carry each replica's --advertise-grpc-addr: the proxies.
        assert client.aclient.meta.leader in addrs, client.aclient.meta.leader

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

        # 3a. one follower's gRPC path stalls: the client gives up on it after
        #     one attempt timeout and the write commits through the others
        lead = _leader(c)
        follower = next(m for m in META if m != lead)
        proxies[follower].set("stall")
        t0 = time.monotonic()
        ok = ledger.write(client, "/mp/d", random_bytes(2 * MiB, seed=4))
        took = time.monotonic() - t0
        proxies[follower].set("pass")
        print(f"\nmeta paths +50 ms: write+verify {slow:.2f}s; {follower} stalled: write "
              f"{'committed' if ok else 'failed: ' + ledger.errors[-1][:160]} after {took:.1f}s; "
              f"proxy connections {[(m, p.stats.accepted) for m, p in proxies.items()]}")
        assert ok, ledger.errors[-1]
        assert took < 8.0 * 3, took  # within the meta deadline of each of its calls
        assert slow > 0.1, "the delayed proxies were not on the client's path"
        # 3b. the leader's gRPC path stalls (Raft is fine: it stays leader).
        #     Followers do not forward mutations, so the write fails with a
        #     clear error once the meta deadline is spent, and leaves nothing.
        proxies[lead].set("stall")
        t0 = time.monotonic()
        ok = ledger.write(client, "/mp/e", random_bytes(MiB, seed=6))
        took = time.monotonic() - t0
        proxies[lead].set("pass")
        assert not ok and "UnavailableError" in ledger.errors[-1], ledger.errors[-1:]
        assert took < 8.0 * 4, took
        print(f"leader path stalled: write failed after {took:.1f}s: {ledger.errors[-1][:120]}")
        # 4. path back: the same path takes a write, everything exact, cluster healthy
        deadline = time.monotonic() + 30
        while not ledger.write(client, "/mp/d", random_bytes(2 * MiB, seed=5)):
            assert time.monotonic() < deadline, ledger.errors[-3:]
            time.sleep(0.3)
        ledger.verify(client)
    asyncio.run(c.cl.wait_healthy(30))
