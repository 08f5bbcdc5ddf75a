"""Static validation of metadata ops and the layout vocabulary.

Everything here is a pure function of the request: the gRPC service calls
:func:`validate_op` before it submits an op to Raft (so bad input costs no log
entry), and the state machine calls it again inside ``apply`` (so a replica
never trusts what reached the log). Checks that need state (does the parent
exist, is the name taken) live in :mod:`tierfs.meta.state`.

Bounded work: every repeated field, every string and every page limit of a
request has a hard cap, kept in the tables below (:data:`LIST_CAPS`,
:data:`STRING_CAPS`, :data:`LIMIT_CAPS`) and checked in one place,
:func:`check_caps`, which both :func:`validate_op` and the service's reads
call before anything else. A whole op is further capped at
:data:`MAX_OP_BYTES` serialized. A new repeated field is capped by adding one
line to :data:`LIST_CAPS` (a test fails until every repeated field of every
request has its line).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from tierfs.errors import (
    ConfigError,
    InvalidArgumentError,
    NameTooLongError,
)
from tierfs.meta.kvpools import MAX_KV_POOLS
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_LAYOUT",
    "LIMIT_CAPS",
    "LIST_CAPS",
    "MAX_BATCH_ITEMS",
    "MAX_CHUNKS_PER_REQUEST",
    "MAX_CHUNK_SIZE",
    "MAX_FILE_SIZE",
    "MAX_GC_ACKS",
    "MAX_GC_GRACE",
    "MAX_GC_PAGE",
    "MAX_GC_TARGETS",
    "MAX_GROUPS_PER_OP",
    "MAX_GROUP_CHUNKS_PAGE",
    "MAX_KV_BUDGET",
    "MAX_KV_GROUP_CHANGES",
    "MAX_KV_USAGE",
    "MAX_NAME_BYTES",
    "MAX_OFFLINE_PER_TICK",
    "MAX_OP_BYTES",
    "MAX_PATH_BYTES",
    "MAX_READDIR_LIMIT",
    "MAX_REPLACEMENTS",
    "MAX_STRING_BYTES",
    "MAX_TARGETS_PER_NODE",
    "MIN_CHUNK_SIZE",
    "MIN_KV_BUDGET",
    "STRING_CAPS",
    "LayoutSpec",
    "cap",
    "check_addr",
    "check_caps",
    "check_kv_budget_floor",
    "check_kv_pool_create",
    "check_kv_pool_name",
    "check_loc",
    "check_op_size",
    "format_redundancy",
    "layout_from_pb",
    "parse_redundancy",
    "split_path",
    "validate_name",
    "validate_op",
]

MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 64 * 1024 * 1024
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
#: K+M above this is refused: ISA-L Reed-Solomon tables and the wish to keep
#: a group's failure domain meaningful both stop well before it.
MAX_WIDTH = 32
MAX_STRIPE_WIDTH = 1024
MAX_FILE_SIZE = 1 << 60
MAX_TARGETS_PER_NODE = 256
MAX_ID_STRING = 256
#: Fragments one MarkFragments request may report, and one ListRepairs page.
MAX_MARK_ITEMS = 4096
MAX_REPAIR_PAGE = 4096
#: Silent storage nodes one Tick marks offline (more wait for the next tick).
MAX_OFFLINE_PER_TICK = 16_384
#: Replacements one RemoveTarget/DrainNode/Tick carries (about 16 bytes
#: each); groups beyond are reported stuck (drain again) or left to the
#: next tick.
MAX_REPLACEMENTS = 8192
#: New placement groups one AddGroups op carries (the leader sends more in
#: several ops); also caps the moves of one RebalanceMoves op (above).
MAX_GROUPS_PER_OP = 1024
#: KV pool groups one KVGroups op sets (tierfs.meta.kvplan; the leader
#: also keeps each op well under MAX_OP_BYTES, and sends the rest in the
#: next ops).
MAX_KV_GROUP_CHANGES = 4096

# ---- caps on what one request may carry (docs/meta.md, "Limits") -------------
#: A serialized op (what goes into the Raft log) is at most this big. Every
#: entry costs the leader's Raft thread a pickle and a zlib pass per follower
#: (~0.25 ms/KiB each on a loaded host); a burst of 1 MB entries stalls it
#: past the election timeout. 256 KiB leaves room for the largest legal op
#: (a renewal or commit of MAX_CHUNKS_PER_REQUEST records and as many uploads).
MAX_OP_BYTES = 256 * 1024
#: Chunk records (and uploads) in one RenewLease / CommitWrite / AbortWrite.
#: A session writes any number of chunks: the client stages their records
#: with its renewals, at most this many a request (about 40 bytes each).
MAX_CHUNKS_PER_REQUEST = 2048
MAX_READDIR_LIMIT = 10_000
#: Rows of one ListGC page, and (gc item, target) pairs in one AckGC.
MAX_GC_PAGE = 10_000
MAX_GC_ACKS = 10_000
#: Targets one ListGC may name (a storage node names its own).
MAX_GC_TARGETS = 1024
#: Group purges in one ListGC(purges) answer, and in one AckGC.
MAX_PURGES_PAGE = 256
MAX_GROUP_CHUNKS_PAGE = 100_000
#: Any string field without its own entry in STRING_CAPS.
MAX_STRING_BYTES = 4096
#: (pool, target) KV usage entries one heartbeat may carry (about 60 bytes
#: each: the most fit well inside MAX_OP_BYTES).
MAX_KV_USAGE = 2048
#: Largest per-target KV pool budget accepted (1 PiB): larger is a typo.
MAX_KV_BUDGET = 1 << 50
#: The smallest nonzero per-target KV budget a new pool may ask for: less
#: holds no object worth caching (``--target-memory 1`` was one byte, not
#: 1 GiB). Checked when a pool is asked for, not in apply, so journals with
#: older, smaller pools replay as they did.
MIN_KV_BUDGET = 64 << 10
_KV_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_KV_POLICY_RE = re.compile(r"^[a-z0-9_-]{1,32}$")
#: Items in one Batch call: as many ops as one Raft entry holds
#: (tierfs.meta.raft.MAX_BATCH_OPS), so a batch is at most one entry.
MAX_BATCH_ITEMS = 256
#: Seconds; MetaOp.gc_grace_ms is a uint32 (about 49 days).
MAX_GC_GRACE = (2**32 - 1) / 1000

#: Most items a repeated field of a request may hold, by (message, field).
LIST_CAPS: dict[tuple[str, str], int] = {
    ("RenewLeaseRequest", "chunks"): MAX_CHUNKS_PER_REQUEST,
    ("RenewLeaseRequest", "uploads"): MAX_CHUNKS_PER_REQUEST,
    ("CommitWriteRequest", "chunks"): MAX_CHUNKS_PER_REQUEST,
    ("CommitWriteRequest", "uploads"): MAX_CHUNKS_PER_REQUEST,
    ("AbortWriteRequest", "uploads"): MAX_CHUNKS_PER_REQUEST,
    ("ChunkRecord", "missing"): MAX_WIDTH,
    ("ListRepairsRequest", "target_ids"): MAX_GC_TARGETS,
    ("MarkFragmentsRequest", "items"): MAX_MARK_ITEMS,
    ("TickRequest", "offline_nodes"): MAX_OFFLINE_PER_TICK,
    ("Replacements", "moves"): MAX_REPLACEMENTS,
    ("AddGroupsRequest", "groups"): MAX_GROUPS_PER_OP,
    ("GroupMembers", "target_ids"): MAX_WIDTH,
    ("RebalanceMovesRequest", "moves"): MAX_REPLACEMENTS,
    ("KVGroupsRequest", "pools"): MAX_KV_POOLS,
    ("KVPoolGroups", "groups"): MAX_KV_GROUP_CHANGES,
    ("KVGroupChange", "target_ids"): MAX_WIDTH,
    ("Replacements", "groups_stuck"): MAX_REPLACEMENTS,
    ("RegisterNodeRequest", "targets"): MAX_TARGETS_PER_NODE,
    ("HeartbeatRequest", "targets"): MAX_TARGETS_PER_NODE,
    ("AckGCRequest", "acks"): MAX_GC_ACKS,
    ("AckGCRequest", "purged"): MAX_PURGES_PAGE,
    ("ListGCRequest", "target_ids"): MAX_GC_TARGETS,
    ("Layout", "groups"): MAX_STRIPE_WIDTH,  # refused when set anyway: meta picks groups
    ("HeartbeatRequest", "kv_usage"): MAX_KV_USAGE,
    ("AddUserRequest", "groups"): 64,  # tierfs.meta.users.MAX_GROUPS
    ("BatchRequest", "items"): MAX_BATCH_ITEMS,
}
#: Most UTF-8 bytes a string field may hold, by (message, field); others get
#: MAX_STRING_BYTES. Names and paths over their cap are NameTooLongError.
STRING_CAPS: dict[tuple[str, str], int] = {
    ("Loc", "path"): MAX_PATH_BYTES,
    ("Loc", "name"): MAX_NAME_BYTES,
    ("LookupRequest", "name"): MAX_NAME_BYTES,
    ("SymlinkRequest", "target"): MAX_PATH_BYTES,
    ("ReaddirRequest", "cursor"): MAX_NAME_BYTES,
    ("OpenWriteRequest", "owner"): MAX_ID_STRING,
    ("Layout", "redundancy"): 64,
    ("RegisterNodeRequest", "node_uuid"): MAX_ID_STRING,
    ("RegisterNodeRequest", "hostname"): MAX_ID_STRING,
    ("RegisterNodeRequest", "data_addr"): MAX_ID_STRING,
    ("RegisterNodeRequest", "control_addr"): MAX_ID_STRING,
    ("TargetSpec", "path"): MAX_ID_STRING,
    ("MetaOp", "client_id"): MAX_ID_STRING,
    ("MetaMemberRequest", "raft_addr"): MAX_ID_STRING,
    ("MetaMemberRequest", "grpc_addr"): MAX_ID_STRING,
    ("CreateKVPoolRequest", "name"): 64,
    ("CreateKVPoolRequest", "redundancy"): 64,
    ("CreateKVPoolRequest", "policy"): 64,
    ("RemoveKVPoolRequest", "name"): 64,
    # user names: tierfs.security.USER_NAME_RE (at most 64)
    ("AddUserRequest", "name"): 64,
    ("RemoveUserRequest", "name"): 64,
    ("IssueTokenRequest", "name"): 64,
    ("RevokeTokenRequest", "name"): 64,
}
#: Largest page a read may ask for, by (message, field); 0 means the default.
LIMIT_CAPS: dict[tuple[str, str], int] = {
    ("ReaddirRequest", "limit"): MAX_READDIR_LIMIT,
    ("ListGCRequest", "limit"): MAX_GC_PAGE,
    ("ListGroupChunksRequest", "limit"): MAX_GROUP_CHUNKS_PAGE,
    ("ListRepairsRequest", "limit"): MAX_REPAIR_PAGE,
}
_NAME_STRINGS = {("Loc", "path"), ("Loc", "name"), ("LookupRequest", "name"), ("SymlinkRequest", "target")}
#: Repeated fields without an entry (none today; a test checks) get this.
_DEFAULT_LIST_CAP = 1024

EC = pb.REDUNDANCY_KIND_EC
REPLICA = pb.REDUNDANCY_KIND_REPLICA


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """A directory's layout policy (0 fields: inherit from the parent)."""

    chunk_size: int = 0
    kind: int = 0
    k: int = 0
    m: int = 0
    stripe_width: int = 0

    @property
    def width(self) -> int:
        return self.k + self.m

    def merged_over(self, base: LayoutSpec) -> LayoutSpec:
        """This spec with its unset fields taken from ``base``."""
        return LayoutSpec(
            chunk_size=self.chunk_size or base.chunk_size,
            kind=self.kind or base.kind,
            k=self.k if self.kind else base.k,
            m=self.m if self.kind else base.m,
            stripe_width=self.stripe_width or base.stripe_width,
        )

    def redundancy(self) -> str:
        return format_redundancy(self.kind, self.k, self.m) if self.kind else ""

    def to_pb(self, groups: list[int] | None = None) -> pb.Layout:
        return pb.Layout(
            chunk_size=self.chunk_size, kind=self.kind,  # type: ignore[arg-type]
            data_shards=self.k, parity_shards=self.m, stripe_width=self.stripe_width,
            groups=groups or [], redundancy=self.redundancy(),
        )


DEFAULT_LAYOUT = LayoutSpec(chunk_size=DEFAULT_CHUNK_SIZE, kind=EC, k=4, m=2, stripe_width=0)

_RED_RE = re.compile(r"^(ec):(\d+)\+(\d+)$|^(replica):(\d+)$")


def parse_redundancy(text: str) -> tuple[int, int, int]:
    """``"ec:4+2"`` -> (EC, 4, 2); ``"replica:3"`` -> (REPLICA, 1, 2)."""
    m = _RED_RE.match(text.strip().lower())
    if m is None:
        raise ConfigError(f"redundancy {text!r} is not 'ec:K+M' or 'replica:N'", field="layout.redundancy")
    if m.group(1):
        k, p = int(m.group(2)), int(m.group(3))
        _check_kkm(EC, k, p)
        return EC, k, p
    n = int(m.group(5))
    _check_kkm(REPLICA, 1, n - 1)
    return REPLICA, 1, n - 1


def format_redundancy(kind: int, k: int, m: int) -> str:
    return f"ec:{k}+{m}" if kind == EC else f"replica:{k + m}"


def _check_kkm(kind: int, k: int, m: int) -> None:
    if kind == EC:
        if k < 1:
            raise ConfigError(f"ec:{k}+{m}: K (data shards) must be at least 1", field="layout.redundancy")
        if m < 1:
            raise ConfigError(f"ec:{k}+{m}: M (parity shards) must be at least 1; use replica:1 for no redundancy",
                              field="layout.redundancy")
    elif kind == REPLICA:
        if k != 1 or m < 0:
            raise ConfigError(f"replica:{k + m}: N must be at least 1", field="layout.redundancy")
    else:
        raise ConfigError(f"unknown redundancy kind {kind}", field="layout.kind")
    if k + m > MAX_WIDTH:
        raise ConfigError(f"{format_redundancy(kind, k, m)}: width {k + m} exceeds the maximum {MAX_WIDTH}",
                          field="layout.redundancy")


def layout_from_pb(lay: pb.Layout) -> LayoutSpec:
    """Validate a layout given on the wire; unset fields stay 0 (inherit)."""
    cs = lay.chunk_size
    if cs and (cs < MIN_CHUNK_SIZE or cs > MAX_CHUNK_SIZE or cs & (cs - 1)):
        raise ConfigError(f"chunk_size {cs} must be a power of two between {MIN_CHUNK_SIZE} (64 KiB) and "
                          f"{MAX_CHUNK_SIZE} (64 MiB)", field="layout.chunk_size")
    if lay.stripe_width > MAX_STRIPE_WIDTH:
        raise ConfigError(f"stripe_width {lay.stripe_width} exceeds the maximum {MAX_STRIPE_WIDTH}",
                          field="layout.stripe_width")
    if lay.groups:
        raise ConfigError("placement groups are chosen by meta; leave layout.groups empty", field="layout.groups")
    kind, k, m = 0, 0, 0
    if lay.kind:
        kind, k, m = int(lay.kind), int(lay.data_shards), int(lay.parity_shards)
        _check_kkm(kind, k, m)
        if lay.redundancy and parse_redundancy(lay.redundancy) != (kind, k, m):
            raise ConfigError(f"redundancy {lay.redundancy!r} contradicts kind/data_shards/parity_shards",
                              field="layout.redundancy")
    elif lay.redundancy:
        kind, k, m = parse_redundancy(lay.redundancy)
    elif lay.data_shards or lay.parity_shards:
        raise ConfigError("data_shards/parity_shards given without kind", field="layout.kind")
    return LayoutSpec(chunk_size=cs, kind=kind, k=k, m=m, stripe_width=lay.stripe_width)


def check_kv_pool_name(name: str, what: str) -> None:
    if not _KV_NAME_RE.match(name):
        raise InvalidArgumentError(f"{what}: KV pool name {name!r} must be 1 to 64 characters of A-Z, a-z, 0-9, "
                                   f"'_', '.' or '-'")


def check_kv_budget_floor(r: pb.CreateKVPoolRequest) -> None:
    """Refuse a nonzero budget under :data:`MIN_KV_BUDGET` (a new pool's
    request only; apply does not call this)."""
    for what, v in (("target_memory", r.target_memory), ("target_disk", r.target_disk)):
        if 0 < v < MIN_KV_BUDGET:
            raise InvalidArgumentError(f"create_kv_pool {r.name!r}: {what} {v} bytes is below the smallest "
                                       f"budget, {MIN_KV_BUDGET >> 10} KiB, and would hold no object; "
                                       f"give a unit (e.g. 256MiB) or 0 for none")


def check_kv_pool_create(r: pb.CreateKVPoolRequest) -> tuple[str, int, str]:
    """Validate a CreateKVPool request whatever the state; returns the
    canonical redundancy, the group width and the policy name."""
    check_kv_pool_name(r.name, "create_kv_pool")
    text = r.redundancy or "replica:1"
    try:
        kind, k, m = parse_redundancy(text)
    except ConfigError as exc:
        raise InvalidArgumentError(f"create_kv_pool {r.name!r}: {exc.reason}") from None
    if not r.target_memory and not r.target_disk:
        raise InvalidArgumentError(f"create_kv_pool {r.name!r}: give a per-target memory or disk budget "
                                   f"(target_memory, target_disk); both are 0")
    for what, v in (("target_memory", r.target_memory), ("target_disk", r.target_disk)):
        if v > MAX_KV_BUDGET:
            raise InvalidArgumentError(f"create_kv_pool {r.name!r}: {what} {v} exceeds the maximum "
                                       f"{MAX_KV_BUDGET} (1 PiB)")
    if r.pin_quota > r.target_memory + r.target_disk:
        raise InvalidArgumentError(f"create_kv_pool {r.name!r}: pin_quota {r.pin_quota} exceeds the pool's "
                                   f"per-target budget {r.target_memory + r.target_disk} (memory + disk)")
    policy = r.policy or "lru"
    if not _KV_POLICY_RE.match(policy):
        raise InvalidArgumentError(f"create_kv_pool {r.name!r}: policy name {policy!r} must be 1 to 32 "
                                   f"characters of a-z, 0-9, '_' or '-'")
    if r.tenant not in ("", "user", "group"):
        raise InvalidArgumentError(f"create_kv_pool {r.name!r}: tenant {r.tenant[:40]!r} must be "
                                   f"\"user\" or \"group\"")
    return format_redundancy(kind, k, m), k + m, policy


def validate_name(name: str) -> None:
    if not name:
        raise InvalidArgumentError("empty name")
    if "/" in name:
        raise InvalidArgumentError(f"name {name!r} contains '/'")
    if "\0" in name:
        raise InvalidArgumentError(f"name {name!r} contains a NUL byte")
    if name in (".", ".."):
        raise InvalidArgumentError(f"{name!r} is not allowed as a name")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise NameTooLongError(f"name of {len(name.encode())} bytes exceeds {MAX_NAME_BYTES} bytes")


def split_path(path: str) -> list[str]:
    """Components of an absolute path; ``"/"`` -> ``[]``. One trailing slash
    is accepted; empty, ``.`` and ``..`` components are refused, not
    normalised, because meta does not resolve them."""
    if "\0" in path:
        raise InvalidArgumentError("path contains a NUL byte")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise NameTooLongError(f"path of {len(path.encode())} bytes exceeds {MAX_PATH_BYTES} bytes")
    if not path.startswith("/"):
        raise InvalidArgumentError(f"path {path!r} is not absolute")
    if path == "/":
        return []
    body = path[1:-1] if path.endswith("/") else path[1:]
    parts = body.split("/")
    for p in parts:
        validate_name(p)
    return parts


def check_loc(loc: pb.Loc, *, entry: bool, what: str) -> None:
    """``entry``: the op names a directory entry (create, unlink, rename), so
    the inode form is not allowed and the root cannot be named."""
    forms = sum((bool(loc.path), bool(loc.parent or loc.name), bool(loc.inode)))
    if forms == 0:
        raise InvalidArgumentError(f"{what}: location is empty (give a path, parent+name or inode)")
    if forms > 1:
        raise InvalidArgumentError(f"{what}: give exactly one of path, parent+name or inode")
    if loc.path:
        parts = split_path(loc.path)
        if entry and not parts:
            raise InvalidArgumentError(f"{what}: the root directory has no name")
    elif loc.parent or loc.name:
        if not loc.parent:
            raise InvalidArgumentError(f"{what}: name given without parent inode")
        validate_name(loc.name)
    elif entry:
        raise InvalidArgumentError(f"{what}: needs a path or parent+name, not an inode id")


def _mode(mode: int, what: str) -> None:
    if mode & ~0o7777:
        raise InvalidArgumentError(f"{what}: mode {oct(mode)} has bits outside 07777")


def _short(value: str, what: str, *, required: bool = True) -> None:
    if required and not value:
        raise InvalidArgumentError(f"{what} is empty")
    if len(value.encode()) > MAX_ID_STRING:
        raise InvalidArgumentError(f"{what} exceeds {MAX_ID_STRING} bytes")
    if "\0" in value:
        raise InvalidArgumentError(f"{what} contains a NUL byte")


def check_addr(value: str, what: str, *, required: bool = True) -> None:
    """A ``host:port`` address (``[v6]:port`` too) that a peer can dial:
    anything else would be stored and handed to every client or replica."""
    _short(value, what, required=required)
    if not value:
        return
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if (not sep or not host or not port.isdigit() or not 0 < int(port) < 65536
            or any(c.isspace() or c in "/[]" for c in host)):
        raise InvalidArgumentError(f"{what}: not a host:port address: {value[:80]!r}")


def cap(field_name: str, count: int, limit: int) -> None:
    """Refuse a list of ``count`` items where at most ``limit`` are allowed."""
    if count > limit:
        raise InvalidArgumentError(f"{field_name}: {count} items exceed the cap of {limit}")


def check_caps(msg: Message, what: str) -> None:
    """Check every repeated field, string and page limit of ``msg`` (and of
    the messages inside it) against the cap tables. Counts are checked before
    anything iterates over a list, so an oversized one costs O(1)."""
    name = msg.DESCRIPTOR.name
    for fd, value in msg.ListFields():
        where = f"{what}.{fd.name}"
        key = (name, fd.name)
        is_msg = fd.type == FieldDescriptor.TYPE_MESSAGE
        if fd.is_repeated:
            cap(where, len(value), LIST_CAPS.get(key, _DEFAULT_LIST_CAP))
            if is_msg:
                for i, item in enumerate(value):
                    check_caps(item, f"{where}[{i}]")
            elif fd.type == FieldDescriptor.TYPE_STRING:
                for i, item in enumerate(value):
                    _check_string(key, item, f"{where}[{i}]")
        elif is_msg:
            check_caps(value, where)
        elif fd.type == FieldDescriptor.TYPE_STRING:
            _check_string(key, value, where)
        elif key in LIMIT_CAPS and value > LIMIT_CAPS[key]:
            raise InvalidArgumentError(f"{where}: {value} exceeds the cap of {LIMIT_CAPS[key]}")


def _check_string(key: tuple[str, str], value: str, where: str) -> None:
    limit = STRING_CAPS.get(key, MAX_STRING_BYTES)
    err = NameTooLongError if key in _NAME_STRINGS else InvalidArgumentError
    # The length in characters is a lower bound of the UTF-8 length: a huge
    # string is refused without encoding it.
    if len(value) > limit:
        raise err(f"{where}: {len(value)} characters exceed the cap of {limit} bytes")
    n = len(value.encode())
    if n > limit:
        raise err(f"{where}: {n} bytes exceed the cap of {limit} bytes")


def check_op_size(size: int, what: str) -> None:
    """Refuse an op (or the request it is made of) of ``size`` serialized bytes over MAX_OP_BYTES."""
    if size > MAX_OP_BYTES:
        raise InvalidArgumentError(f"{what}: {size} bytes exceed the cap of {MAX_OP_BYTES} bytes for one meta request")


def _check_kv_groups(r: pb.KVGroupsRequest) -> None:
    """The state-free checks of a KVGroups op: pools and positions in
    increasing order (so each is named once), no empty group."""
    last_pool = 0
    changes = 0
    for p in r.pools:
        if p.pool_id <= last_pool:
            raise InvalidArgumentError(f"kv_groups: pool {p.pool_id} is 0 or not after pool {last_pool}")
        last_pool = p.pool_id
        last = -1
        for g in p.groups:
            if g.index <= last:
                raise InvalidArgumentError(f"kv_groups: pool {p.pool_id}: group index {g.index} is not after {last}")
            if g.index >= p.count:
                raise InvalidArgumentError(f"kv_groups: pool {p.pool_id}: group index {g.index} is past the "
                                           f"pool's {p.count} groups")
            if not g.target_ids:
                raise InvalidArgumentError(f"kv_groups: pool {p.pool_id}: group index {g.index} has no members")
            last = g.index
        changes += len(p.groups)
    if changes > MAX_KV_GROUP_CHANGES:
        raise InvalidArgumentError(f"kv_groups: {changes} group changes exceed the cap of {MAX_KV_GROUP_CHANGES} "
                                   f"for one op")


def validate_op(op: pb.MetaOp) -> None:
    """Raise a TierFSError if ``op`` is malformed, whatever the state."""
    kind = op.WhichOneof("body")
    if kind is None:
        raise InvalidArgumentError("op has no body")
    _check_string(("MetaOp", "client_id"), op.client_id, "client_id")
    check_caps(getattr(op, kind), kind)
    if op.HasField("kv_default_pool"):
        check_caps(op.kv_default_pool, "kv_default_pool")
        check_kv_pool_create(op.kv_default_pool)
    if kind == "mkdir":
        check_loc(op.mkdir.loc, entry=True, what="mkdir")
        _mode(op.mkdir.mode, "mkdir")
    elif kind == "create":
        check_loc(op.create.loc, entry=True, what="create")
        _mode(op.create.mode, "create")
        if op.create.has_layout:
            layout_from_pb(op.create.layout)
    elif kind == "rename":
        check_loc(op.rename.src, entry=True, what="rename source")
        check_loc(op.rename.dst, entry=True, what="rename destination")
    elif kind == "unlink":
        check_loc(op.unlink.loc, entry=True, what="unlink")
    elif kind == "rmdir":
        check_loc(op.rmdir.loc, entry=True, what="rmdir")
    elif kind == "symlink":
        check_loc(op.symlink.loc, entry=True, what="symlink")
        t = op.symlink.target
        if not t:
            raise InvalidArgumentError("symlink: empty target")
        if "\0" in t:
            raise InvalidArgumentError("symlink: target contains a NUL byte")
        if len(t.encode()) > MAX_PATH_BYTES:
            raise NameTooLongError(f"symlink: target exceeds {MAX_PATH_BYTES} bytes")
    elif kind == "setattr":
        check_loc(op.setattr.loc, entry=False, what="setattr")
        if op.setattr.set_mode:
            _mode(op.setattr.mode, "setattr")
    elif kind == "truncate":
        check_loc(op.truncate.loc, entry=False, what="truncate")
        if op.truncate.size > MAX_FILE_SIZE:
            raise InvalidArgumentError(f"truncate: size {op.truncate.size} exceeds the maximum file size {MAX_FILE_SIZE}")
    elif kind == "set_layout":
        check_loc(op.set_layout.loc, entry=False, what="set_layout")
        layout_from_pb(op.set_layout.layout)
    elif kind == "open_write":
        check_loc(op.open_write.loc, entry=False, what="open_write")
        _short(op.open_write.owner, "open_write: owner", required=False)
    elif kind in ("renew_lease", "commit_write", "abort_write"):
        body = getattr(op, kind)
        if not body.session_id:
            raise InvalidArgumentError(f"{kind}: session_id is 0")
        if kind == "commit_write" and body.size > MAX_FILE_SIZE:
            raise InvalidArgumentError(f"commit_write: size {body.size} exceeds the maximum file size {MAX_FILE_SIZE}")
    elif kind == "register_node":
        r = op.register_node
        _short(r.node_uuid, "register_node: node_uuid")
        _short(r.hostname, "register_node: hostname")
        _short(r.data_addr, "register_node: data_addr")
        _short(r.control_addr, "register_node: control_addr", required=False)
        _short(r.rack, "register_node: rack", required=False)
        if not r.targets:
            raise InvalidArgumentError("register_node: a node must offer at least one target")
        paths = [t.path for t in r.targets]
        for p in paths:
            _short(p, "register_node: target path")
        if len(set(paths)) != len(paths):
            raise InvalidArgumentError("register_node: duplicate target path")
    elif kind == "create_kv_pool":
        check_kv_pool_create(op.create_kv_pool)
    elif kind == "remove_kv_pool":
        check_kv_pool_name(op.remove_kv_pool.name, "remove_kv_pool")
    elif kind == "label_node":
        if not op.label_node.node_id:
            raise InvalidArgumentError("label_node: node_id is 0")
        _short(op.label_node.rack, "label_node: rack", required=False)
    elif kind == "add_groups":
        if not op.add_groups.width:
            raise InvalidArgumentError("add_groups: width is 0")
    elif kind == "kv_groups":
        _check_kv_groups(op.kv_groups)
    elif kind == "finish_rebuild":
        if not op.finish_rebuild.group_id or not op.finish_rebuild.target_id:
            raise InvalidArgumentError("finish_rebuild: group_id and target_id are required")
    elif kind == "heartbeat":
        if not op.heartbeat.node_id:
            raise InvalidArgumentError("heartbeat: node_id is 0")
        ids = [t.target_id for t in op.heartbeat.targets]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError("heartbeat: duplicate target id")
        for rep in op.heartbeat.targets:
            if rep.state not in (pb.TARGET_STATE_UNSPECIFIED, pb.TARGET_STATE_ONLINE,
                               pb.TARGET_STATE_FAILED, pb.TARGET_STATE_READ_ONLY):
                # An unknown number has no name: naming it must not fail itself.
                name = pb.TargetState.Name(rep.state) if rep.state in pb.TargetState.values() else str(rep.state)
                raise InvalidArgumentError(f"heartbeat: a node cannot report its target as {name}")
