"""The MetaService gRPC servicer (grpc.aio) on top of any Replicator.

Mutations: the request is validated here first (bad input costs no log
entry), wrapped in a :class:`tierfs.v1.MetaOp` stamped with this replica's
wall clock and the caller's client/request ids, and submitted to the
replicator; the :class:`tierfs.v1.MetaResult` that comes back is turned into
the reply or re-raised as its TierFSError. Reads wait for the replicator's
read barrier and then read the local state machine (linearizable; a follower
answers NotLeaderError with the leader's address).

Every replica also answers, locally and without a leader, ``GetStatus``
(with the Raft internals when the replicator is Raft), ``Digest`` and
``ForceSnapshot``; the leader answers ``AddMetaMember``/``RemoveMetaMember``.
These work whatever the state machine (also the toy ``kv`` one of the tests).

While this replica leads, a background task submits a Tick op every
``tick_interval`` seconds: it expires storage nodes that missed heartbeats for
``heartbeat_timeout`` and write sessions whose lease ran out, and (if
``replace_after`` > 0) swaps targets down for that long out of their
placement groups.

Bounded work: a request is checked against the caps of
:mod:`tierfs.meta.ops` (lists, strings, page limits, and the whole op at
``MAX_OP_BYTES``) before it is submitted or read, so an oversized one costs
no log entry; unknown fields are dropped rather than logged. Every op carries
``gc_grace`` (``MetaOp.gc_grace_ms``): what it queues for GC is listed only
that long after, judged by :meth:`MetaServicer.now_ns` on the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from tierfs.errors import (
    TierFSError,
    UnsupportedError,
    error_from_code,
    grpc_errors,
)
from tierfs.meta.interfaces import Replicator
from tierfs.meta.ops import MAX_GC_GRACE, check_caps, check_op_size, validate_op
from tierfs.meta.state import MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.proto.v1 import meta_pb2_grpc

__all__ = ["CLIENT_ID_KEY", "DEFAULT_GC_GRACE", "MAX_REQUEST_BYTES", "REQUEST_ID_KEY", "MetaServicer",
           "add_meta_service"]

log = logging.getLogger("tierfs.meta.service")

CLIENT_ID_KEY = "tierfs-client-id"
REQUEST_ID_KEY = "tierfs-request-id"
#: Fragments of replaced chunk versions stay readable this long (seconds).
DEFAULT_GC_GRACE = 300.0
#: gRPC refuses a request larger than this before decoding it (set it as the
#: server's ``grpc.max_receive_message_length``); requests below it are
#: checked against the finer caps of tierfs.meta.ops.
MAX_REQUEST_BYTES = 2 << 20

_R = TypeVar("_R", bound=Message)
Ctx = grpc.aio.ServicerContext[Any, Any]


def _ids(context: Ctx) -> tuple[str, int]:
    client, req = "", 0
    for item in context.invocation_metadata() or ():
        k, v = item[0], item[1]
        if k == CLIENT_ID_KEY:
            client = str(v)
        elif k == REQUEST_ID_KEY:
            with contextlib.suppress(ValueError):
                req = int(v)
    return client, req


class MetaServicer(meta_pb2_grpc.MetaServiceServicer):
    def __init__(
        self,
        replicator: Replicator,
        *,
        heartbeat_timeout: float = 10.0,
        lease_duration: float = 30.0,
        tick_interval: float = 1.0,
        submit_timeout: float = 5.0,
        replace_after: float = 0.0,
        gc_grace: float = DEFAULT_GC_GRACE,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if not 0 <= gc_grace <= MAX_GC_GRACE:
            raise ValueError(f"gc_grace {gc_grace} must be between 0 and {MAX_GC_GRACE:.0f} seconds")
        self._r = replicator
        self.heartbeat_timeout = heartbeat_timeout
        self.lease_duration = lease_duration
        self.tick_interval = tick_interval
        self.submit_timeout = submit_timeout
        self.replace_after = replace_after
        self.gc_grace = gc_grace
        self._clock = clock
        self._ticker: asyncio.Task[None] | None = None

    # ---- plumbing -----------------------------------------------------------

    @property
    def state(self) -> MetaStateMachine:
        sm = self._r.state_machine
        if not isinstance(sm, MetaStateMachine):
            # tierfs-meta --state-machine kv: only the replica RPCs work.
            raise UnsupportedError(f"this replica runs {type(sm).__name__}, not the namespace "
                                   "(state_machine = 'meta'); only status, digest, snapshot and "
                                   "membership calls are served")
        return sm

    def now_ns(self) -> int:
        """This replica's clock, as stamped into ops and used for GC readiness."""
        return self._clock()

    def _op(self, kind: str, req: Message, client: str = "", request_id: int = 0) -> pb.MetaOp:
        # Field caps first (the clearer error), then the whole request as it
        # came, unknown fields included.
        check_caps(req, kind)
        check_op_size(req.ByteSize(), kind)
        op = pb.MetaOp(now_ns=self.now_ns(), client_id=client, request_id=request_id,
                       lease_ms=int(self.lease_duration * 1000), gc_grace_ms=int(self.gc_grace * 1000))
        getattr(op, kind).CopyFrom(req)
        op.DiscardUnknownFields()  # what this version does not know does not go into the log
        return op

    async def submit(self, op: pb.MetaOp, reply_cls: type[_R]) -> _R:
        """Validate, replicate and apply ``op``; its reply or its error."""
        _ = self.state  # refuse before logging an op that another state machine cannot read
        validate_op(op)
        data = op.SerializeToString(deterministic=True)
        check_op_size(len(data), str(op.WhichOneof("body")))
        raw = await self._r.submit(data, self.submit_timeout)
        res = pb.MetaResult.FromString(raw)
        if res.error.code:
            raise error_from_code(res.error.code, res.error.message, leader=res.error.leader)
        return reply_cls.FromString(res.reply)

    async def _mutate(self, context: Ctx, kind: str, req: Message, reply_cls: type[_R]) -> _R:
        client, rid = _ids(context)
        return await self.submit(self._op(kind, req, client, rid), reply_cls)

    async def _read(self, request: Message) -> MetaStateMachine:
        """The state, once the read barrier passed; ``request`` is checked
        against the caps first (nothing is read for an oversized one)."""
        check_caps(request, request.DESCRIPTOR.name)
        check_op_size(request.ByteSize(), request.DESCRIPTOR.name)
        await self._r.read_barrier(self.submit_timeout)
        return self.state

    # ---- the periodic tick --------------------------------------------------

    def _leading(self) -> bool:
        return self._r.status().role in ("leader", "standalone")

    async def tick(self, force: bool = False) -> bool:
        """Submit one Tick op (expire heartbeats, leases, replace long-down
        targets) with this replica's clock, unless the local state says it
        would change nothing (``force`` submits anyway). Only meaningful on
        the leader, whose state is current. Returns whether it submitted."""
        req = pb.TickRequest(heartbeat_timeout_ms=int(self.heartbeat_timeout * 1000),
                             replace_after_ms=int(self.replace_after * 1000))
        op = self._op("tick", req)
        if not force and not self.state.tick_due(op.now_ns, req.heartbeat_timeout_ms, req.replace_after_ms):
            return False
        await self.submit(op, pb.Empty)
        return True

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval)
            if not self._leading():
                continue
            try:
                await self.tick()
            except TierFSError as err:  # lost leadership mid-tick, timeouts: next tick retries
                log.debug("tick failed: %s", err)

    async def start(self) -> None:
        """Start the periodic tick task (idempotent)."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_loop(), name="meta-tick")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None

    # ---- namespace ------------------------------------------------------------

    @grpc_errors
    async def Mkdir(self, request: pb.MkdirRequest, context: Ctx) -> pb.FileInfo:
        return await self._mutate(context, "mkdir", request, pb.FileInfo)

    @grpc_errors
    async def Create(self, request: pb.CreateRequest, context: Ctx) -> pb.FileInfo:
        return await self._mutate(context, "create", request, pb.FileInfo)

    @grpc_errors
    async def Lookup(self, request: pb.LookupRequest, context: Ctx) -> pb.FileInfo:
        return (await self._read(request)).lookup(request.parent, request.name)

    @grpc_errors
    async def Stat(self, request: pb.StatRequest, context: Ctx) -> pb.FileInfo:
        return (await self._read(request)).stat(request.loc)

    @grpc_errors
    async def Readdir(self, request: pb.ReaddirRequest, context: Ctx) -> pb.ReaddirReply:
        return (await self._read(request)).readdir(request.loc, request.cursor, request.limit)

    @grpc_errors
    async def Rename(self, request: pb.RenameRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "rename", request, pb.Empty)

    @grpc_errors
    async def Unlink(self, request: pb.UnlinkRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "unlink", request, pb.Empty)

    @grpc_errors
    async def Rmdir(self, request: pb.RmdirRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "rmdir", request, pb.Empty)

    @grpc_errors
    async def Symlink(self, request: pb.SymlinkRequest, context: Ctx) -> pb.FileInfo:
        return await self._mutate(context, "symlink", request, pb.FileInfo)

    @grpc_errors
    async def Readlink(self, request: pb.ReadlinkRequest, context: Ctx) -> pb.ReadlinkReply:
        return pb.ReadlinkReply(target=(await self._read(request)).readlink(request.loc))

    @grpc_errors
    async def SetAttr(self, request: pb.SetAttrRequest, context: Ctx) -> pb.FileInfo:
        return await self._mutate(context, "setattr", request, pb.FileInfo)

    @grpc_errors
    async def Truncate(self, request: pb.TruncateRequest, context: Ctx) -> pb.FileInfo:
        return await self._mutate(context, "truncate", request, pb.FileInfo)

    @grpc_errors
    async def SetLayout(self, request: pb.SetLayoutRequest, context: Ctx) -> pb.LayoutReply:
        return await self._mutate(context, "set_layout", request, pb.LayoutReply)

    @grpc_errors
    async def GetLayout(self, request: pb.GetLayoutRequest, context: Ctx) -> pb.LayoutReply:
        return pb.LayoutReply(layout=(await self._read(request)).get_layout(request.loc))

    # ---- write sessions ---------------------------------------------------------

    @grpc_errors
    async def OpenWrite(self, request: pb.OpenWriteRequest, context: Ctx) -> pb.OpenWriteReply:
        return await self._mutate(context, "open_write", request, pb.OpenWriteReply)

    @grpc_errors
    async def RenewLease(self, request: pb.RenewLeaseRequest, context: Ctx) -> pb.RenewLeaseReply:
        return await self._mutate(context, "renew_lease", request, pb.RenewLeaseReply)

    @grpc_errors
    async def CommitWrite(self, request: pb.CommitWriteRequest, context: Ctx) -> pb.FileInfo:
        return await self._mutate(context, "commit_write", request, pb.FileInfo)

    @grpc_errors
    async def AbortWrite(self, request: pb.AbortWriteRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "abort_write", request, pb.Empty)

    # ---- cluster map --------------------------------------------------------------

    @grpc_errors
    async def RegisterNode(self, request: pb.RegisterNodeRequest, context: Ctx) -> pb.RegisterNodeReply:
        return await self._mutate(context, "register_node", request, pb.RegisterNodeReply)

    @grpc_errors
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Ctx) -> pb.HeartbeatReply:
        return await self._mutate(context, "heartbeat", request, pb.HeartbeatReply)

    @grpc_errors
    async def GetClusterMap(self, request: pb.GetClusterMapRequest, context: Ctx) -> pb.ClusterMap:
        return (await self._read(request)).cluster_map(request.known_version)

    @grpc_errors
    async def ListGroupChunks(self, request: pb.ListGroupChunksRequest, context: Ctx) -> pb.ListGroupChunksReply:
        return (await self._read(request)).list_group_chunks(request.group_id, request.after_inode, request.limit)

    @grpc_errors
    async def FinishRebuild(self, request: pb.FinishRebuildRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "finish_rebuild", request, pb.Empty)

    @grpc_errors
    async def RemoveTarget(self, request: pb.RemoveTargetRequest, context: Ctx) -> pb.ReplaceReply:
        return await self._mutate(context, "remove_target", request, pb.ReplaceReply)

    @grpc_errors
    async def DrainNode(self, request: pb.DrainNodeRequest, context: Ctx) -> pb.ReplaceReply:
        return await self._mutate(context, "drain_node", request, pb.ReplaceReply)

    @grpc_errors
    async def RemoveNode(self, request: pb.RemoveNodeRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "remove_node", request, pb.Empty)

    # ---- garbage collection ---------------------------------------------------------

    @grpc_errors
    async def ListGC(self, request: pb.ListGCRequest, context: Ctx) -> pb.ListGCReply:
        items = (await self._read(request)).list_gc(request.target_ids, request.after_id, request.limit,
                                                    now_ns=self.now_ns())
        return pb.ListGCReply(items=items)

    @grpc_errors
    async def AckGC(self, request: pb.AckGCRequest, context: Ctx) -> pb.AckGCReply:
        return await self._mutate(context, "ack_gc", request, pb.AckGCReply)

    # ---- the repair queue -------------------------------------------------------------

    @grpc_errors
    async def ListRepairs(self, request: pb.ListRepairsRequest, context: Ctx) -> pb.ListRepairsReply:
        return (await self._read(request)).list_repairs(request.target_ids, request.limit)

    @grpc_errors
    async def MarkFragments(self, request: pb.MarkFragmentsRequest, context: Ctx) -> pb.MarkFragmentsReply:
        return await self._mutate(context, "mark_fragments", request, pb.MarkFragmentsReply)

    # ---- replica status and membership (local, no leader needed) ----------------

    @grpc_errors
    async def GetStatus(self, request: pb.Empty, context: Ctx) -> pb.GetStatusReply:
        st = self._r.status()
        reply = pb.GetStatusReply(id=st.id, role=st.role, leader=st.leader, term=st.term,
                                  commit_index=st.commit_index, applied_index=st.applied_index,
                                  members=st.members, pid=os.getpid())
        details = getattr(self._r, "details", None)  # RaftReplicator only
        if details is not None:
            d = details()
            reply.raft.CopyFrom(pb.RaftStatus(
                raft_addr=d.raft_addr, grpc_addr=d.grpc_addr, raft_members=d.raft_members,
                addr_map=d.addr_map, ready=d.ready, log_len=d.log_len, journal_syncs=d.journal_syncs,
                snapshots=d.snapshots, fatal=d.fatal, truncation=d.truncation,
            ))
        return reply

    @grpc_errors
    async def Digest(self, request: pb.Empty, context: Ctx) -> pb.DigestReply:
        sm = self._r.state_machine
        return pb.DigestReply(digest=sm.digest(), applied_index=self._r.status().applied_index,
                              ops_applied=int(getattr(sm, "ops_applied", 0)))

    @grpc_errors
    async def ForceSnapshot(self, request: pb.Empty, context: Ctx) -> pb.Empty:
        fn = getattr(self._r, "force_snapshot", None)
        if fn is None:
            raise UnsupportedError(f"this meta replica ({type(self._r).__name__}) takes no snapshots")
        fn()
        return pb.Empty()

    async def _membership(self, name: str, request: pb.MetaMemberRequest) -> pb.Empty:
        fn = getattr(self._r, name, None)
        if fn is None:
            raise UnsupportedError(f"this meta replica ({type(self._r).__name__}) cannot change membership")
        # A change waits for this term's no-op and any previous change to
        # apply (BusyError retries inside): allow more than one commit's time.
        await fn(request.raft_addr, request.grpc_addr, timeout=2 * self.submit_timeout)
        return pb.Empty()

    @grpc_errors
    async def AddMetaMember(self, request: pb.MetaMemberRequest, context: Ctx) -> pb.Empty:
        return await self._membership("add_member", request)

    @grpc_errors
    async def RemoveMetaMember(self, request: pb.MetaMemberRequest, context: Ctx) -> pb.Empty:
        return await self._membership("remove_member", request)


def add_meta_service(server: grpc.aio.Server, replicator: Replicator, **opts: Any) -> MetaServicer:
    """Create a :class:`MetaServicer` (``opts``: heartbeat_timeout,
    lease_duration, tick_interval, submit_timeout, replace_after, gc_grace, clock) and register it on
    ``server``. Call ``await servicer.start()`` once the server runs, to
    start the periodic tick, and ``await servicer.stop()`` before shutdown."""
    servicer = MetaServicer(replicator, **opts)
    meta_pb2_grpc.add_MetaServiceServicer_to_server(servicer, server)
    return servicer
