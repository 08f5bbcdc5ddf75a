"""Identities, tokens and derived keys: the primitives every part of TierFS
security is built from (docs/security.md).

One secret roots everything: the cluster secret (:mod:`tierfs.meta.secret`,
``cluster.secret`` under a local cluster's data directory), which every meta
replica holds. From it, by HMAC-SHA256 with a purpose label
(:func:`derive`), come:

- the **admin token** (:func:`admin_token`): whoever holds it is root with
  admin rights. Meta recognises it by recomputing it, so it needs no state
  and works on a fresh cluster; ``tierfs up`` writes it to ``admin.token``
  (mode 0600) under the data directory.
- the **node key** (:func:`node_key`): what storage daemons present to meta
  (``node.key``, mode 0600). Holding it does not give the cluster secret.
- capability keys, one per rotation epoch (:func:`derive` with
  ``f"cap/{epoch}"``; see :mod:`tierfs.capability`).

User tokens are random (:func:`new_user_token`); meta keeps only their
SHA-256 (:func:`hash_token`). A token names its user in clear, so meta finds
the record without trying every hash, and the secret part is compared in
constant time.

Token forms (all URL-safe ASCII, no white space)::

    tfa1.<43 chars>            admin (derived)
    tfn1.<43 chars>            node key (derived)
    tfu1.<user>.<43 chars>     a user's token (random)

The identity a request runs as is :class:`Identity`; servers put the caller's
in :data:`current_identity` for the handler.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import hmac
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from tierfs.errors import ConfigError
from tierfs.fsutil import fsync_dir

__all__ = [
    "ADMIN_PREFIX",
    "ADMIN_TOKEN_FILE",
    "ANONYMOUS",
    "NODE_KEY_FILE",
    "NODE_PREFIX",
    "ROOT",
    "USER_NAME_RE",
    "USER_PREFIX",
    "Identity",
    "admin_token",
    "current_identity",
    "derive",
    "hash_token",
    "load_token_file",
    "new_user_token",
    "node_key",
    "parse_user_token",
    "tokens_equal",
    "write_private_file",
]

ADMIN_PREFIX = "tfa1."
NODE_PREFIX = "tfn1."
USER_PREFIX = "tfu1."
#: file names ``tierfs up`` uses under its data directory
ADMIN_TOKEN_FILE = "admin.token"
NODE_KEY_FILE = "node.key"
#: what a user name may be (it appears in tokens, tenants and logs)
USER_NAME_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,63}$")
_SECRET_CHARS = 43  # 32 bytes, URL-safe base64 without padding


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request runs as.

    ``kind``: ``"admin"`` (the admin token or an admin user), ``"user"``,
    ``"node"`` (a storage daemon's node key) or ``"anonymous"`` (security
    off). ``uid``/``gid``/``groups`` are what POSIX checks use; ``admin``
    grants the admin operations (and is root for permissions)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = field(default=())
    admin: bool = False
    kind: str = "user"

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups


#: the admin token's identity, and what every caller is with security off
ROOT = Identity("root", 0, 0, (), True, "admin")
ANONYMOUS = Identity("anonymous", 0, 0, (), True, "anonymous")

#: the caller of the request being handled (set by the servers' auth layer)
current_identity: contextvars.ContextVar[Identity] = contextvars.ContextVar("tierfs_identity", default=ANONYMOUS)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def derive(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for ``purpose``, derived from the cluster secret."""
    return hmac.new(secret, b"tierfs/" + purpose.encode(), hashlib.sha256).digest()


def admin_token(secret: bytes) -> str:
    return ADMIN_PREFIX + _b64(derive(secret, "admin-token"))


def node_key(secret: bytes) -> str:
    return NODE_PREFIX + _b64(derive(secret, "node-key"))


def new_user_token(name: str) -> str:
    if not USER_NAME_RE.match(name):
        raise ConfigError(f"user name {name!r} must match {USER_NAME_RE.pattern}", field="name")
    return f"{USER_PREFIX}{name}.{secrets.token_urlsafe(32)}"


def parse_user_token(token: str) -> str | None:
    """The user a ``tfu1.`` token names, or None if it is not well formed."""
    if not token.startswith(USER_PREFIX):
        return None
    name, _, rest = token[len(USER_PREFIX):].rpartition(".")
    if not USER_NAME_RE.match(name) or len(rest) != _SECRET_CHARS:
        return None
    return name


def hash_token(token: str) -> bytes:
    """What meta stores of a user token."""
    return hashlib.sha256(token.encode()).digest()


def tokens_equal(a: str | bytes, b: str | bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(a.encode() if isinstance(a, str) else a, b.encode() if isinstance(b, str) else b)


def write_private_file(path: str | os.PathLike[str], text: str, *, overwrite: bool = False) -> Path:
    """Write ``text`` to ``path`` with mode 0600, durably. Unless
    ``overwrite``, an existing file is kept as it is. An overwrite replaces
    the file whole (a temporary file in the same directory, renamed over
    it), so a process reading it meanwhile (a daemon starting, a client)
    sees the old text or the new, never an empty or partial file; a file
    that already holds ``text`` is left alone."""
    p = Path(path)
    if overwrite:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if p.read_text() == text and stat.S_IMODE(p.stat().st_mode) == 0o600:
                return p
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        _write_new(tmp, text)
        try:
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        fsync_dir(p.parent)
        return p
    try:
        _write_new(p, text)
    except FileExistsError:
        return p
    fsync_dir(p.parent)
    return p


def _write_new(p: Path, text: str) -> None:
    """Create ``p`` (mode 0600; FileExistsError if it exists) holding ``text``, synced."""
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def load_token_file(path: str | os.PathLike[str], what: str = "token") -> str:
    """A token (or node key) from a file: one line; refused when "other"
    users may read it. ``ConfigError`` says which file and why."""
    p = Path(path)
    try:
        st = p.stat()
        raw = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {p}", field="token_file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} file {p}: {exc}", field="token_file") from None
    if st.st_mode & 0o007:
        raise ConfigError(f"{what} file {p} is accessible to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                          "chmod 0600 it", field="token_file")
    tok = raw.strip()
    if not tok or any(c.isspace() for c in tok):
        raise ConfigError(f"{what} file {p} does not hold one token", field="token_file")
    return tok
