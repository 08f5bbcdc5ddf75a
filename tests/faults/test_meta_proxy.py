"""Faults on the client's path to meta (gRPC), through TCP fault proxies in
front of every meta replica; Raft between the replicas, the replicas' own
gRPC calls to each other (a follower forwarding to the leader) and the
storage daemons' heartbeats are untouched.

Routing: each replica still binds 127.0.0.1:G, but advertises 127.0.0.2:G
(``--advertise-grpc-addr``), so the leader hints (NotLeader answers, the
leader named by a forwarded reply) point at the proxies too; the client only
knows the proxies. The replicas' ``--peer RAFT=GRPC`` keep the direct
address: that is the replica-to-replica path a follower forwards on.

What it proves: metadata calls ride through added latency and connection
resets (retried on a new connection or another replica); with one
follower's gRPC path stalled the client moves on after one attempt timeout
and the write commits; with the leader's path stalled (the leader itself
healthy) the client gives up on it after one attempt timeout and a follower
forwards the write; a client that can reach only one follower does
everything (mkdir, create, write, read, rename), also across a SIGKILL of
the leader, and prefers the leader when it can reach it; a forwarded
request retried is not applied twice; when the paths are back everything
acknowledged reads back exactly.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from tests.faults.harness import PROXY_HOST, FaultCluster, Ledger, MiB, random_bytes
from tests.faults.proxy import FaultProxy
from tierfs.errors import AlreadyExistsError, from_grpc
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.meta.auth import bearer
from tierfs.meta.service import CLIENT_ID_KEY, REQUEST_ID_KEY
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.proto.v1 import meta_pb2_grpc

META = ("meta-0", "meta-1", "meta-2")


def _meta_behind_proxies(proxies: dict[str, FaultProxy]) -> Callable[[LocalCluster], None]:
    """A plan hook: every replica advertises 127.0.0.2:G, and a pass-through
    proxy listens there before anything starts (storage daemons follow the
    leader hints while they register)."""

    def hook(cl: LocalCluster) -> None:
        for m in META:
            grpc = cl.proc(m).addr
            host, _, port = grpc.rpartition(":")
            cl.proc(m).argv.append(f"--advertise-grpc-addr={PROXY_HOST}:{port}")
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
        #     The client gives up on it after one attempt timeout; a follower
        #     forwards the calls to the leader, and the write commits.
        proxies[lead].set("stall")
        t0 = time.monotonic()
        ok = ledger.write(client, "/mp/e", random_bytes(MiB, seed=6))
        took = time.monotonic() - t0
        proxies[lead].set("pass")
        assert ok, ledger.errors[-1:]
        assert took < 8.0 * 3, took
        print(f"leader path stalled: write committed through a follower after {took:.1f}s")
        # 4. path back: the same path takes a write, everything exact, cluster healthy
        deadline = time.monotonic() + 30
        while not ledger.write(client, "/mp/d", random_bytes(2 * MiB, seed=5)):
            assert time.monotonic() < deadline, ledger.errors[-3:]
            time.sleep(0.3)
        ledger.verify(client)
    asyncio.run(c.cl.wait_healthy(30))


def _proxied(c: FaultCluster) -> dict[str, str]:
    return {m: f"{PROXY_HOST}:{c.cl.proc(m).addr.rpartition(':')[2]}" for m in META}


@pytest.mark.timeout(150)
def test_client_that_reaches_only_a_follower(fc: tuple[FaultCluster, dict[str, FaultProxy]]) -> None:
    c, proxies = fc
    px = _proxied(c)
    lead = _leader(c)
    follower = next(m for m in META if m != lead)

    # All paths open: a client told of the follower first is sent on to the
    # leader by the first reply the follower forwarded.
    async def first_leader() -> str:
        async with MetaClient([px[follower], *(px[m] for m in META if m != follower)], deadline=8.0) as mc:
            await mc.stat("/")
            return mc.leader

    assert asyncio.run(first_leader()) == px[lead]

    # Now only the follower is reachable for the client (the others' client
    # paths reset every connection); the replicas reach each other directly.
    for m in META:
        if m != follower:
            proxies[m].set("reset")
    ledger = Ledger()
    from tierfs.client import Client

    try:
        with Client([px[follower]], request_timeout=2.0, meta_deadline=10.0, meta_attempt_timeout=1.5) as client:
            client.mkdir("/solo")
            client.set_layout("/solo", chunk_size=MiB)
            assert ledger.write(client, "/solo/a", random_bytes(2 * MiB + 3, seed=11)), ledger.errors[-1:]
            client.rename("/solo/a", "/solo/b")
            ledger.acked["/solo/b"] = ledger.acked.pop("/solo/a")
            ledger.deleted.add("/solo/a")
            ledger.verify(client)
            assert client.aclient.meta.leader == px[follower]

            # The leader dies; whoever leads next, the follower's path still works.
            c.cl.kill(lead)
            t0 = time.monotonic()
            while not ledger.write(client, "/solo/c", random_bytes(MiB + 7, seed=12)):
                assert time.monotonic() - t0 < 40, ledger.errors[-3:]
            took = time.monotonic() - t0
            client.mkdir("/solo/d")
            client.rename("/solo/c", "/solo/d/c")
            ledger.acked["/solo/d/c"] = ledger.acked.pop("/solo/c")
            ledger.deleted.add("/solo/c")
            ledger.verify(client)
            new = _leader(c)
            print(f"\nonly {follower} reachable: leader {lead} killed, {new} leads "
                  f"({'directly' if new == follower else 'forwarded'}); first write after the kill took {took:.2f}s")
    finally:
        for p in proxies.values():
            p.set("pass")
        c.cl.start(names=[lead])
    asyncio.run(c.cl.wait_healthy(60))


@pytest.mark.timeout(60)
def test_forwarded_request_is_applied_once(fc: tuple[FaultCluster, dict[str, FaultProxy]]) -> None:
    """A call forwarded by a follower and then retried (its reply lost),
    through the follower again or at the leader, gets the first answer."""
    c, _ = fc
    lead = _leader(c)
    follower = next(m for m in META if m != lead)
    md = (*bearer(os.environ.get("TIERFS_TOKEN")), (CLIENT_ID_KEY, "dedup-test"), (REQUEST_ID_KEY, "7"))
    req = pb.MkdirRequest(loc=pb.Loc(path="/once"), mode=0o755)
    got = []
    for m in (follower, follower, lead):
        with grpc.insecure_channel(c.cl.proc(m).addr) as ch:
            got.append(meta_pb2_grpc.MetaServiceStub(ch).Mkdir(req, metadata=md, timeout=10).attr.inode)
    assert got[0] and got == [got[0]] * 3, got
    # A new request id is a new request: the directory exists by then.
    with grpc.insecure_channel(c.cl.proc(follower).addr) as ch, pytest.raises(grpc.RpcError) as ei:
        meta_pb2_grpc.MetaServiceStub(ch).Mkdir(req, metadata=(*md[:-1], (REQUEST_ID_KEY, "8")), timeout=10)
    assert isinstance(from_grpc(ei.value), AlreadyExistsError)
