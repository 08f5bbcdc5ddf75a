"""POSIX permissions end to end: MetaClient -> gRPC -> MetaServicer (its
real auth layer) -> state machine. Users made with AddUser call with their
own tokens, root with the admin token.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from meta_helpers import recs, register_async, run

from tierfs.errors import NotPermittedError, PermissionDeniedError
from tierfs.meta import (
    LocalReplicator,
    MetaClient,
    MetaStateMachine,
    add_meta_service,
)
from tierfs.meta.auth import Authenticator
from tierfs.meta.perms import NOBODY
from tierfs.security import Identity, admin_token

pytestmark = pytest.mark.timeout(30)

A = Identity("alice", 1001, 1001, (), False, "user")
B = Identity("bob", 1002, 1002, (), False, "user")
ZERO = Identity("zero", 0, 0, (), False, "user")


@contextlib.asynccontextmanager
async def with_tokens(*users: Identity, **opts: Any) -> AsyncIterator[tuple[MetaStateMachine, list[MetaClient]]]:
    """One server with the real auth layer; clients of the admin token and
    of each of ``users`` (made by AddUser, their tokens from its reply)."""
    secret = b"s" * 32
    sm = MetaStateMachine()
    server = grpc.aio.server()
    add_meta_service(server, LocalReplicator(sm), auth=Authenticator(secret), **opts)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    clients = [MetaClient([addr], deadline=5.0, token=admin_token(secret))]
    try:
        for u in users:
            tok = (await clients[0].add_user(u.name, u.uid, u.gid)).token
            clients.append(MetaClient([addr], deadline=5.0, token=tok))
        yield sm, clients
    finally:
        for c in clients:
            await c.close()
        await server.stop(None)


def test_two_users_over_grpc() -> None:
    """Users A and B with their own tokens, root with the admin token."""
    async def main() -> None:
        async with with_tokens(A, B) as (sm, (root, a, b)):
            await register_async(root)
            await root.mkdir("/home")
            await root.mkdir("/home/b", uid=B.uid, gid=B.gid)
            await root.mkdir("/tmp", mode=0o1777)
            # B's files carry B's identity, whatever the request says.
            f = await b.create("/home/b/secret", mode=0o600, uid=0, gid=0)
            assert (f.attr.uid, f.attr.gid) == (B.uid, B.gid)
            await b.mkdir("/home/b/priv", mode=0o700)
            await b.create("/tmp/bf")
            assert sm.may_read(B, f.attr.inode) and not sm.may_read(A, f.attr.inode)

            before = (await root.digest()).digest
            assert (await a.stat("/home/b/secret")).attr.mode == 0o600  # stat needs search only
            for refused in (a.open_write("/home/b/secret", owner="a"), a.truncate("/home/b/secret", 0),
                            a.rename("/home/b/secret", "/tmp/mine"), a.unlink("/home/b/secret"),
                            a.readdir("/home/b/priv"), a.stat("/home/b/priv/x"), a.create("/home/b/priv/x")):
                with pytest.raises(PermissionDeniedError) as exc:
                    await refused
                assert type(exc.value) is PermissionDeniedError and exc.value.errno == errno.EACCES
                assert "alice" in str(exc.value)
            # EPERM crosses the wire as EPERM: chmod of another's file,
            # unlink in a sticky directory.
            for refused in (a.setattr("/home/b/secret", mode=0o666), a.unlink("/tmp/bf")):
                with pytest.raises(NotPermittedError) as perm:
                    await refused
                assert perm.value.errno == errno.EPERM
            assert (await root.digest()).digest == before  # nothing changed

            # B itself, and root, may.
            await b.readdir("/home/b/priv")
            await b.setattr("/home/b/secret", mode=0o644)
            assert (await a.stat("/home/b/secret")).attr.mode == 0o644
            await root.unlink("/tmp/bf")

    run(main())


@pytest.mark.parametrize("squash_on", [True, False])
def test_root_squash_is_configurable(squash_on: bool) -> None:
    async def main() -> None:
        async with with_tokens(ZERO, root_squash=squash_on) as (sm, (root, zero)):
            await register_async(root)
            await root.mkdir("/tmp", mode=0o1777)
            secret = await root.create("/secret", mode=0o600)
            if squash_on:
                with pytest.raises(PermissionDeniedError, match="uid 65534"):
                    await zero.create("/x")
                with pytest.raises(PermissionDeniedError):
                    await zero.open_write("/secret")
                made = await zero.create("/tmp/z")
                assert (made.attr.uid, made.attr.gid) == (NOBODY, NOBODY)
            else:
                await zero.create("/x")
                await zero.open_write("/secret")
                assert sm.may_read(ZERO, secret.attr.inode)

    run(main())


def _raw(addr: str, token: str, method: str, req: Any, reply_cls: Any, client: str, rid: int) -> Any:
    """One call with a chosen (client id, request id): what an attacker
    who speaks gRPC, not MetaClient, sends."""
    from tierfs.errors import from_grpc
    from tierfs.meta.auth import bearer
    from tierfs.meta.wire import CLIENT_ID_KEY, REQUEST_ID_KEY

    with grpc.insecure_channel(addr) as ch:
        fn = ch.unary_unary(f"/tierfs.v1.MetaService/{method}", request_serializer=type(req).SerializeToString,
                            response_deserializer=reply_cls.FromString)
        try:
            return fn(req, timeout=5, metadata=(*bearer(token), (CLIENT_ID_KEY, client), (REQUEST_ID_KEY, str(rid))))
        except grpc.RpcError as exc:
            raise from_grpc(exc) from None


def test_a_repeated_request_id_grants_nothing() -> None:
    """The retry table answers a repeated (client id, request id) with the
    first reply. Before stop 46 it did so whatever the repeat asked, and the
    service then minted a write capability from the repeat's own fields:
    alice, reusing the id of her own abort for a RenewLease of bob's
    session, got a write capability for bob's file in his 0700 home (and
    with it could delete its fragments); reusing bob's (client id, request
    id) got her bob's OpenWrite reply and capability; reusing her own
    OpenWrite's id after bob took her access away got a fresh capability."""
    from tierfs.errors import InvalidArgumentError, SessionExpiredError
    from tierfs.proto.v1 import meta_pb2 as pb

    async def main() -> None:
        secret = b"s" * 32
        sm = MetaStateMachine()
        server = grpc.aio.server()
        add_meta_service(server, LocalReplicator(sm), auth=Authenticator(secret), cluster_secret=secret)
        addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        root = MetaClient([addr], deadline=5.0, token=admin_token(secret))
        try:
            tok_a = (await root.add_user(A.name, A.uid, A.gid)).token
            tok_b = (await root.add_user(B.name, B.uid, B.gid)).token
            await register_async(root)
            await root.mkdir("/home")
            await root.mkdir("/home/a", uid=A.uid, gid=A.gid)
            await root.mkdir("/home/b", mode=0o711, uid=B.uid, gid=B.gid)
            loop = asyncio.get_running_loop()

            def call(tok: str, method: str, req: Any, reply_cls: Any, client: str, rid: int) -> Any:
                return loop.run_in_executor(None, _raw, addr, tok, method, req, reply_cls, client, rid)

            loc = pb.Loc
            await call(tok_a, "Create", pb.CreateRequest(loc=loc(path="/home/a/mine")), pb.FileInfo, "ann", 1)
            await call(tok_b, "Create", pb.CreateRequest(loc=loc(path="/home/b/model.bin"), mode=0o600),
                       pb.FileInfo, "ben", 1)
            await call(tok_b, "Create", pb.CreateRequest(loc=loc(path="/home/b/shared"), mode=0o666),
                       pb.FileInfo, "ben", 2)
            # bob's writer, in progress
            ben = await call(tok_b, "OpenWrite", pb.OpenWriteRequest(loc=loc(path="/home/b/model.bin")),
                             pb.OpenWriteReply, "ben", 3)
            assert ben.write_capability
            # 1. alice's own open and abort under request id 99 ...
            mine = await call(tok_a, "OpenWrite", pb.OpenWriteRequest(loc=loc(path="/home/a/mine")),
                              pb.OpenWriteReply, "ann", 98)
            await call(tok_a, "AbortWrite", pb.AbortWriteRequest(session_id=mine.session_id), pb.Empty, "ann", 99)
            # ... then a RenewLease of bob's session under the same id: refused
            before = sm.digest()
            with pytest.raises(InvalidArgumentError, match="already used for another request"):
                await call(tok_a, "RenewLease", pb.RenewLeaseRequest(session_id=ben.session_id),
                           pb.RenewLeaseReply, "ann", 99)
            assert sm.digest() == before  # the refusal left no trace
            # 2. the same kind of op under the id of her own renewal: the
            # first reply, and no capability for a session she may not write
            mine = await call(tok_a, "OpenWrite", pb.OpenWriteRequest(loc=loc(path="/home/a/mine")),
                              pb.OpenWriteReply, "ann", 100)
            own = await call(tok_a, "RenewLease", pb.RenewLeaseRequest(session_id=mine.session_id),
                             pb.RenewLeaseReply, "ann", 101)
            assert own.write_capability
            again = await call(tok_a, "RenewLease", pb.RenewLeaseRequest(session_id=ben.session_id),
                               pb.RenewLeaseReply, "ann", 101)
            assert again.write_capability == b""
            with pytest.raises(PermissionDeniedError):
                await call(tok_a, "RenewLease", pb.RenewLeaseRequest(session_id=ben.session_id),
                           pb.RenewLeaseReply, "ann", 102)
            # 3. bob's client id and request id, from alice: refused
            with pytest.raises(InvalidArgumentError, match="already used for another request"):
                await call(tok_a, "OpenWrite", pb.OpenWriteRequest(loc=loc(path="/home/b/model.bin")),
                           pb.OpenWriteReply, "ben", 3)
            # a true retry (same caller, same op) gets the first reply and a capability
            retry = await call(tok_b, "OpenWrite", pb.OpenWriteRequest(loc=loc(path="/home/b/model.bin")),
                               pb.OpenWriteReply, "ben", 3)
            assert retry.session_id == ben.session_id and retry.write_capability
            # 4. alice opens bob's shared file while she may, ends that
            # session, bob takes write away: a retry of her open answers
            # as before, but mints no capability any more
            shared = await call(tok_a, "OpenWrite", pb.OpenWriteRequest(loc=loc(path="/home/b/shared")),
                                pb.OpenWriteReply, "ann", 500)
            assert shared.write_capability
            await call(tok_a, "AbortWrite", pb.AbortWriteRequest(session_id=shared.session_id), pb.Empty, "ann", 501)
            await call(tok_b, "SetAttr", pb.SetAttrRequest(loc=loc(path="/home/b/shared"), mode=0o600,
                                                          set_mode=True), pb.FileInfo, "ben", 4)
            with pytest.raises(SessionExpiredError, match="ended as it was opened"):  # (a reply without a
                await call(tok_a, "OpenWrite", pb.OpenWriteRequest(loc=loc(path="/home/b/shared")),  # capability
                           pb.OpenWriteReply, "ann", 500)  # until stop 47)
            with pytest.raises(PermissionDeniedError):
                await call(tok_a, "OpenWrite", pb.OpenWriteRequest(loc=loc(path="/home/b/shared")),
                           pb.OpenWriteReply, "ann", 502)
            # 5. the repair queue: a user sees how much is pending, not
            # which files' chunk keys (bob's, in his 0711 home)
            await root.abort_write(ben.session_id)
            s = await root.open_write("/home/b/model.bin", owner="t")
            await root.commit_write(s.session_id, 1 << 20, recs(s.data_version, [0], missing=(1,)))
            full = await root.list_repairs([])
            assert full.pending == 1 and [i.inode for i in full.items] == [ben.file.attr.inode]
            seen = await call(tok_a, "ListRepairs", pb.ListRepairsRequest(), pb.ListRepairsReply, "ann", 600)
            assert seen.pending == 1 and not seen.items
        finally:
            await root.close()
            await server.stop(None)

    run(main())
