"""The storage daemon's control service (gRPC ``StorageControl``).

Operators and the admin CLI reach a node here, at the ``control_addr`` it
registers with meta: ``Scrub`` runs one scrub pass now and returns its
report; ``RepairStatus`` tells how far this node's rebuilds and its
repair-queue worker have come. Bytes
never travel here; that is the data plane's job.

``Scrub`` is an admin operation. The daemon holds only the node key, so it
asks meta who the caller's token stands for (``MetaService.WhoAmI`` with the
caller's own ``authorization`` metadata) and refuses anyone but an admin;
with meta's authentication off meta answers "anonymous admin" and every
caller may scrub. ``RepairStatus`` (read-only progress) is open.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tierfs.errors import PermissionDeniedError, UnauthenticatedError, grpc_errors
from tierfs.meta.auth import token_from_metadata
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.proto.v1 import storage_control_pb2 as spb
from tierfs.proto.v1 import storage_control_pb2_grpc as spb_grpc
from tierfs.storage.repair import Repairer
from tierfs.storage.scrub import Scrubber
from tierfs.tls import TlsFiles

__all__ = ["ControlServer", "start_control"]

Ctx = grpc.aio.ServicerContext[Any, Any]


WhoAmI = Callable[[str | None], Awaitable[pb.Caller]]


class _Servicer(spb_grpc.StorageControlServicer):
    def __init__(self, scrubber: Scrubber, repairer: Repairer, whoami: WhoAmI | None) -> None:
        self.scrubber = scrubber
        self.repairer = repairer
        self.whoami = whoami

    async def _admin(self, what: str, context: Ctx) -> None:
        if self.whoami is None:
            return
        try:
            token = token_from_metadata(context.invocation_metadata())
        except UnauthenticatedError:
            token = ""  # meta decides: refused with authentication on, anonymous admin with it off
        caller = await self.whoami(token)
        if not caller.admin:
            raise PermissionDeniedError(f"{what} is an admin operation; {caller.kind} {caller.name!r} is not an admin")

    @grpc_errors
    async def Scrub(self, request: spb.ScrubRequest, context: Ctx) -> spb.ScrubReport:
        await self._admin("Scrub", context)
        rep = await self.scrubber.scrub(rate=request.rate, repair=request.repair,
                                        delete_orphans=request.delete_orphans)
        return rep.to_pb()  # type: ignore[no-any-return]

    @grpc_errors
    async def RepairStatus(self, request: spb.RepairStatusRequest, context: Ctx) -> spb.RepairStatusReply:
        r = self.repairer
        return spb.RepairStatusReply(
            node_id=self.scrubber.node_id,
            rebuilds=[spb.GroupRebuild(group_id=p.group_id, target_id=p.target_id, done=p.done, total=p.total,
                                       bytes=p.bytes, state=p.state, error=p.error) for p in r.status()],
            fragments_rebuilt=r.counters["fragments_rebuilt"], bytes_rebuilt=r.counters["bytes_rebuilt"],
            fragments_copied=r.counters["fragments_copied"], queue_pending=r.queue_pending,
            queue_rebuilt=r.counters["queue_rebuilt"], queue_errors=r.counters["queue_errors"],
            queue_error=r.queue_error,
            unrebuildable=[spb.UnrebuildableChunk(inode=i, chunk=c, version=v, detail=d)
                           for (i, c, v), d in sorted(r.unrebuildable.items())])


class ControlServer:
    """A running control service; ``addr`` is where it listens."""

    def __init__(self, server: grpc.aio.Server, addr: str) -> None:
        self.server = server
        self.addr = addr

    async def close(self) -> None:
        await self.server.stop(grace=1.0)


async def start_control(host: str, port: int, scrubber: Scrubber, repairer: Repairer, *,
                        advertise_host: str = "", whoami: WhoAmI | None = None,
                        tls: TlsFiles | None = None) -> ControlServer:
    """Serve StorageControl on ``host:port`` (0: a free port); the returned
    address names ``advertise_host`` (default ``host``). ``whoami``: asks
    meta who a token stands for (None: no admin check). ``tls``: serve TLS
    only (tierfs.tls), as the data plane does."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    spb_grpc.add_StorageControlServicer_to_server(_Servicer(scrubber, repairer, whoami), server)  # type: ignore[no-untyped-call]
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", tls.grpc_server_credentials())
    if bound == 0:
        raise OSError(f"cannot bind the control address {host}:{port}")
    await server.start()
    return ControlServer(server, f"{advertise_host or host}:{bound}")
