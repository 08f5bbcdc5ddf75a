"""Users and their tokens as meta replicates them (docs/security.md).

A user record holds the POSIX identity a token stands for (uid, gid,
supplementary groups), whether it is an admin, and its tokens. Of a token
only the SHA-256 is kept (:func:`tierfs.security.hash_token`), with its
expiry and a revoked flag; the token itself is made by the leader's servicer
and shown once. The ops that change users are applied by
:class:`tierfs.meta.state.MetaStateMachine` through the functions here, so
every replica computes the same records (times are op times).

Everything here is deterministic; the snapshot encoding sorts by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierfs.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from tierfs.meta.undo import Tracked
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.security import USER_NAME_RE, Identity

__all__ = [
    "MAX_GROUPS",
    "MAX_TOKENS_PER_USER",
    "MAX_USERS",
    "TokenRecord",
    "UserRecord",
    "add_user",
    "identity_of",
    "issue_token",
    "remove_user",
    "revoke_token",
    "users_from_json",
    "users_to_json",
]

#: Users one cluster may hold (each is in every snapshot).
MAX_USERS = 4096
#: Tokens a user may hold, revoked and expired ones included until a new
#: token makes room by dropping them.
MAX_TOKENS_PER_USER = 32
#: Supplementary groups of one user.
MAX_GROUPS = 64
#: Longest token lifetime (ms): ten years.
MAX_EXPIRES_MS = 10 * 365 * 86400 * 1000
_HASH_BYTES = 32
_NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class TokenRecord:
    id: int
    hash: bytes
    created: int
    expires: int  # ns; 0 = never
    revoked: bool = False

    def live(self, now_ns: int) -> bool:
        return not self.revoked and (not self.expires or now_ns < self.expires)


@dataclass(slots=True)
class UserRecord(Tracked):
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    admin: bool
    created: int
    next_token: int = 1
    tokens: list[TokenRecord] = field(default_factory=list)

    def to_pb(self) -> pb.User:
        return pb.User(name=self.name, uid=self.uid, gid=self.gid, groups=list(self.groups), admin=self.admin,
                       created_ns=self.created,
                       tokens=[pb.UserToken(id=t.id, created_ns=t.created, expires_ns=t.expires, revoked=t.revoked)
                               for t in self.tokens])


def identity_of(u: UserRecord) -> Identity:
    return Identity(u.name, u.uid, u.gid, u.groups, u.admin, "admin" if u.admin else "user")


def check_name(name: str, what: str) -> None:
    if not USER_NAME_RE.match(name):
        raise InvalidArgumentError(f"{what}: user name {name!r} must match {USER_NAME_RE.pattern}")


def _check_expires(ms: int, what: str) -> None:
    if ms > MAX_EXPIRES_MS:
        raise InvalidArgumentError(f"{what}: expires_ms {ms} exceeds the cap of {MAX_EXPIRES_MS} (ten years)")


def _check_hash(h: bytes, what: str) -> None:
    if len(h) != _HASH_BYTES:
        raise InvalidArgumentError(f"{what}: token_hash must be {_HASH_BYTES} bytes (set by meta), not {len(h)}")


def validate_add_user(r: pb.AddUserRequest) -> None:
    check_name(r.name, "add_user")
    # uid 0 without --admin is allowed: meta's root_squash decides what it
    # is worth (nobody by default; root for permissions, never admin, off).
    if len(r.groups) > MAX_GROUPS:
        raise InvalidArgumentError(f"add_user: {len(r.groups)} groups exceed the cap of {MAX_GROUPS}")
    _check_expires(r.expires_ms, "add_user")


def _new_token(u: UserRecord, token_hash: bytes, expires_ms: int, now: int, what: str) -> TokenRecord:
    _check_hash(token_hash, what)
    _check_expires(expires_ms, what)
    if any(t.hash == token_hash for t in u.tokens):
        raise AlreadyExistsError(f"{what}: that token is already issued")
    # Make room by dropping tokens that can never be used again.
    kept = [t for t in u.tokens if t.live(now)]
    if len(kept) >= MAX_TOKENS_PER_USER:
        raise InvalidArgumentError(f"{what}: user {u.name!r} holds {len(kept)} live tokens, the most allowed; "
                                   "revoke some first (`tierfs user revoke`)")
    tok = TokenRecord(u.next_token, bytes(token_hash), now, now + expires_ms * _NS_PER_MS if expires_ms else 0)
    u.next_token += 1
    u.tokens = [*kept, tok]
    return tok


def add_user(users: dict[str, UserRecord], r: pb.AddUserRequest, now: int) -> tuple[UserRecord, TokenRecord]:
    validate_add_user(r)
    if r.name in users:
        raise AlreadyExistsError(f"user {r.name!r} already exists (`tierfs user ls` lists them)")
    if len(users) >= MAX_USERS:
        raise InvalidArgumentError(f"the cluster has {len(users)} users, the most allowed; remove one first")
    u = UserRecord(r.name, r.uid, r.gid, tuple(sorted(set(r.groups))), r.admin, now)
    tok = _new_token(u, r.token_hash, r.expires_ms, now, "add_user")
    users[r.name] = u
    return u, tok


def _user(users: dict[str, UserRecord], name: str, what: str) -> UserRecord:
    check_name(name, what)
    u = users.get(name)
    if u is None:
        raise NotFoundError(f"{what}: no user {name!r} (`tierfs user ls` lists them)")
    return u


def remove_user(users: dict[str, UserRecord], name: str) -> None:
    _user(users, name, "remove_user")
    del users[name]


def issue_token(users: dict[str, UserRecord], r: pb.IssueTokenRequest, now: int) -> tuple[UserRecord, TokenRecord]:
    u = _user(users, r.name, "issue_token")
    return u, _new_token(u, r.token_hash, r.expires_ms, now, "issue_token")


def revoke_token(users: dict[str, UserRecord], r: pb.RevokeTokenRequest) -> int:
    u = _user(users, r.name, "revoke_token")
    if not r.all and not r.token_id:
        raise InvalidArgumentError("revoke_token: give a token id or all")
    if not r.all and all(t.id != r.token_id for t in u.tokens):
        raise NotFoundError(f"revoke_token: user {r.name!r} has no token {r.token_id}")
    n = 0
    out = []
    for t in u.tokens:
        if not t.revoked and (r.all or t.id == r.token_id):
            t = TokenRecord(t.id, t.hash, t.created, t.expires, True)
            n += 1
        out.append(t)
    u.tokens = out
    return n


def users_to_json(users: dict[str, UserRecord]) -> list[list[Any]]:
    return [[u.name, u.uid, u.gid, list(u.groups), u.admin, u.created, u.next_token,
             [[t.id, t.hash.hex(), t.created, t.expires, t.revoked] for t in u.tokens]]
            for _, u in sorted(users.items())]


def users_from_json(rows: list[list[Any]]) -> dict[str, UserRecord]:
    out: dict[str, UserRecord] = {}
    for name, uid, gid, groups, admin, created, next_token, tokens in rows:
        out[name] = UserRecord(name, uid, gid, tuple(groups), admin, created, next_token,
                               [TokenRecord(i, bytes.fromhex(h), c, e, r) for i, h, c, e, r in tokens])
    return out
