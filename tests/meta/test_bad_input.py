"""Bad input gets a clear error and changes nothing.

Each case is applied straight to the state machine (as if it had reached
the Raft log: ``apply`` must record the error and leave the digest as it
was), and a selection goes through the real gRPC service, which must refuse
it before submitting anything (the replicator's commit index stays put).
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import Message
from meta_helpers import Driver, meta_server, register_async, run

from tierfs.errors import (
    AlreadyExistsError,
    ConfigError,
    InvalidArgumentError,
    InvalidRenameError,
    IsADirectoryError_,
    NameTooLongError,
    NotADirectoryError_,
    NotFoundError,
    SessionExpiredError,
    TierFSError,
    error_from_code,
)
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20

# Inode ids in the fixture state (see populated()): / = 1, /d = 2, /d/f = 3,
# /d/sub = 4, /l = 5.
D, F, SUB = 2, 3, 4


def P(path: str) -> pb.Loc:
    return pb.Loc(path=path)


def populated() -> Driver:
    d = Driver()
    d.register()
    assert d.mkdir("/d").attr.inode == D
    assert d.create("/d/f").attr.inode == F
    assert d.mkdir("/d/sub").attr.inode == SUB
    d.do("symlink", pb.SymlinkRequest(loc=P("/l"), target="/d/f"))
    d.write("/d/f", 6 * MiB, [0, 1])
    return d


LONG = "x" * 256
MB_LONG = "é" * 128  # 256 bytes in UTF-8
DEEP = "/" + "/".join(["p" * 200] * 21)  # > 4096 bytes

CASES: list[tuple[str, str, Message, type[TierFSError]]] = [
    ("empty-name", "mkdir", pb.MkdirRequest(loc=pb.Loc(parent=1, name="")), InvalidArgumentError),
    ("empty-loc", "mkdir", pb.MkdirRequest(), InvalidArgumentError),
    ("slash-in-name", "create", pb.CreateRequest(loc=pb.Loc(parent=D, name="a/b")), InvalidArgumentError),
    ("nul-in-name", "create", pb.CreateRequest(loc=pb.Loc(parent=D, name="a\0b")), InvalidArgumentError),
    ("nul-in-path", "create", pb.CreateRequest(loc=P("/d/a\0b")), InvalidArgumentError),
    ("dot-name", "mkdir", pb.MkdirRequest(loc=pb.Loc(parent=D, name=".")), InvalidArgumentError),
    ("dotdot-name", "mkdir", pb.MkdirRequest(loc=pb.Loc(parent=D, name="..")), InvalidArgumentError),
    ("dotdot-in-path", "create", pb.CreateRequest(loc=P("/d/../x")), InvalidArgumentError),
    ("dot-in-path", "unlink", pb.UnlinkRequest(loc=P("/d/./f")), InvalidArgumentError),
    ("empty-component", "create", pb.CreateRequest(loc=P("/d//x")), InvalidArgumentError),
    ("name-too-long", "create", pb.CreateRequest(loc=P("/d/" + LONG)), NameTooLongError),
    ("name-too-long-utf8", "mkdir", pb.MkdirRequest(loc=pb.Loc(parent=D, name=MB_LONG)), NameTooLongError),
    ("path-too-long", "mkdir", pb.MkdirRequest(loc=P(DEEP)), NameTooLongError),
    ("relative-path", "create", pb.CreateRequest(loc=P("d/x")), InvalidArgumentError),
    ("two-forms", "create", pb.CreateRequest(loc=pb.Loc(path="/d/x", parent=D, name="x")), InvalidArgumentError),
    ("inode-form-for-entry-op", "unlink", pb.UnlinkRequest(loc=pb.Loc(inode=F)), InvalidArgumentError),
    ("name-without-parent", "mkdir", pb.MkdirRequest(loc=pb.Loc(name="x")), InvalidArgumentError),
    ("create-root", "mkdir", pb.MkdirRequest(loc=P("/")), InvalidArgumentError),
    ("rename-root", "rename", pb.RenameRequest(src=P("/"), dst=P("/x")), InvalidArgumentError),
    ("unknown-inode-setattr", "setattr", pb.SetAttrRequest(loc=pb.Loc(inode=999), set_mode=True), NotFoundError),
    ("unknown-parent", "mkdir", pb.MkdirRequest(loc=pb.Loc(parent=999, name="x")), NotFoundError),
    ("unknown-inode-truncate", "truncate", pb.TruncateRequest(loc=pb.Loc(inode=999)), NotFoundError),
    ("missing-parent", "create", pb.CreateRequest(loc=P("/nope/x")), NotFoundError),
    ("unlink-missing", "unlink", pb.UnlinkRequest(loc=P("/d/nope")), NotFoundError),
    ("rename-into-self", "rename", pb.RenameRequest(src=P("/d"), dst=P("/d/x")), InvalidRenameError),
    ("rename-into-subtree", "rename", pb.RenameRequest(src=P("/d"), dst=P("/d/sub/x")), InvalidRenameError),
    ("create-existing", "create", pb.CreateRequest(loc=P("/d/f")), AlreadyExistsError),
    ("mkdir-existing", "mkdir", pb.MkdirRequest(loc=P("/d/f")), AlreadyExistsError),
    ("symlink-existing", "symlink", pb.SymlinkRequest(loc=P("/d/sub"), target="x"), AlreadyExistsError),
    ("file-as-dir-path", "create", pb.CreateRequest(loc=P("/d/f/x")), NotADirectoryError_),
    ("file-as-dir-parent", "mkdir", pb.MkdirRequest(loc=pb.Loc(parent=F, name="x")), NotADirectoryError_),
    ("symlink-as-dir", "create", pb.CreateRequest(loc=P("/l/x")), NotADirectoryError_),
    ("rmdir-file", "rmdir", pb.RmdirRequest(loc=P("/d/f")), NotADirectoryError_),
    ("set-layout-on-file", "set_layout", pb.SetLayoutRequest(loc=P("/d/f"), layout=pb.Layout(chunk_size=MiB)),
     NotADirectoryError_),
    ("unlink-dir", "unlink", pb.UnlinkRequest(loc=P("/d/sub")), IsADirectoryError_),
    ("truncate-dir", "truncate", pb.TruncateRequest(loc=P("/d")), IsADirectoryError_),
    ("open-write-dir", "open_write", pb.OpenWriteRequest(loc=P("/d")), IsADirectoryError_),
    ("rename-file-over-dir", "rename", pb.RenameRequest(src=P("/d/f"), dst=P("/d/sub")), IsADirectoryError_),
    ("rename-dir-over-file", "rename", pb.RenameRequest(src=P("/d/sub"), dst=P("/d/f")), NotADirectoryError_),
    ("truncate-symlink", "truncate", pb.TruncateRequest(loc=P("/l")), InvalidArgumentError),
    ("chunk-not-pow2", "create", pb.CreateRequest(loc=P("/d/x"), has_layout=True,
                                                  layout=pb.Layout(chunk_size=3 * MiB)), ConfigError),
    ("chunk-too-small", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(chunk_size=32 * 1024)),
     ConfigError),
    ("chunk-too-big", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(chunk_size=128 * MiB)),
     ConfigError),
    ("ec-k0", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(redundancy="ec:0+2")), ConfigError),
    ("ec-m0", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(redundancy="ec:4+0")), ConfigError),
    ("ec-too-wide", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(redundancy="ec:30+5")),
     ConfigError),
    ("replica-0", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(redundancy="replica:0")),
     ConfigError),
    ("unknown-scheme", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(redundancy="raid5")),
     ConfigError),
    ("kind-contradicts", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(
        kind=pb.REDUNDANCY_KIND_EC, data_shards=4, parity_shards=2, redundancy="ec:8+2")), ConfigError),
    ("shards-without-kind", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(data_shards=4)),
     ConfigError),
    ("stripe-too-wide", "set_layout", pb.SetLayoutRequest(loc=P("/d"), layout=pb.Layout(stripe_width=5000)),
     ConfigError),
    ("groups-given", "create", pb.CreateRequest(loc=P("/d/x"), has_layout=True, layout=pb.Layout(groups=[1])),
     ConfigError),
    ("mode-bits", "mkdir", pb.MkdirRequest(loc=P("/d/x"), mode=0o170755), InvalidArgumentError),
    ("setattr-mode-bits", "setattr", pb.SetAttrRequest(loc=P("/d/f"), set_mode=True, mode=1 << 20),
     InvalidArgumentError),
    ("symlink-empty-target", "symlink", pb.SymlinkRequest(loc=P("/d/x"), target=""), InvalidArgumentError),
    ("symlink-nul-target", "symlink", pb.SymlinkRequest(loc=P("/d/x"), target="a\0"), InvalidArgumentError),
    ("symlink-long-target", "symlink", pb.SymlinkRequest(loc=P("/d/x"), target="t" * 5000), NameTooLongError),
    ("truncate-huge", "truncate", pb.TruncateRequest(loc=P("/d/f"), size=1 << 62), InvalidArgumentError),
    ("commit-session-0", "commit_write", pb.CommitWriteRequest(session_id=0), InvalidArgumentError),
    ("commit-unknown-session", "commit_write", pb.CommitWriteRequest(
        session_id=4242, size=1, chunks=[pb.ChunkRecord(index=0, generation=1 << 20, length=1)]),
     SessionExpiredError),
    ("abort-unknown-session", "abort_write", pb.AbortWriteRequest(session_id=4242), SessionExpiredError),
    ("register-no-uuid", "register_node", pb.RegisterNodeRequest(
        hostname="h", data_addr="a", targets=[pb.TargetSpec(path="/x")]), InvalidArgumentError),
    ("register-no-targets", "register_node", pb.RegisterNodeRequest(node_uuid="u", hostname="h", data_addr="a"),
     InvalidArgumentError),
    ("register-dup-paths", "register_node", pb.RegisterNodeRequest(
        node_uuid="u", hostname="h", data_addr="a", targets=[pb.TargetSpec(path="/x"), pb.TargetSpec(path="/x")]),
     InvalidArgumentError),
    ("heartbeat-node-0", "heartbeat", pb.HeartbeatRequest(), InvalidArgumentError),
    ("heartbeat-claims-offline", "heartbeat", pb.HeartbeatRequest(node_id=1, targets=[pb.TargetReport(
        target_id=1, state=pb.TARGET_STATE_OFFLINE)]), InvalidArgumentError),
    ("heartbeat-unknown-node", "heartbeat", pb.HeartbeatRequest(node_id=99), NotFoundError),
    # A state number this version has no name for (found by test_hostile_inputs: was a ValueError).
    ("heartbeat-unknown-state", "heartbeat", pb.HeartbeatRequest(node_id=1, targets=[pb.TargetReport(
        target_id=1, state=99)]), InvalidArgumentError),
]


@pytest.mark.parametrize(("kind", "req", "exc"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_state_machine_rejects_and_changes_nothing(kind: str, req: Message, exc: type[TierFSError]) -> None:
    d = populated()
    before = d.sm.digest()
    d.advance(5)  # a later clock in the op must not leak into the state either
    res = pb.MetaResult.FromString(d.raw(kind, req))
    assert res.error.code != 0, f"{kind} was accepted"
    err = error_from_code(res.error.code, res.error.message)
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert err.message
    assert d.sm.digest() == before


def test_op_without_body_and_garbage() -> None:
    d = populated()
    before = d.sm.digest()
    res = pb.MetaResult.FromString(d.sm.apply(pb.MetaOp(now_ns=d.now + 1).SerializeToString()))
    assert isinstance(error_from_code(res.error.code, res.error.message), InvalidArgumentError)
    assert d.sm.digest() == before


def test_reads_reject_bad_locations() -> None:
    d = populated()
    with pytest.raises(NotFoundError, match="no inode 999"):
        d.sm.stat(pb.Loc(inode=999))
    with pytest.raises(InvalidArgumentError):
        d.sm.stat(pb.Loc(path="relative"))
    with pytest.raises(NotADirectoryError_):
        d.sm.readdir(P("/d/f"))
    with pytest.raises(NotADirectoryError_):
        d.sm.lookup(F, "x")
    with pytest.raises(InvalidArgumentError):
        d.sm.lookup(D, "..")
    with pytest.raises(InvalidArgumentError):
        d.sm.readlink(P("/d"))


def test_name_of_exactly_255_bytes_is_fine() -> None:
    d = populated()
    d.create("/d/" + "n" * 255)
    d.mkdir("/d/" + "é" * 127 + "x")


GRPC_CASES: list[tuple[str, Any, type[TierFSError]]] = [
    ("mkdir", ("/d/..",), InvalidArgumentError),
    ("mkdir", ("/d/" + LONG,), NameTooLongError),
    ("create", ("d/x",), InvalidArgumentError),
    ("create", ((D, "a/b"),), InvalidArgumentError),
    ("create", ("/d/f",), AlreadyExistsError),
    ("create", ("/d/f/x",), NotADirectoryError_),
    ("unlink", ("/d/sub",), IsADirectoryError_),
    ("rename", ("/d", "/d/sub/z"), InvalidRenameError),
    ("setattr", (999,), NotFoundError),
    ("set_layout", ("/d",), ConfigError),
    ("symlink", ("/d/s", ""), InvalidArgumentError),
]


@pytest.mark.timeout(60)
def test_grpc_rejects_before_submitting() -> None:
    async def main() -> None:
        async with meta_server() as (mc, _svc, _addr):
            await register_async(mc)
            await mc.mkdir("/d")
            await mc.create("/d/f")
            await mc.mkdir("/d/sub")
            before = await mc.digest()
            for method, args, exc in GRPC_CASES:
                kw: dict[str, Any] = {"redundancy": "ec:0+1"} if method == "set_layout" else {}
                if method == "setattr":
                    kw = {"mode": 0o600}
                with pytest.raises(exc):
                    await getattr(mc, method)(*args, **kw)
            after = await mc.digest()
            assert after.digest == before.digest
            # validated in the service: nothing reached the log except the ops that
            # need state to be refused (exists, not-a-directory, ...)
            assert after.applied_index - before.applied_index == 5
            with pytest.raises(InvalidArgumentError):
                await mc.stat("relative/path")
            with pytest.raises(InvalidArgumentError):
                await MetaClient.stat(mc, True)  # a bool is not an inode id
    run(main())
