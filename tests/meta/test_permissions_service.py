"""POSIX permissions end to end: MetaClient -> gRPC -> MetaServicer (its
real auth layer) -> state machine. Users made with AddUser call with their
own tokens, root with the admin token.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from meta_helpers import register_async, run

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
