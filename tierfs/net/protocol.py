"""The data-plane wire format: one fixed 88-byte header, then the payload.

Layout (little-endian, ``struct`` format :data:`HEADER_FORMAT`)::

    off size field        meaning
      0   4  magic        b"TFDP"
      4   1  version      1
      5   1  op           :class:`Op`
      6   2  flags        :class:`Flag` bits (RESPONSE on every reply)
      8   8  request_id   chosen by the client, echoed in the reply
     16   4  target       target id the request is for
     20   4  status       reply: 0 = OK, else an ErrorCode; request: the
                          capability slot it runs under (0 = none; see CAP)
     24   8  inode        \
     32   8  chunk         | FragmentKey
     40   8  fragment      |
     48   8  fversion     /
     56   8  offset       byte offset (READ)
     64   8  length       READ: bytes wanted (ALL = to the end);
                          DELETE reply: 1 existed / 0 not; STAT reply: size
     72   8  payload_len  bytes following the header
     80   4  payload_crc  CRC32C of the payload (STAT reply: fragment CRC32C)
     84   4  header_crc   CRC32C of bytes 0..83

KV ops reuse the header (``inode`` = pool id throughout):

    KV_PUT     payload = value || key; offset = key length; fversion = CRC32C
               of the value (the server checks crc32c(key, fversion) ==
               payload_crc, which proves it without a second pass over the
               value); chunk = TTL in ms (0 none); fragment = flags
               (KV_OVERWRITE, pin kind << KV_PIN_SHIFT, and the writer's
               placement stamp << KV_STAMP_SHIFT); length = pin TTL ms.
               With KV_GROUP set (writers of stop 34 on, in replica:N and
               EC pools) the stamp is the writer's *group* stamp: the
               latest placement stamp of any position in the key's group in
               its map, since the writer may have skipped a position it
               calls down (daemons up to stop 33 ignore the bit and take
               the stamp as this position's).
               Reply: length = 1 stored, 0 already there (a no-op; an object
               there with an earlier stamp is replaced). Error
               STALE_VERSION: the daemon's map, newer than the writer's,
               places the key in a group without this target, or (KV_GROUP)
               has a later group stamp for it: a position the writer
               skipped came back or was replaced since its map, or (stop 37
               on) a later placement stamp for this position than the
               writer's, checked again after any wait for a lease (the
               writer refreshes its map and puts again; stamp 0 is not
               checked).
    KV_GET     payload = key; length = the most bytes the caller can take.
               Reply: length = 1 hit / 0 miss; payload = the value, its
               payload_crc the object's stored CRC32C (checked end to end);
               chunk = the milliseconds the object has left to live, rounded
               down (0: no TTL; daemons of releases up to stop 28 echo the
               request's 0), so that a client's local copy expires with it.
               fragment = KV_GET flags: KV_SIZE_ONLY asks for the size alone
               (a cheap stat): the reply carries no payload, length = 1 hit /
               0 miss and offset = the object's size in bytes (the request's
               length is ignored; the object is read and CRC-checked like a
               get, so a torn or corrupt one is a miss, and it counts as an
               access for the pool's eviction policy).
               fragment >> KV_STAMP_SHIFT = the placement stamp the reader's
               map requires: an object put with an earlier one is a miss
               (docs/kv.md, "Overwrites and map changes"). Daemons up to
               stop 29 mask the flags and ignore the stamp.
    KV_EXISTS  payload = keys, each as u16 length + bytes; offset = count;
               fragment >> KV_STAMP_SHIFT = the least stamp that counts.
               Reply: payload = a bitmap, bit i set if key i is present:
               one request per target for a whole batch. With KV_WITH_CRC
               in fragment (stop 39) the reply is one little-endian u64 per
               key instead: 0 if absent, else KV_PRESENT | the object's
               stored CRC32C, from the index (no I/O). Daemons before stop
               39 ignore the flag and answer the bitmap (ceil(count/8)
               bytes, never 8 * count): a reader tells the two apart by
               the length.
    KV_DELETE  payload = key; fragment >> KV_STAMP_SHIFT = the deleter's
               placement stamp (0: not checked; STALE_VERSION as for
               KV_PUT), its group stamp when fragment has KV_GROUP (as for
               KV_PUT). Reply: length = 1 existed / 0 not.
    KV_PIN     payload = key; fragment = pin kind (0 = unpin); length = pin
               TTL ms; chunk = the pinner's placement stamp (0: not
               checked; STALE_VERSION as for KV_DELETE; daemons up to
               stop 31 ignore it); fversion = the pinner's group stamp
               (clients of stop 35 on, outside replica:1; 0: not checked;
               STALE_VERSION as for a KV_DELETE with KV_GROUP; daemons up
               to stop 34 ignore it). Reply: length = 1 found / 0 not.

Capabilities (docs/security-caps.md): a storage daemon that requires them
serves a request only under a capability meta signed.

    CAP        payload = an encoded capability (tierfs.capability, 64 bytes);
               status = the slot (1..MAX_CAP_SLOTS) to keep it in on this
               connection. The server verifies it once (HMAC, expiry) and
               answers status 0 or the refusal; a later request names the
               slot in its own ``status`` field. A CAP for a slot in use
               replaces it. Requests are checked in arrival order, so a CAP
               may be pipelined right before the requests that use it.

Everything here is pure: encoding into a caller-owned buffer and decoding
from one, with no I/O.
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass, field

import crc32c as _crc32c

from tierfs.errors import ConfigError, ProtocolError
from tierfs.storage.api import FragmentKey

__all__ = [
    "ALL",
    "F_MORE",
    "F_RESPONSE",
    "HEADER_FORMAT",
    "HEADER_SIZE",
    "KV_GROUP",
    "KV_OPS",
    "KV_OVERWRITE",
    "KV_PIN_SHIFT",
    "KV_PRESENT",
    "KV_SIZE_ONLY",
    "KV_STAMP_SHIFT",
    "KV_WITH_CRC",
    "MAGIC",
    "MAX_CAP_PAYLOAD",
    "MAX_CAP_SLOTS",
    "MAX_KV_EXISTS_KEYS",
    "MAX_KV_KEY",
    "MAX_KV_STAMP",
    "PAYLOAD_OPS",
    "SERIAL",
    "VERSION",
    "Flag",
    "Header",
    "Limits",
    "Op",
    "crc32c",
    "decode_header",
    "encode_header",
    "pack_keys",
    "serial_of",
    "unpack_keys",
]

MAGIC = b"TFDP"
VERSION = 1
HEADER_FORMAT = "<4sBBHQIIQQQQQQQII"
_STRUCT = struct.Struct(HEADER_FORMAT)
HEADER_SIZE = _STRUCT.size
_CRC_SPAN = HEADER_SIZE - 4
_U64 = (1 << 64) - 1
#: ``length`` value meaning "to the end of the fragment".
ALL = _U64
#: Set in a READ answer's ``length`` and a STAT answer's ``offset`` when the
#: rest of the field is the serial of the fragment file read or described
#: (releases before it answer 0 there): docs/dataplane.md, "Serials".
SERIAL = 1 << 63


def serial_of(field_value: int) -> int:
    """The fragment-file serial an answer field carries (0: none)."""
    return field_value & (SERIAL - 1) if field_value & SERIAL else 0


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value))


class Op(enum.IntEnum):
    PING = 1
    WRITE = 2
    READ = 3
    DELETE = 4
    STAT = 5
    # KV objects (see "KV ops" in the module docstring).
    KV_PUT = 6
    KV_GET = 7
    KV_EXISTS = 8
    KV_DELETE = 9
    KV_PIN = 10
    # A capability for the requests that follow (see "Capabilities").
    CAP = 11


#: Ops whose request carries a payload (the others' requests are bare headers).
PAYLOAD_OPS = frozenset({2, 6, 7, 8, 9, 10, 11})
#: KV ops (served by a target's KV store, not its chunk engine).
KV_OPS = frozenset({6, 7, 8, 9, 10})
#: Capability slots per connection: a request's ``status`` is 0 or 1..this.
MAX_CAP_SLOTS = 1024
#: Largest CAP payload a server receives (a capability is 64 bytes).
MAX_CAP_PAYLOAD = 256
#: Longest KV key, in bytes.
MAX_KV_KEY = 512
#: Most keys one KV_EXISTS request carries.
MAX_KV_EXISTS_KEYS = 4096
#: KV_PUT flag bits (in the ``fragment`` field).
KV_OVERWRITE = 0x1
KV_PIN_SHIFT = 1  # two bits: 0 none, 1 soft, 2 hard
#: KV_PUT / KV_DELETE: the stamp is the writer's group stamp (the latest of
#: its group's positions in the writer's map), not this position's own.
KV_GROUP = 0x8
#: KV_PUT / KV_GET / KV_EXISTS: the placement stamp in the flags word's
#: bits 8-63 (older daemons read only the low bits)
KV_STAMP_SHIFT = 8
MAX_KV_STAMP = (1 << 56) - 1
#: KV_GET flag bit (in the ``fragment`` field): answer with the size only.
KV_SIZE_ONLY = 0x1
#: KV_EXISTS flag bit (in the ``fragment`` field): answer each key's stored
#: CRC32C (a u64 each: KV_PRESENT | crc, or 0), not a bitmap.
KV_WITH_CRC = 0x2
KV_PRESENT = 1 << 32


class Flag(enum.IntFlag):
    RESPONSE = 0x1
    #: Set on every frame of a batch except the last (advisory: the server
    #: may use it to defer flushing; completion is still per frame).
    MORE = 0x2


# Plain ints for the hot path (IntFlag arithmetic costs microseconds).
F_RESPONSE = int(Flag.RESPONSE)
F_MORE = int(Flag.MORE)
_KNOWN_FLAGS = F_RESPONSE | F_MORE
_OPS = frozenset(int(o) for o in Op)


@dataclass(slots=True)
class Header:
    op: int
    request_id: int
    flags: int = 0
    target: int = 0
    status: int = 0
    inode: int = 0
    chunk: int = 0
    fragment: int = 0
    fversion: int = 0
    offset: int = 0
    length: int = 0
    payload_len: int = 0
    payload_crc: int = 0

    @property
    def key(self) -> FragmentKey:
        return FragmentKey(self.inode, self.chunk, self.fragment, self.fversion)

    @property
    def is_response(self) -> bool:
        return bool(self.flags & F_RESPONSE)


def encode_header(
    buf: bytearray | memoryview,
    op: int,
    request_id: int,
    *,
    flags: int = 0,
    target: int = 0,
    status: int = 0,
    key: FragmentKey | tuple[int, int, int, int] | None = None,
    offset: int = 0,
    length: int = 0,
    payload_len: int = 0,
    payload_crc: int = 0,
) -> None:
    """Pack a header into ``buf[:HEADER_SIZE]`` (no allocation beyond the int
    boxing ``struct`` does)."""
    if key is None:
        inode = chunk = fragment = fversion = 0
    elif isinstance(key, tuple):
        inode, chunk, fragment, fversion = key
    else:
        inode, chunk, fragment, fversion = key.inode, key.chunk, key.fragment, key.version
    try:
        _STRUCT.pack_into(
            buf, 0, MAGIC, VERSION, op, flags, request_id, target, status,
            inode, chunk, fragment, fversion, offset, length, payload_len, payload_crc, 0,
        )
    except struct.error as exc:
        raise ProtocolError(f"header field out of range: {exc}") from None
    struct.pack_into("<I", buf, _CRC_SPAN, crc32c(memoryview(buf)[:_CRC_SPAN]))


def decode_header(buf: bytes | bytearray | memoryview, max_payload: int) -> Header:
    """Parse and validate one header. Raises ProtocolError with the reason."""
    if len(buf) < HEADER_SIZE:
        raise ProtocolError(f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
    (magic, version, op, flags, request_id, target, status, inode, chunk, fragment,
     fversion, offset, length, payload_len, payload_crc, header_crc) = _STRUCT.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    got = crc32c(memoryview(buf)[:_CRC_SPAN])
    if got != header_crc:
        raise ProtocolError(f"header CRC mismatch: {got:#010x} != {header_crc:#010x}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}")
    if op not in _OPS:
        raise ProtocolError(f"unknown op {op}")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown flags {flags:#x}")
    if payload_len > max_payload:
        raise ProtocolError(f"frame payload {payload_len} exceeds limit {max_payload}")
    return Header(op, request_id, flags, target, status, inode, chunk, fragment, fversion,
                  offset, length, payload_len, payload_crc)


def default_offload_min() -> int:
    """``Limits.offload_min_bytes`` unless given: TIERFS_OFFLOAD_MIN_BYTES, else
    512 KiB where this process may use 8 CPUs or more, else 0."""
    env = os.environ.get("TIERFS_OFFLOAD_MIN_BYTES", "").strip()
    if env:
        try:
            return int(env)
        except ValueError:
            raise ConfigError(f"not a byte count: {env!r}", field="TIERFS_OFFLOAD_MIN_BYTES") from None
    return 512 << 10 if usable_cpus() >= 8 else 0


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's cpuset
    counts, unlike ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-connection hard limits, enforced by both ends."""

    #: Largest payload of one frame (a fragment, or an error message).
    max_frame_bytes: int = 128 << 20
    #: Payload bytes a server connection holds (received-not-stored plus
    #: read-not-yet-sent) before it stops reading from the socket.
    max_inflight_bytes: int = 512 << 20
    #: Requests a server connection has started and not answered before it
    #: stops reading from the socket.
    max_inflight_requests: int = 256
    #: Size of each direction's shared-memory ring (shm transport).
    shm_ring_bytes: int = 16 << 20
    #: A client connection checks the CRC of an answer's payload of at least
    #: this many bytes on a worker thread, and the shm transport copies it
    #: out of the ring there, so that the event loop goes on receiving
    #: meanwhile (tierfs.net.framing, "Off the loop"). 0: all on the loop.
    #: Default: 512 KiB where this process may use 8 CPUs or more (its
    #: affinity mask), else 0 (on 2 cores the workers only compete with the
    #: loop and the daemons); TIERFS_OFFLOAD_MIN_BYTES overrides it.
    offload_min_bytes: int = field(default_factory=lambda: default_offload_min())
    #: Socket send/receive buffer size asked of the kernel (tcp).
    socket_buffer_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_inflight_bytes", "max_inflight_requests",
                     "shm_ring_bytes", "socket_buffer_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError("must be positive", field=name)
        if self.max_inflight_bytes < self.max_frame_bytes:
            raise ConfigError("must be at least max_frame_bytes", field="max_inflight_bytes")
        if self.offload_min_bytes < 0:
            raise ConfigError("must be 0 (off) or positive", field="offload_min_bytes")
        if self.shm_ring_bytes < HEADER_SIZE * 2:
            raise ConfigError(f"must be at least {HEADER_SIZE * 2}", field="shm_ring_bytes")


def pack_keys(keys: list[bytes]) -> bytes:
    """KV_EXISTS payload: each key as a little-endian u16 length, then its bytes."""
    for k in keys:
        if not 0 < len(k) <= MAX_KV_KEY:
            raise ProtocolError(f"KV key of {len(k)} bytes (1..{MAX_KV_KEY})")
    return b"".join([len(k).to_bytes(2, "little") + k for k in keys])


def unpack_keys(buf: bytes | bytearray | memoryview, count: int) -> list[bytes]:
    """Inverse of :func:`pack_keys`; ProtocolError on any inconsistency."""
    if not 0 < count <= MAX_KV_EXISTS_KEYS:
        raise ProtocolError(f"KV_EXISTS of {count} keys (1..{MAX_KV_EXISTS_KEYS})")
    view = memoryview(buf)
    keys: list[bytes] = []
    pos = 0
    for _ in range(count):
        if pos + 2 > len(view):
            raise ProtocolError("KV_EXISTS payload ends inside a key length")
        n = int.from_bytes(view[pos:pos + 2], "little")
        pos += 2
        if not 0 < n <= MAX_KV_KEY or pos + n > len(view):
            raise ProtocolError(f"KV_EXISTS key of {n} bytes at offset {pos - 2} (1..{MAX_KV_KEY}, within the payload)")
        keys.append(bytes(view[pos:pos + n]))
        pos += n
    if pos != len(view):
        raise ProtocolError(f"KV_EXISTS payload has {len(view) - pos} bytes after its {count} keys")
    return keys
