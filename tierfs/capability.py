"""Data-plane capabilities: what meta signs so that a storage daemon serves a
request (docs/security-caps.md).

A capability is 64 bytes: a 48-byte body, then a 16-byte HMAC-SHA256 tag
(truncated) of the body under the capability key of the body's epoch::

    off size field
      0   1  version     1
      1   1  kind        KIND_FILE | KIND_KV | KIND_NODE
      2   1  ops         OP_READ | OP_WRITE (write includes delete, KV pin)
      3   1  reserved    0
      4   4  epoch       key epoch (u32)
      8   8  scope       inode (file), pool id (KV), node id (node)
     16   8  lo          first chunk covered (file); 0 otherwise
     24   8  hi          chunk bound, exclusive (file); ALL_CHUNKS = every chunk
     32   8  principal   uid (file), tenant (KV: uid, or GROUP_TENANT | gid), node id;
                         a file write capability carries its write session's
                         data_version (mod 2**32) in bits 32-63 (0: any, as
                         minted before stop 48): see ``check_scope``
     40   8  expiry_ms   ms since the Unix epoch, meta's clock
     48  16  mac

The key of epoch ``e`` is ``derive(cluster_secret, f"cap/{e}")``
(:func:`epoch_key`); an epoch lasts ``rotation`` seconds. Meta hands storage
daemons the keys of e-1, e and e+1; a capability of an older epoch is
refused as expired.

Everything here is pure: no clock is read (``now_ms`` is an argument), no
I/O."""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tierfs.chunk import GEN_SHIFT
from tierfs.errors import (
    CapabilityExpiredError,
    PermissionDeniedError,
    TierFSError,
    UnauthenticatedError,
)
from tierfs.security import derive

__all__ = [
    "ALL_CHUNKS",
    "CAP_SIZE",
    "GROUP_TENANT",
    "KIND_FILE",
    "KIND_KV",
    "KIND_NODE",
    "OP_READ",
    "OP_WRITE",
    "Capability",
    "Keyring",
    "check_scope",
    "decode",
    "encode",
    "epoch_at",
    "epoch_key",
    "keys_around",
    "mint",
    "session_of_generation",
    "tenant_of",
    "verify",
    "write_principal",
]

VERSION = 1
KIND_FILE, KIND_KV, KIND_NODE = 1, 2, 3
_KINDS = {KIND_FILE: "file", KIND_KV: "kv", KIND_NODE: "node"}
OP_READ, OP_WRITE = 1, 2
_OPS = OP_READ | OP_WRITE
ALL_CHUNKS = (1 << 64) - 1
#: set in a KV principal for a group tenant (the rest is the gid)
GROUP_TENANT = 1 << 32
#: A file write capability's principal: the uid in bits 0-31, its session's
#: data_version (mod 2**32, never 0) in bits 32-63.
SESSION_SHIFT = 32
_SESSION_MASK = (1 << 32) - 1
_BODY = struct.Struct("<BBBBIQQQQQ")
BODY_SIZE = _BODY.size
MAC_SIZE = 16
CAP_SIZE = BODY_SIZE + MAC_SIZE


@dataclass(frozen=True, slots=True)
class Capability:
    kind: int
    ops: int
    epoch: int
    scope: int
    lo: int
    hi: int
    principal: int
    expiry_ms: int
    mac: bytes = b""

    def body(self) -> bytes:
        return _BODY.pack(VERSION, self.kind, self.ops, 0, self.epoch, self.scope, self.lo, self.hi,
                          self.principal, self.expiry_ms)

    @property
    def session(self) -> int:
        """The write session (its data_version mod 2**32) a file write
        capability is for; 0: none named (any generation of the inode)."""
        return self.principal >> SESSION_SHIFT if self.kind == KIND_FILE else 0

    def describe(self) -> str:
        what = {KIND_FILE: f"inode {self.scope}", KIND_KV: f"KV pool {self.scope}",
                KIND_NODE: f"node {self.scope}"}.get(self.kind, f"scope {self.scope}")
        if self.session:
            what += f" (write session version {self.session})"
        ops = "+".join(n for b, n in ((OP_READ, "read"), (OP_WRITE, "write")) if self.ops & b) or "none"
        return f"{_KINDS.get(self.kind, '?')} capability ({ops}) for {what}"


def write_principal(uid: int, data_version: int) -> int:
    """The principal of a file write capability for the session of
    ``data_version`` (see the layout above)."""
    v = data_version & _SESSION_MASK
    return (uid & _SESSION_MASK) | ((v or 1) << SESSION_SHIFT)


def session_of_generation(generation: int) -> int:
    """The session a fragment generation belongs to, as a write capability
    names it (its data_version mod 2**32, 0 read as 1, as ``write_principal``)."""
    return ((generation >> GEN_SHIFT) & _SESSION_MASK) or 1


def epoch_key(secret: bytes, epoch: int) -> bytes:
    return derive(secret, f"cap/{epoch}")


def epoch_at(now_ms: int, rotation_s: float) -> int:
    return int(now_ms // int(rotation_s * 1000))


def keys_around(secret: bytes, epoch: int) -> dict[int, bytes]:
    """The keys meta hands daemons at ``epoch``: e-1, e and e+1."""
    return {e: epoch_key(secret, e) for e in (epoch - 1, epoch, epoch + 1) if e >= 0}


def tenant_of(uid: int, gid: int, tenant_mode: str) -> int:
    """A KV pool's tenant of a caller: its uid, or GROUP_TENANT | gid for a
    pool created with ``tenant = "group"``."""
    return GROUP_TENANT | gid if tenant_mode == "group" else uid


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()[:MAC_SIZE]


def mint(key: bytes, *, kind: int, ops: int, epoch: int, scope: int, principal: int, expiry_ms: int,
         lo: int = 0, hi: int = ALL_CHUNKS) -> Capability:
    """A capability signed with ``key`` (the key of ``epoch``)."""
    if kind not in _KINDS or not ops or ops & ~_OPS:
        raise ValueError(f"bad capability kind {kind} / ops {ops}")
    cap = Capability(kind, ops, epoch, scope, lo, hi, principal, expiry_ms)
    return Capability(kind, ops, epoch, scope, lo, hi, principal, expiry_ms, _mac(key, cap.body()))


def encode(cap: Capability) -> bytes:
    return cap.body() + cap.mac


def decode(raw: bytes | bytearray | memoryview) -> Capability:
    """Parse (not verify) a capability; UnauthenticatedError if malformed."""
    if len(raw) != CAP_SIZE:
        raise UnauthenticatedError(f"a capability is {CAP_SIZE} bytes, got {len(raw)}")
    b = bytes(raw)
    version, kind, ops, _res, epoch, scope, lo, hi, principal, expiry = _BODY.unpack_from(b, 0)
    if version != VERSION or kind not in _KINDS or not ops or ops & ~_OPS:
        raise UnauthenticatedError(f"malformed capability (version {version}, kind {kind}, ops {ops})")
    return Capability(kind, ops, epoch, scope, lo, hi, principal, expiry, b[BODY_SIZE:])


class Keyring:
    """Capability keys by epoch (what a storage daemon holds). ``keys``: one
    per epoch, the last given for it (the current secret's: the node signs
    its own capabilities with it); ``also``: the keys given before it for
    the same epoch (secrets being rotated in or out), which verify too."""

    __slots__ = ("also", "keys", "newest", "oldest")

    def __init__(self, keys: Mapping[int, bytes] | Iterable[tuple[int, bytes]] = ()) -> None:
        self.keys: dict[int, bytes] = {}
        self.also: dict[int, tuple[bytes, ...]] = {}
        for epoch, key in (keys.items() if isinstance(keys, Mapping) else keys):
            prev = self.keys.get(epoch)
            if prev is not None and prev != key:
                self.also[epoch] = (*self.also.get(epoch, ()), prev)
            self.keys[epoch] = key
        self.oldest = min(self.keys, default=0)
        self.newest = max(self.keys, default=-1)

    def same(self, other: Keyring) -> bool:
        return self.keys == other.keys and self.also == other.also

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


def verify(keyring: Keyring, now_ms: int, cap: Capability | bytes | bytearray | memoryview) -> Capability:
    """Check a capability's tag (constant time) and expiry; the capability,
    or UnauthenticatedError (malformed, forged, unknown epoch) or
    CapabilityExpiredError (past its expiry, or of a retired key epoch)."""
    c = cap if isinstance(cap, Capability) else decode(cap)
    key = keyring.keys.get(c.epoch)
    if key is None:
        if keyring and c.epoch < keyring.oldest:
            raise CapabilityExpiredError(f"{c.describe()}: key epoch {c.epoch} is retired "
                                         f"(this node holds epochs {keyring.oldest}..{keyring.newest}); "
                                         "fetch a fresh one from meta")
        raise UnauthenticatedError(f"{c.describe()}: unknown key epoch {c.epoch}")
    if not hmac.compare_digest(_mac(key, c.body()), c.mac) and \
            not any(hmac.compare_digest(_mac(k, c.body()), c.mac) for k in keyring.also.get(c.epoch, ())):
        raise UnauthenticatedError(f"{c.describe()}: signature does not verify (forged or corrupted)")
    if c.expiry_ms <= now_ms:
        raise CapabilityExpiredError(f"{c.describe()} expired {now_ms - c.expiry_ms} ms ago; "
                                     "fetch a fresh one from meta")
    return c


def check_scope(c: Capability, kind: int, scope: int, op: int, chunk: int = 0,
                generation: int = 0) -> TierFSError | None:
    """Whether a verified capability covers one request: None, or the
    PermissionDeniedError saying why not. Node capabilities cover every
    inode (fragment ops only). A file write capability that names its
    session covers writes and deletes of that session's generations only:
    not the file's committed fragments of other sessions, which its holder
    could otherwise overwrite or delete until it expired, after the
    session had ended and after a chmod (until stop 48)."""
    if c.kind == KIND_NODE and kind == KIND_FILE:
        pass
    elif c.kind != kind:
        return PermissionDeniedError(f"{c.describe()} does not cover a {_KINDS.get(kind, '?')} request")
    elif c.scope != scope:
        return PermissionDeniedError(f"{c.describe()} does not cover "
                                     f"{'inode' if kind == KIND_FILE else 'KV pool'} {scope}")
    elif kind == KIND_FILE and not c.lo <= chunk < c.hi:
        return PermissionDeniedError(f"{c.describe()} covers chunks [{c.lo}, {c.hi}), not chunk {chunk}")
    elif (kind == KIND_FILE and op == OP_WRITE and c.session
          and session_of_generation(generation) != c.session):
        return PermissionDeniedError(f"{c.describe()} does not cover generation {generation:#x} "
                                     f"(another write session's fragments)")
    if not c.ops & op:
        return PermissionDeniedError(f"{c.describe()} does not allow {'write' if op == OP_WRITE else 'read'}")
    return None
