"""Bounded requests: every list, string and page limit of a meta request has
a hard cap (tierfs.meta.ops), checked before anything changes or is read,
with an error naming the field, the count and the cap; a whole op is capped
at MAX_OP_BYTES. Applied straight to the state machine (a replica never
trusts the log) and through the real gRPC service (refused before
submitting: the commit index stays put)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message
from meta_helpers import Driver, meta_server, register_async, run, unknown_field

from tierfs.config import load
from tierfs.errors import (
    ConfigError,
    InvalidArgumentError,
    NameTooLongError,
    TierFSError,
    error_from_code,
    from_grpc,
)
from tierfs.meta import ops
from tierfs.meta.config import MetaConfig
from tierfs.meta.daemon import build_parser
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.proto.v1 import meta_pb2_grpc

pytestmark = pytest.mark.timeout(60)

CHUNKS = ops.MAX_CHUNKS_PER_REQUEST


def _request_types() -> list[Descriptor]:
    """Every message a client can send: MetaOp bodies and read requests."""
    out = [f.message_type for f in pb.MetaOp.DESCRIPTOR.oneofs_by_name["body"].fields]
    out += [m.input_type for m in pb.DESCRIPTOR.services_by_name["MetaService"].methods]
    return list({d.full_name: d for d in out}.values())


def test_every_repeated_field_of_every_request_has_a_cap() -> None:
    missing: list[str] = []
    seen: set[str] = set()

    def walk(d: Descriptor) -> None:
        if d.full_name in seen:
            return
        seen.add(d.full_name)
        for f in d.fields:
            if f.is_repeated and (d.name, f.name) not in ops.LIST_CAPS:
                missing.append(f"{d.name}.{f.name}")
            if f.message_type is not None:
                walk(f.message_type)

    for d in _request_types():
        walk(d)
    assert not missing, f"add these to tierfs.meta.ops.LIST_CAPS: {missing}"
    # and every entry of the tables names a real field
    for table in (ops.LIST_CAPS, ops.STRING_CAPS, ops.LIMIT_CAPS):
        for msg, fld in table:
            assert fld in getattr(pb, msg).DESCRIPTOR.fields_by_name, (msg, fld)


def _ok_chunks(n: int, data_version: int = 1) -> list[pb.ChunkRecord]:
    return [pb.ChunkRecord(index=i, generation=data_version << 20, length=4 << 20, crc32c=0xFFFFFFFF)
            for i in range(n)]


def _with_unknown_field(req: pb.RenewLeaseRequest, size: int) -> pb.RenewLeaseRequest:
    """``req`` carrying an unknown length-delimited field of ``size`` bytes."""
    out = pb.RenewLeaseRequest()
    out.ParseFromString(unknown_field(req, size))
    return out


def _ok_uploads(n: int, data_version: int = 1) -> list[pb.ChunkUpload]:
    return [pb.ChunkUpload(index=i, generation=(data_version << 20) | 1) for i in range(n)]


# (case, op kind, request, error type, words the message must contain)
OVER: list[tuple[str, str, Message, type[TierFSError], tuple[str, ...]]] = [
    ("renew-chunks", "renew_lease", pb.RenewLeaseRequest(session_id=1, chunks=_ok_chunks(CHUNKS + 1)),
     InvalidArgumentError, ("renew_lease.chunks", str(CHUNKS + 1), str(CHUNKS))),
    ("commit-chunks", "commit_write", pb.CommitWriteRequest(session_id=1, size=1, chunks=_ok_chunks(CHUNKS + 1)),
     InvalidArgumentError, ("commit_write.chunks", str(CHUNKS + 1), str(CHUNKS))),
    ("abort-uploads", "abort_write", pb.AbortWriteRequest(session_id=1, uploads=_ok_uploads(CHUNKS + 1)),
     InvalidArgumentError, ("abort_write.uploads", str(CHUNKS + 1))),
    ("renew-uploads", "renew_lease", pb.RenewLeaseRequest(session_id=1, uploads=_ok_uploads(CHUNKS + 1)),
     InvalidArgumentError, ("renew_lease.uploads", str(CHUNKS + 1), str(CHUNKS))),
    ("mark-items", "mark_fragments", pb.MarkFragmentsRequest(items=[pb.RepairItem(inode=2, chunk=i)
                                                                    for i in range(ops.MAX_MARK_ITEMS + 1)]),
     InvalidArgumentError, ("mark_fragments.items", str(ops.MAX_MARK_ITEMS + 1))),
    ("register-targets", "register_node", pb.RegisterNodeRequest(
        node_uuid="u", hostname="h", data_addr="a:1",
        targets=[pb.TargetSpec(path=f"/t{i}") for i in range(ops.MAX_TARGETS_PER_NODE + 1)]),
     InvalidArgumentError, ("register_node.targets", "257", "256")),
    ("heartbeat-targets", "heartbeat", pb.HeartbeatRequest(
        node_id=1, targets=[pb.TargetReport(target_id=i + 1) for i in range(ops.MAX_TARGETS_PER_NODE + 1)]),
     InvalidArgumentError, ("heartbeat.targets", "257", "256")),
    ("ack-gc-acks", "ack_gc", pb.AckGCRequest(acks=[pb.GCAck(id=i + 1, target_id=1)
                                                   for i in range(ops.MAX_GC_ACKS + 1)]),
     InvalidArgumentError, ("ack_gc.acks", str(ops.MAX_GC_ACKS + 1), str(ops.MAX_GC_ACKS))),
    ("owner", "open_write", pb.OpenWriteRequest(loc=pb.Loc(path="/d/f"), owner="o" * 1_000_000),
     InvalidArgumentError, ("open_write.owner", "1000000", "256")),
    ("huge-path", "mkdir", pb.MkdirRequest(loc=pb.Loc(path="/" + "a" * 200_000)),
     NameTooLongError, ("mkdir.loc.path", "4096")),
    ("huge-name", "mkdir", pb.MkdirRequest(loc=pb.Loc(parent=1, name="n" * 100_000)),
     NameTooLongError, ("mkdir.loc.name", "255")),
    ("symlink-target", "symlink", pb.SymlinkRequest(loc=pb.Loc(path="/s"), target="t" * 100_000),
     NameTooLongError, ("symlink.target",)),
    ("target-path", "register_node", pb.RegisterNodeRequest(
        node_uuid="u", hostname="h", data_addr="a:1", targets=[pb.TargetSpec(path="/" + "p" * 5000)]),
     InvalidArgumentError, ("register_node.targets[0].path",)),
    ("layout-redundancy", "set_layout", pb.SetLayoutRequest(loc=pb.Loc(path="/d"), layout=pb.Layout(
        redundancy="ec:" + "9" * 5000)), InvalidArgumentError, ("set_layout.layout.redundancy",)),
    # Under every list cap, over the size of one op: an unknown field counts.
    ("op-bytes", "renew_lease", _with_unknown_field(pb.RenewLeaseRequest(
        session_id=1, uploads=_ok_uploads(CHUNKS)), ops.MAX_OP_BYTES),
     InvalidArgumentError, ("bytes exceed the cap of", str(ops.MAX_OP_BYTES))),
]


def _populated() -> Driver:
    d = Driver()
    d.register()
    d.mkdir("/d")
    d.create("/d/f")
    return d


@pytest.mark.parametrize(("kind", "req", "exc", "words"), [c[1:] for c in OVER], ids=[c[0] for c in OVER])
def test_state_machine_refuses_over_cap_and_changes_nothing(kind: str, req: Message, exc: type[TierFSError],
                                                            words: tuple[str, ...]) -> None:
    d = _populated()
    before = d.sm.digest()
    d.advance(5)
    res = pb.MetaResult.FromString(d.raw(kind, req, client="c", rid=7))
    err = error_from_code(res.error.code, res.error.message)
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    for w in words:
        assert w in err.message, (w, err.message)
    assert d.sm.digest() == before


def test_at_cap_is_accepted() -> None:
    d = _populated()
    s = d.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path="/d/f"), owner="o" * 256), pb.OpenWriteReply)
    # A full batch of records and uploads fits in one op, staged or committed
    # (the client sends batches of MAX_CHUNKS_PER_REQUEST).
    dv = s.data_version
    d.do("renew_lease", pb.RenewLeaseRequest(session_id=s.session_id, chunks=_ok_chunks(CHUNKS, dv),
                                             uploads=_ok_uploads(CHUNKS, dv)), pb.RenewLeaseReply)
    info = d.do("commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=CHUNKS * 4 << 20,
                                                      chunks=_ok_chunks(CHUNKS, dv),
                                                      uploads=_ok_uploads(CHUNKS, dv)), pb.FileInfo)
    assert info.attr.size == CHUNKS * 4 << 20 and len(info.chunks) == CHUNKS
    ops.validate_op(pb.MetaOp(mkdir=pb.MkdirRequest(loc=pb.Loc(path="/" + "/".join(["p" * 200] * 20)))))  # 4020 B
    d.do("ack_gc", pb.AckGCRequest(acks=[pb.GCAck(id=i + 1, target_id=1) for i in range(ops.MAX_GC_ACKS)]),
         pb.AckGCReply)


def test_grpc_refuses_over_cap_before_submitting() -> None:
    async def main() -> None:
        async with meta_server() as (mc, _svc, addr), grpc.aio.insecure_channel(addr) as ch:
            await register_async(mc)
            await mc.mkdir("/d")
            await mc.create("/d/f")
            before = await mc.digest()
            stub = meta_pb2_grpc.MetaServiceStub(ch)
            for _, kind, req, exc, words in OVER:
                rpc = {"renew_lease": "RenewLease", "commit_write": "CommitWrite", "abort_write": "AbortWrite",
                       "register_node": "RegisterNode", "heartbeat": "Heartbeat", "ack_gc": "AckGC",
                       "open_write": "OpenWrite", "mkdir": "Mkdir", "symlink": "Symlink",
                       "set_layout": "SetLayout", "mark_fragments": "MarkFragments"}[kind]
                with pytest.raises(grpc.RpcError) as info:
                    await getattr(stub, rpc)(req, timeout=5)
                err = from_grpc(info.value)
                assert type(err) is exc and words[0] in str(err), err
            # reads: page limits, listed targets, cursors
            with pytest.raises(InvalidArgumentError, match=r"ReaddirRequest.limit: 10001 exceeds the cap of 10000"):
                await mc.readdir("/d", limit=ops.MAX_READDIR_LIMIT + 1)
            with pytest.raises(InvalidArgumentError, match=r"ListGCRequest.limit: 10001 exceeds the cap"):
                await mc.list_gc([], limit=ops.MAX_GC_PAGE + 1)
            with pytest.raises(InvalidArgumentError, match=r"ListGCRequest.target_ids: 1025 items exceed the cap"):
                await mc.list_gc(range(1, ops.MAX_GC_TARGETS + 2))
            with pytest.raises(InvalidArgumentError, match=r"ReaddirRequest.cursor"):
                await mc.readdir("/d", cursor="c" * 300)
            with pytest.raises(InvalidArgumentError, match=r"ListGroupChunksRequest.limit"):
                await mc.list_group_chunks(1, limit=ops.MAX_GROUP_CHUNKS_PAGE + 1)
            assert len((await mc.readdir("/d", limit=ops.MAX_READDIR_LIMIT)).entries) == 1
            after = await mc.digest()
            assert (after.digest, after.applied_index) == (before.digest, before.applied_index)
    run(main())


def _with_unknown_field(req: Message, size: int) -> bytes:
    """``req`` plus a length-delimited field 999 the schema does not know."""
    tag = (999 << 3) | 2
    header = bytearray()
    for v in (tag, size):
        while True:
            b, v = v & 0x7F, v >> 7
            header.append(b | (0x80 if v else 0))
            if not v:
                break
    return req.SerializeToString() + bytes(header) + b"u" * size


def test_unknown_fields_count_towards_the_op_cap_and_stay_out_of_the_log() -> None:
    async def main() -> None:
        async with meta_server() as (mc, _svc, addr):
            before = await mc.digest()
            async with grpc.aio.insecure_channel(addr) as ch:
                call = ch.unary_unary("/tierfs.v1.MetaService/Mkdir", request_serializer=lambda b: b,
                                      response_deserializer=pb.FileInfo.FromString)
                with pytest.raises(grpc.RpcError) as info:
                    await call(_with_unknown_field(pb.MkdirRequest(loc=pb.Loc(path="/x")), 600_000), timeout=5)
                err = from_grpc(info.value)
                assert isinstance(err, InvalidArgumentError) and "mkdir: 6000" in str(err), err
                assert (await mc.digest()).applied_index == before.applied_index
                # a small one is accepted, without the field
                info2 = await call(_with_unknown_field(pb.MkdirRequest(loc=pb.Loc(path="/y")), 100), timeout=5)
                assert info2.attr.inode
    run(main())


def test_gc_grace_config_flag_env_toml(tmp_path: Any) -> None:
    toml = tmp_path / "meta.toml"
    toml.write_text('[meta]\ngc_grace = "2m"\n')
    assert load(MetaConfig, None, env={}).gc_grace == 300.0
    assert load(MetaConfig, toml, env={}).gc_grace == 120.0
    assert load(MetaConfig, toml, env={"TIERFS_META_GC_GRACE": "1.5"}).gc_grace == 1.5
    args = build_parser().parse_args(["--gc-grace", "250ms"])
    assert load(MetaConfig, toml, env={"TIERFS_META_GC_GRACE": "1.5"}, overrides={"gc_grace": args.gc_grace}
                ).gc_grace == 0.25
    with pytest.raises(ConfigError, match="gc_grace"):
        load(MetaConfig, None, env={"TIERFS_META_GC_GRACE": "2000h"})
