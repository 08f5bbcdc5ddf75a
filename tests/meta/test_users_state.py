"""Users and token hashes in the replicated meta state: the ops, their
refusals (which change nothing), snapshots and digests (docs/security.md)."""

from __future__ import annotations

import pytest
from meta_helpers import SEC, Driver

from tierfs.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
)
from tierfs.meta import MetaStateMachine
from tierfs.meta.auth import Authenticator
from tierfs.meta.users import MAX_TOKENS_PER_USER
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.security import admin_token, hash_token, new_user_token, node_key


def _add(d: Driver, name: str, uid: int = 1000, *, admin: bool = False, expires_ms: int = 0,
         groups: tuple[int, ...] = ()) -> tuple[str, pb.UserTokenReply]:
    tok = new_user_token(name)
    r = d.do("add_user", pb.AddUserRequest(name=name, uid=uid, gid=uid, groups=list(groups), admin=admin,
                                           expires_ms=expires_ms, token_hash=hash_token(tok)), pb.UserTokenReply)
    return tok, r


def test_users_round_trip_through_snapshots_and_keep_old_digests() -> None:
    d = Driver()
    d.mkdir("/a")
    # no users: the snapshot has no users key, so the digest is what it was before users existed
    assert b'"users"' not in d.sm.snapshot()
    _add(d, "alice", 1000, groups=(7, 5, 7))
    _add(d, "root2", 0, admin=True, expires_ms=60_000)
    d.do("issue_token", pb.IssueTokenRequest(name="alice", token_hash=hash_token(new_user_token("alice"))),
         pb.UserTokenReply)
    d.do("revoke_token", pb.RevokeTokenRequest(name="alice", token_id=1), pb.RevokeTokenReply)
    snap = d.sm.snapshot()
    other = MetaStateMachine()
    other.restore(snap)
    assert other.digest() == d.sm.digest() and other.snapshot() == snap
    u = other.users["alice"]
    assert u.groups == (5, 7) and [(t.id, t.revoked) for t in u.tokens] == [(1, True), (2, False)]
    assert other.users["root2"].tokens[0].expires == other.users["root2"].tokens[0].created + 60 * SEC
    # replaying the log gives the same state
    replay = Driver()
    for op in d.log:
        replay.sm.apply(op)
    assert replay.sm.digest() == d.sm.digest()


@pytest.mark.parametrize("req, err", [
    (pb.AddUserRequest(name="Bad Name", uid=5, gid=5), InvalidArgumentError),
    (pb.AddUserRequest(name="zero", uid=0, gid=0), InvalidArgumentError),  # root without admin
    (pb.AddUserRequest(name="nohash", uid=5, gid=5), InvalidArgumentError),  # no token hash
    (pb.AddUserRequest(name="alice", uid=5, gid=5, token_hash=hash_token("x")), AlreadyExistsError),
    (pb.AddUserRequest(name="groups", uid=5, gid=5, groups=list(range(65)), token_hash=hash_token("y")),
     InvalidArgumentError),
    (pb.AddUserRequest(name="long", uid=5, gid=5, expires_ms=10**15, token_hash=hash_token("z")),
     InvalidArgumentError),
])
def test_refused_user_ops_change_nothing(req: pb.AddUserRequest, err: type[Exception]) -> None:
    d = Driver()
    _add(d, "alice")
    before = d.sm.digest()
    with pytest.raises(err):
        d.do("add_user", req, pb.UserTokenReply)
    for kind, r, e in [
        ("remove_user", pb.RemoveUserRequest(name="nobody"), NotFoundError),
        ("revoke_token", pb.RevokeTokenRequest(name="alice", token_id=9), NotFoundError),
        ("revoke_token", pb.RevokeTokenRequest(name="alice"), InvalidArgumentError),
        ("issue_token", pb.IssueTokenRequest(name="nobody", token_hash=hash_token("q")), NotFoundError),
    ]:
        with pytest.raises(e):
            d.do(kind, r)
    assert d.sm.digest() == before


def test_live_token_cap_and_room_from_dead_tokens() -> None:
    d = Driver()
    _add(d, "bob")
    for _ in range(MAX_TOKENS_PER_USER - 1):
        d.do("issue_token", pb.IssueTokenRequest(name="bob", token_hash=hash_token(new_user_token("bob"))),
             pb.UserTokenReply)
    with pytest.raises(InvalidArgumentError, match="live tokens"):
        d.do("issue_token", pb.IssueTokenRequest(name="bob", token_hash=hash_token(new_user_token("bob"))))
    d.do("revoke_token", pb.RevokeTokenRequest(name="bob", token_id=3), pb.RevokeTokenReply)
    r = d.do("issue_token", pb.IssueTokenRequest(name="bob", token_hash=hash_token(new_user_token("bob"))),
             pb.UserTokenReply)
    assert r.token_id == MAX_TOKENS_PER_USER + 1 and 3 not in [t.id for t in d.sm.users["bob"].tokens]


def test_authenticator() -> None:
    secret = b"s" * 32
    a = Authenticator(secret)
    d = Driver()
    tok, _ = _add(d, "carol", 1234, expires_ms=1000, groups=(9,))
    now = d.now
    me = a.identify(tok, d.sm.users, lambda: now)
    assert (me.name, me.uid, me.groups, me.admin, me.kind) == ("carol", 1234, (9,), False, "user")
    assert a.identify(admin_token(secret), {}, lambda: 0).kind == "admin"
    assert a.identify(node_key(secret), {}, lambda: 0).kind == "node"
    for bad, msg in [(tok, "expired"), (admin_token(b"t" * 32), "invalid admin token"),
                     (node_key(b"t" * 32), "invalid node key"), ("hello", "unrecognised"),
                     (new_user_token("carol"), "invalid token for user"), (new_user_token("dan"), "invalid token for user")]:
        with pytest.raises(UnauthenticatedError, match=msg):
            a.identify(bad, d.sm.users, lambda: now + 2 * SEC)


def test_unknown_user_and_wrong_token_get_the_same_message() -> None:
    """A caller without a credential cannot tell which user names exist: a
    made-up token of a user that exists and of one that does not are
    refused with the same message (the name aside). Until stop 47 the second
    said "unknown user"."""
    a = Authenticator(b"s" * 32)
    d = Driver()
    _add(d, "carol")
    msgs = []
    for name in ("carol", "nobody1"):
        with pytest.raises(UnauthenticatedError) as ei:
            a.identify(new_user_token(name), d.sm.users, lambda: d.now)
        msgs.append(str(ei.value).replace(repr(name), "NAME"))
    assert msgs[0] == msgs[1], msgs
