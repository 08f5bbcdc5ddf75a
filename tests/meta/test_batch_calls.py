"""Batched mutations: concurrent namespace mutations of one MetaClient travel
in one ``Batch`` call, each with its own request id, result and error,
applied in order (docs/meta.md, "Batched mutations"). Against a real
3-replica meta service."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from cluster import MetaCluster

from tierfs.errors import (
    AlreadyExistsError,
    DirectoryNotEmptyError,
    InvalidArgumentError,
    NameTooLongError,
    NotFoundError,
    PermissionDeniedError,
    TierFSError,
    error_from_code,
    from_grpc,
)
from tierfs.meta import MetaClient
from tierfs.meta.auth import bearer
from tierfs.meta.ops import MAX_BATCH_ITEMS
from tierfs.meta.service import CLIENT_ID_KEY
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.proto.v1 import meta_pb2_grpc

pytestmark = pytest.mark.timeout(180)


def _item(rid: int, **op: object) -> pb.BatchItem:
    return pb.BatchItem(request_id=rid, **op)  # type: ignore[arg-type]


def _outcome(res: pb.MetaResult) -> TierFSError | bytes:
    if res.error.code:
        return error_from_code(res.error.code, res.error.message, leader=res.error.leader)
    return res.reply


async def _batch(addr: str, req: pb.BatchRequest, client: str = "batch-test") -> list[TierFSError | bytes]:
    async with grpc.aio.insecure_channel(addr) as ch:
        md = (*bearer(os.environ.get("TIERFS_TOKEN", "")), (CLIENT_ID_KEY, client))
        try:
            reply = await meta_pb2_grpc.MetaServiceStub(ch).Batch(req, metadata=md, timeout=30.0)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from None
    assert len(reply.results) == len(req.items)
    return [_outcome(r) for r in reply.results]


def test_concurrent_mutations_of_one_client_travel_together(meta_cluster: MetaCluster) -> None:
    n = 40

    async def main() -> None:
        async with MetaClient(meta_cluster.addresses, deadline=30.0) as mc:
            await mc.mkdir("/c")
            out = await asyncio.gather(*(mc.mkdir(f"/c/d{i}") for i in range(n)), mc.mkdir("/c/d3"),
                                       mc.symlink("/c/s", "/c/d0"), mc.unlink("/c/missing"),
                                       return_exceptions=True)
            assert mc.batch_calls > 0 and mc.batched_ops >= n // 2, (mc.batch_calls, mc.batched_ops)
            infos = out[:n]
            assert all(isinstance(x, pb.FileInfo) for x in infos), infos
            # each op its own result...
            assert len({x.attr.inode for x in infos if isinstance(x, pb.FileInfo)}) == n
            # ... and its own error, the one its call alone gives
            assert isinstance(out[n], AlreadyExistsError)
            assert isinstance(out[n + 1], pb.FileInfo)
            assert isinstance(out[n + 2], NotFoundError)
            for i, x in enumerate(infos):
                assert isinstance(x, pb.FileInfo)
                assert (await mc.stat(f"/c/d{i}")).attr.inode == x.attr.inode
            # the mutations in Batch calls then run one at a time again
            await mc.rmdir("/c/d1")
            await mc.rename("/c/d2", "/c/e2")
            with pytest.raises(NotFoundError):
                await mc.stat("/c/d2")

    asyncio.run(main())
    meta_cluster.wait_converged()


def test_batch_items_in_order_each_with_its_own_error_and_request_id(meta_cluster: MetaCluster) -> None:
    leader = meta_cluster.addresses[meta_cluster.wait_leader()]
    req = pb.BatchRequest(items=[
        _item(1, mkdir=pb.MkdirRequest(loc=pb.Loc(path="/o"))),
        _item(2, mkdir=pb.MkdirRequest(loc=pb.Loc(path="/o/p"))),
        _item(3, rmdir=pb.RmdirRequest(loc=pb.Loc(path="/o"))),  # not empty: applied after /o/p
        _item(4, rename=pb.RenameRequest(src=pb.Loc(path="/o/p"), dst=pb.Loc(path="/o/q"))),
        _item(5, symlink=pb.SymlinkRequest(loc=pb.Loc(path="/o/s"), target="/o/q")),
        _item(6, unlink=pb.UnlinkRequest(loc=pb.Loc(path="/o/none"))),
        _item(7),  # no op at all
        _item(8, mkdir=pb.MkdirRequest(loc=pb.Loc(path="/o/" + "n" * 300))),  # over a cap: fails alone
        _item(9, mkdir=pb.MkdirRequest(loc=pb.Loc(path="/o/last"))),
    ])

    first = asyncio.run(_batch(leader, req))
    assert isinstance(first[0], bytes) and isinstance(first[1], bytes)
    assert isinstance(first[2], DirectoryNotEmptyError)
    assert first[3] == pb.Empty().SerializeToString()
    assert isinstance(first[4], bytes)
    assert isinstance(first[5], NotFoundError)
    assert isinstance(first[6], InvalidArgumentError)
    assert isinstance(first[7], NameTooLongError)
    assert isinstance(first[8], bytes)
    made = pb.FileInfo.FromString(first[1]).attr.inode

    # The same call again (a retry: same client, same request ids): the ops
    # that succeeded answer with their first result, nothing is applied twice.
    again = asyncio.run(_batch(leader, req))
    for i in (0, 1, 4, 8):
        assert again[i] == first[i], i
    assert pb.FileInfo.FromString(again[1]).attr.inode == made

    # A new request id is a new op: /o/p was renamed, so this one makes a new /o/p.
    fresh = asyncio.run(_batch(leader, pb.BatchRequest(items=[_item(10, mkdir=pb.MkdirRequest(
        loc=pb.Loc(path="/o/p")))])))
    assert isinstance(fresh[0], bytes) and pb.FileInfo.FromString(fresh[0]).attr.inode != made

    # Over the item cap: the whole call is refused and nothing is applied.
    over = pb.BatchRequest(items=[_item(100 + i, mkdir=pb.MkdirRequest(loc=pb.Loc(path=f"/o/x{i}")))
                                  for i in range(MAX_BATCH_ITEMS + 1)])
    with pytest.raises(InvalidArgumentError):
        asyncio.run(_batch(leader, over))

    # Through a follower: forwarded to the leader like any leader call.
    follower = next(a for a in meta_cluster.addresses if a != leader)
    via = asyncio.run(_batch(follower, pb.BatchRequest(items=[
        _item(11, mkdir=pb.MkdirRequest(loc=pb.Loc(path="/o/via"))),
        _item(12, mkdir=pb.MkdirRequest(loc=pb.Loc(path="/o/via")))])))
    assert isinstance(via[0], bytes) and isinstance(via[1], AlreadyExistsError)
    meta_cluster.wait_converged()

    async def check() -> None:
        async with MetaClient(meta_cluster.addresses, deadline=30.0) as mc:
            names = sorted(e.name for e in (await mc.readdir("/o")).entries)
            assert names == ["last", "p", "q", "s", "via"]

    asyncio.run(check())


def test_batch_items_run_as_the_caller(meta_cluster: MetaCluster) -> None:
    """Permissions are checked per item, as the caller, as for a call of
    its own: one refused item fails alone and changes nothing."""
    if not os.environ.get("TIERFS_TOKEN"):
        pytest.skip("needs the cluster's authentication (TIERFS_TOKEN)")

    async def main() -> None:
        async with MetaClient(meta_cluster.addresses, deadline=30.0) as root:
            tok = (await root.add_user("batchuser", 2001, 2001)).token
            await root.mkdir("/mine", uid=2001, gid=2001)
            await root.mkdir("/theirs", mode=0o755)
            async with MetaClient(meta_cluster.addresses, deadline=30.0, token=tok) as user:
                out = await asyncio.gather(*(user.mkdir(f"/mine/d{i}") for i in range(8)),
                                           user.mkdir("/theirs/x"), user.mkdir("/mine/d8"),
                                           return_exceptions=True)
                assert user.batch_calls > 0
                assert all(isinstance(x, pb.FileInfo) and x.attr.uid == 2001 for x in out[:8]), out
                assert isinstance(out[8], PermissionDeniedError)
                assert isinstance(out[9], pb.FileInfo)
            with pytest.raises(NotFoundError):
                await root.stat("/theirs/x")

    asyncio.run(main())


def test_a_full_batch_retried_is_answered_not_applied_again(meta_cluster: MetaCluster) -> None:
    """A Batch of MAX_BATCH_ITEMS renames sent twice (its reply lost, the
    client retries with the same request ids): every item of the second
    call answers with its first result. Until stop 47 meta kept a client's
    last 128 results, so the second call applied the first 128 renames
    again ("no such file" for renames that had taken effect)."""
    leader = meta_cluster.addresses[meta_cluster.wait_leader()]
    n = MAX_BATCH_ITEMS
    made = asyncio.run(_batch(leader, pb.BatchRequest(items=[_item(1, mkdir=pb.MkdirRequest(loc=pb.Loc(path="/full")))]
                                                      + [_item(2 + i, mkdir=pb.MkdirRequest(
                                                          loc=pb.Loc(path=f"/full/f{i}")))
                                                         for i in range(n - 1)]), client="full-batch"))
    assert all(isinstance(x, bytes) for x in made), [x for x in made if not isinstance(x, bytes)][:3]
    req = pb.BatchRequest(items=[_item(1000 + i, rename=pb.RenameRequest(src=pb.Loc(path=f"/full/f{i}"),
                                                                          dst=pb.Loc(path=f"/full/g{i}")))
                                 for i in range(n - 1)])
    first = asyncio.run(_batch(leader, req, client="full-batch"))
    again = asyncio.run(_batch(leader, req, client="full-batch"))
    assert all(isinstance(x, bytes) for x in first), [x for x in first if not isinstance(x, bytes)][:3]
    bad = [(i, x) for i, x in enumerate(again) if x != first[i]]
    assert not bad, f"{len(bad)} of {n - 1} retried items were not answered from the table, e.g. {bad[:2]}"


def test_a_client_keeps_its_request_ids_in_flight_within_the_spread(meta_cluster: MetaCluster,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """MetaClient takes a new request id only within REQUEST_SPREAD of the
    oldest still in flight (meta keeps twice as many results per client),
    whether the mutation goes alone or in a Batch; all complete, none waits
    for ever. The spread is made small here to see it bind."""
    import tierfs.meta.client as client_mod

    monkeypatch.setattr(client_mod, "REQUEST_SPREAD", 16)
    widest = 0

    async def main() -> None:
        nonlocal widest
        async with MetaClient(meta_cluster.addresses, deadline=30.0) as mc:
            take = mc._new_rid

            async def watched() -> int:
                nonlocal widest
                rid = await take()
                widest = max(widest, rid - next(iter(mc._rids)))
                return rid

            mc._new_rid = watched  # type: ignore[method-assign]
            await mc.mkdir("/spread")
            out = await asyncio.wait_for(asyncio.gather(*(mc.mkdir(f"/spread/d{i}") for i in range(200))), 60)
            assert len({x.attr.inode for x in out}) == 200
            assert mc.batch_calls > 0
            assert not mc._rids

    asyncio.run(main())
    assert 0 < widest < 16, widest


def test_status_of_a_cluster_without_storage_is_not_healthy(meta_cluster: MetaCluster) -> None:
    """Meta up, no storage node registered: nothing can be stored, and
    `tierfs status` says so (it said "healthy" until stop 47)."""
    from tests.cluster import meta_cluster_from_env
    from tierfs.cli.cluster import cluster_status
    from tierfs.cli.main import render_status

    if meta_cluster_from_env() is not None:
        pytest.skip("needs a meta cluster of its own (no storage registered)")
    meta_cluster.wait_leader()
    st = asyncio.run(cluster_status(meta_cluster.addresses))
    assert st["storage"] == [] and not st["healthy"], st
    text = render_status(st)
    assert text.startswith("cluster: DEGRADED") and "no storage node has registered" in text, text


def test_status_says_why_a_replica_did_not_answer(meta_cluster: MetaCluster, tmp_path: Path) -> None:
    """A replica up with another cluster secret refuses our token: the META
    table says `refused` and why, under it (it said `unreachable` alone
    until stop 47, the cause only in a direct call)."""
    import json
    import subprocess
    import sys

    from tests.cluster import meta_cluster_from_env
    from tierfs.cli.cluster import cluster_status
    from tierfs.cli.main import render_status
    from tierfs.local import free_ports
    from tierfs.meta.secret import ensure_secret_file

    if meta_cluster_from_env() is not None:
        pytest.skip("starts a replica of its own")
    raft, grpc_port = free_ports(2)
    cmd = [sys.executable, "-m", "tierfs.meta.daemon", "--raft-addr", f"127.0.0.1:{raft}",
           "--grpc-addr", f"127.0.0.1:{grpc_port}", "--data-dir", str(tmp_path / "odd"),
           "--cluster-secret-file", str(ensure_secret_file(tmp_path / "other.secret"))]
    repo = Path(__file__).resolve().parents[2]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=repo,
                          env=dict(os.environ, PYTHONPATH=str(repo))) as p:
        try:
            assert p.stdout is not None
            odd = json.loads(p.stdout.readline())["grpc"]
            meta_cluster.wait_leader()
            st = asyncio.run(cluster_status([*meta_cluster.addresses, odd]))
            row = next(m for m in st["meta"] if m["addr"] == odd)
            assert row["state"] == "refused" and "invalid admin token" in row["error"], row
            text = render_status(st)
            assert f"  {odd}: " in text and "invalid admin token" in text, text
        finally:
            p.kill()
