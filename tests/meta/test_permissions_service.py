"""POSIX permissions end to end: MetaClient -> gRPC -> MetaServicer ->
state machine.

test_two_users_over_grpc runs the real auth layer: users A and B made with
AddUser call with their own tokens, root with the admin token. The root
squash test needs a non-admin identity with uid 0, which AddUser refuses to
make (tierfs.meta.users), so it uses a stand-in layer (:class:`AsIdentity`,
a server interceptor) on servers with auth off, where the servicer takes the
identity the context holds: three servers share one replicator (one state).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from meta_helpers import register_async, run

from tierfs.errors import NotPermittedError, PermissionDeniedError
from tierfs.meta import (
    LocalReplicator,
    MetaClient,
    MetaServicer,
    MetaStateMachine,
    add_meta_service,
)
from tierfs.meta.auth import Authenticator
from tierfs.meta.perms import NOBODY
from tierfs.security import ANONYMOUS, Identity, admin_token, current_identity

pytestmark = pytest.mark.timeout(30)

A = Identity("alice", 1001, 1001, (), False, "user")
B = Identity("bob", 1002, 1002, (), False, "user")
ZERO = Identity("zero", 0, 0, (), False, "user")


class AsIdentity(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Runs every handler of the server with ``current_identity`` = ``ident``."""

    def __init__(self, ident: Identity) -> None:
        self.ident = ident

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner, ident = handler.unary_unary, self.ident

        async def call(request: Any, context: Any) -> Any:
            token = current_identity.set(ident)
            try:
                return await inner(request, context)
            finally:
                current_identity.reset(token)

        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


@contextlib.asynccontextmanager
async def servers(*idents: Identity, **opts: Any) -> AsyncIterator[tuple[MetaStateMachine, list[MetaClient],
                                                                         list[MetaServicer]]]:
    """One server per identity over one shared state; a client of each."""
    sm = MetaStateMachine()
    rep = LocalReplicator(sm)
    started: list[grpc.aio.Server] = []
    clients: list[MetaClient] = []
    svcs: list[MetaServicer] = []
    try:
        for ident in idents:
            server = grpc.aio.server(interceptors=[AsIdentity(ident)])
            svcs.append(add_meta_service(server, rep, **opts))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            started.append(server)
            clients.append(MetaClient([f"127.0.0.1:{port}"], deadline=5.0))
        yield sm, clients, svcs
    finally:
        for c in clients:
            await c.close()
        for s in started:
            await s.stop(None)


@contextlib.asynccontextmanager
async def with_tokens() -> AsyncIterator[tuple[MetaStateMachine, list[MetaClient]]]:
    """One server with the real auth layer; clients of the admin token and
    of users A and B (made by AddUser, their tokens from its reply)."""
    secret = b"s" * 32
    sm = MetaStateMachine()
    server = grpc.aio.server()
    add_meta_service(server, LocalReplicator(sm), auth=Authenticator(secret))
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    clients = [MetaClient([addr], deadline=5.0, token=admin_token(secret))]
    try:
        for u in (A, B):
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
        async with with_tokens() as (sm, (root, a, b)):
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
        async with servers(ANONYMOUS, ZERO, root_squash=squash_on) as (sm, (root, zero), (_, zsvc)):
            await register_async(root)
            await root.mkdir("/tmp", mode=0o1777)
            secret = await root.create("/secret", mode=0o600)
            assert zsvc.root_squash is squash_on
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
