"""Shared helpers for the meta tests: drive a MetaStateMachine op by op, and
run a real grpc.aio MetaService (LocalReplicator) with a MetaClient."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from tierfs.chunk import generation
from tierfs.errors import error_from_code
from tierfs.meta import (
    LocalReplicator,
    MetaClient,
    MetaServicer,
    MetaStateMachine,
    add_meta_service,
)
from tierfs.meta.kvplan import kv_plan_input, plan_kv
from tierfs.meta.rebalance import plan_top_up, top_up_input
from tierfs.meta.state import KV_HELD_FORMAT
from tierfs.proto.v1 import meta_pb2 as pb

R = TypeVar("R", bound=Message)
SEC = 10**9
T0 = 1_700_000_000 * SEC


class Driver:
    """Applies ops to a state machine the way the service would, with a
    controllable clock; records the op log for replay."""

    def __init__(self, sm: MetaStateMachine | None = None) -> None:
        self.sm = sm or MetaStateMachine()
        self.now = T0
        self.log: list[bytes] = []
        #: stamped into every op, as the service stamps its gc_grace
        self.gc_grace_ms = 0
        #: likewise its purge_grace (group purges)
        self.purge_grace_ms = 0
        #: act as the leader's service does: top up placement groups after
        #: every op (False: only the ops a test applies)
        self.leader = True
        #: act as a leader of this version for KV pools: stamp ``kv_planned``
        #: on every op and commit the pools' groups (tierfs.meta.kvplan)
        #: after every op that bumped the map (False: the ops of older
        #: versions, which re-plan in apply)
        self.kv_planned = False
        #: stamped into every op (MetaOp.min_format; 0 = a leader of before
        #: formats). With kv_planned and KV_HELD_FORMAT or more, the pools
        #: are planned as this version's leader plans them, with its
        #: replace_after (``replace_after_ms``).
        self.min_format = 0
        self.replace_after_ms = 0

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * SEC)

    def raw(self, kind: str, req: Message, *, client: str = "", rid: int = 0, lease_ms: int = 0) -> bytes:
        if kind == "create" and self.leader:
            assert isinstance(req, pb.CreateRequest)
            w = self.sm.create_width(req.loc, req.layout if req.has_layout else None)
            if w and w not in self.sm.widths:
                self.top_up(w)
        version = self.sm.map_version
        out = self._apply(kind, req, client=client, rid=rid, lease_ms=lease_ms)
        if self.kv_planned and kind != "kv_groups" and self.sm.map_version != version:
            self.plan_kv()
        if self.leader and kind not in ("add_groups", "rebalance_moves", "kv_groups"):
            self.top_up()
        return out

    def _apply(self, kind: str, req: Message, *, client: str = "", rid: int = 0, lease_ms: int = 0) -> bytes:
        op = pb.MetaOp(now_ns=self.now, client_id=client, request_id=rid, lease_ms=lease_ms,
                       gc_grace_ms=self.gc_grace_ms, purge_grace_ms=self.purge_grace_ms)
        getattr(op, kind).CopyFrom(req)
        op.kv_planned = self.kv_planned
        op.min_format = self.min_format
        data = op.SerializeToString(deterministic=True)
        self.log.append(data)
        return self.sm.apply(data)

    def plan_kv(self) -> int:
        """What a leader stamping ``kv_planned`` does after a map bump: plan
        the KV pools' groups and commit them as KVGroups ops. Returns the
        ops applied."""
        n = 0
        held = self.min_format >= KV_HELD_FORMAT
        for req in plan_kv(kv_plan_input(self.sm, now_ns=self.now,
                                         replace_after_ms=self.replace_after_ms if held else None)):
            res = pb.MetaResult.FromString(self._apply("kv_groups", req))
            if res.error.code:
                raise error_from_code(res.error.code, res.error.message)
            n += 1
        return n

    def top_up(self, extra_width: int = 0) -> None:
        """What the leader's service does after an op (tierfs.meta.rebalance):
        plan the groups the widths lack and commit them as AddGroups ops."""
        for req in plan_top_up(top_up_input(self.sm, extra_width)):
            res = pb.MetaResult.FromString(self._apply("add_groups", req))
            if res.error.code:
                break

    def do(self, kind: str, req: Message, reply_cls: type[R] = pb.Empty, **kw: Any) -> R:  # type: ignore[assignment]
        res = pb.MetaResult.FromString(self.raw(kind, req, **kw))
        if res.error.code:
            raise error_from_code(res.error.code, res.error.message)
        return reply_cls.FromString(res.reply)

    # conveniences
    def mkdir(self, path: str) -> pb.FileInfo:
        return self.do("mkdir", pb.MkdirRequest(loc=pb.Loc(path=path)), pb.FileInfo)

    def create(self, path: str, **layout: Any) -> pb.FileInfo:
        req = pb.CreateRequest(loc=pb.Loc(path=path))
        if layout:
            req.layout.CopyFrom(pb.Layout(**layout))
            req.has_layout = True
        return self.do("create", req, pb.FileInfo)

    def stat(self, path: str) -> pb.FileInfo:
        return self.sm.stat(pb.Loc(path=path))

    def register(self, nodes: int = 6, targets: int = 2, prefix: str = "node") -> list[pb.RegisterNodeReply]:
        out = []
        for i in range(nodes):
            req = pb.RegisterNodeRequest(
                node_uuid=f"{prefix}-{i}", hostname=f"{prefix}{i}", data_addr=f"127.0.0.1:{9000 + i}",
                targets=[pb.TargetSpec(path=f"/data/t{j}", capacity=1 << 40) for j in range(targets)])
            out.append(self.do("register_node", req, pb.RegisterNodeReply))
        return out

    def write(self, path: str, size: int, chunks: list[int]) -> pb.FileInfo:
        s = self.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path=path), owner="t"), pb.OpenWriteReply)
        return self.do("commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=size,
                                                             chunks=recs(s.data_version, chunks)), pb.FileInfo)


def gen0(data_version: int) -> int:
    """The generation of a session's first upload of a chunk."""
    return generation(data_version, 0)


def recs(data_version: int, chunks: list[int], length: int = 1 << 20,
         missing: tuple[int, ...] = ()) -> list[pb.ChunkRecord]:
    """Commit records for ``chunks``, each uploaded once in the session
    tagged ``data_version`` (the CRC is not checked by meta)."""
    return [pb.ChunkRecord(index=c, generation=gen0(data_version), length=length, crc32c=0, missing=missing)
            for c in chunks]


def ups(data_version: int, chunks: list[int]) -> list[pb.ChunkUpload]:
    return [pb.ChunkUpload(index=c, generation=gen0(data_version)) for c in chunks]


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


@contextlib.asynccontextmanager
async def meta_server(**opts: Any) -> AsyncIterator[tuple[MetaClient, MetaServicer, str]]:
    """A real gRPC MetaService on 127.0.0.1:0 over a LocalReplicator."""
    sm = MetaStateMachine()
    server = grpc.aio.server()
    svc = add_meta_service(server, LocalReplicator(sm), **opts)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    addr = f"127.0.0.1:{port}"
    client = MetaClient([addr], deadline=5.0)
    try:
        yield client, svc, addr
    finally:
        await client.close()
        await svc.stop()
        await server.stop(None)


async def register_async(mc: MetaClient, nodes: int = 6, targets: int = 2) -> list[pb.RegisterNodeReply]:
    return [await mc.register_node(f"node-{i}", f"node{i}", f"127.0.0.1:{9000 + i}",
                                   [(f"/data/t{j}", 1 << 40) for j in range(targets)])
            for i in range(nodes)]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def unknown_field(req: Any, size: int) -> bytes:
    """``req`` serialized plus an unknown length-delimited field 999 of ``size`` bytes."""
    header = bytearray()
    for v in ((999 << 3) | 2, size):
        while True:
            b, v = v & 0x7F, v >> 7
            header.append(b | (0x80 if v else 0))
            if not v:
                break
    return bytes(req.SerializeToString()) + bytes(header) + b"u" * size
