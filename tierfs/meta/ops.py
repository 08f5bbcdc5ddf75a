"""Static validation of metadata ops and the layout vocabulary.

Everything here is a pure function of the request: the gRPC service calls
:func:`validate_op` before it submits an op to Raft (so bad input costs no log
entry), and the state machine calls it again inside ``apply`` (so a replica
never trusts what reached the log). Checks that need state (does the parent
exist, is the name taken) live in :mod:`tierfs.meta.state`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tierfs.errors import (
    ConfigError,
    InvalidArgumentError,
    NameTooLongError,
)
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_LAYOUT",
    "MAX_CHUNK_SIZE",
    "MAX_FILE_SIZE",
    "MAX_NAME_BYTES",
    "MAX_PATH_BYTES",
    "MIN_CHUNK_SIZE",
    "LayoutSpec",
    "check_loc",
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
#: Fragments one MarkFragments request may report (the repair queue pages).
MAX_MARK_ITEMS = 10_000

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


def validate_op(op: pb.MetaOp) -> None:
    """Raise a TierFSError if ``op`` is malformed, whatever the state."""
    kind = op.WhichOneof("body")
    if kind is None:
        raise InvalidArgumentError("op has no body")
    if len(op.client_id.encode()) > MAX_ID_STRING:
        raise InvalidArgumentError("client id too long")
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
        if not r.targets:
            raise InvalidArgumentError("register_node: a node must offer at least one target")
        if len(r.targets) > MAX_TARGETS_PER_NODE:
            raise InvalidArgumentError(f"register_node: more than {MAX_TARGETS_PER_NODE} targets")
        paths = [t.path for t in r.targets]
        for p in paths:
            _short(p, "register_node: target path")
        if len(set(paths)) != len(paths):
            raise InvalidArgumentError("register_node: duplicate target path")
    elif kind == "mark_fragments":
        if len(op.mark_fragments.items) > MAX_MARK_ITEMS:
            raise InvalidArgumentError(f"mark_fragments: {len(op.mark_fragments.items)} items, at most "
                                       f"{MAX_MARK_ITEMS} per request")
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
                raise InvalidArgumentError(f"heartbeat: a node cannot report its target as {pb.TargetState.Name(rep.state)}")
