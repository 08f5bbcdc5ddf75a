"""Linearizable reads: followers forward them to the leader (and name it),
and a deposed leader that does not know it yet (SIGSTOPped while the others elected a new one) never
answers with stale state."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from pathlib import Path

import grpc
import pytest

from tests.cluster import MetaCluster, auth_channel, kv_get, kv_put, meta_cluster_from_env, wait_for
from tierfs.errors import NotFoundError, NotLeaderError, TierFSError, from_grpc
from tierfs.meta import MetaClient
from tierfs.meta.service import LEADER_KEY
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.proto.v1 import meta_pb2_grpc


@pytest.mark.timeout(120)
def test_follower_forwards_linearizable_read(meta_cluster: MetaCluster) -> None:
    """Runs against TIERFS_TEST_META too (nothing is killed)."""
    c = meta_cluster

    async def make() -> None:
        async with MetaClient(c.addresses, deadline=20.0) as mc:
            await mc.mkdir("/read-me")

    asyncio.run(make())
    leader = c.wait_leader()
    follower = next(i for i in c.live() if i != leader)
    # The mkdir needed only one follower: this one may not have heard from the leader yet.
    wait_for(lambda: c.status(follower).leader == c.addresses[leader], 20, "the follower to know the leader")
    with auth_channel(c.addresses[follower]) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        # The leader answers (after its read barrier); the follower passes
        # the reply on and names the leader in the trailing metadata.
        info, call = stub.Stat.with_call(pb.StatRequest(loc=pb.Loc(path="/read-me")), timeout=10)
        assert info.attr.type == pb.INODE_TYPE_DIRECTORY
        assert (LEADER_KEY, c.addresses[leader]) in tuple(call.trailing_metadata() or ())
        # An error of the leader comes back as it is.
        with pytest.raises(grpc.RpcError) as ei:
            stub.Stat(pb.StatRequest(loc=pb.Loc(path="/not-there")), timeout=10)
    assert isinstance(from_grpc(ei.value), NotFoundError)


@pytest.mark.timeout(120)
def test_deposed_leader_never_serves_a_stale_read(tmp_path: Path) -> None:
    if meta_cluster_from_env() is not None:
        pytest.skip("stops replicas: needs a local cluster")
    with MetaCluster(tmp_path, n=3) as c:
        c.put("x", "old")
        old = c.wait_leader()
        proc = c.replicas[old].proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: any(c.status(i).role == "leader" for i in c.live() if i != old),
                     20, "a new leader")
            wait_for(lambda: _put_avoiding(c, old, "x", "new"), 30, "put on the new leader")
            # Ask the frozen old leader; it sees the request only once resumed,
            # while it still believes it leads.
            answer: list[object] = []

            def ask() -> None:
                try:
                    answer.append(kv_get(c.addresses[old], ["x"], timeout=15)["x"])
                except TierFSError as err:
                    answer.append(err)

            t = threading.Thread(target=ask)
            t.start()
            # (if it times out the request is still queued client-side: same outcome)
            with contextlib.suppress(TimeoutError):
                wait_for(lambda: _has_conn(c, old), 5, "request to reach the frozen replica", interval=0.05)
        finally:
            proc.send_signal(signal.SIGCONT)
        t.join(30)
        assert answer, "no answer"
        got = answer[0]
        # Either it finds out it is no longer leader, or it answers the new value: never "old".
        assert got == "new" or isinstance(got, TierFSError), got
        if isinstance(got, TierFSError):
            print(f"deposed leader answered {type(got).__name__}: {got}")
        c.wait_converged(30)
        assert c.get("x") == "new"


def _put_avoiding(c: MetaCluster, frozen: int, key: str, value: str) -> bool:
    for i in c.live():
        if i == frozen:
            continue
        try:
            kv_put(c.addresses[i], key, value)
            return True
        except TierFSError:
            continue
    return False


def _has_conn(c: MetaCluster, i: int) -> bool:
    # Established TCP connections to the replica's gRPC port (from /proc).
    port = int(c.addresses[i].rsplit(":", 1)[1])
    with open("/proc/net/tcp") as f:
        lines = f.readlines()[1:]
    hexport = f"{port:04X}"
    return any(line.split()[1].endswith(":" + hexport) and line.split()[3] == "01" for line in lines)


@pytest.mark.timeout(120)
def test_leader_grpc_address_is_replicated_when_not_configured(tmp_path: Path) -> None:
    if meta_cluster_from_env() is not None:
        pytest.skip("starts its own replicas")
    with MetaCluster(tmp_path, n=3, peer_grpc=False) as c:
        leader = c.wait_leader()
        followers = [i for i in range(3) if i != leader]
        for f in followers:
            wait_for(lambda f=f: c.status(f).leader == c.addresses[leader], 20, "leader address on follower")
        with pytest.raises(NotLeaderError) as ei:
            kv_put(c.addresses[followers[0]], "a", "")
        assert ei.value.leader == c.addresses[leader]
        # ... and survives a new election (the new leader registers itself)
        c.kill(leader)
        new = c.wait_leader()
        other = next(i for i in followers if i != new)
        wait_for(lambda: c.status(other).leader == c.addresses[new], 20, "new leader address")
