"""Authentication of meta RPCs, and which identity may call what
(docs/security.md).

Every ``MetaService`` call carries the gRPC metadata
``authorization: Bearer <token>``. :class:`Authenticator` turns a token into
an :class:`~tierfs.security.Identity`:

- the admin token (``tfa1.``, derived from the cluster secret): ``ROOT``;
- the node key (``tfn1.``, derived too): :data:`NODE`, a storage daemon;
- a user token (``tfu1.<user>.``): the user's record in the replicated
  state, if the token's hash is one of the user's live tokens.

Anything else - no token, a malformed header, a token of another cluster,
an unknown user, a revoked or expired token - is
:class:`~tierfs.errors.UnauthenticatedError` with a message that says which,
except that an unknown user and a wrong token of a known one get the same
message (a caller without a credential learns no user names).

:func:`check_allowed` is the one table of who may call what: the node key
only the storage-node RPCs (:data:`NODE_RPCS`), RegisterNode and Heartbeat
only the node key or an admin, the storage daemons' bookkeeping mutations
and the reads of every file's chunk keys (:data:`NODE_ONLY_RPCS`) only
the node key or an admin, and the admin
operations (:data:`ADMIN_RPCS`) only an admin. Refusals are
:class:`~tierfs.errors.PermissionDeniedError` naming the operation.

Client side: :func:`bearer` is the metadata entry a client adds, and
:func:`resolve_token` the one rule for which token a client uses.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tierfs.errors import ConfigError, PermissionDeniedError, UnauthenticatedError
from tierfs.meta.users import UserRecord, identity_of
from tierfs.security import (
    ADMIN_PREFIX,
    ADMIN_TOKEN_FILE,
    NODE_PREFIX,
    ROOT,
    USER_PREFIX,
    Identity,
    admin_token,
    hash_token,
    load_token_file,
    node_key,
    parse_user_token,
    tokens_equal,
)

__all__ = [
    "ADMIN_RPCS",
    "AUTH_KEY",
    "NODE",
    "NODE_ONLY_RPCS",
    "NODE_RPCS",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "Authenticator",
    "bearer",
    "check_allowed",
    "default_token",
    "resolve_token",
    "token_from_metadata",
    "write_credentials",
]

AUTH_KEY = "authorization"
TOKEN_ENV = "TIERFS_TOKEN"
TOKEN_FILE_ENV = "TIERFS_TOKEN_FILE"
#: what a storage daemon's node key stands for
NODE = Identity("node", 0, 0, (), False, "node")

#: What the node key may call (everything else is refused to it). Stat:
#: the repair and scrub workers read a chunk's records (CRC, generation,
#: missing fragments) by inode.
NODE_RPCS = frozenset({
    "RegisterNode", "Heartbeat", "GetClusterMap", "ListGC", "AckGC", "ListRepairs", "MarkFragments",
    "FinishRebuild", "ListGroupChunks", "GetStatus", "Digest", "WhoAmI", "Stat",
})
#: Storage-node calls that change state: the node key or an admin only (a
#: user acking GC or finishing a rebuild could lose data).
NODE_ONLY_RPCS = frozenset({"RegisterNode", "Heartbeat", "AckGC", "MarkFragments", "FinishRebuild",
                            # Reads of every file's chunk keys (inode,
                            # generation) whatever its directory's mode,
                            # and a hash of the whole state (forked and
                            # hashed on each call): not a user's business.
                            "ListGC", "ListGroupChunks", "Digest"})
#: Admin operations.
ADMIN_RPCS = frozenset({
    "DrainNode", "UndrainNode", "RemoveNode", "RemoveTarget", "LabelNode", "CreateKVPool", "RemoveKVPool", "AddMetaMember",
    "RemoveMetaMember", "ForceSnapshot", "AddUser", "ListUsers", "RemoveUser", "IssueToken", "RevokeToken",
})
_HOW = ("set TIERFS_TOKEN or TIERFS_TOKEN_FILE, pass --token-file (CLI) or ClientConfig(token=...); "
        "a local cluster's admin token is DATA/admin.token")


def token_from_metadata(metadata: Iterable[Any] | None) -> str:
    """The bearer token of a call's metadata; UnauthenticatedError when
    there is none or the header is malformed."""
    found: list[str] = []
    for item in metadata or ():
        if item[0] == AUTH_KEY:
            v = item[1]
            found.append(v if isinstance(v, str) else bytes(v).decode(errors="replace"))
    if not found:
        raise UnauthenticatedError(f"no credential: this meta service requires a token "
                                   f"(gRPC metadata '{AUTH_KEY}: Bearer <token>'); {_HOW}")
    if len(found) > 1:
        raise UnauthenticatedError(f"malformed credential: {len(found)} '{AUTH_KEY}' entries, expected one")
    scheme, _, tok = found[0].partition(" ")
    tok = tok.strip()
    if scheme.lower() != "bearer" or not tok or any(c.isspace() for c in tok):
        raise UnauthenticatedError(f"malformed credential: expected '{AUTH_KEY}: Bearer <token>'")
    return tok


class Authenticator:
    """Checks tokens against one cluster secret (the admin token and the
    node key are derived from it: no state needed) and the user records."""

    def __init__(self, secret: bytes, accepted: Sequence[bytes] = ()) -> None:
        """``accepted``: secrets whose admin token and node key pass too (a
        rotation under way: docs/security.md)."""
        self._admins = [admin_token(s) for s in (secret, *accepted)]
        self._nodes = [node_key(s) for s in (secret, *accepted)]

    def identify(self, token: str, users: Mapping[str, UserRecord], now: Callable[[], int]) -> Identity:
        """``now``: the time (ns) expiry is judged by; asked only for user tokens."""
        if token.startswith(ADMIN_PREFIX):
            if any(tokens_equal(token, t) for t in self._admins):
                return ROOT
            raise UnauthenticatedError("invalid admin token (not this cluster's: it is derived from the "
                                       "cluster secret)")
        if token.startswith(NODE_PREFIX):
            if any(tokens_equal(token, t) for t in self._nodes):
                return NODE
            raise UnauthenticatedError("invalid node key (not this cluster's: it is derived from the "
                                       "cluster secret)")
        if not token.startswith(USER_PREFIX):
            raise UnauthenticatedError("unrecognised token: not an admin token (tfa1.), node key (tfn1.) "
                                       "or user token (tfu1.)")
        name = parse_user_token(token)
        if name is None:
            raise UnauthenticatedError("malformed user token (expected tfu1.<user>.<43 characters>)")
        # An unknown user gets the same answer as a wrong token of a known
        # one: the message must not tell a caller without a credential which
        # user names exist.
        # Expired and revoked tokens are dropped when the user is issued
        # another (users.py): such a token lands here too, and must not be
        # told it was never issued (until stop 48 that was all it heard).
        invalid = UnauthenticatedError(f"invalid token for user {name!r} (not one meta issued, or the user was "
                                       "removed or never added, or it expired or was revoked and has been "
                                       "forgotten since)")
        u = users.get(name)
        if u is None:
            raise invalid
        h = hash_token(token)
        for t in u.tokens:
            if tokens_equal(t.hash, h):
                if t.revoked:
                    raise UnauthenticatedError(f"token {t.id} of user {name!r} was revoked")
                now_ns = now() if t.expires else 0
                if t.expires and now_ns >= t.expires:
                    raise UnauthenticatedError(f"token {t.id} of user {name!r} expired "
                                               f"{(now_ns - t.expires) / 1e9:.0f} s ago")
                return identity_of(u)
        raise invalid


def check_allowed(method: str, ident: Identity) -> None:
    """PermissionDeniedError unless ``ident`` may call ``method``."""
    if ident.kind == "node":
        if method not in NODE_RPCS:
            raise PermissionDeniedError(f"{method}: the node key may call only the storage-node RPCs; "
                                        "use a user or admin token")
        return
    if method in NODE_ONLY_RPCS and not ident.admin:
        raise PermissionDeniedError(f"{method}: only storage daemons (the node key) or an admin may call it; "
                                    f"{ident.name!r} is neither")
    if method in ADMIN_RPCS and not ident.admin:
        raise PermissionDeniedError(f"{method} is an admin operation; user {ident.name!r} is not an admin")


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client call carries for ``token`` (none for None or
    "": meta then answers "no credential")."""
    return ((AUTH_KEY, f"Bearer {token}"),) if token else ()


# A default the CLI sets for every client it makes in one command (its
# --token-file, its own environment, its --data): (token,) or None.
_default: contextvars.ContextVar[tuple[str | None] | None] = contextvars.ContextVar("tierfs_default_token",
                                                                                    default=None)


@contextlib.contextmanager
def default_token(token: str | None) -> Iterator[None]:
    """Within the block, clients made without a token of their own use
    ``token`` (None: none) instead of looking in the environment."""
    reset = _default.set((token,))
    try:
        yield
    finally:
        _default.reset(reset)


def _one_token(tok: str, where: str, *, strip: bool = True) -> str:
    """``tok`` when it can be one (printable ASCII, no whitespace; a
    variable's surrounding whitespace dropped), else ConfigError saying
    so (gRPC would refuse the header with an internal error)."""
    t = tok.strip() if strip else tok
    if all(33 <= ord(c) < 127 for c in t):
        return t
    lines = len(t.splitlines())
    why = (f"{lines} lines" if lines > 1 else
           "whitespace" if any(c.isspace() for c in t) else "a character a token never has")
    raise ConfigError(f"{where} does not hold one token (it has {why}); a token is one line like "
                      "tfu1.NAME.SECRET: set it to the token alone (`tierfs user token NAME` prints only the "
                      "token on stdout)", field="token")


def resolve_token(token: str | None = None, token_file: str | os.PathLike[str] | None = None,
                  data_dir: str | os.PathLike[str] | None = "./.tierfs",
                  env: Mapping[str, str] | None = None) -> str | None:
    """The token a client uses, from the first of: ``token`` (given, even
    "" or wrong: used as is), ``token_file``, ``$TIERFS_TOKEN`` (set, even
    empty), ``$TIERFS_TOKEN_FILE``, ``DATA_DIR/admin.token`` when that file
    exists (a local cluster). Inside :func:`default_token` its token
    replaces the last three. None: no credential (fine with security off)."""
    if token is not None:
        return _one_token(token, "the token given", strip=False)
    if token_file:
        return load_token_file(token_file)
    chosen = _default.get()
    if chosen is not None:
        return chosen[0]
    env = os.environ if env is None else env
    if TOKEN_ENV in env:
        return _one_token(env[TOKEN_ENV], f"${TOKEN_ENV}")
    if env.get(TOKEN_FILE_ENV):
        return load_token_file(env[TOKEN_FILE_ENV])
    if data_dir:
        p = Path(data_dir) / ADMIN_TOKEN_FILE
        if p.exists():
            return load_token_file(p, "admin token")
    return None


def write_credentials(secret_file: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``out_dir/admin.token`` and ``out_dir/node.key`` (mode 0600),
    derived from the cluster secret in ``secret_file``; returns their paths."""
    from tierfs.meta.secret import load_secret
    from tierfs.security import NODE_KEY_FILE, write_private_file

    secret = load_secret(secret_file)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return (write_private_file(out / ADMIN_TOKEN_FILE, admin_token(secret) + "\n", overwrite=True),
            write_private_file(out / NODE_KEY_FILE, node_key(secret) + "\n", overwrite=True))


def main(argv: list[str] | None = None) -> int:
    """``python -m tierfs.meta.auth SECRET_FILE OUT_DIR``: write the admin
    token and the node key derived from the cluster secret (deploy files)."""
    import sys

    from tierfs.errors import ConfigError

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or any(a.startswith("-") for a in args):
        print("usage: python -m tierfs.meta.auth SECRET_FILE OUT_DIR   (writes OUT_DIR/admin.token and "
              "OUT_DIR/node.key, mode 0600)", file=sys.stderr)
        return 2
    try:
        admin, node = write_credentials(args[0], args[1])
    except ConfigError as exc:
        print(f"tierfs.meta.auth: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {admin} and {node}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
