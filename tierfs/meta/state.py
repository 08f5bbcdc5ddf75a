"""The metadata state machine: namespace, layouts, cluster map, placement
groups, write sessions, the GC queue and KV pool definitions
(:mod:`tierfs.meta.kvpools`).

One :class:`MetaStateMachine` lives in every meta replica. Raft hands it
committed ops (serialized :class:`tierfs.v1.MetaOp`) in log order;
:meth:`MetaStateMachine.apply` is deterministic and never raises: an op that
fails leaves the state as it was and records the error in its
:class:`tierfs.v1.MetaResult`, so every replica agrees on the outcome. Time
comes from the op (``now_ns``, stamped by the leader) and never from the
local clock; the state keeps the largest time seen so a new leader with a
slower clock cannot move it backwards, and one op moves it forwards by at
most MAX_CLOCK_STEP_NS. Every op runs in an undo transaction
(:mod:`tierfs.meta.undo`): one that raises half-way is rolled back.

Reads (:meth:`stat`, :meth:`readdir`, :meth:`cluster_map`, ...) run against
the local state and raise TierFSError directly; the service runs them after
the replicator's read barrier.

Snapshots are canonical JSON (sorted keys, no floats), so ``digest()`` (sha256
of the snapshot) is equal on replicas holding equal state, and a restored
replica digests equal to the one it was taken from.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from google.protobuf.message import DecodeError, Message

from tierfs.chunk import ChunkRecord, parity_size, session_version
from tierfs.errors import (
    AlreadyExistsError,
    BusyError,
    DirectoryNotEmptyError,
    InsufficientTargetsError,
    InternalError,
    InvalidArgumentError,
    InvalidRenameError,
    IsADirectoryError_,
    NoSpaceError,
    NotADirectoryError_,
    NotFoundError,
    ProtocolError,
    SessionExpiredError,
    StaleVersionError,
    TierFSError,
)
from tierfs.meta import users as users_mod
from tierfs.meta.dedup import (
    REQUEST_TTL_NS,
    REQUESTS_PER_CLIENT,
    REQUESTS_PER_CLIENT_OLD,
    RequestTable,
)
from tierfs.meta.domains import domain, domain_line, rack_counts
from tierfs.meta.gcqueue import GCEntry, GCQueue
from tierfs.meta.interfaces import LegacyEntryError, ReplicaTooOldError
from tierfs.meta.kvpools import (
    DEFAULT_POOL_NAME,
    MAX_KV_POOLS,
    KVPoolRecord,
    pool_from_json,
    pool_to_json,
    replan_groups,
    set_groups,
)
from tierfs.meta.ops import (
    DEFAULT_LAYOUT,
    MAX_GC_PAGE,
    MAX_PURGES_PAGE,
    MAX_READDIR_LIMIT,
    MAX_REPAIR_PAGE,
    LayoutSpec,
    check_kv_pool_create,
    check_loc,
    check_op_size,
    layout_from_pb,
    split_path,
    validate_op,
)
from tierfs.meta.perms import (
    R,
    W,
    X,
    access_ok,
    check_chown,
    chmod_mode,
    chown_mode,
    denied,
    from_caller,
    is_root,
    may_delete,
    new_owner,
    not_permitted,
)
from tierfs.meta.placement import distinct_nodes, domain_cap
from tierfs.meta.undo import Tracked, new_object, transaction
from tierfs.meta.users import UserRecord
from tierfs.proto.v1 import common_pb2
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.security import ANONYMOUS, ROOT, Identity

#: The op format this code applies. The leader stamps it into every op
#: (``MetaOp.min_format``); a replica that finds a higher one in the log
#: raises ReplicaTooOldError (its Raft layer stops it) instead of applying
#: the entry its own, older way. Bump it with every change to what apply
#: does with an op or to the fields it reads (docs/operations.md,
#: "Upgrading meta replicas"). TIERFS_TEST_OP_FORMAT overrides it, only to
#: play a newer or older version in tests.
OP_FORMAT = int(os.environ.get("TIERFS_TEST_OP_FORMAT", "") or 9)
#: Entries of this format on keep KV placement stamps (docs/kv.md,
#: "Overwrites and map changes"): pool members' since, the group count
#: history, targets' up_since. Entries of older leaders leave them empty,
#: so a replica's state is the same whether it replayed those entries or
#: loaded a snapshot an older replica took.
KV_STAMPS_FORMAT = 2
#: Entries of this format on may give a KV pool one group per target
#: present (down ones included) rather than per eligible target: the
#: leader's planner keeps a pool's group count, and redundant pools' down
#: members in place, while a target is only down (docs/kv_pools.md,
#: "Placement groups").
KV_HELD_FORMAT = 3
#: Entries of this format on bind the retry table's results to what they
#: answered (the op's kind and the caller): a request id used again for
#: another kind of request, or by another identity, is refused instead of
#: answered with the first reply (tierfs.meta.dedup). Older entries replay
#: as they did.
DEDUP_BOUND_FORMAT = 4
#: Entries of this format on update a directory's layout field by field: the
#: fields a SetLayout leaves unset keep the directory's own values. Older
#: entries replaced the whole spec (unset fields were inherited from the
#: parent again, so a second set-layout lost the first's settings).
LAYOUT_MERGE_FORMAT = 4
#: Entries of this format on keep a client's last REQUESTS_PER_CLIENT (4096)
#: results for retries; older ones kept 128, fewer than one Batch call's
#: items, so a batch retried after a lost reply was partly applied again
#: (a rename moved twice, a mkdir answered "exists").
DEDUP_WINDOW_FORMAT = 5
#: Entries of this format may be UndrainNode ops (``tierfs node undrain``),
#: a kind that replicas of older formats do not know.
UNDRAIN_FORMAT = 6
#: Entries of this format on: the FinishRebuild of a move also names its
#: new member in the GC items its copy source still has to delete in that
#: group, at the same position. A move copies those generations (readers
#: may still hold them, stop 52), and GC then deletes the copies with the
#: rest; before, they outlived their item and scrub found them as orphans.
GC_COPIES_FORMAT = 7
#: Entries of this format may be RedirectMoves ops: the leader sends a move
#: whose new member stayed full (read-only) or failed on to another target
#: (tierfs.meta.rebalance), a kind that replicas of older formats do not know.
REDIRECT_FORMAT = 8
#: Entries of this format on record a *group purge* whenever a member leaves
#: a position for good (replaced, or the move or drain that copied from it
#: finished): its node deletes its copy of that position once the op's GC
#: grace is over, and acknowledges (docs/repair.md, "Purging a former
#: member's copy"); the target may not rejoin the group meanwhile. Before,
#: the copy stayed until a scrub pass reached it and found it older than
#: orphan_grace: a full target stayed full, an old member of a move kept
#: twice its share, for an hour or more.
PURGE_FORMAT = 9
#: Entries of this format on stamp a target's ``full_since`` (the state
#: clock when its node reported it full or failed): the leader's redirect of
#: a move stuck on it counts from there, so a new leader goes on counting
#: instead of starting again (under a leader killed every few seconds no
#: move was ever redirected).
FULL_SINCE_FORMAT = 9

__all__ = ["ROOT_INODE", "MetaStateMachine"]

#: tests only (TIERFS_TEST_CHECK_PLACEMENT_CACHE, set by tests/conftest.py):
#: every create also computes its groups afresh and fails (InternalError)
#: where the per-map-version cache differs.
_CHECK_PLACEMENT_CACHE = bool(os.environ.get("TIERFS_TEST_CHECK_PLACEMENT_CACHE"))

ROOT_INODE = 1
FILE = pb.INODE_TYPE_FILE
DIR = pb.INODE_TYPE_DIRECTORY
SYMLINK = pb.INODE_TYPE_SYMLINK
ONLINE = pb.TARGET_STATE_ONLINE
OFFLINE = pb.TARGET_STATE_OFFLINE
NODE_ONLINE = pb.NODE_STATE_ONLINE
NODE_OFFLINE = pb.NODE_STATE_OFFLINE

DEFAULT_LEASE_MS = 30_000
MAX_LEASE_MS = 600_000
#: Files spread over at most this many placement groups unless the layout
#: asks for more: enough for full-bandwidth reads of a large file on a
#: mid-size cluster, few enough to keep a small file's stat reply small.
AUTO_STRIPE_MAX = 16
DEFAULT_READDIR_LIMIT = 1000
DEFAULT_GC_PAGE = 1000
#: 2: chunk records (generation, length, valid, crc, missing) replace the
#: per-chunk versions of format 1, whose fragments could not be told apart.
SNAPSHOT_FORMAT = 2
#: How far one op may move the state clock forwards. The leader stamps ops
#: with time continued from the state clock (MetaServicer.now_ns), so a
#: correct leader never needs more than the time since the previous op; a
#: longer idle gap is caught up over several ops.
MAX_CLOCK_STEP_NS = 3600 * 10**9
NS_PER_MS = 1_000_000


@dataclass(slots=True)
class Inode(Tracked):
    id: int
    type: int
    mode: int
    uid: int
    gid: int
    mtime: int
    ctime: int
    nlink: int = 1
    size: int = 0
    data_version: int = 0
    parent: int = 0
    entries: dict[str, int] = field(default_factory=dict)
    # Directories: explicit (possibly partial) policy or None; files: the
    # fully resolved layout chosen at create time.
    layout: LayoutSpec | None = None
    groups: list[int] = field(default_factory=list)
    chunks: dict[int, ChunkRecord] = field(default_factory=dict)
    target: str = ""
    session: int = 0


@dataclass(slots=True)
class Node(Tracked):
    id: int
    uuid: str
    hostname: str
    data_addr: str
    control_addr: str
    state: int
    last_hb: int
    targets: list[int] = field(default_factory=list)
    draining: bool = False  # `tierfs node drain`: its targets leave every group
    rack: str = ""  # failure domain label; "" = the node is its own (tierfs.meta.domains)


@dataclass(slots=True)
class Target(Tracked):
    id: int
    node: int
    path: str
    capacity: int
    used: int = 0
    reported: int = ONLINE  # what the storage daemon says about its disk
    present: bool = True  # offered in the node's latest registration
    down_since: int = 0  # clock when it stopped being usable; 0 while usable
    # map version from which it has been usable without a break (KV copies
    # it holds from before are not served: docs/kv.md); 0 = since it joined
    up_since: int = 0
    removed: bool = False  # declared dead (`tierfs target rm`): never used again
    # state clock since when its node has reported it full (read-only) or
    # failed; 0 otherwise (FULL_SINCE_FORMAT)
    full_since: int = 0


@dataclass(slots=True)
class Session(Tracked):
    id: int
    inode: int
    owner: str
    expiry: int
    version: int
    uploads: set[tuple[int, int]] = field(default_factory=set)  # (chunk, generation) begun
    # chunk -> record stored and staged by a renewal: published at commit
    staged: dict[int, ChunkRecord] = field(default_factory=dict)




def _fingerprint(msg: pb.MetaOp) -> str:
    """What a retry of ``msg`` must repeat for the retry table to answer it
    with the first reply: the op's kind and the identity the leader
    authenticated (``caller``; absent with security off). Not the request's
    fields: a leader stamps some of them itself (replacement plans, token
    hashes), so a true retry may carry other values there."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(msg.WhichOneof("body")).encode())
    h.update(b"\0")
    h.update(msg.caller.SerializeToString(deterministic=True))
    return h.hexdigest()


def _result(reply: Message | None = None, err: TierFSError | None = None) -> bytes:
    res = pb.MetaResult()
    if err is not None:
        res.error.code = err.code  # type: ignore[assignment]
        res.error.message = err.message
    else:
        res.error.code = common_pb2.ERROR_CODE_OK
        if reply is not None:
            res.reply = reply.SerializeToString(deterministic=True)
    return res.SerializeToString(deterministic=True)


class MetaStateMachine(Tracked):
    """Implements :class:`tierfs.meta.interfaces.StateMachine`."""

    def __init__(self) -> None:
        #: apply() calls on this instance (local diagnostics; not replicated
        #: state, so not in snapshots or the digest).
        self.ops_applied = 0
        #: GC grace of the op being applied (MetaOp.gc_grace_ms); not state.
        self._gc_grace_ns = 0
        #: Purge grace of the op being applied (MetaOp.purge_grace_ms); not state.
        self._purge_grace_ns = 0
        #: Whether the op being applied records group purges (PURGE_FORMAT); not state.
        self._purging = False
        #: tests only (TIERFS_TEST_APPLY_FAIL_MARKER): an op whose bytes
        #: contain the marker raises after it mutated the state, on every
        #: replica - the undo log must put everything back.
        self._fail_marker = os.environ.get("TIERFS_TEST_APPLY_FAIL_MARKER", "").encode()
        self._reset()

    # ---- lifecycle ----------------------------------------------------------

    def _reset(self) -> None:
        self.clock = 0
        self.next_inode = ROOT_INODE + 1
        self.next_node = 1
        self.next_target = 1
        self.next_group = 1
        self.next_session = 1
        self.next_gc = 1
        self.map_version = 1
        self._op_version = 1  # the map version when the op being applied began
        self._stamping = False  # whether that op keeps KV placement stamps (KV_STAMPS_FORMAT)
        self.inodes: dict[int, Inode] = {
            ROOT_INODE: Inode(id=ROOT_INODE, type=DIR, mode=0o755, uid=0, gid=0, mtime=0, ctime=0,
                              nlink=2, parent=ROOT_INODE, layout=DEFAULT_LAYOUT),
        }
        # file or symlink inode -> the directory holding it (directories
        # know their parent): derived from the entries, not in snapshots;
        # what lets an op that names a file by inode check search
        # permission along its path.
        self.holder: dict[int, int] = {}
        self.nodes: dict[int, Node] = {}
        self.targets: dict[int, Target] = {}
        self.groups: dict[int, list[int]] = {}
        # group id -> members that replaced a failed target, not rebuilt yet
        self.rebuilding: dict[int, set[int]] = {}
        # group id -> {rebuilding member: the member it replaced, still
        # readable (a drain) so the rebuild can copy instead of decode}
        self.rebuild_sources: dict[int, dict[int, int]] = {}
        self.widths: set[int] = {DEFAULT_LAYOUT.width}
        # Per-group chunk inventory, derived from the chunk records (not in
        # snapshots; rebuilt on restore): group id -> {inode: (chunks, bytes
        # each member holds)}, and group id -> bytes each member holds.
        # What list_group_chunks and the rebalancer read instead of
        # scanning every inode.
        self.ginv: dict[int, dict[int, tuple[int, int]]] = {}
        # Derived, never in the snapshot: width -> (healthy groups, (group,
        # members online) pairs) of that width, valid for the map key it
        # was computed at (_placement_key). Every change of a group's
        # members or of a target's state bumps the map; an op that fails
        # undoes what it put here with the rest (a tracked dict). Without
        # it a create cost O(groups x width): 2 ms of apply per create,
        # on every replica, with 1,000 targets (docs/scale.md).
        self._placement: dict[int, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]] = {}
        self._placement_key: tuple[int, int, int] = (0, 0, 0)
        self.gbytes: dict[int, int] = {}
        # Rebalance moves not finished: group id -> (new member, old member
        # it copies from, bytes), and the totals of the finished ones.
        self.moving: dict[int, tuple[int, int, int]] = {}
        # Group purges (PURGE_FORMAT): target id -> {(group, position):
        # (purge id, ready at (state clock, ns), map version from which the
        # target no longer holds the position)}. A target with a purge in a
        # group is not made a member of it until the purge is acknowledged.
        self.purges: dict[int, dict[tuple[int, int], tuple[int, int, int]]] = {}
        self.next_purge = 1
        self.moves_done = 0
        self.bytes_moved = 0
        # group id -> {position: the map version that announced its current
        # member}: a commit whose writer's map is older records the position
        # missing (its fragment went to the member before).
        self.pos_epoch: dict[int, dict[int, int]] = {}
        self.sessions: dict[int, Session] = {}
        # (inode, chunk) of committed chunks with fragments known missing or
        # bad (derived from the chunk records: not in snapshots)
        self.degraded: set[tuple[int, int]] = set()
        self.gc = GCQueue()
        self.requests = RequestTable()
        # KV pools (tierfs.meta.kvpools), by pool id; ids are never reused.
        self.kv_pools: dict[int, KVPoolRecord] = {}
        self.next_kv_pool = 1
        # Whether the default pool was made (or found made) once: removed by
        # an operator, it is not made again.
        self.kv_default_done = False
        # Users and their token hashes (tierfs.meta.users), by name.
        self.users: dict[str, UserRecord] = {}

    # ---- StateMachine protocol ---------------------------------------------

    def apply(self, op: bytes) -> bytes:
        self.ops_applied += 1
        try:
            msg = pb.MetaOp.FromString(op)
        except (DecodeError, ValueError) as exc:
            return _result(err=ProtocolError(f"undecodable meta op: {exc}"))
        if msg.min_format > OP_FORMAT:
            self.ops_applied -= 1  # not applied
            raise ReplicaTooOldError(
                f"this replica runs meta op format {OP_FORMAT}, and the log holds an entry of format "
                f"{msg.min_format} (written by a newer leader): upgrade this replica to the leader's TierFS "
                f"version and start it again (docs/operations.md, 'Upgrading meta replicas')")
        # A failed op must leave the state exactly as it was, clock included:
        # every mutation inside the transaction is undone if the op raises,
        # wherever it raises (tierfs/meta/undo.py).
        dedup = bool(msg.client_id and msg.request_id)
        fingerprint = _fingerprint(msg) if dedup and msg.min_format >= DEDUP_BOUND_FORMAT else None
        try:
            with transaction():
                self.clock = self._advance(msg.now_ns)
                if dedup:
                    found, first, first_print = self.requests.lookup(msg.client_id, msg.request_id)
                    if found and fingerprint is not None and first_print is not None and first_print != fingerprint:
                        raise InvalidArgumentError(
                            f"request id {msg.request_id} of client {msg.client_id!r} was already used for "
                            f"another request (another kind of op, or another caller): a retry must repeat its "
                            f"request; a new request needs a new id")
                    if found:
                        return first if first is not None else _result(err=InternalError(
                            f"request {msg.request_id} of client {msg.client_id} was already applied, but its "
                            f"reply was too large to keep for retries: read the state again instead"))
                self._gc_grace_ns = msg.gc_grace_ms * NS_PER_MS
                self._purge_grace_ns = msg.purge_grace_ms * NS_PER_MS
                validate_op(msg)
                kind = msg.WhichOneof("body")
                check_op_size(len(op), str(kind))  # the service refuses these; the log is not trusted either
                version = self._op_version = self.map_version
                self._stamping = msg.min_format >= KV_STAMPS_FORMAT
                self._purging = msg.min_format >= PURGE_FORMAT
                reply = getattr(self, f"_op_{kind}")(msg, getattr(msg, str(kind)))
                if self.map_version != version and not msg.kv_planned and kind != "kv_groups":
                    # Every change of which targets are usable bumps the
                    # map. An entry of an older leader re-plans the KV
                    # pool groups in the same op, as it always did; a
                    # leader that stamps kv_planned commits them itself
                    # (tierfs.meta.kvplan, _op_kv_groups).
                    self._kv_replan()
                out = _result(reply)
                if self._fail_marker and self._fail_marker in op:
                    raise RuntimeError("test hook: failing after the op mutated the state")
        except TierFSError as err:
            return _result(err=err)
        except ReplicaTooOldError:
            self.ops_applied -= 1  # not applied (the transaction undid what it began)
            raise
        except Exception as exc:  # a bug: still a deterministic outcome everywhere
            return _result(err=InternalError(f"{type(exc).__name__}: {exc}"))
        # Only successes are remembered: a retry of a failed request is simply
        # tried again (it cannot have taken effect), and a refused op leaves
        # no trace in the state at all. The dedup table changes only here,
        # after the op succeeded (it keeps an activity order of its own that
        # the undo log would not restore).
        if dedup:
            self.requests.remember(msg.client_id, msg.request_id, out, self.clock, fingerprint,
                                   REQUESTS_PER_CLIENT if msg.min_format >= DEDUP_WINDOW_FORMAT
                                   else REQUESTS_PER_CLIENT_OLD)
        return out

    def _advance(self, now_ns: int) -> int:
        """The state clock after an op stamped ``now_ns``: never backwards
        (a new leader with a slower clock) and never more than
        MAX_CLOCK_STEP_NS forwards in one op, so a leader whose clock jumped
        ahead cannot drag the clock far (docs/meta.md, "Time"). A fresh
        state (clock 0) takes the first stamp as is."""
        if self.clock and now_ns > self.clock + MAX_CLOCK_STEP_NS:
            now_ns = self.clock + MAX_CLOCK_STEP_NS
        return max(self.clock, now_ns)

    def snapshot(self) -> bytes:
        return json.dumps(self._to_json(), sort_keys=True, separators=(",", ":")).encode()

    def restore(self, data: bytes) -> None:
        doc = json.loads(data)
        if doc.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"unknown meta snapshot format {doc.get('format')!r}")
        self._reset()
        self._from_json(doc)

    def digest(self) -> str:
        return hashlib.sha256(self.snapshot()).hexdigest()

    # ---- helpers used by ops and reads -------------------------------------

    def _inode(self, ino: int) -> Inode:
        node = self.inodes.get(ino)
        if node is None:
            raise NotFoundError(f"no inode {ino}")
        return node

    def _resolve(self, path: str, ident: Identity = ROOT, op: str = "") -> Inode:
        cur = self.inodes[ROOT_INODE]
        walked = ""
        check = not is_root(ident)
        for name in split_path(path):
            if cur.type != DIR:
                raise NotADirectoryError_(f"{walked or '/'} is not a directory")
            if check:
                self._need(ident, cur, X, op, path)
            child = cur.entries.get(name)
            walked += "/" + name
            if child is None:
                raise NotFoundError(f"{walked}: no such file or directory")
            cur = self.inodes[child]
        return cur

    def _dir(self, ino: Inode, what: str) -> Inode:
        if ino.type != DIR:
            raise NotADirectoryError_(f"{what} is not a directory")
        return ino

    def _get(self, loc: pb.Loc, ident: Identity = ROOT, op: str = "") -> Inode:
        """The object a location names (path, parent+name or inode), with
        search permission on every directory above it checked for ``ident``
        (by whichever form it is named: a directory chain is unique)."""
        if loc.path:
            return self._resolve(loc.path, ident, op)
        if loc.inode:
            n = self._inode(loc.inode)
            self._search(ident, self._container(n), op, self._where(loc))
            return n
        parent = self._dir(self._inode(loc.parent), f"inode {loc.parent}")
        self._search(ident, parent, op, self._where(loc))
        child = parent.entries.get(loc.name)
        if child is None:
            raise NotFoundError(f"{loc.name!r} not found in directory inode {loc.parent}")
        return self.inodes[child]

    def _entry(self, loc: pb.Loc, ident: Identity = ROOT, op: str = "") -> tuple[Inode, str]:
        """The directory and name a location names (entry ops), with search
        permission on that directory and every one above it checked."""
        if loc.path:
            parts = split_path(loc.path)
            if not parts:  # an IndexError inside apply until stop 47 (a create of "/")
                raise IsADirectoryError_(f"{op or 'this op'}: '/' is the root directory, which has no name")
            parent = self._dir(self._resolve("/" + "/".join(parts[:-1]), ident, op), "/" + "/".join(parts[:-1]))
            if not is_root(ident):
                self._need(ident, parent, X, op, loc.path)
            return parent, parts[-1]
        parent = self._dir(self._inode(loc.parent), f"inode {loc.parent}")
        self._search(ident, parent, op, self._where(loc))
        return parent, loc.name

    # ---- permissions (tierfs.meta.perms; docs/security-authz.md) -------------

    def _container(self, n: Inode) -> Inode | None:
        """The directory holding ``n`` (None for the root)."""
        if n.id == ROOT_INODE:
            return None
        pid = n.parent if n.type == DIR else self.holder.get(n.id)
        return None if pid is None else self.inodes.get(pid)

    def _path_of(self, n: Inode) -> str:
        """``n``'s path, for messages (only built for a denial)."""
        parts: list[str] = []
        cur = n
        while cur.id != ROOT_INODE:
            up = self._container(cur)
            if up is None:
                return f"inode {n.id}"
            parts.append(next((k for k, v in up.entries.items() if v == cur.id), f"inode {cur.id}"))
            cur = up
        return "/" + "/".join(reversed(parts))

    def _need(self, ident: Identity, n: Inode, want: int, op: str, where: str) -> None:
        if not access_ok(ident, n.mode, n.uid, n.gid, want):
            kind = "directory" if n.type == DIR else "file" if n.type == FILE else "symlink"
            raise denied(op, where, ident, want, f"{kind} {self._path_of(n)}", n.mode, n.uid, n.gid)

    def _unsearchable(self, ident: Identity, d: Inode | None) -> Inode | None:
        """The topmost directory from ``d`` up to the root that ``ident``
        may not search, or None."""
        if is_root(ident):
            return None
        bad = None
        while d is not None:
            if not access_ok(ident, d.mode, d.uid, d.gid, X):
                bad = d
            d = None if d.id == ROOT_INODE else self.inodes[d.parent]
        return bad

    def _search(self, ident: Identity, d: Inode | None, op: str, where: str) -> None:
        """Search (x) permission on ``d`` and every directory above it: what
        a path walk to ``d``'s entries needs."""
        bad = self._unsearchable(ident, d)
        if bad is not None:
            self._need(ident, bad, X, op, where)

    def _sticky(self, ident: Identity, d: Inode, n: Inode, op: str, where: str) -> None:
        if not may_delete(ident, d.mode, d.uid, n.uid):
            raise not_permitted(op, where, ident, f"directory {self._path_of(d)} is sticky (mode {d.mode:04o}): only "
                                                  f"the entry's owner (uid {n.uid}), the directory's owner "
                                                  f"(uid {d.uid}) or root may remove or rename the entry")

    def _session_writer(self, ident: Identity, f: Inode, op: str, sid: int) -> None:
        """Who may renew, commit or abort a write session: root, the file's
        owner, or whoever may write the file (the rights are judged again
        at each call, so a chmod that takes write away ends a group
        member's session at its next renewal)."""
        if not (is_root(ident) or ident.uid == f.uid or access_ok(ident, f.mode, f.uid, f.gid, W)):
            self._need(ident, f, W, op, f"session {sid}")

    def access(self, ident: Identity, ino: int, want: int) -> bool:
        """Whether ``ident`` may access inode ``ino`` as ``want`` asks
        (:data:`tierfs.meta.perms.R`, ``W``, ``X``), search permission on
        every directory above it included: the check behind capabilities."""
        n = self.inodes.get(ino)
        if n is None:
            return False
        if is_root(ident):
            return True
        if self._unsearchable(ident, self._container(n)) is not None:
            return False
        return access_ok(ident, n.mode, n.uid, n.gid, want)

    def may_write_session(self, ident: Identity, sid: int) -> int | None:
        """The inode of write session ``sid`` when a write capability for it
        may be minted to ``ident``: the session is live and ``ident`` may
        renew it (:meth:`_session_writer`'s rule); None otherwise. Judged
        after the op, on the state as it is now: a reply the retry table
        gave (a repeated request id) grants nothing the caller may not do
        now."""
        s = self.sessions.get(sid)
        if s is None or s.expiry < self.clock:
            return None
        f = self.inodes.get(s.inode)
        if f is None:
            return None
        if not (is_root(ident) or ident.uid == f.uid or access_ok(ident, f.mode, f.uid, f.gid, W)):
            return None
        return f.id

    def may_read(self, ident: Identity, ino: int) -> bool:
        """Whether a read capability for ``ino`` may be minted to ``ident``."""
        return self.access(ident, ino, R)

    @staticmethod
    def _where(loc: pb.Loc) -> str:
        if loc.path:
            return loc.path
        if loc.inode:
            return f"inode {loc.inode}"
        return f"{loc.name!r} in inode {loc.parent}"

    def _effective_layout(self, d: Inode) -> LayoutSpec:
        chain: list[LayoutSpec] = []
        cur = d
        while True:
            if cur.layout is not None:
                chain.append(cur.layout)
            if cur.id == ROOT_INODE:
                break
            cur = self.inodes[cur.parent]
        spec = LayoutSpec()
        for lay in chain:
            spec = spec.merged_over(lay)
        return spec.merged_over(DEFAULT_LAYOUT)

    def _attr(self, n: Inode) -> pb.Attr:
        return pb.Attr(inode=n.id, type=n.type, mode=n.mode, uid=n.uid, gid=n.gid,  # type: ignore[arg-type]
                       size=n.size, mtime_ns=n.mtime, ctime_ns=n.ctime, nlink=n.nlink,
                       data_version=n.data_version, parent=n.parent)

    def _info(self, n: Inode) -> pb.FileInfo:
        info = pb.FileInfo(attr=self._attr(n))
        if n.type == FILE:
            assert n.layout is not None
            info.layout.CopyFrom(n.layout.to_pb(n.groups))
            for idx in sorted(n.chunks):
                n.chunks[idx].fill_pb(info.chunks.add(), idx)
            info.writing = n.session != 0
        elif n.type == DIR:
            info.layout.CopyFrom(self._effective_layout(n).to_pb())
        else:
            info.symlink_target = n.target
        return info

    def _new_inode(self, kind: int, mode: int, uid: int, gid: int) -> Inode:
        ino = new_object(lambda: Inode(id=self.next_inode, type=kind, mode=mode, uid=uid, gid=gid,
                                       mtime=self.clock, ctime=self.clock))
        self.next_inode += 1
        self.inodes[ino.id] = ino
        return ino

    def _touch(self, d: Inode) -> None:
        d.mtime = d.ctime = self.clock

    @staticmethod
    def _owner(ident: Identity, r: pb.MkdirRequest | pb.CreateRequest | pb.SymlinkRequest, mode: int,
               is_dir: bool, parent: Inode) -> tuple[int, int, int]:
        """(mode, uid, gid) of a new inode (tierfs.meta.perms.new_owner)."""
        uid, gid, mode = new_owner(ident, r.uid, r.gid, mode, is_dir, parent.mode, parent.gid)
        return mode, uid, gid

    def _gc_chunk(self, f: Inode, chunk: int, version: int) -> None:
        """Queue the fragments of ``chunk`` at ``version`` for deletion, once
        the op's GC grace has passed (open readers may still read them)."""
        if not f.groups:
            return
        gid = f.groups[chunk % len(f.groups)]
        members = self.groups.get(gid, [])
        self.gc.add(GCEntry(id=self.next_gc, inode=f.id, chunk=chunk, version=version, group=gid,
                            pending={t: j for j, t in enumerate(members)}, ready=self.clock + self._gc_grace_ns))
        self.next_gc += 1

    def _drop_session(self, s: Session, f: Inode | None) -> None:
        """End ``s``; every generation it uploaded that is not the committed
        one of its chunk goes to GC."""
        self.sessions.pop(s.id, None)
        if f is not None:
            f.session = 0
            for c, gen in sorted(s.uploads):
                rec = f.chunks.get(c)
                if rec is None or rec.generation != gen:
                    self._gc_chunk(f, c, gen)

    def _member_bytes(self, f: Inode, rec: ChunkRecord) -> int:
        """Bytes one member of the chunk's group stores for ``rec`` (a
        parity fragment's length for EC: the most any member holds)."""
        lay = f.layout
        assert lay is not None
        if lay.kind == pb.REDUNDANCY_KIND_REPLICA:
            return rec.length
        return parity_size(lay.k, lay.chunk_size, rec.length)

    def _inventory(self, f: Inode, idx: int, rec: ChunkRecord | None, sign: int) -> None:
        if rec is None or not f.groups:
            return
        gid = f.groups[idx % len(f.groups)]
        b = self._member_bytes(f, rec)
        per = self.ginv.setdefault(gid, {})
        n, tot = per.get(f.id, (0, 0))
        n, tot = n + sign, tot + sign * b
        if n:
            per[f.id] = (n, tot)
        else:
            per.pop(f.id, None)
            if not per:
                del self.ginv[gid]
        left = self.gbytes.get(gid, 0) + sign * b
        if left:
            self.gbytes[gid] = left
        else:
            self.gbytes.pop(gid, None)

    def _set_chunk(self, f: Inode, idx: int, rec: ChunkRecord) -> None:
        self._inventory(f, idx, f.chunks.get(idx), -1)
        self._inventory(f, idx, rec, +1)
        f.chunks[idx] = rec
        if rec.missing:
            self.degraded.add((f.id, idx))
        else:
            self.degraded.discard((f.id, idx))

    def _pop_chunk(self, f: Inode, idx: int) -> ChunkRecord:
        self.degraded.discard((f.id, idx))
        rec = f.chunks.pop(idx)
        self._inventory(f, idx, rec, -1)
        return rec

    def _live_session(self, f: Inode) -> Session | None:
        """The file's session if its lease has not run out; an expired one is
        dropped here (deterministic: the clock comes from the op)."""
        if not f.session:
            return None
        s = self.sessions.get(f.session)
        if s is None:
            f.session = 0
            return None
        if s.expiry < self.clock:
            self._drop_session(s, f)
            return None
        return s

    def _release_inode(self, n: Inode) -> None:
        """Last link gone: forget the inode, queue its chunks for GC."""
        if n.type == FILE:
            if n.session and n.session in self.sessions:
                self._drop_session(self.sessions[n.session], n)
            for c in sorted(n.chunks):
                self._gc_chunk(n, c, self._pop_chunk(n, c).generation)
        self.holder.pop(n.id, None)
        del self.inodes[n.id]

    # ---- namespace ops ------------------------------------------------------

    def _op_mkdir(self, op: pb.MetaOp, r: pb.MkdirRequest) -> Message:
        ident = from_caller(op)
        parent, name = self._entry(r.loc, ident, "mkdir")
        if name in parent.entries:
            raise AlreadyExistsError(f"{self._where(r.loc)} already exists")
        self._need(ident, parent, W | X, "mkdir", self._where(r.loc))
        d = self._new_inode(DIR, *self._owner(ident, r, r.mode or 0o755, True, parent))
        d.nlink, d.parent = 2, parent.id
        parent.entries[name] = d.id
        parent.nlink += 1
        self._touch(parent)
        return self._info(d)

    def _op_create(self, op: pb.MetaOp, r: pb.CreateRequest) -> Message:
        ident = from_caller(op)
        parent, name = self._entry(r.loc, ident, "create")
        if name in parent.entries:
            raise AlreadyExistsError(f"{self._where(r.loc)} already exists")
        self._need(ident, parent, W | X, "create", self._where(r.loc))
        if r.map_version and r.map_version != self.map_version:
            raise StaleVersionError(f"cluster map version {r.map_version} is stale; current is {self.map_version}")
        base = self._effective_layout(parent)
        spec = layout_from_pb(r.layout).merged_over(base) if r.has_layout else base
        # Groups are planned by the leader's service (add_groups), never here.
        if not op.min_format and not any(len(g) == spec.width for g in self.groups.values()) and distinct_nodes(
                self._eligible()) >= spec.width:
            # Releases before leader-planned groups (before the op format
            # existed) planned a width's first groups inside this apply; the
            # leaders since commit AddGroups first. Applied here, such an
            # entry would fail, and every file of that width with it: the
            # replica's namespace would silently differ from the writer's.
            raise LegacyEntryError(
                f"a create of {self._where(r.loc)} ({spec.redundancy()}) written by a TierFS release that "
                f"planned placement groups inside apply (before 2026-12-02, merge 3034c02); this release "
                f"cannot replay it as that one did. Start this replica's previous release again, force a "
                f"snapshot on every replica (MetaClient.force_snapshot), then upgrade (docs/operations.md, "
                f"'Upgrading meta replicas')")
        pending: list[list[int]] = []
        groups = self._choose_groups(spec, self.next_inode, pending)
        self._commit_width(spec.width, pending)
        f = self._new_inode(FILE, *self._owner(ident, r, r.mode or 0o644, False, parent))
        f.layout, f.groups = replace(spec, stripe_width=len(groups)), groups
        parent.entries[name] = f.id
        self.holder[f.id] = parent.id
        self._touch(parent)
        return self._info(f)

    def _op_symlink(self, op: pb.MetaOp, r: pb.SymlinkRequest) -> Message:
        ident = from_caller(op)
        parent, name = self._entry(r.loc, ident, "symlink")
        if name in parent.entries:
            raise AlreadyExistsError(f"{self._where(r.loc)} already exists")
        self._need(ident, parent, W | X, "symlink", self._where(r.loc))
        s = self._new_inode(SYMLINK, *self._owner(ident, r, 0o777, False, parent))
        s.target, s.size = r.target, len(r.target.encode())
        parent.entries[name] = s.id
        self.holder[s.id] = parent.id
        self._touch(parent)
        return self._info(s)

    def _op_unlink(self, op: pb.MetaOp, r: pb.UnlinkRequest) -> Message:
        ident = from_caller(op)
        parent, name = self._entry(r.loc, ident, "unlink")
        ino = parent.entries.get(name)
        if ino is None:
            raise NotFoundError(f"{self._where(r.loc)}: no such file or directory")
        n = self.inodes[ino]
        self._need(ident, parent, W | X, "unlink", self._where(r.loc))
        self._sticky(ident, parent, n, "unlink", self._where(r.loc))
        if n.type == DIR:
            raise IsADirectoryError_(f"{self._where(r.loc)} is a directory (use rmdir)")
        # Conditions (a failed writer removing the file it created; entries
        # of older leaders never carry them).
        if r.expect_inode and n.id != r.expect_inode:
            raise BusyError(f"{self._where(r.loc)} is inode {n.id} now, not {r.expect_inode}: left as it is")
        if r.only_if_empty and (n.type != FILE or n.size or n.chunks or self._live_session(n) is not None):
            raise BusyError(f"{self._where(r.loc)} is not an empty regular file without a writer: left as it is")
        del parent.entries[name]
        self._touch(parent)
        n.nlink -= 1
        if n.nlink <= 0:
            self._release_inode(n)
        return pb.Empty()

    def _op_rmdir(self, op: pb.MetaOp, r: pb.RmdirRequest) -> Message:
        ident = from_caller(op)
        parent, name = self._entry(r.loc, ident, "rmdir")
        ino = parent.entries.get(name)
        if ino is None:
            raise NotFoundError(f"{self._where(r.loc)}: no such file or directory")
        d = self.inodes[ino]
        self._need(ident, parent, W | X, "rmdir", self._where(r.loc))
        self._sticky(ident, parent, d, "rmdir", self._where(r.loc))
        if d.type != DIR:
            raise NotADirectoryError_(f"{self._where(r.loc)} is not a directory")
        if d.entries:
            raise DirectoryNotEmptyError(f"{self._where(r.loc)} is not empty")
        del parent.entries[name]
        parent.nlink -= 1
        self._touch(parent)
        del self.inodes[d.id]
        return pb.Empty()

    def _op_rename(self, op: pb.MetaOp, r: pb.RenameRequest) -> Message:
        ident = from_caller(op)
        sp, sname = self._entry(r.src, ident, "rename")
        dp, dname = self._entry(r.dst, ident, "rename")
        sino = sp.entries.get(sname)
        if sino is None:
            raise NotFoundError(f"{self._where(r.src)}: no such file or directory")
        src = self.inodes[sino]
        dino = dp.entries.get(dname)
        if dino == sino:
            return pb.Empty()  # same entry (or same inode): POSIX says do nothing
        self._need(ident, sp, W | X, "rename", self._where(r.src))
        self._sticky(ident, sp, src, "rename", self._where(r.src))
        self._need(ident, dp, W | X, "rename", self._where(r.dst))
        if dino is not None:
            self._sticky(ident, dp, self.inodes[dino], "rename", self._where(r.dst))
        if src.type == DIR and sp.id != dp.id:
            self._need(ident, src, W, "rename", self._where(r.src))  # its ".." changes
        if src.type == DIR:
            # dp must not be src nor lie under it.
            cur = dp
            while True:
                if cur.id == src.id:
                    raise InvalidRenameError(
                        f"cannot move directory {self._where(r.src)} into its own subtree {self._where(r.dst)}")
                if cur.id == ROOT_INODE:
                    break
                cur = self.inodes[cur.parent]
        victim: Inode | None = None
        if dino is not None:
            victim = self.inodes[dino]
            if src.type == DIR and victim.type != DIR:
                raise NotADirectoryError_(f"cannot replace non-directory {self._where(r.dst)} with a directory")
            if src.type != DIR and victim.type == DIR:
                raise IsADirectoryError_(f"cannot replace directory {self._where(r.dst)} with a non-directory")
            if victim.type == DIR and victim.entries:
                raise DirectoryNotEmptyError(f"{self._where(r.dst)} is not empty")
        # All checks passed: mutate.
        if victim is not None:
            del dp.entries[dname]
            if victim.type == DIR:
                dp.nlink -= 1
                del self.inodes[victim.id]
            else:
                victim.nlink -= 1
                if victim.nlink <= 0:
                    self._release_inode(victim)
        del sp.entries[sname]
        dp.entries[dname] = src.id
        if src.type != DIR:
            self.holder[src.id] = dp.id
        if src.type == DIR and sp.id != dp.id:
            sp.nlink -= 1
            dp.nlink += 1
            src.parent = dp.id
        src.ctime = self.clock
        self._touch(sp)
        self._touch(dp)
        return pb.Empty()

    def _op_setattr(self, op: pb.MetaOp, r: pb.SetAttrRequest) -> Message:
        ident = from_caller(op)
        where = self._where(r.loc)
        n = self._get(r.loc, ident, "setattr")
        # Every rule is decided before anything changes.
        chown = r.set_uid or r.set_gid
        if chown:
            check_chown(ident, "chown", where, n.uid, n.gid, r.uid if r.set_uid else None,
                        r.gid if r.set_gid else None)
        mode = n.mode
        if r.set_mode:
            mode = chmod_mode(ident, "chmod", where, n.uid, r.gid if r.set_gid else n.gid, r.mode)
        elif chown:
            mode = chown_mode(n.mode, n.type == DIR)
        if r.set_mtime and not is_root(ident) and ident.uid != n.uid:
            # A touch (UTIME_NOW) needs only write permission, an explicit
            # time ownership; the request cannot tell them apart, so write
            # permission is enough for both.
            self._need(ident, n, W, "utimes", where)
        n.mode = mode
        if r.set_uid:
            n.uid = r.uid
        if r.set_gid:
            n.gid = r.gid
        if r.set_mtime:
            n.mtime = r.mtime_ns
        n.ctime = self.clock
        return self._info(n)

    def _op_truncate(self, op: pb.MetaOp, r: pb.TruncateRequest) -> Message:
        ident = from_caller(op)
        f = self._get(r.loc, ident, "truncate")
        if f.type == DIR:
            raise IsADirectoryError_(f"{self._where(r.loc)} is a directory")
        if f.type != FILE:
            raise InvalidArgumentError(f"{self._where(r.loc)} is not a regular file")
        self._need(ident, f, W, "truncate", self._where(r.loc))
        s = self._live_session(f)
        if s is not None:
            raise BusyError(f"{self._where(r.loc)} is being written (session {s.id}, owner {s.owner!r})")
        self._set_size(f, r.size)
        f.mtime = f.ctime = self.clock
        return self._info(f)

    def _set_size(self, f: Inode, size: int) -> None:
        """POSIX truncate semantics: chunks wholly past ``size`` go to GC and
        the tail chunk's valid length is cut, so that growing the file
        again reads zeros there (tierfs.chunk.valid_bytes)."""
        assert f.layout is not None
        cs = f.layout.chunk_size
        keep = -(-size // cs)
        for c in sorted(f.chunks):
            if c >= keep:
                self._gc_chunk(f, c, self._pop_chunk(f, c).generation)
        tail = f.chunks.get(keep - 1) if size % cs else None
        if tail is not None and tail.valid > size % cs:
            self._set_chunk(f, keep - 1, replace(tail, valid=size % cs))
        f.size = size

    def _op_set_layout(self, op: pb.MetaOp, r: pb.SetLayoutRequest) -> Message:
        ident = from_caller(op)
        d = self._dir(self._get(r.loc, ident, "set_layout"), self._where(r.loc))
        if not ident.admin and ident.uid != d.uid:
            raise not_permitted("set_layout", self._where(r.loc), ident,
                                f"only the directory's owner (uid {d.uid}) or an admin may set its layout")
        spec = layout_from_pb(r.layout)
        if op.min_format >= LAYOUT_MERGE_FORMAT and d.layout is not None:
            # The fields the request leaves unset keep this directory's own
            # values (set-layout --chunk-size 2MiB keeps its replica:2).
            spec = spec.merged_over(d.layout)
        parent_eff = self._effective_layout(self.inodes[d.parent]) if d.id != ROOT_INODE else DEFAULT_LAYOUT
        eff = spec.merged_over(parent_eff)
        d.layout = spec if d.id != ROOT_INODE else eff
        d.ctime = self.clock
        # A new width gets its groups from the leader's service (add_groups,
        # submitted before the reply): planning is not done inside apply.
        self.widths.add(eff.width)
        return pb.LayoutReply(layout=self._effective_layout(d).to_pb())

    # ---- placement ----------------------------------------------------------

    def _target_state(self, t: Target) -> int:
        if t.removed:
            return pb.TARGET_STATE_FAILED
        if not t.present or self.nodes[t.node].state != NODE_ONLINE:
            return OFFLINE
        return t.reported

    def _set_kv_groups(self, pool: KVPoolRecord, groups: list[list[int]]) -> None:
        """Give ``pool`` these groups; with placement stamps when the op
        keeps them, else (entries of older leaders) without any."""
        if self._stamping:
            set_groups(pool, groups, self._changed_at())
            return
        pool.groups = groups
        if pool.since or pool.history:
            pool.since, pool.history = [], []

    def _changed_at(self) -> int:
        """The map version a change the current op makes is first seen in
        (every such op bumps the map): later than every map before it."""
        return self._op_version + 1

    def _eligible(self) -> dict[int, int]:
        return {t.id: t.node for t in self.targets.values()
                if self._target_state(t) == ONLINE and not self.nodes[t.node].draining}

    def node_racks(self) -> dict[int, str]:
        """Node id -> rack label ("" = none) for placement's ``racks=``."""
        return {n.id: n.rack for n in self.nodes.values()}

    def target_domains(self) -> dict[int, str]:
        """Target id -> failure domain (tierfs.meta.domains.domain)."""
        return {t.id: domain(t.node, self.nodes[t.node].rack) for t in self.targets.values()}

    def eligible_domains(self) -> int:
        """How many failure domains hold an eligible target."""
        return len({domain(n, self.nodes[n].rack) for n in self._eligible().values()})

    def eligible_targets(self) -> dict[int, int]:
        """Target id -> node id of the targets placement may choose."""
        return self._eligible()

    def _kv_present(self) -> list[Target]:
        """Targets a KV pool keeps a group for (op format 3 on): every
        target not removed, still offered by its node, on a node not
        draining, whether up or down."""
        return [t for t in self.targets.values()
                if not t.removed and t.present and not self.nodes[t.node].draining]

    def kv_held_targets(self, now_ns: int, replace_after_ms: int) -> tuple[frozenset[int], int]:
        """(targets down less than ``replace_after_ms``, or at all when it
        is 0, whose positions redundant KV pools keep; the group count a
        pool keeps), for the leader's planner (tierfs.meta.kvplan)."""
        now, after = self._advance(now_ns), replace_after_ms * NS_PER_MS
        present = self._kv_present()
        held = frozenset(t.id for t in present if t.down_since and (not after or now - t.down_since < after))
        return held, len(present)

    def create_width(self, loc: pb.Loc, layout: pb.Layout | None) -> int:
        """The width a Create at ``loc`` would use (0 if it cannot be told:
        apply then gives the real error)."""
        try:
            parent, _ = self._entry(loc)
            base = self._effective_layout(parent)
            return (layout_from_pb(layout).merged_over(base) if layout is not None else base).width
        except TierFSError:
            return 0

    def _caps(self, eligible: dict[int, int]) -> Callable[[int], int]:
        """width -> members of one group allowed in one rack now
        (placement.domain_cap; a width the nodes cannot fill has no rack
        limit beyond its width)."""
        racks = self.node_racks()
        memo: dict[int, int] = {}

        def cap(width: int) -> int:
            if width not in memo:
                memo[width] = domain_cap(eligible, width, racks) or width
            return memo[width]
        return cap

    def _check_group(self, members: list[int], eligible: dict[int, int], cap: int, what: str,
                     doms: dict[int, str] | None = None) -> None:
        if len(set(members)) != len(members):
            raise InvalidArgumentError(f"{what}: members {members} repeat a target")
        for m in members:
            if m not in eligible:
                raise InvalidArgumentError(f"{what}: target {m} is not eligible for placement")
        if len({eligible[m] for m in members}) != len(members):
            raise InvalidArgumentError(f"{what}: two members of {members} share a node")
        # The caller's doms: one per op, not per group (10,000 targets).
        counts = rack_counts(members, self.target_domains() if doms is None else doms)
        if counts and max(counts.values()) > cap:
            raise InvalidArgumentError(f"{what}: {members} puts more than {cap} member(s) in one rack "
                                       f"({self.eligible_domains()} racks)")

    def _op_add_groups(self, op: pb.MetaOp, r: pb.AddGroupsRequest) -> Message:
        """Groups the leader computed at ``map_version``: checked (members
        eligible, on distinct nodes, the rack rule) and written; refused
        when the map moved since (the leader plans again)."""
        if r.map_version != self.map_version:
            raise StaleVersionError(f"add_groups: planned at map version {r.map_version}, the map is now at "
                                    f"{self.map_version}")
        w = r.width
        eligible = self._eligible()
        cap = self._caps(eligible)(w)
        have = sum(len(g) == w for g in self.groups.values())
        if have + len(r.groups) > max(len(eligible), 1):
            raise InvalidArgumentError(f"add_groups: {have} groups of width {w} exist; {len(r.groups)} more exceed "
                                       f"one per eligible target ({len(eligible)})")
        new = []
        doms = self.target_domains()
        for i, g in enumerate(r.groups):
            members = list(g.target_ids)
            if len(members) != w:
                raise InvalidArgumentError(f"add_groups: group {i} has {len(members)} members, not {w}")
            self._check_group(members, eligible, cap, f"add_groups: group {i}", doms)
            new.append(members)
        self._commit_width(w, new)
        return pb.Empty()

    def _op_label_node(self, op: pb.MetaOp, r: pb.LabelNodeRequest) -> Message:
        node = self.nodes.get(r.node_id)
        if node is None:
            raise NotFoundError(f"no storage node {r.node_id} (`tierfs status` lists them)")
        if node.rack != r.rack:
            node.rack = r.rack
            self.map_version += 1
        return pb.Empty()

    def _op_rebalance_moves(self, op: pb.MetaOp, r: pb.RebalanceMovesRequest) -> Message:
        """Moves the leader planned (tierfs.meta.rebalance): each one still
        valid (the group is not rebuilding, the old member still holds the
        position, the new one is eligible, on a node and rack the rule
        allows) makes the new member rebuild by copy from the old one, which
        serves that position's reads until FinishRebuild. The others are
        skipped (the leader plans again)."""
        eligible = self._eligible()
        cap = self._caps(eligible)
        doms = self.target_domains()
        reply = pb.RebalanceMovesReply()
        seen: set[int] = set()
        for mv in r.moves:
            members = self.groups.get(mv.group_id)
            ok = (members is not None and mv.group_id not in seen and mv.group_id not in self.rebuilding
                  and mv.position < len(members) and members[mv.position] == mv.old_target
                  and mv.new_target in eligible and mv.new_target not in members
                  and not self.purging_in(mv.group_id, mv.new_target))
            if ok:
                assert members is not None
                others = [m for j, m in enumerate(members) if j != mv.position]
                ok = (eligible[mv.new_target] not in {self.targets[m].node for m in others}
                      and rack_counts(others, doms)[doms[mv.new_target]] < cap(len(members)))
            if not ok:
                reply.skipped.append(mv.group_id)
                continue
            assert members is not None
            seen.add(mv.group_id)
            members[mv.position] = mv.new_target
            self.pos_epoch.setdefault(mv.group_id, {})[mv.position] = self.map_version + 1
            self.rebuilding.setdefault(mv.group_id, set()).add(mv.new_target)
            self.rebuild_sources.setdefault(mv.group_id, {})[mv.new_target] = mv.old_target
            self.moving[mv.group_id] = (mv.new_target, mv.old_target, mv.bytes)
            reply.applied += 1
        if reply.applied:
            self.map_version += 1
        return reply

    def _op_redirect_moves(self, op: pb.MetaOp, r: pb.RebalanceMovesRequest) -> Message:
        """Moves the leader sends on to another target: their new member
        (``old_target`` here) is full (read-only) or has failed, so their
        copy cannot go on there. Each one still valid (the group is moving
        onto that member at that position, the member is still full or
        failed, the group is wider than one and its other members can
        rebuild what the member got while it served the position, the new
        target is eligible, on a node and in a rack the rule allows) is
        applied as a drain's replacement is: the new target inherits the
        move's copy source, which keeps serving the position until
        FinishRebuild; chunks written to the full member meanwhile are
        rebuilt from the group. The others are skipped."""
        reply = pb.RebalanceMovesReply()
        valid = pb.Replacements(planned=True)
        seen: set[int] = set()
        for mv in r.moves:
            t = self.targets.get(mv.old_target)
            moving = self.moving.get(mv.group_id)
            ok = (t is not None and moving is not None and moving[0] == mv.old_target
                  and mv.group_id not in seen and len(self.groups.get(mv.group_id, ())) > 1
                  and self._target_state(t) in (pb.TARGET_STATE_READ_ONLY, pb.TARGET_STATE_FAILED)
                  and not self.redirect_would_lose(mv.group_id, mv.old_target))
            if ok:
                seen.add(mv.group_id)
                valid.moves.append(mv)
            else:
                reply.skipped.append(mv.group_id)
        stuck = self._apply_replacements(valid, lambda tid: True)
        reply.skipped.extend(stuck)
        reply.applied = len(valid.moves) - len(stuck)
        return reply

    def redirectable_moves(self) -> list[tuple[int, int, int]]:
        """Moves in flight whose new member is full (read-only) or has
        failed, in a group wider than one whose other members can rebuild
        what that member holds, as (group, position, member): what a
        RedirectMoves op may send on to another target."""
        out = []
        for gid in sorted(self.moving):
            new = self.moving[gid][0]
            t = self.targets.get(new)
            members = self.groups.get(gid, [])
            if (t is None or new not in members or len(members) < 2
                    or self._target_state(t) not in (pb.TARGET_STATE_READ_ONLY, pb.TARGET_STATE_FAILED)
                    or self.redirect_would_lose(gid, new)):
                continue
            out.append((gid, members.index(new), new))
        return out

    def redirect_would_lose(self, gid: int, tid: int) -> bool:
        """Whether the other members of group ``gid`` (``tid``, a move's new
        member, left out) are too few to rebuild a chunk of it: fewer
        readable, not rebuilding, than a file stored there needs."""
        members = self.groups.get(gid, [])
        if gid not in self.ginv:
            return False
        rb = self.rebuilding.get(gid, set())
        readable = sum(1 for m in members if m != tid and m not in rb and m in self.targets
                       and self._target_state(self.targets[m]) in (ONLINE, pb.TARGET_STATE_READ_ONLY))
        if readable >= len(members) - 1:
            return False  # K <= width - 1 for every layout wider than one
        for ino in self.ginv[gid]:
            lay = self.inodes[ino].layout if ino in self.inodes else None
            if lay is not None and (1 if lay.kind == pb.REDUNDANCY_KIND_REPLICA else lay.k) > readable:
                return True
        return False

    def target_bytes(self) -> dict[int, int]:
        """Bytes each target holds by the inventory (every group member
        counted with its group's bytes per member)."""
        out = {t: 0 for t in self.targets}
        for gid, b in self.gbytes.items():
            for m in self.groups.get(gid, ()):
                if m in out:
                    out[m] += b
        return out

    def rule_violations(self) -> int:
        """Groups with more members in one rack than the rule allows."""
        cap = self._caps(self._eligible())
        doms = self.target_domains()
        bad = 0
        for g in self.groups.values():
            counts = rack_counts(g, doms)
            if counts and max(counts.values()) > cap(len(g)):
                bad += 1
        return bad

    def stuck_moves(self) -> list[tuple[int, int, int, int, str]]:
        """Moves in flight whose copy cannot go on now, as (group, old
        member, new member, its node, why): the new member is full (read-only: its
        rebuild writes are refused) or down. The old member still serves
        the position, so nothing is lost; the group stays ``rebuilding``
        until the new member has room again (or is down long enough to be
        replaced: the replacement inherits the copy). What
        ``tierfs rebalance status`` and ``tierfs status`` name."""
        out = []
        for gid in sorted(self.moving):
            new, old, _ = self.moving[gid]
            t = self.targets.get(new)
            if t is None:
                continue
            state = self._target_state(t)
            if state == pb.TARGET_STATE_READ_ONLY:
                why = f"destination target {new} is full (read-only)"
            elif state == OFFLINE:
                why = f"destination target {new} is down"
            elif state == pb.TARGET_STATE_FAILED:
                why = f"destination target {new} has failed"
            else:
                continue
            out.append((gid, old, new, t.node, why))
        return out

    def failure_domain(self) -> str:
        """The ``tierfs status`` sentence (tierfs.meta.domains.domain_line)."""
        eligible = self._eligible()
        # The widest groups that hold data (those of a layout no file uses,
        # the root's default ec:4+2 on a cluster of ec:2+1 directories, say,
        # made it speak of width 6 while every file was placed by rack);
        # every group when none holds data yet.
        width = max((len(g) for gid, g in self.groups.items() if gid in self.ginv),
                    default=max((len(g) for g in self.groups.values()), default=max(self.widths, default=0)))
        return domain_line(any(n.rack for n in self.nodes.values()), self.eligible_domains(),
                           len(set(eligible.values())), width, self._caps(eligible)(width) if width else 0)

    def _commit_width(self, width: int, new: list[list[int]]) -> None:
        self.widths.add(width)
        for grp in new:
            self.groups[self.next_group] = grp
            self.next_group += 1
        if new:
            self.map_version += 1

    def _refuse_if_full(self, red: str, w: int, need: int) -> None:
        """No group can take a new file: when the targets that are full
        (READ_ONLY: below their reserve) are what is missing, say so with
        NoSpaceError (ENOSPC), not as if nodes were down."""
        live = {t.node for t in self.targets.values()
                if self._target_state(t) == ONLINE and not self.nodes[t.node].draining}
        full = {t.node for t in self.targets.values()
                if self._target_state(t) == pb.TARGET_STATE_READ_ONLY and not self.nodes[t.node].draining} - live
        if full and len(live) < need <= len(live | full):
            raise NoSpaceError(
                f"layout {red}: the cluster is full: {len(full)} storage node(s) have only full targets (read-only: "
                f"free space below their reserve) and {len(live)} have room, {w} needed for a new file: free "
                f"space (delete files; GC returns it after gc_grace) or add storage")

    def _groups_online(self, w: int) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """(groups of width ``w`` with every member online, (group, members
        online) for every group of that width), in group id order; computed
        once per map version (see ``_placement``)."""
        key = (self.map_version, self.next_group, len(self.groups))
        if key != self._placement_key:
            self._placement = {}
            self._placement_key = key
        got = self._placement.get(w)
        if got is not None and not _CHECK_PLACEMENT_CACHE:
            return got
        online = tuple((g, sum(self._target_state(self.targets[t]) == ONLINE for t in self.groups[g]))
                       for g in sorted(self.groups) if len(self.groups[g]) == w)
        fresh = (tuple(g for g, n in online if n == w), online)
        if got is not None and got != fresh:
            raise AssertionError(f"placement cache for width {w} at map {key} is stale: {got} != {fresh}")
        self._placement[w] = fresh
        return fresh

    def _choose_groups(self, spec: LayoutSpec, ino: int, pending: list[list[int]]) -> list[int]:
        w = spec.width
        full, pairs = self._groups_online(w)
        # Read only where no group is healthy; empty when there are no
        # groups of this width, and (not built, O(groups)) when all are.
        online = dict(pairs) if len(full) < len(pairs) else {}
        healthy = [*full, *range(self.next_group, self.next_group + len(pending))]
        # Members a degraded write needs (the client's default acknowledgement rule).
        need = min(w, 2) if spec.kind == pb.REDUNDANCY_KIND_REPLICA else min(w, spec.k + 1)
        if not healthy:
            # Every group of this width has a member down (with 6 nodes and
            # ec:4+2 every group spans every node): place the file on groups
            # that can still take a degraded write, which the down member
            # catches up on when it returns (docs/repair.md).
            healthy = [g for g, n in online.items() if n >= need]
        red = spec.redundancy()
        if not healthy:
            self._refuse_if_full(red, w, need)
        if not healthy and online and distinct_nodes(self._eligible()) >= need:
            # Enough nodes are up, but every group of this width lacks too
            # many of its members (the groups were made when other nodes lived).
            raise InsufficientTargetsError(
                f"layout {red}: no placement group of width {w} has {need} or more members online (the most "
                f"is {max(online.values())}: too many storage nodes are down for a new file to be written "
                f"safely); bring nodes back, or replace the dead ones (`tierfs target rm`)")
        if not healthy and not online and distinct_nodes(self._eligible()) >= w:
            # Enough nodes, but no group of this width at all: the leader
            # plans a new width's groups before its first create and did not
            # get them committed (they went stale as the map moved, or a
            # leader of another release wrote this entry). Until stop 48 this
            # said "needs 2 online targets ..., but only 5 node(s) have one".
            raise InsufficientTargetsError(
                f"layout {red} needs {w} online targets on distinct storage nodes; "
                f"{distinct_nodes(self._eligible())} node(s) have one, but no placement group of width {w} "
                f"exists yet (the meta leader makes a new width's groups before its first file; the cluster map "
                f"changed meanwhile): try again in a few seconds")
        if not healthy:
            nodes = distinct_nodes(self._eligible())
            raise InsufficientTargetsError(
                f"layout {red} needs {w} online targets on distinct storage nodes, but only {nodes} "
                f"node(s) have an online target: start or register more storage nodes, or use a "
                f"narrower redundancy for this directory")
        sw = spec.stripe_width or min(len(healthy), AUTO_STRIPE_MAX)
        if sw > len(healthy):
            raise InsufficientTargetsError(
                f"layout {red} with stripe_width {sw} needs {sw} healthy placement groups of width {w}; "
                f"the cluster has {len(healthy)}: lower stripe_width or add storage nodes")
        start = ino % len(healthy)
        return [healthy[(start + i) % len(healthy)] for i in range(sw)]

    # ---- write sessions ------------------------------------------------------

    def _lease_ns(self, op: pb.MetaOp, asked: int) -> int:
        ms = min(asked or op.lease_ms or DEFAULT_LEASE_MS, MAX_LEASE_MS)
        return ms * NS_PER_MS

    def _session(self, sid: int) -> tuple[Session, Inode]:
        s = self.sessions.get(sid)
        if s is None:
            raise SessionExpiredError(f"write session {sid} is unknown, expired or already ended")
        if s.expiry < self.clock:
            raise SessionExpiredError(f"write session {sid} expired (lease ran out)")
        return s, self.inodes[s.inode]

    def _op_open_write(self, op: pb.MetaOp, r: pb.OpenWriteRequest) -> Message:
        ident = from_caller(op)
        f = self._get(r.loc, ident, "open_write")
        if f.type == DIR:
            raise IsADirectoryError_(f"{self._where(r.loc)} is a directory")
        if f.type != FILE:
            raise InvalidArgumentError(f"{self._where(r.loc)} is not a regular file")
        # The owner's first write of a file never written (its create): POSIX
        # lets open(O_CREAT) write through the descriptor whatever the mode,
        # and the client creates and opens in two ops.
        if not (ident.uid == f.uid and f.data_version == 0 and f.size == 0):
            self._need(ident, f, W, "open_write", self._where(r.loc))
        if r.map_version and r.map_version != self.map_version:
            raise StaleVersionError(f"cluster map version {r.map_version} is stale; current is {self.map_version}")
        if f.session:
            s = self.sessions.get(f.session)
            if s is not None and s.expiry >= self.clock:
                raise BusyError(f"{self._where(r.loc)} is being written by {s.owner!r} (session {s.id}; its lease "
                                f"runs out in {(s.expiry - self.clock) / 1e9:.1f} s unless its writer renews it)")
        self._live_session(f)  # drops an expired session (its chunks go to GC)
        f.data_version += 1
        s = Session(id=self.next_session, inode=f.id, owner=r.owner,
                    expiry=self.clock + self._lease_ns(op, r.lease_ms), version=f.data_version)
        self.next_session += 1
        self.sessions[s.id] = s
        f.session = s.id
        return pb.OpenWriteReply(session_id=s.id, lease_expiry_ns=s.expiry, data_version=s.version,
                                 file=self._info(f))

    def _op_renew_lease(self, op: pb.MetaOp, r: pb.RenewLeaseRequest) -> Message:
        s, f = self._session(r.session_id)
        self._session_writer(from_caller(op), f, "renew_lease", s.id)
        ups = self._check_uploads(s, f, r.uploads)
        recs = self._check_records(s, f, r.chunks, None)
        s.uploads.update(ups)
        for idx in sorted(recs):
            s.uploads.add((idx, recs[idx].generation))
            s.staged[idx] = recs[idx]
        s.expiry = self.clock + self._lease_ns(op, r.lease_ms)
        return pb.RenewLeaseReply(lease_expiry_ns=s.expiry)

    @staticmethod
    def _check_chunk_index(f: Inode, c: int, size: int | None) -> None:
        assert f.layout is not None
        limit = -(-size // f.layout.chunk_size) if size is not None else -(-(1 << 60) // f.layout.chunk_size)
        if c >= limit:
            raise InvalidArgumentError(
                f"chunk {c} lies beyond the file size {size} (chunk size {f.layout.chunk_size})")

    def _check_uploads(self, s: Session, f: Inode, uploads: Iterable[pb.ChunkUpload]) -> list[tuple[int, int]]:
        out = []
        for u in uploads:
            self._check_chunk_index(f, u.index, None)
            if session_version(u.generation) != s.version:
                raise InvalidArgumentError(
                    f"chunk {u.index}: generation {u.generation:#x} does not belong to write session {s.id} "
                    f"(data version {s.version})")
            out.append((u.index, u.generation))
        return out

    def _check_records(self, s: Session, f: Inode, chunks: Iterable[pb.ChunkRecord],
                       size: int | None) -> dict[int, ChunkRecord]:
        """The records a renewal stages or a commit publishes, checked."""
        assert f.layout is not None
        lay = f.layout
        width = lay.width
        # The floor below which a chunk is not stored at all (the client's
        # acknowledgement rule, min_write_fragments, is stricter).
        floor = 1 if lay.kind == pb.REDUNDANCY_KIND_REPLICA else lay.k
        recs: dict[int, ChunkRecord] = {}
        for c in chunks:
            self._check_chunk_index(f, c.index, size)
            if c.index in recs:
                raise InvalidArgumentError(f"chunk {c.index} is listed twice in the commit")
            if session_version(c.generation) != s.version:
                raise InvalidArgumentError(
                    f"chunk {c.index}: generation {c.generation:#x} does not belong to write session {s.id} "
                    f"(data version {s.version})")
            if not 0 < c.length <= lay.chunk_size:
                raise InvalidArgumentError(f"chunk {c.index}: length {c.length} outside (0, {lay.chunk_size}]")
            missing = sorted(set(c.missing))
            if len(missing) != len(c.missing) or any(j >= width for j in missing):
                raise InvalidArgumentError(f"chunk {c.index}: bad missing fragment list {list(c.missing)} "
                                           f"(width {width})")
            if width - len(missing) < floor:
                raise InvalidArgumentError(f"chunk {c.index}: only {width - len(missing)} of {width} fragments "
                                           f"stored, {lay.redundancy()} needs at least {floor}")
            recs[c.index] = ChunkRecord(c.generation, c.length, c.length, c.crc32c, tuple(missing))
        return recs

    def _op_commit_write(self, op: pb.MetaOp, r: pb.CommitWriteRequest) -> Message:
        s, f = self._session(r.session_id)
        self._session_writer(from_caller(op), f, "commit_write", s.id)
        ups = self._check_uploads(s, f, r.uploads)
        recs = {**s.staged, **self._check_records(s, f, r.chunks, r.size)}
        for idx in sorted(s.staged):
            self._check_chunk_index(f, idx, r.size)
        if r.map_version:
            recs = self._stale_positions(f, recs, r.map_version)
        s.uploads.update(ups)
        for idx in sorted(recs):
            old = f.chunks.get(idx)
            if old is not None and old.generation != recs[idx].generation:
                self._gc_chunk(f, idx, old.generation)
            s.uploads.add((idx, recs[idx].generation))
            self._set_chunk(f, idx, recs[idx])
        self._set_size(f, r.size)
        f.mtime = f.ctime = self.clock
        self._drop_session(s, f)
        return self._info(f)

    def _stale_positions(self, f: Inode, recs: dict[int, ChunkRecord], map_version: int) -> dict[int, ChunkRecord]:
        """``recs`` with the positions whose member changed after the
        writer's map ``map_version`` added to ``missing``: a writer with an
        older map sent that fragment to the member before (still alive when
        it was drained or moved away), which no longer serves it."""
        assert f.layout is not None
        floor = 1 if f.layout.kind == pb.REDUNDANCY_KIND_REPLICA else f.layout.k
        out = dict(recs)
        for idx in sorted(recs):
            pe = self.pos_epoch.get(f.groups[idx % len(f.groups)]) if f.groups else None
            stale = {j for j, v in pe.items() if v > map_version} if pe else set()
            if not stale:
                continue
            missing = set(recs[idx].missing) | stale
            if f.layout.width - len(missing) < floor:
                raise StaleVersionError(
                    f"chunk {idx}: placement changed since cluster map version {map_version} the writer used "
                    f"({len(missing)} of {f.layout.width} fragments would be on former members): write it again")
            out[idx] = replace(recs[idx], missing=tuple(sorted(missing)))
        return out

    def _op_abort_write(self, op: pb.MetaOp, r: pb.AbortWriteRequest) -> Message:
        s = self.sessions.get(r.session_id)
        if s is None:
            raise SessionExpiredError(f"write session {r.session_id} is unknown, expired or already ended")
        f = self.inodes[s.inode]
        self._session_writer(from_caller(op), f, "abort_write", s.id)
        s.uploads.update(self._check_uploads(s, f, r.uploads))
        self._drop_session(s, f)
        return pb.Empty()

    # ---- the repair queue ------------------------------------------------------

    def _op_mark_fragments(self, op: pb.MetaOp, r: pb.MarkFragmentsRequest) -> Message:
        """Fragments of committed chunks rebuilt (``done``: cleared from the
        chunk's missing list) or found missing or bad (added). Items naming
        another generation than the committed one are ignored: the chunk was
        rewritten meanwhile."""
        changed = 0
        for it in r.items:
            f = self.inodes.get(it.inode)
            rec = f.chunks.get(it.chunk) if f is not None and f.type == FILE else None
            if f is None or rec is None or rec.generation != it.version:
                continue
            assert f.layout is not None
            if it.fragment >= f.layout.width:
                raise InvalidArgumentError(f"fragment {it.fragment} is outside the layout's {f.layout.width}")
            missing = set(rec.missing)
            if r.done:
                missing.discard(it.fragment)
            else:
                missing.add(it.fragment)
            if len(missing) != len(rec.missing):
                self._set_chunk(f, it.chunk, replace(rec, missing=tuple(sorted(missing))))
                changed += 1
        return pb.MarkFragmentsReply(changed=changed)

    # ---- cluster map ---------------------------------------------------------

    def _op_register_node(self, op: pb.MetaOp, r: pb.RegisterNodeRequest) -> Message:
        node = next((n for n in self.nodes.values() if n.uuid == r.node_uuid), None)
        changed = False
        if node is None:
            node = Node(id=self.next_node, uuid=r.node_uuid, hostname=r.hostname, data_addr=r.data_addr,
                        control_addr=r.control_addr, state=NODE_ONLINE, last_hb=self.clock)
            self.next_node += 1
            self.nodes[node.id] = node
            changed = True
        before = {t: self._target_state(self.targets[t]) for t in node.targets}
        if (node.hostname, node.data_addr, node.control_addr, node.state) != (
                r.hostname, r.data_addr, r.control_addr, NODE_ONLINE):
            changed = True
        node.hostname, node.data_addr, node.control_addr = r.hostname, r.data_addr, r.control_addr
        node.state, node.last_hb = NODE_ONLINE, self.clock
        by_path = {self.targets[t].path: self.targets[t] for t in node.targets}
        reply = pb.RegisterNodeReply(node_id=node.id)
        offered = set()
        for spec in r.targets:
            t = by_path.get(spec.path)
            if t is None:
                t = Target(id=self.next_target, node=node.id, path=spec.path, capacity=spec.capacity)
                self.next_target += 1
                self.targets[t.id] = t
                node.targets.append(t.id)
                changed = True
            t.capacity, t.present, t.reported = spec.capacity, True, ONLINE
            if t.full_since:
                t.full_since = 0
            offered.add(t.id)
            reply.targets.append(pb.RegisteredTarget(path=spec.path, target_id=t.id))
        for tid in node.targets:
            if tid not in offered:
                self.targets[tid].present = False
        if any(self._target_state(self.targets[t]) != s for t, s in before.items()):
            changed = True
        if r.rack and node.rack != r.rack:
            # An empty rack leaves the label as is (it may come from `tierfs node label`).
            node.rack = r.rack
            changed = True
        if changed:
            # New groups come from the leader's service (add_groups).
            self.map_version += 1
        self._refresh_down()
        if op.HasField("kv_default_pool") and not self.kv_default_done and self.targets:
            self._kv_make_default(op.kv_default_pool, plan=not op.kv_planned)
        reply.map_version = self.map_version
        return reply

    def _op_heartbeat(self, op: pb.MetaOp, r: pb.HeartbeatRequest) -> Message:
        node = self.nodes.get(r.node_id)
        if node is None:
            raise NotFoundError(f"unknown storage node {r.node_id}: register it first")
        for rep in r.targets:
            if rep.target_id not in node.targets:
                raise InvalidArgumentError(f"target {rep.target_id} does not belong to node {node.id}")
        before = {t: self._target_state(self.targets[t]) for t in node.targets}
        node.state, node.last_hb = NODE_ONLINE, self.clock
        stamp = op.min_format >= FULL_SINCE_FORMAT
        for rep in r.targets:
            t = self.targets[rep.target_id]
            t.used, t.capacity = rep.used, rep.capacity
            t.reported = rep.state or ONLINE
            if stamp and t.reported == ONLINE:
                if t.full_since:  # assigned only on a change: each assignment is an undo record
                    t.full_since = 0
            elif stamp and not t.full_since:
                t.full_since = self.clock
        if any(self._target_state(self.targets[t]) != s for t, s in before.items()):
            self.map_version += 1
        self._refresh_down()
        return pb.HeartbeatReply(map_version=self.map_version, state=node.state)  # type: ignore[arg-type]

    def _refresh_down(self) -> None:
        for tid in sorted(self.targets):
            t = self.targets[tid]
            if self._target_state(t) in (ONLINE, pb.TARGET_STATE_READ_ONLY):
                if t.down_since:
                    if self._stamping:
                        # Back: what it holds of KV pools missed the writes made
                        # while it was down (the op that brought it back bumps the map).
                        t.up_since = self._changed_at()
                    # Only when it changes: an assignment is an undo record,
                    # and this runs over every target (1.2 ms per heartbeat
                    # that changes a state with 1,000 targets, when every up
                    # target was assigned 0 again).
                    t.down_since = 0
            elif not t.down_since:
                t.down_since = self.clock

    def _replace_down_targets(self, after_ns: int) -> None:
        """Swap every target down for ``after_ns`` or longer out of its groups."""
        self._replace_targets([tid for tid in sorted(self.targets)
                               if self.targets[tid].down_since and self.clock - self.targets[tid].down_since >= after_ns])

    def _apply_replacements(self, rep: pb.Replacements, replaceable: Callable[[int], bool], *,
                            source: bool = False) -> list[int]:
        """Replacements the leader planned (tierfs.meta.replace): each one
        still valid (the old member still holds the position and is one
        this op replaces, the new one eligible, not a member, on a node the
        group does not use and in a rack under its limit) is applied as
        :meth:`_replace_member` does; the others leave their group stuck.
        O(moves x width) plus one pass over the targets. Returns the
        groups stuck (the leader's and the refused)."""
        eligible = self._eligible()
        doms = self.target_domains()
        cap = self._caps(eligible)
        stuck = list(rep.groups_stuck)
        changed = False
        for mv in rep.moves:
            members = self.groups.get(mv.group_id)
            old, new = mv.old_target, mv.new_target
            ok = (members is not None and mv.position < len(members) and members[mv.position] == old
                  and replaceable(old) and new in eligible and new not in members
                  and not self.purging_in(mv.group_id, new))
            if ok:
                assert members is not None
                others = [m for j, m in enumerate(members) if j != mv.position]
                ok = (eligible[new] not in {self.targets[m].node for m in others if m in self.targets}
                      and rack_counts(others, doms)[doms[new]] < cap(len(members)))
            if not ok:
                stuck.append(mv.group_id)
                continue
            self._replace_member(mv.group_id, mv.position, new, source=source)
            changed = True
        if changed:
            self.map_version += 1
        return stuck

    def _replace_member(self, gid: int, j: int, new: int, *, source: bool) -> None:
        """Put ``new`` at position ``j`` of group ``gid``, rebuilding (from
        the old member when ``source``; a source the old member inherited
        passes on). The caller bumps the map."""
        members = self.groups[gid]
        tid = members[j]
        members[j] = new
        self.pos_epoch.setdefault(gid, {})[j] = self.map_version + 1  # the caller's bump announces it
        rb = self.rebuilding.setdefault(gid, set())
        srcs = self.rebuild_sources.get(gid, {})
        # A member replaced before its own rebuild finished: the new one
        # inherits its source (the data never reached tid).
        inherited = srcs.pop(tid, 0) if tid in rb else 0
        rb.discard(tid)
        rb.add(new)
        src = inherited or (tid if source else 0)
        if src:
            self.rebuild_sources.setdefault(gid, {})[new] = src
        if src != tid:
            # tid serves nothing of this position any more (a dead or full
            # member, or one replaced before its own copy finished); a copy
            # source is purged when the copy finishes (FinishRebuild).
            self._purge_later(tid, gid, j)
        mv = self.moving.get(gid)
        if mv is not None and mv[0] == tid:
            self.moving[gid] = (new, mv[1], mv[2])  # the move's copy goes on to the replacement
        if gid in self.rebuild_sources and not self.rebuild_sources[gid]:
            del self.rebuild_sources[gid]

    def _replace_targets(self, tids: Iterable[int], *, source: bool = False) -> list[int]:
        """Swap each of ``tids`` out of its groups, each time for the
        least-used online target on a node the group does not use yet: what
        apply did before the leader planned replacements
        (tierfs.meta.replace), kept for the entries of older versions (a
        Tick, RemoveTarget or DrainNode without ``replaced.planned``), which
        must replay as they did. O(targets x groups): never on new entries. The
        newcomer is marked rebuilding (with the old member as its copy
        source when ``source``: a drain, the old member still serves).
        Returns the groups left unchanged for want of a candidate."""
        eligible = self._eligible()
        doms = self.target_domains()
        cap = self._caps(eligible)
        usage: dict[int, int] = {}
        for members in self.groups.values():
            for m in members:
                usage[m] = usage.get(m, 0) + 1
        changed = False
        stuck: list[int] = []
        for tid in tids:
            for gid in sorted(self.groups):
                members = self.groups[gid]
                if tid not in members:
                    continue
                limit = cap(len(members))
                used_nodes = {self.targets[m].node for m in members if m != tid}
                cands = [c for c in sorted(eligible) if eligible[c] not in used_nodes and c not in members]
                if not cands:
                    stuck.append(gid)
                    continue  # nowhere to go: the group stays degraded
                # The rack rule first (a rack over its share is a worse
                # failure than a slightly fuller target), then usage.
                in_rack = rack_counts([m for m in members if m != tid], doms)
                new = min(cands, key=lambda c: (in_rack[doms[c]] >= limit, usage.get(c, 0), c))
                self._replace_member(gid, members.index(tid), new, source=source)
                usage[new] = usage.get(new, 0) + 1
                usage[tid] -= 1
                changed = True
        if changed:
            self.map_version += 1
        return stuck

    def _op_finish_rebuild(self, op: pb.MetaOp, r: pb.FinishRebuildRequest) -> Message:
        if r.group_id not in self.groups:
            raise NotFoundError(f"no placement group {r.group_id}")
        rb = self.rebuilding.get(r.group_id, set())
        if r.target_id not in rb:
            raise InvalidArgumentError(f"target {r.target_id} is not being rebuilt in group {r.group_id}")
        rb.discard(r.target_id)
        if not rb:
            del self.rebuilding[r.group_id]
        srcs = self.rebuild_sources.get(r.group_id)
        src = 0
        if srcs is not None:
            src = srcs.pop(r.target_id, 0)
            if not srcs:
                del self.rebuild_sources[r.group_id]
        members = self.groups[r.group_id]
        if src and op.min_format >= GC_COPIES_FORMAT and r.target_id in members:
            # The move copied its source's generations waiting for GC
            # (tierfs.storage.repair.Repairer.copy_waiting): GC deletes
            # those copies too.
            self.gc.add_copies(src, r.group_id, r.target_id, members.index(r.target_id))
        if src and r.target_id in members and src not in members:
            # The copy is done: the source's copy of the position goes
            # (unless the source holds a position of the group again: a
            # move redirected back onto its own source).
            self._purge_later(src, r.group_id, members.index(r.target_id))
        mv = self.moving.get(r.group_id)
        if mv is not None and mv[0] == r.target_id:
            del self.moving[r.group_id]
            self.moves_done += 1
            self.bytes_moved += mv[2]
        self.map_version += 1
        return pb.Empty()

    def _op_remove_target(self, op: pb.MetaOp, r: pb.RemoveTargetRequest) -> Message:
        """Declare a target dead: it is replaced in every group now (its
        fragments are rebuilt from the survivors) and never used again.
        GC items still waiting for it are dropped."""
        t = self.targets.get(r.target_id)
        if t is None:
            raise NotFoundError(f"no target {r.target_id}")
        if t.removed:
            raise InvalidArgumentError(f"target {r.target_id} is already removed")
        t.removed = True
        self._refresh_down()
        self.map_version += 1
        if r.replaced.planned:
            stuck = self._apply_replacements(r.replaced, lambda tid: tid == t.id)
        else:
            stuck = self._replace_targets([t.id])  # an entry of an older version
        self._drop_gc_for({t.id})
        return pb.ReplaceReply(groups_stuck=stuck)

    def _op_drain_node(self, op: pb.MetaOp, r: pb.DrainNodeRequest) -> Message:
        """Move every fragment off a node while it still serves: its targets
        are replaced in every group by targets elsewhere, each new member
        rebuilding by copy from the old one. (Again on a draining node:
        retries the groups that found no replacement before.)"""
        node = self.nodes.get(r.node_id)
        if node is None:
            raise NotFoundError(f"no storage node {r.node_id}")
        if not node.draining:
            node.draining = True
            self.map_version += 1
        if r.replaced.planned:
            mine = set(node.targets)
            stuck = self._apply_replacements(r.replaced, mine.__contains__, source=True)
        else:
            stuck = self._replace_targets(sorted(node.targets), source=True)  # an entry of an older version
        return pb.ReplaceReply(groups_stuck=stuck)

    def _op_undrain_node(self, op: pb.MetaOp, r: pb.UndrainNodeRequest) -> Message:
        """Undo a drain: the node's targets may take new fragments again.
        Groups already moved off it keep their new members (the copies
        finish); groups the drain could not move keep it, as they did."""
        node = self.nodes.get(r.node_id)
        if node is None:
            raise NotFoundError(f"no storage node {r.node_id}")
        was = node.draining
        if was:
            node.draining = False
            self.map_version += 1
        return pb.UndrainNodeReply(was_draining=was)

    def _op_remove_node(self, op: pb.MetaOp, r: pb.RemoveNodeRequest) -> Message:
        """Forget a node and its targets, once no group needs them: none is a
        member of a group or the copy source of an unfinished rebuild."""
        node = self.nodes.get(r.node_id)
        if node is None:
            raise NotFoundError(f"no storage node {r.node_id}")
        mine = set(node.targets)
        held = sorted(g for g, members in self.groups.items() if mine.intersection(members))
        if held:
            raise BusyError(f"node {node.id} still holds fragments of groups {held[:10]}: drain it first "
                            f"(`tierfs node drain {node.id}`) or remove its targets")
        feeding = sorted(g for g, srcs in self.rebuild_sources.items() if mine.intersection(srcs.values()))
        if feeding:
            raise BusyError(f"node {node.id} is the copy source of unfinished rebuilds in groups {feeding[:10]}; "
                            f"wait for them (`tierfs status`)")
        for tid in node.targets:
            del self.targets[tid]
        del self.nodes[node.id]
        self._drop_gc_for(mine)
        self.map_version += 1
        return pb.Empty()

    # ---- KV pools --------------------------------------------------------------

    def _kv_create(self, r: pb.CreateKVPoolRequest, *, plan: bool) -> KVPoolRecord:
        """A new pool; with ``plan`` (entries of older versions) its groups
        planned here, else none until the leader's KVGroups op."""
        if any(p.name == r.name for p in self.kv_pools.values()):  # first: the clearer answer
            raise AlreadyExistsError(f"KV pool {r.name!r} already exists")
        redundancy, width, policy = check_kv_pool_create(r)
        if len(self.kv_pools) >= MAX_KV_POOLS:
            raise InvalidArgumentError(f"the cluster has {len(self.kv_pools)} KV pools, the most allowed; "
                                       f"remove one first (`tierfs kv pool rm NAME`)")
        pool = KVPoolRecord(id=self.next_kv_pool, name=r.name, redundancy=redundancy, width=width,
                            target_memory=r.target_memory, target_disk=r.target_disk, fsync=r.fsync,
                            pin_quota=r.pin_quota, policy=policy, created=self.clock, tenant=r.tenant or "user")
        self.next_kv_pool += 1
        self._set_kv_groups(pool, replan_groups([], self._eligible(), width) if plan else [])
        self.kv_pools[pool.id] = pool
        if r.name == DEFAULT_POOL_NAME:
            self.kv_default_done = True
        self.map_version += 1
        return pool

    def _kv_make_default(self, r: pb.CreateKVPoolRequest, *, plan: bool) -> None:
        """The default pool, from the leader's stamp on a registration: made
        once, when the cluster first has targets. One of that name made by
        an operator before counts as made."""
        self.kv_default_done = True
        if all(p.name != DEFAULT_POOL_NAME for p in self.kv_pools.values()):
            req = pb.CreateKVPoolRequest()
            req.CopyFrom(r)
            req.name = DEFAULT_POOL_NAME
            self._kv_create(req, plan=plan)

    def _kv_replan(self) -> None:
        """Re-plan every pool's groups over the eligible targets: what apply
        did on every map bump before the leader planned them
        (tierfs.meta.kvplan), kept for the entries of older versions (ops
        without ``kv_planned``), which must replay as they did.
        O(pools x groups x width): never on new entries."""
        eligible = self._eligible()
        for pid in sorted(self.kv_pools):
            pool = self.kv_pools[pid]
            groups = replan_groups([list(g) for g in pool.groups], eligible, pool.width)
            if groups != pool.groups:
                self._set_kv_groups(pool, groups)

    def _op_create_kv_pool(self, op: pb.MetaOp, r: pb.CreateKVPoolRequest) -> Message:
        return self._kv_create(r, plan=not op.kv_planned).to_pb()

    def _op_kv_groups(self, op: pb.MetaOp, r: pb.KVGroupsRequest) -> Message:
        """KV pool groups the leader planned (tierfs.meta.kvplan) at
        ``map_version``. Each pool named must exist; each group given must
        have the pool's width, members eligible and on distinct nodes (KV
        pools place without the rack rule: a lost object is a miss); the
        pool may hold at most one group per target present (op format 3
        on; per eligible target before), and a pool
        that grows gets a group for every new position. Anything wrong, or
        the map moved since, refuses the whole op (the leader plans
        again). O(groups changed x width) plus one pass over the targets
        and, per pool changed, one copy of its group list."""
        if r.map_version != self.map_version:
            raise StaleVersionError(f"kv_groups: planned at map version {r.map_version}, the map is now at "
                                    f"{self.map_version}")
        eligible = self._eligible()
        if op.min_format >= KV_HELD_FORMAT:
            limit, what_limit = len(self._kv_present()), "target present"
        else:
            limit, what_limit = len(eligible), "eligible target"
        todo: list[tuple[KVPoolRecord, int, list[tuple[int, list[int]]]]] = []
        for p in r.pools:
            pool = self.kv_pools.get(p.pool_id)
            if pool is None:
                raise NotFoundError(f"kv_groups: no KV pool {p.pool_id}")
            have = len(pool.groups)
            added = sum(g.index >= have for g in p.groups)
            if p.count > have and added != p.count - have:
                raise InvalidArgumentError(f"kv_groups: pool {pool.name!r} grows from {have} to {p.count} groups "
                                           f"but {added} new group(s) are given")
            if p.count > limit:
                raise InvalidArgumentError(f"kv_groups: pool {pool.name!r}: {p.count} groups exceed one per "
                                           f"{what_limit} ({limit})")
            changes = []
            for g in p.groups:
                members = list(g.target_ids)
                what = f"kv_groups: pool {pool.name!r} group {g.index + 1}"
                if len(members) != pool.width:
                    raise InvalidArgumentError(f"{what} has {len(members)} members, not {pool.width}")
                self._check_group(members, eligible, pool.width, what, {})  # no rack rule: no domains
                changes.append((g.index, members))
            todo.append((pool, p.count, changes))
        changed = False
        for pool, count, changes in todo:
            groups = list(pool.groups[:count])
            for i, members in changes:
                if i < len(groups):
                    groups[i] = members
                else:
                    groups.append(members)
            if groups != pool.groups:
                self._set_kv_groups(pool, groups)
                changed = True
        if changed:
            self.map_version += 1
        return pb.Empty()

    def _op_remove_kv_pool(self, op: pb.MetaOp, r: pb.RemoveKVPoolRequest) -> Message:
        pool = next((p for p in self.kv_pools.values() if p.name == r.name), None)
        if pool is None:
            raise NotFoundError(f"no KV pool {r.name!r} (`tierfs kv pool ls` lists them)")
        del self.kv_pools[pool.id]
        self.map_version += 1
        return pb.Empty()

    def kv_pool_list(self) -> list[pb.KVPool]:
        return [self.kv_pools[p].to_pb() for p in sorted(self.kv_pools)]

    # ---- users (tierfs.meta.users) -------------------------------------------

    def _op_add_user(self, op: pb.MetaOp, r: pb.AddUserRequest) -> Message:
        u, tok = users_mod.add_user(self.users, r, self.clock)
        return pb.UserTokenReply(user=u.to_pb(), token_id=tok.id)

    def _op_remove_user(self, op: pb.MetaOp, r: pb.RemoveUserRequest) -> Message:
        users_mod.remove_user(self.users, r.name)
        return pb.Empty()

    def _op_issue_token(self, op: pb.MetaOp, r: pb.IssueTokenRequest) -> Message:
        u, tok = users_mod.issue_token(self.users, r, self.clock)
        return pb.UserTokenReply(user=u.to_pb(), token_id=tok.id)

    def _op_revoke_token(self, op: pb.MetaOp, r: pb.RevokeTokenRequest) -> Message:
        return pb.RevokeTokenReply(revoked=users_mod.revoke_token(self.users, r))

    def user_list(self) -> list[pb.User]:
        return [self.users[n].to_pb() for n in sorted(self.users)]

    def _drop_gc_for(self, tids: set[int]) -> None:
        self.gc.drop_targets(tids)
        for t in sorted(tids):
            self.purges.pop(t, None)  # it will never acknowledge

    def _op_ack_gc(self, op: pb.MetaOp, r: pb.AckGCRequest) -> Message:
        acked = sum(self.gc.ack(a.id, a.target_id) for a in r.acks)
        done = 0
        for p in r.purged:
            mine = self.purges.get(p.target_id)
            key = (p.group_id, p.position)
            if mine is not None and key in mine and mine[key][0] == p.id:
                del mine[key]
                if not mine:
                    del self.purges[p.target_id]
                done += 1
        return pb.AckGCReply(acked=acked, purges_acked=done)

    # ---- group purges ----------------------------------------------------------

    def _purge_later(self, tid: int, gid: int, j: int) -> None:
        """Record that target ``tid`` no longer holds position ``j`` of
        group ``gid`` (an entry of PURGE_FORMAT on): its node deletes that
        copy once the op's purge grace is over (readers holding the map
        before may still read it meanwhile). Not for a target removed (it will
        never come back to delete anything)."""
        t = self.targets.get(tid)
        if not self._purging or t is None or t.removed:
            return
        self.purges.setdefault(tid, {})[(gid, j)] = (self.next_purge, self.clock + self._purge_grace_ns,
                                                      self.map_version + 1)
        self.next_purge += 1

    def purging_in(self, gid: int, tid: int) -> bool:
        """Whether target ``tid`` still has to purge a copy of a position of
        group ``gid``: it may not become a member of that group until then
        (its node could delete what a new copy wrote). O(width)."""
        mine = self.purges.get(tid)
        if not mine:
            return False
        return any((gid, j) in mine for j in range(max(len(self.groups.get(gid, ())), 1)))

    def barred(self) -> frozenset[tuple[int, int]]:
        """Every (group, target) pair :meth:`purging_in` refuses."""
        return frozenset((g, t) for t, mine in self.purges.items() for g, _ in mine)

    def purges_pending(self) -> int:
        return sum(len(m) for m in self.purges.values())

    def list_purges(self, target_ids: Iterable[int], now_ns: int = 0,
                    limit: int = MAX_PURGES_PAGE) -> list[pb.GroupPurge]:
        """The group purges of ``target_ids`` whose grace is over at
        ``now_ns`` (the leader's clock, never taken below the state
        clock), oldest first, at most ``limit``."""
        now = max(self.clock, now_ns)
        rows = [(pid, t, g, j, mv) for t in target_ids for (g, j), (pid, ready, mv)
                in self.purges.get(t, {}).items() if ready <= now]
        rows.sort()
        return [pb.GroupPurge(id=pid, target_id=t, group_id=g, position=j, map_version=mv)
                for pid, t, g, j, mv in rows[:limit]]

    def _op_tick(self, op: pb.MetaOp, r: pb.TickRequest) -> Message:
        if r.heartbeat_timeout_ms:
            limit = self.clock - r.heartbeat_timeout_ms * NS_PER_MS
            expired = [n for _, n in sorted(self.nodes.items()) if n.state == NODE_ONLINE and n.last_hb < limit]
            for n in expired:
                n.state = NODE_OFFLINE
            if expired:
                self.map_version += 1
        silent = [self.nodes[i] for i in sorted(set(r.offline_nodes)) if i in self.nodes]
        silent = [n for n in silent if n.state == NODE_ONLINE]
        for n in silent:
            n.state = NODE_OFFLINE
        if silent:
            self.map_version += 1
        self._refresh_down()
        if r.replaced.planned:
            after = r.replace_after_ms * NS_PER_MS

            def down(tid: int) -> bool:
                t = self.targets.get(tid)
                return bool(after and t is not None and t.down_since and self.clock - t.down_since >= after)
            self._apply_replacements(r.replaced, down)
        elif r.replace_after_ms:
            self._replace_down_targets(r.replace_after_ms * NS_PER_MS)  # an entry of an older leader
        for sid in sorted(self.sessions):
            s = self.sessions[sid]
            if s.expiry < self.clock:
                self._drop_session(s, self.inodes.get(s.inode))
        # Last: the dedup table is not covered by the undo log (apply).
        self.requests.expire(self.clock - REQUEST_TTL_NS)
        return pb.Empty()

    # ---- reads (after the replicator's read barrier) ------------------------

    def tick_due(self, now_ns: int, heartbeat_timeout_ms: int, replace_after_ms: int = 0) -> bool:
        """Whether a Tick op at ``now_ns`` would change anything beyond the
        clock: the leader skips the log entry otherwise (an idle cluster
        writes nothing and its digest stays still)."""
        now = self._advance(now_ns)
        if heartbeat_timeout_ms:
            limit = now - heartbeat_timeout_ms * NS_PER_MS
            if any(n.state == NODE_ONLINE and n.last_hb < limit for n in self.nodes.values()):
                return True
        if any(s.expiry < now for s in self.sessions.values()):
            return True
        if self.requests.expire_due(now - REQUEST_TTL_NS):
            return True
        if replace_after_ms:
            after = replace_after_ms * NS_PER_MS
            down = {t.id for t in self.targets.values() if t.down_since and now - t.down_since >= after}
            if down and self._replaceable(down):
                return True
        return False

    def down_for(self, now_ns: int, replace_after_ms: int) -> list[int]:
        """Targets a Tick at ``now_ns`` may replace: down ``replace_after_ms``
        or longer (O(targets); the leader plans their replacements,
        tierfs.meta.replace)."""
        now, after = self._advance(now_ns), replace_after_ms * NS_PER_MS
        return sorted(t.id for t in self.targets.values() if t.down_since and now - t.down_since >= after)

    def rebuild_would_lose(self, gid: int, tid: int) -> bool:
        """Whether swapping down member ``tid`` of group ``gid`` out for a
        new target would lose data rather than rebuild it: fewer of the
        other members are readable than a chunk stored in the group needs
        (K of ec:K+M, one copy of replica:N; the only member of a replica:1
        group has none). Held in place instead, the target's fragments are
        back when it is (until stop 47 a replica:1 file was unreadable for
        good after its node was down for replace_after). O(1) when at most
        this member is down; else O(files in the group) at worst."""
        members = self.groups.get(gid)
        if members is None or tid not in members or gid not in self.ginv:
            return False  # holds no data
        rb = self.rebuilding.get(gid, set())
        readable = sum(1 for m in members if m != tid and m not in rb and m in self.targets
                       and self._target_state(self.targets[m]) in (ONLINE, pb.TARGET_STATE_READ_ONLY))
        if len(members) > 1 and readable >= len(members) - 1:
            return False  # K <= width - 1 for every layout wider than one
        if readable == 0:
            return True
        for ino in self.ginv[gid]:
            lay = self.inodes[ino].layout if ino in self.inodes else None
            if lay is not None and (1 if lay.kind == pb.REDUNDANCY_KIND_REPLICA else lay.k) > readable:
                return True
        return False

    def _replaceable(self, down: set[int]) -> bool:
        """Whether some group holding one of ``down`` has a candidate to
        replace it (a group with none would make every tick a no-op log
        entry, forever)."""
        eligible = self._eligible()
        for members in self.groups.values():
            for tid in down.intersection(members):
                used = {self.targets[m].node for m in members if m != tid}
                if any(n not in used and c not in members for c, n in eligible.items()):
                    return True
        return False

    # Reads take the caller's identity (``ident``; the service passes the
    # authenticated one) and check search permission along the path like
    # the ops: stat, lookup, readlink and get_layout need nothing more (as
    # stat(2)), readdir needs read permission on the directory.

    def stat(self, loc: pb.Loc, *, ident: Identity = ANONYMOUS) -> pb.FileInfo:
        _check_read_loc(loc, "stat")
        n = self._get(loc, ident, "stat")
        if loc.path.endswith("/") and loc.path != "/" and n.type != DIR:
            # POSIX: a trailing slash names a directory (ENOTDIR). Checked on
            # this read path, not in apply: entries replay as they did.
            raise NotADirectoryError_(f"{loc.path}: not a directory")
        return self._info(n)

    def lookup(self, parent: int, name: str, *, ident: Identity = ANONYMOUS) -> pb.FileInfo:
        _check_read_loc(pb.Loc(parent=parent, name=name), "lookup")
        return self._info(self._get(pb.Loc(parent=parent, name=name), ident, "lookup"))

    def readdir(self, loc: pb.Loc, cursor: str = "", limit: int = 0, *,
                ident: Identity = ANONYMOUS) -> pb.ReaddirReply:
        _check_read_loc(loc, "readdir")
        d = self._dir(self._get(loc, ident, "readdir"), self._where(loc))
        self._need(ident, d, R, "readdir", self._where(loc))
        # Read without search permission lists names (and inode and type,
        # as getdents does) but not attributes, which need a lookup.
        attrs = access_ok(ident, d.mode, d.uid, d.gid, X)
        limit = min(limit or DEFAULT_READDIR_LIMIT, MAX_READDIR_LIMIT)
        # One more than the page tells whether another page follows, without
        # sorting the whole directory for every page.
        names = heapq.nsmallest(limit + 1, (n for n in d.entries if n > cursor))
        page = names[:limit]
        reply = pb.ReaddirReply(next_cursor=page[-1] if len(names) > limit else "")
        for name in page:
            n = self.inodes[d.entries[name]]
            attr = self._attr(n) if attrs else pb.Attr(inode=n.id, type=n.type)  # type: ignore[arg-type]
            e = reply.entries.add(name=name, attr=attr)
            if attrs and n.type == FILE and n.layout is not None:
                e.layout.CopyFrom(n.layout.to_pb())
        return reply

    def readlink(self, loc: pb.Loc, *, ident: Identity = ANONYMOUS) -> str:
        _check_read_loc(loc, "readlink")
        n = self._get(loc, ident, "readlink")
        if n.type != SYMLINK:
            raise InvalidArgumentError(f"{self._where(loc)} is not a symbolic link")
        return n.target

    def get_layout(self, loc: pb.Loc, *, ident: Identity = ANONYMOUS) -> pb.Layout:
        _check_read_loc(loc, "get_layout")
        n = self._get(loc, ident, "get_layout")
        if n.type == FILE:
            assert n.layout is not None
            return n.layout.to_pb(n.groups)
        if n.type == DIR:
            return self._effective_layout(n).to_pb()
        raise InvalidArgumentError(f"{self._where(loc)} is a symbolic link and has no layout")

    def cluster_map(self, known_version: int = 0) -> pb.ClusterMap:
        if known_version and known_version == self.map_version:
            return pb.ClusterMap(version=self.map_version, unchanged=True)
        out = pb.ClusterMap(version=self.map_version)
        for nid in sorted(self.nodes):
            n = self.nodes[nid]
            out.nodes.append(pb.ClusterNode(
                node_id=n.id, node_uuid=n.uuid, hostname=n.hostname, data_addr=n.data_addr,
                control_addr=n.control_addr, state=n.state, last_heartbeat_ns=n.last_hb,  # type: ignore[arg-type]
                target_ids=n.targets, draining=n.draining, rack=n.rack))
        for tid in sorted(self.targets):
            t = self.targets[tid]
            out.targets.append(pb.ClusterTarget(target_id=t.id, node_id=t.node, path=t.path, capacity=t.capacity,
                                                used=t.used, state=self._target_state(t),  # type: ignore[arg-type]
                                                up_since=t.up_since))
        for gid in sorted(self.groups):
            rb = sorted(self.rebuilding.get(gid, ()))
            srcs = self.rebuild_sources.get(gid, {})
            out.groups.append(pb.PlacementGroup(group_id=gid, width=len(self.groups[gid]),
                                                target_ids=self.groups[gid], rebuilding=rb,
                                                rebuild_sources=[srcs.get(t, 0) for t in rb]))
        out.kv_pools.extend(self.kv_pool_list())
        return out

    def list_group_chunks(self, group_id: int, after_inode: int = 0, limit: int = 0, *, gc_holder: int = 0,
                          after_gc_id: int = 0, now_ns: int = 0) -> pb.ListGroupChunksReply:
        """Committed chunks stored in ``group_id`` (what a rebuild must
        restore), file by file in inode order.

        ``gc_holder``: instead, the generations of the group's chunks waiting
        for GC (not ready at ``now_ns``, the leader's clock) whose fragment
        ``gc_holder`` still holds, by GC item id: a move copies them from its
        source too (a reader may hold one for up to gc_grace). With
        ``group_id`` 0, for scrub: every GC item, of any group, whose
        fragment ``gc_holder`` still has to delete or whose position it now
        serves (a move's copy, which no item names), with ``gc_ready``
        (O(items) a page)."""
        limit = limit or 10_000
        reply = pb.ListGroupChunksReply()
        if gc_holder and not group_id:
            now = max(self.clock, now_ns)
            for e in self.gc.after(after_gc_id):
                j = e.pending.get(gc_holder)
                ready = e.ready <= now
                if j is None:
                    members = self.groups.get(e.group, ())
                    if gc_holder not in members:
                        continue
                    j = members.index(gc_holder)
                reply.chunks.append(pb.GroupChunk(inode=e.inode, chunk=e.chunk, version=e.version, gc_id=e.id,
                                                  fragment=j, gc_ready=ready))
                if len(reply.chunks) >= limit:
                    reply.next_gc_id = e.id
                    break
            return reply
        if group_id not in self.groups:
            raise NotFoundError(f"no placement group {group_id}")
        if gc_holder:
            items = self.gc.waiting(gc_holder, group_id, after_gc_id, limit, max(self.clock, now_ns))
            reply.chunks.extend(pb.GroupChunk(inode=e.inode, chunk=e.chunk, version=e.version, gc_id=e.id,
                                              fragment=e.pending[gc_holder])
                                for e in items)
            if len(items) >= limit:
                reply.next_gc_id = items[-1].id
            return reply
        # The inventory names the files with chunks in the group: no scan
        # of the namespace.
        for ino in sorted(i for i in self.ginv.get(group_id, {}) if i > after_inode):
            f = self.inodes[ino]
            n = len(f.groups)
            slots = {k for k, g in enumerate(f.groups) if g == group_id}
            for c in sorted(f.chunks):
                if c % n in slots:
                    reply.chunks.append(pb.GroupChunk(inode=ino, chunk=c, version=f.chunks[c].generation))
            if len(reply.chunks) >= limit:
                reply.next_inode = ino
                break
        return reply

    def list_repairs(self, target_ids: Iterable[int], limit: int = 0) -> pb.ListRepairsReply:
        """Fragments of committed chunks known missing or bad, each with the
        group member that must rebuild it (``target_ids``: only theirs)."""
        want = set(target_ids)
        limit = min(limit or 1000, MAX_REPAIR_PAGE)
        reply = pb.ListRepairsReply()
        for ino, c in sorted(self.degraded):
            f = self.inodes[ino]
            rec = f.chunks[c]
            reply.pending += len(rec.missing)
            if len(reply.items) >= limit or not f.groups:
                continue
            gid = f.groups[c % len(f.groups)]
            members = self.groups.get(gid, [])
            for j in rec.missing:
                tid = members[j] if j < len(members) else 0
                if tid and (tid in want or not want):
                    reply.items.append(pb.RepairItem(inode=ino, chunk=c, version=rec.generation, fragment=j,
                                                     group_id=gid, target_id=tid))
        return reply

    def list_gc(self, target_ids: Iterable[int], after_id: int = 0, limit: int = 0,
                now_ns: int = 0) -> list[pb.GCItem]:
        """Rows ``(item, target, fragment)`` of the GC items with id above
        ``after_id`` that are ready at ``now_ns`` (the leader's clock; never
        taken below the state clock, so an idle cluster needs no op for its
        items to become ready), for ``target_ids`` (all targets when empty).
        At least ``limit`` rows unless the queue ends; an item's rows are
        never split over two pages."""
        limit = min(limit or DEFAULT_GC_PAGE, MAX_GC_PAGE)
        rows = self.gc.page(target_ids, after_id, limit, max(self.clock, now_ns))
        return [pb.GCItem(id=item.id, inode=item.inode, chunk=item.chunk, version=item.version,
                          group_id=item.group, target_id=t, fragment=item.pending[t]) for item, t in rows]

    # ---- snapshot encoding --------------------------------------------------

    def _to_json(self) -> dict[str, Any]:
        def lay(x: LayoutSpec | None) -> list[int] | None:
            return None if x is None else [x.chunk_size, x.kind, x.k, x.m, x.stripe_width]

        inodes = []
        for i in sorted(self.inodes):
            n = self.inodes[i]
            inodes.append({
                "id": n.id, "type": n.type, "mode": n.mode, "uid": n.uid, "gid": n.gid, "mtime": n.mtime,
                "ctime": n.ctime, "nlink": n.nlink, "size": n.size, "dv": n.data_version, "parent": n.parent,
                "entries": dict(sorted(n.entries.items())), "layout": lay(n.layout), "groups": n.groups,
                "chunks": [[c, r.generation, r.length, r.valid, r.crc, list(r.missing)]
                           for c, r in sorted(n.chunks.items())],
                "target": n.target, "session": n.session,
            })
        return {
            "format": SNAPSHOT_FORMAT,
            "counters": [self.clock, self.next_inode, self.next_node, self.next_target,
                         self.next_group, self.next_session, self.next_gc, self.map_version],
            "inodes": inodes,
            "nodes": [[n.id, n.uuid, n.hostname, n.data_addr, n.control_addr, n.state, n.last_hb, n.targets]
                      for _, n in sorted(self.nodes.items())],
            "targets": [[t.id, t.node, t.path, t.capacity, t.used, t.reported, t.present, t.down_since,
                         *([t.up_since, t.full_since] if t.full_since else [t.up_since] if t.up_since else [])]
                        for _, t in sorted(self.targets.items())],
            "groups": [[g, self.groups[g]] for g in sorted(self.groups)],
            "rebuilding": [[g, sorted(self.rebuilding[g])] for g in sorted(self.rebuilding)],
            "rebuild_sources": [[g, sorted([n, o] for n, o in self.rebuild_sources[g].items())]
                                for g in sorted(self.rebuild_sources)],
            "draining": sorted(n for n in self.nodes if self.nodes[n].draining),
            "removed_targets": sorted(t for t in self.targets if self.targets[t].removed),
            "widths": sorted(self.widths),
            "sessions": [[s.id, s.inode, s.owner, s.expiry, s.version, sorted([c, g] for c, g in s.uploads),
                          [[c, r.generation, r.length, r.valid, r.crc, list(r.missing)]
                           for c, r in sorted(s.staged.items())]]
                         for _, s in sorted(self.sessions.items())],
            "gc": self.gc.to_json(),
            "dedup": self.requests.to_json(),
            # Only when some result has a fingerprint (ops of format 4 on):
            # a state that kept none encodes as before.
            **({"dedup_prints": prints} if (prints := self.requests.prints_to_json()) else {}),
            "kv": {"next_pool": self.next_kv_pool, "default_done": self.kv_default_done,
                   "pools": [pool_to_json(self.kv_pools[p]) for p in sorted(self.kv_pools)]},
            # Only when there are users: a cluster without any keeps the
            # digest it had before users existed.
            **({"users": users_mod.users_to_json(self.users)} if self.users else {}),
            # Rack labels and rebalance moves, likewise only when there are
            # any (an unlabelled cluster that never moved keeps its digest).
            **({"racks": [[n.id, n.rack] for _, n in sorted(self.nodes.items()) if n.rack]}
               if any(n.rack for n in self.nodes.values()) else {}),
            **({"rebalance": {"moving": [[g, *self.moving[g]] for g in sorted(self.moving)],
                              "done": self.moves_done, "bytes": self.bytes_moved}}
               if self.moving or self.moves_done else {}),
            **({"pos_epoch": [[g, sorted([j, v] for j, v in self.pos_epoch[g].items())]
                              for g in sorted(self.pos_epoch)]} if self.pos_epoch else {}),
            # Group purges, once the cluster ever had one (the next id is state).
            **({"purges": {"next": self.next_purge,
                           "rows": sorted([t, g, j, *v] for t, m in self.purges.items() for (g, j), v in m.items())}}
               if self.next_purge > 1 else {}),
        }

    def _from_json(self, doc: dict[str, Any]) -> None:
        def lay(x: list[int] | None) -> LayoutSpec | None:
            return None if x is None else LayoutSpec(*x)

        (self.clock, self.next_inode, self.next_node, self.next_target,
         self.next_group, self.next_session, self.next_gc, self.map_version) = doc["counters"]
        self.inodes = {}
        for d in doc["inodes"]:
            chunks = {c: ChunkRecord(g, n, v, crc, tuple(miss)) for c, g, n, v, crc, miss in d["chunks"]}
            self.inodes[d["id"]] = Inode(
                id=d["id"], type=d["type"], mode=d["mode"], uid=d["uid"], gid=d["gid"], mtime=d["mtime"],
                ctime=d["ctime"], nlink=d["nlink"], size=d["size"], data_version=d["dv"], parent=d["parent"],
                entries=dict(d["entries"]), layout=lay(d["layout"]), groups=list(d["groups"]), chunks=chunks,
                target=d["target"], session=d["session"])
        self.nodes = {n[0]: Node(id=n[0], uuid=n[1], hostname=n[2], data_addr=n[3], control_addr=n[4],
                                 state=n[5], last_hb=n[6], targets=list(n[7])) for n in doc["nodes"]}
        self.targets = {t[0]: Target(id=t[0], node=t[1], path=t[2], capacity=t[3], used=t[4], reported=t[5],
                                     present=t[6], down_since=t[7], up_since=t[8] if len(t) > 8 else 0,
                                     full_since=t[9] if len(t) > 9 else 0)
                        for t in doc["targets"]}
        self.groups = {g: list(m) for g, m in doc["groups"]}
        self.rebuilding = {g: set(m) for g, m in doc["rebuilding"]}
        # Keys added after format 1 was fixed: absent from older snapshots.
        self.rebuild_sources = {g: {n: o for n, o in m} for g, m in doc.get("rebuild_sources", [])}
        for n in doc.get("draining", []):
            self.nodes[n].draining = True
        for t in doc.get("removed_targets", []):
            self.targets[t].removed = True
        self.widths = set(doc["widths"])
        self.sessions = {s[0]: Session(id=s[0], inode=s[1], owner=s[2], expiry=s[3], version=s[4],
                                       uploads={(c, g) for c, g in s[5]},
                                       staged={c: ChunkRecord(g, n, v, crc, tuple(miss))
                                               for c, g, n, v, crc, miss in s[6]})
                         for s in doc["sessions"]}
        self.degraded = {(i, c) for i, n in self.inodes.items() for c, r in n.chunks.items() if r.missing}
        self.holder = {c: i for i, n in self.inodes.items() if n.type == DIR for c in n.entries.values()
                       if self.inodes[c].type != DIR}
        # GC items gained a ready time (7th field) and the dedup table an
        # activity order ("dedup" replaced "requests", sorted by client).
        self.gc = GCQueue.from_json(doc["gc"])
        if "dedup" in doc:
            self.requests = RequestTable.from_json(doc["dedup"])
            self.requests.load_prints(doc.get("dedup_prints", []))
        else:
            self.requests = RequestTable.from_json(doc["requests"], ordered=False)
        # KV pools came later still: a snapshot without them has none.
        kv = doc.get("kv", {})
        self.next_kv_pool = kv.get("next_pool", 1)
        self.kv_default_done = kv.get("default_done", False)
        self.kv_pools = {row[0]: pool_from_json(row) for row in kv.get("pools", [])}
        self.users = users_mod.users_from_json(doc.get("users", []))
        for nid, rack in doc.get("racks", []):
            self.nodes[nid].rack = rack
        reb = doc.get("rebalance", {})
        self.moving = {row[0]: (row[1], row[2], row[3]) for row in reb.get("moving", [])}
        self.moves_done = reb.get("done", 0)
        self.bytes_moved = reb.get("bytes", 0)
        self.pos_epoch = {g: {j: v for j, v in rows} for g, rows in doc.get("pos_epoch", [])}
        pur = doc.get("purges", {})
        self.next_purge = pur.get("next", 1)
        self.purges = {}
        for t, g, j, pid, ready, mv in pur.get("rows", []):
            self.purges.setdefault(t, {})[(g, j)] = (pid, ready, mv)
        # The per-group inventory is derived from the chunk records.
        for ino in sorted(self.inodes):
            f = self.inodes[ino]
            for c in sorted(f.chunks):
                self._inventory(f, c, f.chunks[c], +1)


def _check_read_loc(loc: pb.Loc, what: str) -> None:
    # Reads use the same location rules as ops on existing objects.
    check_loc(loc, entry=False, what=what)
