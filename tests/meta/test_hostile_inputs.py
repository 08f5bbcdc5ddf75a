"""Hypothesis-generated hostile requests for every MetaService RPC, against
a real meta replica (a process on loopback).

The RPCs come from the service descriptor, and every request is built field
by field from its message descriptor, so a new RPC or a new field is covered
without touching this file. Values are the ones that break servers: empty
and huge strings, NUL, "/", ".", ".." and deep paths, negative and extreme
int64s, uint fields at 2**64-1, unknown enum values, repeated fields at and
just past their cap (tierfs.meta.ops.LIST_CAPS). Each call must end in a
clear TierFSError (never INTERNAL or UNKNOWN, never a timeout) or in a
legitimate success; a refused call leaves the state digest unchanged; the
replica is alive and has logged no traceback at the end.

Security: with ``TIERFS_TOKEN`` set, every call carries it as
``authorization: Bearer`` metadata (the suite's admin token once
authentication is on), so the same test runs with security on and off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cluster import MetaCluster
from tierfs.errors import InternalError, TierFSError, from_grpc
from tierfs.meta import ops
from tierfs.net import parse_address
from tierfs.proto.v1 import meta_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["MetaService"]
#: Examples per RPC: 38 RPCs x (call + digest) in about 25 s on a loaded 2-core host.
EXAMPLES = int(os.environ.get("TIERFS_HOSTILE_EXAMPLES", "12"))
#: TIERFS_HOSTILE_RANDOM=1: fresh random examples (bug hunting); CI runs the same fixed ones.
RANDOM = bool(os.environ.get("TIERFS_HOSTILE_RANDOM"))
CALL_TIMEOUT = 10.0
MiB = 1 << 20

FD = FieldDescriptor
# Integers: the edges of each wire type, plus the small ids that name real
# things (the root inode is 1).
_I64 = [0, 1, 2, 3, -1, -(2**63), 2**63 - 1, 2**62, -(2**31)]
_I32 = [0, 1, 2, -1, -(2**31), 2**31 - 1]
_U64 = [0, 1, 2, 3, 2**64 - 1, 2**63, 2**32, 2**53 + 1]
_U32 = [0, 1, 2, 2**32 - 1, 2**31, 0o7777, 0o170777]
_INTS: dict[int, list[int]] = {
    FD.TYPE_INT64: _I64, FD.TYPE_SINT64: _I64, FD.TYPE_SFIXED64: _I64,
    FD.TYPE_INT32: _I32, FD.TYPE_SINT32: _I32, FD.TYPE_SFIXED32: _I32,
    FD.TYPE_UINT64: _U64, FD.TYPE_FIXED64: _U64,
    FD.TYPE_UINT32: _U32, FD.TYPE_FIXED32: _U32,
}
# Plausible values too ("/d/f" exists, "/x" does not, "ec:2+1" parses), so
# that calls get past validation into the state machine.
_SHORT_STRINGS = ["", "/", ".", "..", "\x00", "a\x00b", "/..", "../..", "a/b", "//", "/d/..", " ", "\n",
                  "d", "f", "x", "/d", "/d/f", "/x", "/d/x", "/d/f/x", "default", "127.0.0.1:1", "ec:4+2",
                  "ec:2+1", "replica:1", "ec:0+0", "replica:0", "ec:99+99", "x:1:2", "lru"]
_PIECES = ["a", "é", "/", "\x00", "../", "d/"]


def _long(n: int, piece: str) -> str:
    return (piece * (n // len(piece) + 1))[:n]


def _strings(small: bool) -> st.SearchStrategy[str]:
    base: list[st.SearchStrategy[str]] = [
        st.sampled_from(_SHORT_STRINGS),
        st.text(st.characters(blacklist_categories=["Cs"]), max_size=8),
    ]
    if not small:
        base += [
            st.builds(_long, st.sampled_from([256, 4097, 70_000, 300_000]), st.sampled_from(_PIECES)),
            # Deep paths: long chains of components.
            st.builds(lambda k: "/" + "/".join(["d"] * k), st.sampled_from([64, 1025, 2049, 100_000])),
        ]
    return st.one_of(base)


def _scalar(fd: FieldDescriptor, small: bool) -> st.SearchStrategy[Any]:
    if fd.type == FD.TYPE_STRING:
        return _strings(small)
    if fd.type == FD.TYPE_BYTES:
        return st.sampled_from([b"", b"\x00", b"\xff" * 300_000]) if not small else st.sampled_from([b"", b"\x00"])
    if fd.type == FD.TYPE_BOOL:
        return st.booleans()
    if fd.type == FD.TYPE_ENUM:
        known = [v.number for v in fd.enum_type.values]
        # proto3 enums are open: unknown numbers arrive as they are.
        return st.sampled_from([*known, max(known) + 1, 99, -1, 2**31 - 1])
    if fd.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return st.sampled_from([0.0, -1.0, 1e300, float("inf"), float("nan")])
    return st.sampled_from(_INTS[fd.type])


def _cap(owner: Descriptor, fd: FieldDescriptor) -> int:
    return ops.LIST_CAPS.get((owner.name, fd.name), 1024)


def messages(desc: Descriptor, depth: int = 0, small: bool = False) -> st.SearchStrategy[Message]:
    """Hostile instances of ``desc``: every field unset or hostile."""
    cls = _class(desc)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for fd in desc.fields:
        if fd.type == FD.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
            continue  # maps appear only in replies
        if fd.type == FD.TYPE_MESSAGE:
            if depth >= 3:
                continue
            elem: st.SearchStrategy[Any] = st.deferred(
                lambda fd=fd, depth=depth, small=small: messages(fd.message_type, depth + 1, small))
        else:
            elem = _scalar(fd, small)
        if fd.is_repeated:
            n = _cap(desc, fd)
            few = st.lists(elem, max_size=3)
            if small or depth >= 2:
                fields[fd.name] = few
            else:
                # At the cap and one past it: the copies are of one small element (cheap to build).
                small_elem = (messages(fd.message_type, depth + 1, True) if fd.type == FD.TYPE_MESSAGE
                              else _scalar(fd, True))
                fields[fd.name] = st.one_of(few, st.builds(lambda e, k: [e] * k, small_elem,
                                                           st.sampled_from([n, n + 1])))
        else:
            fields[fd.name] = elem
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: _build(cls, kw))


def _p(path: str) -> pb.Loc:
    return pb.Loc(path=path)


#: A request each RPC would accept (or nearly) in the fixture's state, to
#: mutate one or two fields of: hostile values that get past the first
#: check reach the state machine.
BASES: dict[str, Message] = {
    "Mkdir": pb.MkdirRequest(loc=_p("/d/new"), mode=0o755),
    "Create": pb.CreateRequest(loc=_p("/d/new-file"), mode=0o644),
    "Lookup": pb.LookupRequest(parent=2, name="f"),
    "Stat": pb.StatRequest(loc=_p("/d/f")),
    "Readdir": pb.ReaddirRequest(loc=_p("/d")),
    "Rename": pb.RenameRequest(src=_p("/d/f"), dst=_p("/d/g")),
    "Unlink": pb.UnlinkRequest(loc=_p("/d/f")),
    "Rmdir": pb.RmdirRequest(loc=_p("/d/sub")),
    "Symlink": pb.SymlinkRequest(loc=_p("/d/s2"), target="/d/f"),
    "Readlink": pb.ReadlinkRequest(loc=_p("/d/s")),
    "SetAttr": pb.SetAttrRequest(loc=_p("/d/f"), set_mode=True, mode=0o600),
    "Truncate": pb.TruncateRequest(loc=_p("/d/f"), size=0),
    "SetLayout": pb.SetLayoutRequest(loc=_p("/d/sub"), layout=pb.Layout(redundancy="ec:2+1", chunk_size=1 << 20)),
    "GetLayout": pb.GetLayoutRequest(loc=_p("/d")),
    "OpenWrite": pb.OpenWriteRequest(loc=_p("/d/f"), owner="w", lease_ms=60_000),
    "RenewLease": pb.RenewLeaseRequest(session_id=1, lease_ms=60_000, uploads=[pb.ChunkUpload(index=0, generation=1)]),
    "CommitWrite": pb.CommitWriteRequest(session_id=1, size=10, chunks=[pb.ChunkRecord(
        index=0, generation=(1 << 20) | 1, length=10)]),
    "AbortWrite": pb.AbortWriteRequest(session_id=1),
    "Heartbeat": pb.HeartbeatRequest(node_id=1, targets=[pb.TargetReport(target_id=1, used=1, capacity=1 << 40)]),
    "RegisterNode": pb.RegisterNodeRequest(node_uuid="n9", hostname="h9", data_addr="127.0.0.1:9100",
                                           targets=[pb.TargetSpec(path="/t0", capacity=1 << 40)]),
    "CreateKVPool": pb.CreateKVPoolRequest(name="p", target_memory=1 << 20),
    "RemoveKVPool": pb.RemoveKVPoolRequest(name="p"),
    "MarkFragments": pb.MarkFragmentsRequest(),
}


def _leaves(desc: Descriptor, depth: int = 0) -> list[tuple[FieldDescriptor, ...]]:
    """Field paths of ``desc`` down to singular sub-messages (Loc.path, layout.chunk_size)."""
    out: list[tuple[FieldDescriptor, ...]] = []
    for fd in desc.fields:
        out.append((fd,))
        if fd.type == FD.TYPE_MESSAGE and not fd.is_repeated and depth < 2 \
                and not fd.message_type.GetOptions().map_entry:
            out += [(fd, *rest) for rest in _leaves(fd.message_type, depth + 1)]
    return out


def mutated(base: Message) -> st.SearchStrategy[Message]:
    """``base`` with one or two of its fields (nested ones too) set hostile."""
    leaves = _leaves(base.DESCRIPTOR)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = type(base)()
        msg.CopyFrom(base)
        for _ in range(draw(st.integers(1, 2))):
            path = draw(st.sampled_from(leaves))
            holder = msg
            for fd in path[:-1]:
                holder = getattr(holder, fd.name)
            fd = path[-1]
            elem: st.SearchStrategy[Any] = (messages(fd.message_type, 1) if fd.type == FD.TYPE_MESSAGE
                                            else _scalar(fd, False))
            if fd.is_repeated:
                value = draw(st.lists(elem, max_size=3))
                del getattr(holder, fd.name)[:]
                getattr(holder, fd.name).extend(value)
            elif fd.type == FD.TYPE_MESSAGE:
                getattr(holder, fd.name).CopyFrom(draw(elem))
            else:
                setattr(holder, fd.name, draw(elem))
        return msg

    return build()


def _build(cls: type[Message], kw: dict[str, Any]) -> Message:
    msg = cls()
    for name, value in kw.items():
        fd = msg.DESCRIPTOR.fields_by_name[name]
        if fd.is_repeated:
            if fd.type == FD.TYPE_MESSAGE:
                getattr(msg, name).extend(value)
            else:
                getattr(msg, name).extend(value)
        elif fd.type == FD.TYPE_MESSAGE:
            getattr(msg, name).CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


def _class(desc: Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(desc)


# --- the replica -----------------------------------------------------------------------


def _metadata() -> tuple[tuple[str, str], ...]:
    token = os.environ.get("TIERFS_TOKEN", "")
    return (("authorization", f"Bearer {token}"),) if token else ()


class Target:
    """One replica, a channel to it and its digest."""

    def __init__(self, cluster: MetaCluster) -> None:
        self.cluster = cluster
        self.channel = grpc.insecure_channel(cluster.addresses[0], options=[
            ("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)])
        self.md = _metadata()
        self.calls: dict[str, Any] = {}
        self.outcomes: dict[str, dict[str, int]] = {}

    def call(self, method: MethodDescriptor, req: Message) -> Message:
        fn = self.calls.get(method.name)
        if fn is None:
            fn = self.calls[method.name] = self.channel.unary_unary(
                f"/{SERVICE.full_name}/{method.name}", request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=_class(method.output_type).FromString)
        return fn(req, timeout=CALL_TIMEOUT, metadata=self.md)  # type: ignore[no-any-return]

    def reseed(self) -> None:
        """(Re)make what the BASES aim at, where an earlier success removed or moved it."""
        for rpc, req in (("Mkdir", pb.MkdirRequest(loc=pb.Loc(path="/d"), mode=0o755)),
                         ("Create", pb.CreateRequest(loc=pb.Loc(path="/d/f"), mode=0o644)),
                         ("Mkdir", pb.MkdirRequest(loc=pb.Loc(path="/d/sub"), mode=0o755)),
                         ("Symlink", pb.SymlinkRequest(loc=pb.Loc(path="/d/s"), target="/d/f"))):
            with contextlib.suppress(grpc.RpcError):  # already there, or /d itself is gone
                self.call(SERVICE.methods_by_name[rpc], req)

    def digest(self) -> str:
        reply = self.call(SERVICE.methods_by_name["Digest"], pb.Empty())
        assert isinstance(reply, pb.DigestReply)
        return reply.digest


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root: Path = tmp_path_factory.mktemp("hostile")
    # No periodic tick: it may change the digest (the clock) between two calls.
    with MetaCluster(root, n=1, state_machine="meta", extra_args=["--tick-interval=3600"]) as c:
        c.wait_leader()
        t = Target(c)
        # Something to aim at: six storage nodes (ids 1-6), /d (inode 2), /d/f (3), /d/sub, /d/s.
        for i in range(6):
            t.call(SERVICE.methods_by_name["RegisterNode"], pb.RegisterNodeRequest(
                node_uuid=f"n{i}", hostname=f"h{i}", data_addr=f"127.0.0.1:{9000 + i}",
                targets=[pb.TargetSpec(path="/t0", capacity=1 << 40)]))
        t.reseed()
        yield t
        t.channel.close()
        assert c.replicas[0].alive, "the replica died"
        log = c.log(0)
        assert "Traceback" not in log, log[-4000:]
        print("\nhostile inputs, outcomes per RPC:", {k: v for k, v in sorted(t.outcomes.items())})


#: RPCs whose success would take the one-replica cluster apart (a member
#: that does not exist would cost the quorum); their refusals are still tried.
_NEVER_SUCCEED = {"AddMetaMember", "RemoveMetaMember"}


def _dialable(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit())


def test_every_rpc_is_covered() -> None:
    names = {m.name for m in SERVICE.methods}
    assert len(names) >= 38 and {"Mkdir", "Heartbeat", "CreateKVPool", "AddMetaMember"} <= names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rpc", [m.name for m in SERVICE.methods])
def test_hostile_inputs(target: Target, rpc: str) -> None:
    method = SERVICE.methods_by_name[rpc]
    base = BASES.get(rpc, _class(method.input_type)())
    requests = messages(method.input_type)
    if base.DESCRIPTOR.fields:
        requests = st.one_of(requests, mutated(base))
    if rpc in _NEVER_SUCCEED:
        requests = requests.filter(lambda r: not _dialable(r.raft_addr))
    target.reseed()
    counts = target.outcomes.setdefault(rpc, {"ok": 0, "refused": 0})
    state = {"digest": target.digest()}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not RANDOM,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    def one(req: Message) -> None:
        try:
            target.call(method, req)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), (
                f"{rpc}: {code} {exc.details()}")  # type: ignore[attr-defined]
            err = from_grpc(exc)
            assert isinstance(err, TierFSError) and not isinstance(err, InternalError), repr(err)
            assert str(err), f"{rpc}: an error without a message"
            after = target.digest()
            assert after == state["digest"], f"{rpc}: refused ({err}) but the state changed"
            counts["refused"] += 1
            return
        assert rpc not in _NEVER_SUCCEED, f"{rpc} accepted {req}"
        counts["ok"] += 1
        state["digest"] = target.digest()  # a legitimate success may change the state
        # ... but not into one that clients cannot use: every address in the map dials.
        cmap = target.call(SERVICE.methods_by_name["GetClusterMap"], pb.GetClusterMapRequest())
        assert isinstance(cmap, pb.ClusterMap)
        for node in cmap.nodes:
            parse_address(node.data_addr)

    one()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("rpc", "req"), [
    # Accepted before: the address then sat in every client's cluster map and
    # every client's next map refresh failed on it.
    ("RegisterNode", pb.RegisterNodeRequest(node_uuid="u", hostname="h", data_addr="nowhere",
                                            targets=[pb.TargetSpec(path="/t", capacity=1)])),
    ("RegisterNode", pb.RegisterNodeRequest(node_uuid="u", hostname="h", data_addr="127.0.0.1:1",
                                            control_addr="h:99999", targets=[pb.TargetSpec(path="/t")])),
    # INTERNAL before (a ValueError deep in the replicator).
    ("AddMetaMember", pb.MetaMemberRequest(raft_addr="")),
    ("AddMetaMember", pb.MetaMemberRequest(raft_addr="a b:1")),
    ("RemoveMetaMember", pb.MetaMemberRequest(raft_addr="127.0.0.1:1", grpc_addr="x")),
    # INTERNAL before: the error message named the state with a name it does not have.
    ("Heartbeat", pb.HeartbeatRequest(node_id=1, targets=[pb.TargetReport(target_id=1, state=99)])),
])
def test_found_bugs_stay_fixed(target: Target, rpc: str, req: Message) -> None:
    before = target.digest()
    with pytest.raises(grpc.RpcError) as info:
        target.call(SERVICE.methods_by_name[rpc], req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value  # type: ignore[attr-defined]
    assert target.digest() == before
