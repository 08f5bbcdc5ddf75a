"""POSIX permissions in the meta state machine (docs/security-authz.md):
ops built with a ``MetaOp.caller`` for users A and B, root and others, as
the service stamps them. Every denial is checked to change nothing (digest
before and after), and the log, denials included, replays to the same
state on a fresh replica."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf.message import Message
from meta_helpers import Driver, R, recs

from tierfs.errors import NotPermittedError, PermissionDeniedError, error_from_code
from tierfs.meta import MetaStateMachine
from tierfs.meta.perms import NOBODY, caller_pb, squash
from tierfs.meta.perms import R as MAY_R
from tierfs.meta.perms import W as MAY_W
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.security import ROOT, Identity

pytestmark = pytest.mark.timeout(30)

A = Identity("alice", 1001, 1001, (3000,), False, "user")
B = Identity("bob", 1002, 1002, (3000, 3001), False, "user")
C = Identity("carol", 1003, 1003, (), False, "user")
ADMIN_USER = Identity("ops", 1100, 1100, (), True, "user")
ZERO = Identity("zero", 0, 0, (), False, "user")  # a user record made with uid 0


def L(path: str) -> pb.Loc:
    return pb.Loc(path=path)


class Users(Driver):
    """A Driver whose ops run as a given identity (``MetaOp.caller``)."""

    def as_(self, who: Identity, kind: str, req: Message, reply_cls: type[R] = pb.Empty) -> R:  # type: ignore[assignment]
        op = pb.MetaOp(now_ns=self.now, caller=caller_pb(who))
        getattr(op, kind).CopyFrom(req)
        data = op.SerializeToString(deterministic=True)
        self.log.append(data)
        res = pb.MetaResult.FromString(self.sm.apply(data))
        if res.error.code:
            raise error_from_code(res.error.code, res.error.message)
        return reply_cls.FromString(res.reply)

    def denied(self, who: Identity, kind: str, req: Message, exc: type[PermissionDeniedError] = PermissionDeniedError,
               *, words: tuple[str, ...] = ()) -> PermissionDeniedError:
        """``kind`` as ``who`` is refused with ``exc`` and changes nothing."""
        before = self.sm.digest()
        with pytest.raises(exc) as info:
            self.as_(who, kind, req)
        assert self.sm.digest() == before, f"denied {kind} changed the state"
        msg = str(info.value)
        # setattr's messages name what was refused: chmod, chown, utimes
        ops = ("setattr", "chmod", "chown", "utimes") if kind == "setattr" else (kind,)
        assert any(f"{o} " in msg for o in ops), msg
        for w in words:
            assert w in msg, (w, msg)
        if exc is PermissionDeniedError:
            assert type(info.value) is PermissionDeniedError and info.value.errno == errno.EACCES, msg
        return info.value

    # conveniences as a user
    def mkdir_as(self, who: Identity, path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> pb.FileInfo:
        return self.as_(who, "mkdir", pb.MkdirRequest(loc=L(path), mode=mode, uid=uid, gid=gid), pb.FileInfo)

    def create_as(self, who: Identity, path: str, mode: int = 0o644, uid: int = 0, gid: int = 0) -> pb.FileInfo:
        return self.as_(who, "create", pb.CreateRequest(loc=L(path), mode=mode, uid=uid, gid=gid), pb.FileInfo)

    def chmod_as(self, who: Identity, path: str, mode: int) -> pb.FileInfo:
        return self.as_(who, "setattr", pb.SetAttrRequest(loc=L(path), set_mode=True, mode=mode), pb.FileInfo)


@pytest.fixture
def d() -> Iterator[Users]:
    """/home/a (A's, 0755), /home/b (B's, 0755) holding B's 0600 file
    ``secret`` and B's 0700 directory ``priv`` (with ``priv/f``), and /tmp
    (root's, 01777)."""
    drv = Users()
    drv.register()
    drv.mkdir_as(ROOT, "/home")
    drv.mkdir_as(ROOT, "/home/a", 0o755, A.uid, A.gid)
    drv.mkdir_as(ROOT, "/home/b", 0o755, B.uid, B.gid)
    drv.mkdir_as(ROOT, "/tmp", 0o1777)
    drv.create_as(B, "/home/b/secret", 0o600)
    drv.mkdir_as(B, "/home/b/priv", 0o700)
    drv.create_as(B, "/home/b/priv/f", 0o644)
    yield drv
    # Every replica applying the same log, denials included, agrees.
    replay = MetaStateMachine()
    for op in drv.log:
        replay.apply(op)
    assert replay.digest() == drv.sm.digest()


def ino(d: Users, path: str) -> int:
    return d.sm.stat(L(path)).attr.inode


def test_new_inodes_belong_to_the_caller_not_the_request(d: Users) -> None:
    s = d.stat("/home/b/secret").attr
    assert (s.uid, s.gid, s.mode) == (B.uid, B.gid, 0o600)
    # A user cannot give a new file away (the request's fields are ignored) ...
    f = d.create_as(A, "/home/a/f", 0o640, uid=0, gid=0).attr
    assert (f.uid, f.gid) == (A.uid, A.gid)
    # ... root and admins can (and zero means the caller's own).
    assert (d.create_as(ROOT, "/home/a/g", uid=7, gid=8).attr.uid, d.stat("/home/a/g").attr.gid) == (7, 8)
    assert d.create_as(ADMIN_USER, "/home/a/h").attr.uid == ADMIN_USER.uid
    assert d.create_as(ADMIN_USER, "/home/a/i", uid=5).attr.uid == 5
    sl = d.as_(A, "symlink", pb.SymlinkRequest(loc=L("/home/a/l"), target="f", uid=9), pb.FileInfo).attr
    assert (sl.uid, sl.mode) == (A.uid, 0o777)


def test_a_cannot_read_write_rename_or_unlink_bs_private_file(d: Users) -> None:
    secret = ino(d, "/home/b/secret")
    # stat needs only search permission on the directory (as stat(2)) ...
    assert d.sm.stat(L("/home/b/secret"), ident=A).attr.mode == 0o600
    # ... but no read capability would be minted.
    assert not d.sm.may_read(A, secret) and not d.sm.access(A, secret, MAY_W)
    assert d.sm.may_read(B, secret) and d.sm.access(B, secret, MAY_R | MAY_W) and d.sm.may_read(ROOT, secret)
    d.denied(A, "open_write", pb.OpenWriteRequest(loc=L("/home/b/secret"), owner="a"),
             words=("/home/b/secret", "write (w)", "alice", "mode 0600"))
    d.denied(A, "open_write", pb.OpenWriteRequest(loc=pb.Loc(inode=secret), owner="a"))
    d.denied(A, "truncate", pb.TruncateRequest(loc=L("/home/b/secret"), size=0))
    d.denied(A, "rename", pb.RenameRequest(src=L("/home/b/secret"), dst=L("/home/a/mine")),
             words=("directory /home/b", "write and search"))
    d.denied(A, "unlink", pb.UnlinkRequest(loc=L("/home/b/secret")))
    d.denied(A, "unlink", pb.UnlinkRequest(loc=pb.Loc(parent=ino(d, "/home/b"), name="secret")))
    d.denied(A, "setattr", pb.SetAttrRequest(loc=L("/home/b/secret"), set_mode=True, mode=0o666), NotPermittedError,
             words=("chmod", "owner"))
    # Nor may A put a file over it from its own directory.
    d.create_as(A, "/home/a/x")
    d.denied(A, "rename", pb.RenameRequest(src=L("/home/a/x"), dst=L("/home/b/secret")))
    # B (and root) may do all of it.
    s = d.as_(B, "open_write", pb.OpenWriteRequest(loc=L("/home/b/secret"), owner="b"), pb.OpenWriteReply)
    d.as_(B, "commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=1 << 20,
                                                   chunks=recs(s.data_version, [0])), pb.FileInfo)
    d.as_(B, "truncate", pb.TruncateRequest(loc=L("/home/b/secret"), size=10), pb.FileInfo)
    d.as_(B, "rename", pb.RenameRequest(src=L("/home/b/secret"), dst=L("/home/b/s2")))
    d.as_(ROOT, "unlink", pb.UnlinkRequest(loc=L("/home/b/s2")))


def test_a_cannot_list_or_enter_bs_private_directory(d: Users) -> None:
    priv, f = ino(d, "/home/b/priv"), ino(d, "/home/b/priv/f")
    assert [e.name for e in d.sm.readdir(L("/home/b/priv"), ident=B).entries] == ["f"]
    for loc in (L("/home/b/priv"), pb.Loc(inode=priv)):
        with pytest.raises(PermissionDeniedError, match=r"readdir .*alice .*read \(r\) permission on directory "
                                                        r"/home/b/priv \(mode 0700, owner 1002:1002\)"):
            d.sm.readdir(loc, ident=A)
    # Whichever way the file inside is named, the directory's search bit
    # stands in the way - and a name that does not exist is no different
    # from one that does (no existence leak).
    for loc in (L("/home/b/priv/f"), pb.Loc(parent=priv, name="f"), pb.Loc(inode=f), L("/home/b/priv/none"),
                pb.Loc(parent=priv, name="none")):
        with pytest.raises(PermissionDeniedError, match="search"):
            d.sm.stat(loc, ident=A)
    with pytest.raises(PermissionDeniedError):
        d.sm.lookup(priv, "f", ident=A)
    with pytest.raises(PermissionDeniedError):
        d.sm.get_layout(pb.Loc(inode=f), ident=A)
    assert not d.sm.may_read(A, f)
    d.denied(A, "create", pb.CreateRequest(loc=L("/home/b/priv/new")))
    d.denied(A, "open_write", pb.OpenWriteRequest(loc=pb.Loc(inode=f)), words=("search (x)", "/home/b/priv"))
    d.denied(A, "setattr", pb.SetAttrRequest(loc=pb.Loc(inode=f), set_mtime=True, mtime_ns=1))
    d.denied(A, "mkdir", pb.MkdirRequest(loc=pb.Loc(parent=priv, name="d")))


def test_search_permission_along_the_path(d: Users) -> None:
    # priv/pub is wide open, but priv above it is not: nothing below priv
    # is reachable for A, by path, by parent+name or by inode.
    d.mkdir_as(B, "/home/b/priv/pub", 0o777)
    d.create_as(B, "/home/b/priv/pub/f", 0o666)
    d.as_(B, "symlink", pb.SymlinkRequest(loc=L("/home/b/priv/pub/ln"), target="f"), pb.FileInfo)
    pub, f = ino(d, "/home/b/priv/pub"), ino(d, "/home/b/priv/pub/f")
    for loc in (L("/home/b/priv/pub/f"), pb.Loc(parent=pub, name="f"), pb.Loc(inode=f), pb.Loc(inode=pub)):
        with pytest.raises(PermissionDeniedError, match=r"search \(x\) permission on directory /home/b/priv "):
            d.sm.stat(loc, ident=A)
    with pytest.raises(PermissionDeniedError):
        d.sm.readdir(pb.Loc(inode=pub), ident=A)
    with pytest.raises(PermissionDeniedError):
        d.sm.readlink(L("/home/b/priv/pub/ln"), ident=A)
    assert not d.sm.access(A, f, MAY_R | MAY_W)
    d.denied(A, "truncate", pb.TruncateRequest(loc=pb.Loc(inode=f), size=0))
    d.denied(A, "unlink", pb.UnlinkRequest(loc=pb.Loc(parent=pub, name="f")))
    d.denied(A, "rename", pb.RenameRequest(src=pb.Loc(parent=pub, name="f"), dst=L("/home/a/f")))
    # Search without read (0711): A reaches what it knows the name of, but
    # cannot list priv.
    d.chmod_as(B, "/home/b/priv", 0o711)
    assert d.sm.stat(pb.Loc(inode=f), ident=A).attr.inode == f
    assert d.sm.readlink(L("/home/b/priv/pub/ln"), ident=A) == "f"
    assert d.sm.access(A, f, MAY_R | MAY_W)
    d.as_(A, "truncate", pb.TruncateRequest(loc=L("/home/b/priv/pub/f"), size=5), pb.FileInfo)
    with pytest.raises(PermissionDeniedError):
        d.sm.readdir(L("/home/b/priv"), ident=A)
    # Read without search (0744): the names (and inode and type), no attributes.
    d.chmod_as(B, "/home/b/priv", 0o744)
    ents = d.sm.readdir(L("/home/b/priv"), ident=A).entries
    assert [(e.name, e.attr.inode, e.attr.type, e.attr.mode) for e in ents] == [
        ("f", ino(d, "/home/b/priv/f"), pb.INODE_TYPE_FILE, 0), ("pub", pub, pb.INODE_TYPE_DIRECTORY, 0)]
    assert not any(e.HasField("layout") for e in ents)
    with pytest.raises(PermissionDeniedError):
        d.sm.stat(L("/home/b/priv/f"), ident=A)
    # The index behind inode-named checks follows renames across directories.
    d.chmod_as(B, "/home/b/priv", 0o755)
    d.as_(B, "rename", pb.RenameRequest(src=L("/home/b/secret"), dst=L("/home/b/priv/pub/secret")))
    d.chmod_as(B, "/home/b/priv", 0o700)
    with pytest.raises(PermissionDeniedError):
        d.sm.stat(pb.Loc(inode=ino(d, "/home/b/priv/pub/secret")), ident=A)


def test_sticky_directory(d: Users) -> None:
    d.create_as(A, "/tmp/a")
    d.create_as(B, "/tmp/b", 0o666)
    d.mkdir_as(B, "/tmp/bdir")
    sticky: dict[str, Any] = {"exc": NotPermittedError, "words": ("sticky",)}
    err = d.denied(A, "unlink", pb.UnlinkRequest(loc=L("/tmp/b")), **sticky)
    assert err.errno == errno.EPERM
    d.denied(A, "rmdir", pb.RmdirRequest(loc=L("/tmp/bdir")), **sticky)
    d.denied(A, "rename", pb.RenameRequest(src=L("/tmp/b"), dst=L("/tmp/b2")), **sticky)
    d.denied(A, "rename", pb.RenameRequest(src=L("/tmp/b"), dst=L("/home/a/b")), **sticky)
    # Replacing another's entry is removing it.
    d.denied(A, "rename", pb.RenameRequest(src=L("/tmp/a"), dst=L("/tmp/b")), **sticky)
    # Writing B's 0666 file is still allowed: the sticky bit guards entries.
    d.as_(A, "truncate", pb.TruncateRequest(loc=L("/tmp/b"), size=0), pb.FileInfo)
    # Own entries: fine; the directory's owner (root here) may remove any.
    d.as_(A, "rename", pb.RenameRequest(src=L("/tmp/a"), dst=L("/tmp/a2")))
    d.as_(A, "unlink", pb.UnlinkRequest(loc=L("/tmp/a2")))
    d.as_(ROOT, "unlink", pb.UnlinkRequest(loc=L("/tmp/b")))
    # A sticky directory of a user: its owner may remove others' entries.
    d.mkdir_as(B, "/home/b/drop", 0o1777)
    d.create_as(A, "/home/b/drop/from-a")
    d.denied(C, "unlink", pb.UnlinkRequest(loc=L("/home/b/drop/from-a")), **sticky)
    d.as_(B, "unlink", pb.UnlinkRequest(loc=L("/home/b/drop/from-a")))
    # Without the sticky bit, write permission on the directory is enough.
    d.mkdir_as(B, "/home/b/open", 0o777)
    d.create_as(A, "/home/b/open/x", 0o600)
    d.as_(C, "unlink", pb.UnlinkRequest(loc=L("/home/b/open/x")))


def test_chmod_rules(d: Users) -> None:
    d.create_as(A, "/home/a/f")
    assert d.chmod_as(A, "/home/a/f", 0o600).attr.mode == 0o600
    err = d.denied(B, "setattr", pb.SetAttrRequest(loc=L("/home/a/f"), set_mode=True, mode=0o666), NotPermittedError,
                   words=("chmod /home/a/f", "only the owner (uid 1001) or root"))
    assert err.errno == errno.EPERM
    assert d.chmod_as(ROOT, "/home/a/f", 0o4755).attr.mode == 0o4755
    # setgid on a file whose group the owner is not in: the bit is dropped.
    d.as_(ROOT, "setattr", pb.SetAttrRequest(loc=L("/home/a/f"), set_gid=True, gid=4000))
    assert d.chmod_as(A, "/home/a/f", 0o2755).attr.mode == 0o0755
    assert d.chmod_as(ROOT, "/home/a/f", 0o2755).attr.mode == 0o2755


def test_chown_rules(d: Users) -> None:
    d.create_as(A, "/home/a/f", 0o755)
    d.mkdir_as(A, "/home/a/d", 0o2775)
    for req in (pb.SetAttrRequest(loc=L("/home/a/f"), set_uid=True, uid=B.uid),
                pb.SetAttrRequest(loc=L("/home/a/f"), set_uid=True, uid=0)):
        err = d.denied(A, "setattr", req, NotPermittedError, words=("chown", "only root may change the owner"))
        assert err.errno == errno.EPERM
    d.denied(A, "setattr", pb.SetAttrRequest(loc=L("/home/a/f"), set_gid=True, gid=3001), NotPermittedError,
             words=("not in group 3001",))
    d.denied(B, "setattr", pb.SetAttrRequest(loc=L("/home/a/f"), set_gid=True, gid=3000), NotPermittedError,
             words=("only the owner",))
    d.denied(B, "setattr", pb.SetAttrRequest(loc=L("/home/a/f"), set_uid=True, uid=A.uid), NotPermittedError)
    # The owner gives the file to one of its own groups; chown to itself is a no-op.
    assert d.as_(A, "setattr", pb.SetAttrRequest(loc=L("/home/a/f"), set_gid=True, gid=3000), pb.FileInfo).attr.gid == 3000
    d.as_(A, "setattr", pb.SetAttrRequest(loc=L("/home/a/f"), set_uid=True, uid=A.uid), pb.FileInfo)
    # Root changes the owner; chown of a file clears setuid, and setgid
    # where group execute is set (also for root), not on directories.
    d.chmod_as(ROOT, "/home/a/f", 0o6755)
    f = d.as_(ROOT, "setattr", pb.SetAttrRequest(loc=L("/home/a/f"), set_uid=True, uid=B.uid), pb.FileInfo).attr
    assert (f.uid, f.mode) == (B.uid, 0o0755)
    d.chmod_as(ROOT, "/home/a/f", 0o6745)
    assert d.as_(B, "setattr", pb.SetAttrRequest(loc=L("/home/a/f"), set_gid=True, gid=3001),
                 pb.FileInfo).attr.mode == 0o2745  # setgid without group execute stays
    dd = d.as_(ROOT, "setattr", pb.SetAttrRequest(loc=L("/home/a/d"), set_uid=True, uid=C.uid), pb.FileInfo).attr
    assert (dd.uid, dd.mode) == (C.uid, 0o2775)


def test_utimes_needs_ownership_or_write(d: Users) -> None:
    d.create_as(A, "/home/a/ro", 0o644)
    d.create_as(A, "/home/a/gw", 0o664)
    d.as_(A, "setattr", pb.SetAttrRequest(loc=L("/home/a/gw"), set_gid=True, gid=3000))
    d.denied(B, "setattr", pb.SetAttrRequest(loc=L("/home/a/ro"), set_mtime=True, mtime_ns=5), words=("utimes",))
    assert d.as_(B, "setattr", pb.SetAttrRequest(loc=L("/home/a/gw"), set_mtime=True, mtime_ns=5),
                 pb.FileInfo).attr.mtime_ns == 5
    assert d.as_(A, "setattr", pb.SetAttrRequest(loc=L("/home/a/ro"), set_mtime=True, mtime_ns=6),
                 pb.FileInfo).attr.mtime_ns == 6


def test_group_and_other_bits(d: Users) -> None:
    d.mkdir_as(A, "/home/a/team", 0o770)
    d.as_(A, "setattr", pb.SetAttrRequest(loc=L("/home/a/team"), set_gid=True, gid=3000))
    # B is in group 3000, C is not.
    d.create_as(B, "/home/a/team/by-b")
    d.denied(C, "create", pb.CreateRequest(loc=L("/home/a/team/by-c")))
    # The first class that matches decides: an owner without owner bits is
    # refused even though "other" would allow.
    d.create_as(A, "/home/a/odd", 0o047)
    d.as_(ROOT, "truncate", pb.TruncateRequest(loc=L("/home/a/odd"), size=1), pb.FileInfo)  # not fresh any more
    d.denied(A, "open_write", pb.OpenWriteRequest(loc=L("/home/a/odd")), words=("write",))
    d.as_(C, "open_write", pb.OpenWriteRequest(loc=L("/home/a/odd")), pb.OpenWriteReply)


def test_setgid_directory(d: Users) -> None:
    d.mkdir_as(B, "/home/b/proj", 0o2777)
    d.as_(B, "setattr", pb.SetAttrRequest(loc=L("/home/b/proj"), set_gid=True, gid=3000))
    f = d.create_as(A, "/home/b/proj/f", 0o664).attr
    sub = d.mkdir_as(A, "/home/b/proj/sub", 0o775).attr
    assert (f.uid, f.gid, f.mode) == (A.uid, 3000, 0o664)
    assert (sub.uid, sub.gid, sub.mode) == (A.uid, 3000, 0o2775)  # the bit is inherited
    assert d.create_as(A, "/home/b/proj/sub/deeper").attr.gid == 3000
    # A non-member creating a setgid file in the group loses the bit; a member keeps it.
    assert d.create_as(C, "/home/b/proj/c", 0o2755).attr.mode == 0o0755
    assert d.create_as(A, "/home/b/proj/a2", 0o2755).attr.mode == 0o2755
    # Root's explicit gid is overridden by the directory's too.
    assert d.create_as(ROOT, "/home/b/proj/r", gid=9).attr.gid == 3000


def test_root_squash(d: Users) -> None:
    squashed = squash(ZERO, True)
    assert (squashed.uid, squashed.gid, squashed.groups) == (NOBODY, NOBODY, ())
    assert squash(ZERO, False) == ZERO
    for never in (ROOT, ADMIN_USER, Identity("n", 0, 0, (), False, "node"), Identity("anon", 0, 0, (), True, "anonymous")):
        assert squash(never, True) == never
    d.create_as(ROOT, "/rootfile", 0o644)
    # Squashed, uid 0 is nobody: no write in root's directories or files.
    d.denied(squashed, "create", pb.CreateRequest(loc=L("/x")), words=("uid 65534",))
    d.denied(squashed, "open_write", pb.OpenWriteRequest(loc=L("/rootfile")))
    d.denied(squashed, "unlink", pb.UnlinkRequest(loc=L("/home/b/secret")))
    assert not d.sm.may_read(squashed, ino(d, "/home/b/secret"))
    made = d.create_as(squashed, "/tmp/z").attr
    assert (made.uid, made.gid) == (NOBODY, NOBODY)
    # Unsquashed (root_squash = false), a uid-0 user is root for permissions.
    d.as_(ZERO, "unlink", pb.UnlinkRequest(loc=L("/home/b/secret")))
    assert d.sm.may_read(ZERO, ino(d, "/home/b/priv/f"))


def test_set_layout_outside_ones_own_tree_needs_admin(d: Users) -> None:
    lay = pb.Layout(redundancy="replica:3")
    d.as_(A, "set_layout", pb.SetLayoutRequest(loc=L("/home/a"), layout=lay), pb.LayoutReply)
    for path in ("/", "/home", "/home/b", "/tmp"):
        d.denied(A, "set_layout", pb.SetLayoutRequest(loc=L(path), layout=lay), NotPermittedError,
                 words=("admin",))
    d.as_(ADMIN_USER, "set_layout", pb.SetLayoutRequest(loc=L("/home/b"), layout=lay), pb.LayoutReply)
    d.as_(ROOT, "set_layout", pb.SetLayoutRequest(loc=L("/"), layout=lay), pb.LayoutReply)
    assert d.sm.get_layout(L("/home/a/"), ident=A).redundancy == "replica:3"


def test_write_sessions_belong_to_writers(d: Users) -> None:
    s = d.as_(B, "open_write", pb.OpenWriteRequest(loc=L("/home/b/secret"), owner="b"), pb.OpenWriteReply)
    # Session ids are guessable: another user can neither renew, commit nor abort it.
    d.denied(A, "renew_lease", pb.RenewLeaseRequest(session_id=s.session_id), words=(f"session {s.session_id}",))
    d.denied(A, "commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=1 << 20,
                                                      chunks=recs(s.data_version, [0])))
    d.denied(A, "abort_write", pb.AbortWriteRequest(session_id=s.session_id))
    d.as_(B, "renew_lease", pb.RenewLeaseRequest(session_id=s.session_id), pb.RenewLeaseReply)
    d.as_(B, "abort_write", pb.AbortWriteRequest(session_id=s.session_id))


def test_create_then_write_a_read_only_file(d: Users) -> None:
    # open(O_CREAT|O_WRONLY, 0444) writes through the descriptor it returns:
    # the client's create + open_write pair gets the same for the owner's
    # first write of a file never written, and nothing more.
    d.create_as(A, "/home/a/ro", 0o444)
    d.denied(B, "open_write", pb.OpenWriteRequest(loc=L("/home/a/ro")))  # B is not the owner
    s = d.as_(A, "open_write", pb.OpenWriteRequest(loc=L("/home/a/ro")), pb.OpenWriteReply)
    d.as_(A, "commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=1 << 20,
                                                   chunks=recs(s.data_version, [0])), pb.FileInfo)
    d.denied(A, "open_write", pb.OpenWriteRequest(loc=L("/home/a/ro")))
    d.denied(A, "truncate", pb.TruncateRequest(loc=L("/home/a/ro"), size=0))


def test_entry_ops_need_write_and_search_on_the_directory(d: Users) -> None:
    d.mkdir_as(A, "/home/a/ro", 0o555)
    d.create_as(ROOT, "/home/a/ro/f", uid=A.uid, gid=A.gid)
    d.mkdir_as(ROOT, "/home/a/ro/sub", uid=A.uid, gid=A.gid)
    for kind, req in (("create", pb.CreateRequest(loc=L("/home/a/ro/g"))),
                      ("mkdir", pb.MkdirRequest(loc=L("/home/a/ro/g"))),
                      ("symlink", pb.SymlinkRequest(loc=L("/home/a/ro/g"), target="f")),
                      ("unlink", pb.UnlinkRequest(loc=L("/home/a/ro/f"))),
                      ("rmdir", pb.RmdirRequest(loc=L("/home/a/ro/sub"))),
                      ("rename", pb.RenameRequest(src=L("/home/a/ro/f"), dst=L("/home/a/ro/g"))),
                      ("rename", pb.RenameRequest(src=L("/home/a/ro/f"), dst=L("/home/a/g")))):
        d.denied(A, kind, req, words=("directory /home/a/ro", "write and search (w+x)"))
    # A directory moved to another parent needs write on itself (its "..").
    d.mkdir_as(A, "/home/a/x", 0o555)
    d.denied(A, "rename", pb.RenameRequest(src=L("/home/a/x"), dst=L("/tmp/x")), words=("directory /home/a/x",))
    d.as_(A, "rename", pb.RenameRequest(src=L("/home/a/x"), dst=L("/home/a/y")))  # same parent: fine
    # Existence is decided before write permission (EEXIST, as Linux).
    with pytest.raises(FileExistsError):
        d.as_(A, "create", pb.CreateRequest(loc=L("/home/a/ro/f")))
