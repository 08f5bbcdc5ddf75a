"""The MetaService gRPC servicer (grpc.aio) on top of any Replicator.

Mutations: the request is validated here first (bad input costs no log
entry), wrapped in a :class:`tierfs.v1.MetaOp` stamped with this replica's
wall clock and the caller's client/request ids, and submitted to the
replicator; the :class:`tierfs.v1.MetaResult` that comes back is turned into
the reply or re-raised as its TierFSError. Reads wait for the replicator's
read barrier and then read the local state machine (linearizable; a follower
answers NotLeaderError with the leader's address).

Every replica also answers, locally and without a leader, ``GetStatus``
(with the Raft internals when the replicator is Raft), ``Digest`` and
``ForceSnapshot``; the leader answers ``AddMetaMember``/``RemoveMetaMember``.
These work whatever the state machine (also the toy ``kv`` one of the tests).

While this replica leads, a background task submits a Tick op every
``tick_interval`` seconds: it expires storage nodes that missed heartbeats for
``heartbeat_timeout`` and write sessions whose lease ran out, and (if
``replace_after`` > 0) swaps targets down for that long out of their
placement groups. The replacements (for those, and for ``RemoveTarget`` and
``DrainNode``) are chosen here, in a worker thread
(:mod:`tierfs.meta.replace`), and sent inside the op; apply only checks them.

Bounded work: a request is checked against the caps of
:mod:`tierfs.meta.ops` (lists, strings, page limits, and the whole op at
``MAX_OP_BYTES``) before it is submitted or read, so an oversized one costs
no log entry; unknown fields are dropped rather than logged. Every op carries
``gc_grace`` (``MetaOp.gc_grace_ms``): what it queues for GC is listed only
that long after, judged by :meth:`MetaServicer.now_ns` on the leader.

Time: :meth:`MetaServicer.now_ns` is the one source of the time stamped into
ops. It continues the state clock at the leader's monotonic rate from the
moment this replica became leader, so neither a leader whose wall clock
jumped ahead nor the return to a correct leader afterwards can freeze lease
expiry or failure detection (docs/meta.md, "Time").

Heartbeats are not log entries: the leader remembers when it last heard
from each storage node (and its latest usage report) in memory and commits a
``Heartbeat`` op only when it changes replicated state (a node back online,
a target's state or capacity, or usage not written for ``usage_interval``).
Failure detection uses that memory; a new leader gives every node
``NEW_LEADER_GRACE`` x ``heartbeat_timeout`` from its start as leader to be
heard from (the daemons must find it first). The KV usage a heartbeat
carries (per pool and target) lives only in that memory: ``ListKVPools``
answers it, and the logged Heartbeat op is stripped of it.

Data-plane capabilities (docs/security-caps.md): with a ``cluster_secret``
the servicer mints them into its replies (a read capability into FileInfo
when the caller may read the file, a write capability into OpenWrite and
RenewLease replies, KV ones by ``GetKVCapability``) and hands storage
daemons the keys of the epochs around now in RegisterNode and Heartbeat
replies. Minting happens here, never in the state machine's apply.

Authentication: :func:`add_meta_service` registers every MetaService
method behind an auth layer (:class:`_Guarded`, built from the service
descriptor): the call's ``authorization: Bearer`` token becomes an Identity
(:mod:`tierfs.meta.auth`), the method is checked against who may call it,
and ``tierfs.security.current_identity`` holds the caller while the handler
runs; :meth:`MetaServicer._op` stamps it into ``MetaOp.caller``. Without an
``auth`` (security off) every caller is ANONYMOUS. User tokens are made
here (AddUser, IssueToken): only their hash goes into the op.

Placement (docs/rebalance.md): the heavy placement code never runs inside
apply. The servicer's :class:`tierfs.meta.rebalance.Rebalancer` computes new
groups and rebalance moves from the leader's state and commits the result
(``AddGroups``, ``RebalanceMoves``); RegisterNode, a Heartbeat that brings
targets back, SetLayout and a Create of a new width wait for the groups
before they reply, so the cluster behaves as when apply planned them.

KV pools: ``CreateKVPool``/``RemoveKVPool`` are ops like any other. The
leader stamps its ``kv_default_pool`` request (None: no default pool) on
every RegisterNode op; the state machine makes the ``default`` pool from the
first one that finds the cluster with targets. The pools' groups are
planned here too (:class:`tierfs.meta.kvplan.KVPlanner`): every op is
stamped ``kv_planned`` (apply does not re-plan the pools), and after an op
that bumped the map the servicer commits the groups that changed
(``KVGroups``) before it replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from prometheus_client import Counter, Gauge, Histogram

from tierfs import capability as capmod
from tierfs.errors import (
    ERROR_CODE_KEY,
    AlreadyExistsError,
    BusyError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    NotLeaderError,
    SessionExpiredError,
    TierFSError,
    TimeoutError_,
    UnauthenticatedError,
    UnsupportedError,
    abort,
    error_from_code,
    grpc_errors,
)
from tierfs.meta.auth import Authenticator, check_allowed, token_from_metadata
from tierfs.meta.interfaces import Replicator
from tierfs.meta.kvplan import KVPlanner
from tierfs.meta.kvpools import DEFAULT_POOL_REQUEST
from tierfs.meta.ops import (
    MAX_BATCH_ITEMS,
    MAX_GC_GRACE,
    MAX_OFFLINE_PER_TICK,
    cap,
    check_addr,
    check_caps,
    check_kv_budget_floor,
    check_op_size,
    validate_op,
)
from tierfs.meta.perms import caller_pb, squash
from tierfs.meta.rebalance import Rebalancer
from tierfs.meta.replace import plan_replacements, replace_input, replacements_pb
from tierfs.meta.state import MAX_CLOCK_STEP_NS, OP_FORMAT, MetaStateMachine
from tierfs.meta.wire import BATCH_RPCS, CLIENT_ID_KEY, FORWARDED_KEY, LEADER_KEY, REQUEST_ID_KEY
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.proto.v1 import meta_pb2_grpc
from tierfs.security import (
    ANONYMOUS,
    USER_NAME_RE,
    Identity,
    current_identity,
    hash_token,
    new_user_token,
)
from tierfs.tls import TlsFiles, TlsStamp, grpc_channel

__all__ = ["BATCH_RPCS", "CLIENT_ID_KEY", "DEFAULT_GC_GRACE", "FORWARDED_KEY", "LEADER_KEY", "MAX_REQUEST_BYTES",
           "REQUEST_ID_KEY", "MetaServicer", "add_meta_service", "error_result"]

log = logging.getLogger("tierfs.meta.service")

#: The caller's metadata a follower passes on when it forwards.
_FORWARD_MD = ("authorization", CLIENT_ID_KEY, REQUEST_ID_KEY)
#: Fragments of replaced chunk versions stay readable this long (seconds).
DEFAULT_GC_GRACE = 300.0
#: A write capability lives for its session's lease and this much more
#: (seconds): room for the clocks of meta and the storage daemons to differ.
WRITE_CAP_SLACK = 60.0
#: A new leader waits this many heartbeat timeouts from its start for a node
#: it has not heard from yet before calling it offline: every daemon must
#: find the new leader first (a failed call's backoff, the channel's
#: reconnect, the next beat). With one timeout, a whole-meta restart on a
#: busy machine marked nodes offline that were beating all along.
NEW_LEADER_GRACE = 2
#: KV map leases: meta counts a lease as running this much longer than the
#: node does (a relative clock-rate difference, and a fixed margin for a
#: check that ran just before the lease ended and its reply).
LEASE_DRIFT = 0.01
#: The longest a GetClusterMap call may wait for a change (``wait_ms``).
MAX_MAP_WAIT_MS = 5000
#: How long a whole cluster map built for a map version is answered again
#: (MetaServicer.cluster_map): its usage figures and heartbeat times are at
#: most this old.
MAP_MEMO_S = 1.0
#: The longest KV map lease, as a share of ``heartbeat_timeout``.
KV_LEASE_OF_TIMEOUT = 1.0
LEASE_MARGIN_NS = 100_000_000
#: gRPC refuses a request larger than this before decoding it (set it as the
#: server's ``grpc.max_receive_message_length``); requests below it are
#: checked against the finer caps of tierfs.meta.ops.
MAX_REQUEST_BYTES = 2 << 20

_R = TypeVar("_R", bound=Message)
Ctx = grpc.aio.ServicerContext[Any, Any]




def error_result(err: TierFSError) -> pb.MetaResult:
    """``err`` as a Batch item's result (a NotLeaderError keeps its leader)."""
    res = pb.MetaResult()
    res.error.code = err.code  # type: ignore[assignment]
    res.error.message = err.message
    if isinstance(err, NotLeaderError):
        res.error.leader = err.leader
    return res


def _ids(context: Ctx) -> tuple[str, int]:
    client, req = "", 0
    for item in context.invocation_metadata() or ():
        k, v = item[0], item[1]
        if k == CLIENT_ID_KEY:
            client = str(v)
        elif k == REQUEST_ID_KEY:
            with contextlib.suppress(ValueError):
                req = int(v)
    return client, req


class MetaServicer(meta_pb2_grpc.MetaServiceServicer):
    def __init__(
        self,
        replicator: Replicator,
        *,
        heartbeat_timeout: float = 10.0,
        lease_duration: float = 30.0,
        tick_interval: float = 1.0,
        submit_timeout: float = 5.0,
        replace_after: float = 0.0,
        gc_grace: float = DEFAULT_GC_GRACE,
        purge_grace: float = 30.0,
        usage_interval: float = 30.0,
        kv_default_pool: pb.CreateKVPoolRequest | None = DEFAULT_POOL_REQUEST,
        root_squash: bool = True,
        clock: Callable[[], int] = time.time_ns,
        monotonic: Callable[[], int] | None = None,
        cluster_secret: bytes | None = None,
        cap_key_rotation: float = 3600.0,
        file_cap_ttl: float = 600.0,
        kv_cap_ttl: float = 300.0,
        cap_clock: Callable[[], int] = time.time_ns,
        auth: Authenticator | None = None,
        forward: bool = True,
        forward_wait: float = 2.0,
        peer_tls: TlsFiles | None = None,
        rebalance: bool = True,
        rebalance_interval: float = 5.0,
        rebalance_max_moving: int = 4,
        rebalance_write_defer: float = 30.0,
        rebalance_redirect_after: float = 10.0,
        accepted_secrets: Sequence[bytes] = (),
        kv_lease: float = 5.0,
    ) -> None:
        """``cluster_secret``: the root of the data-plane capability keys
        (None: no capabilities are minted and no keys handed out, so storage
        daemons check none). ``accepted_secrets``: secrets being rotated in
        or out (docs/security.md): storage daemons get their keys too (before
        the current ones), so capabilities other replicas sign with them
        pass; this replica signs with ``cluster_secret`` only. ``cap_clock`` (wall ns) dates capabilities: the
        daemons compare expiries with their own wall clocks.

        ``clock`` is the wall clock (ns) used only to anchor time when this
        replica starts leading; ``monotonic`` (ns) measures time from there
        (default ``time.monotonic_ns``, or ``clock`` itself when a custom
        ``clock`` is given, so a test's fake clock drives both). ``auth``:
        check every call's token (:mod:`tierfs.meta.auth`); None is security
        off, every caller anonymous root.

        ``forward``: a follower forwards every leader call to the leader
        (:meth:`forward`) instead of answering NotLeaderError;
        ``forward_wait``: how long it holds a call while no leader is known
        (an election); ``peer_tls``: the TLS files it dials the leader with
        (its own certificate and CA; None: plaintext).

        ``kv_lease``: how long a storage node may act on stamped KV requests
        after a heartbeat that found its map current (docs/kv.md, "Map
        leases"; 0: no leases, the behaviour before them), at most
        KV_LEASE_OF_TIMEOUT x ``heartbeat_timeout``."""
        if not 0 <= kv_lease <= 60:
            raise ValueError(f"kv_lease {kv_lease} must be between 0 and 60 seconds")
        if not 0 <= gc_grace <= MAX_GC_GRACE:
            raise ValueError(f"gc_grace {gc_grace} must be between 0 and {MAX_GC_GRACE:.0f} seconds")
        self._r = replicator
        self.heartbeat_timeout = heartbeat_timeout
        self.lease_duration = lease_duration
        self.tick_interval = tick_interval
        self.submit_timeout = submit_timeout
        self.replace_after = replace_after
        # (map version, targets down) of the last tick that found nothing to
        # replace: the next ticks skip planning until one of them changes.
        self._replace_idle: tuple[int, tuple[int, ...]] = (-1, ())
        self._held_logged: frozenset[tuple[int, int]] = frozenset()
        self.gc_grace = gc_grace
        # Group purges wait this long, never longer than GC would.
        self.purge_grace = max(0.0, min(purge_grace, gc_grace))
        self.usage_interval = usage_interval
        self.kv_default_pool = kv_default_pool
        self.root_squash = root_squash
        self._clock = clock
        if cluster_secret is not None and not 0 < max(file_cap_ttl, kv_cap_ttl) <= cap_key_rotation:
            raise ValueError(f"capability lifetimes ({file_cap_ttl}, {kv_cap_ttl} s) must be positive and at most "
                             f"cap_key_rotation ({cap_key_rotation} s)")
        self._secret = cluster_secret
        self._accepted_secrets = list(accepted_secrets) if cluster_secret is not None else []
        self.cap_key_rotation = cap_key_rotation
        self.file_cap_ttl = file_cap_ttl
        self.kv_cap_ttl = kv_cap_ttl
        self._cap_clock = cap_clock
        self._cap_keys: dict[int, bytes] = {}
        self._cap_epoch = -1  # the epoch _cap_keys was made for
        self._mono = monotonic or (time.monotonic_ns if clock is time.time_ns else clock)
        self._ticker: asyncio.Task[None] | None = None
        self.auth = auth
        self.forward_enabled = forward
        self.forward_wait = forward_wait
        self._peer_tls = peer_tls
        self._peer_stubs: dict[str, tuple[grpc.aio.Channel, Any]] = {}
        self._peer_tls_stamp = TlsStamp(peer_tls)
        #: channels dropped after a failed forward, closing once their calls end
        self._peer_closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        # Per leadership (reset whenever this replica starts leading a term):
        self._lead_term: int | None = None
        self._lead_since = 0  # monotonic ns
        self._anchor: tuple[int, int] | None = None  # (op time ns, monotonic ns)
        self._hb_seen: dict[int, int] = {}  # node id -> monotonic ns of its last heartbeat
        self._hb_used: dict[int, dict[int, int]] = {}  # node id -> {target: used} last reported
        self._hb_free: dict[int, dict[int, int]] = {}  # node id -> {target: file system free} last reported
        self._usage_logged: dict[int, int] = {}  # node id -> monotonic ns usage was last committed
        # node id -> {(pool id, target id): latest KV usage reported}
        self._kv_used: dict[int, dict[tuple[int, int], pb.KVTargetUsage]] = {}
        # No longer than the time a silent node takes to go offline, so a dead
        # node's lease has run out (but for the margin) by the re-plan that
        # moves its keys.
        self.kv_lease = min(kv_lease, KV_LEASE_OF_TIMEOUT * heartbeat_timeout) if heartbeat_timeout else kv_lease
        # KV map leases (docs/kv.md, "Map leases"), per leadership: node id ->
        # monotonic ns of the latest lease this leader granted it, and the map
        # version it last reported applying.
        self._kv_granted: dict[int, int] = {}
        self._kv_applied: dict[int, int] = {}
        self._kv_told: dict[int, int] = {}  # node id -> map version of this leader's last answer
        # kv_published, kept while nothing can lower it: (key, value) where
        # the key is (map version, _lead_since, nodes, _kv_lagging), and
        # _kv_lagging counts heartbeats that reported a map older than the
        # current one (only those can lower it; time only raises it).
        self._kv_pub_memo: tuple[tuple[int, int, int, int], int] | None = None
        # cluster_map: ((state, map version, leading), monotonic s, map)
        self._map_memo: tuple[tuple[int, int, bool], float, pb.ClusterMap] | None = None
        self._kv_lagging = 0
        # GetClusterMap calls waiting for a change (wait_ms): set, and
        # replaced, when a commit here moves the map past _map_notified.
        self._map_event = asyncio.Event()
        self._map_notified = -1
        self.rebalancer = Rebalancer(lambda: self.state, self._background_op, self._leadership,
                                     enabled=rebalance, interval=rebalance_interval,
                                     max_moving=rebalance_max_moving, write_defer=rebalance_write_defer,
                                     redirect_after=rebalance_redirect_after,
                                     unreported=self._unreported_targets, free=self._targets_free)
        self.kv_planner = KVPlanner(lambda: self.state, self._background_op, self._leadership,
                                    interval=rebalance_interval, replace_after=replace_after)

    async def _background_op(self, kind: str, req: object, reply_cls: type) -> object:
        """Commit an op the leader made itself (placement work)."""
        assert isinstance(req, Message)
        return await self.submit(self._op(kind, req), reply_cls)

    # ---- plumbing -----------------------------------------------------------

    @property
    def state(self) -> MetaStateMachine:
        sm = self._r.state_machine
        if not isinstance(sm, MetaStateMachine):
            # tierfs-meta --state-machine kv: only the replica RPCs work.
            raise UnsupportedError(f"this replica runs {type(sm).__name__}, not the namespace "
                                   "(state_machine = 'meta'); only status, digest, snapshot and "
                                   "membership calls are served")
        return sm

    def _leadership(self) -> bool:
        """Whether this replica leads; on the first call of a new term as
        leader, reset what belongs to one leadership (time anchor, heartbeat
        memory: every known node gets NEW_LEADER_GRACE x heartbeat_timeout
        from now to be heard from)."""
        st = self._r.status()
        if st.role not in ("leader", "standalone"):
            self._lead_term = None
            return False
        if st.term != self._lead_term:
            self._lead_term = st.term
            self._lead_since = self._mono()
            self._anchor = None
            self._hb_seen.clear()
            self._hb_used.clear()
            self._hb_free.clear()
            self._usage_logged.clear()
            self._kv_used.clear()
            self._kv_granted.clear()
            self._kv_applied.clear()
            self._kv_told.clear()
        return True

    def now_ns(self) -> int:
        """The time to stamp into an op (and to compare state times with).

        It continues the state clock at this replica's monotonic rate from
        when it started leading, so a wall clock that jumps (here or on an
        earlier leader) cannot stop time: anchored at the state clock, or at
        the wall clock where that is ahead - but at most MAX_CLOCK_STEP_NS
        ahead (a clock a day fast moves state time by at most that), or as is
        for a fresh state. If the state moves past it (entries of an earlier
        leader still being applied), time continues from the state."""
        self._leadership()
        sm = self._r.state_machine
        state_clock = sm.clock if isinstance(sm, MetaStateMachine) else 0
        mono = self._mono()
        if self._anchor is None:
            wall = self._clock()
            base = wall if not state_clock else max(state_clock, min(wall, state_clock + MAX_CLOCK_STEP_NS))
            self._anchor = (base, mono)
        now = self._anchor[0] + (mono - self._anchor[1])
        if now < state_clock:
            self._anchor = (state_clock, mono)
            now = state_clock
        return now

    def identity(self) -> Identity:
        """Who the request being handled runs as, for permissions: the
        authenticated caller (``current_identity``), root-squashed as this
        replica is configured. Ops carry it (``MetaOp.caller``), so the
        squash of the leader that stamped an op holds on every replica."""
        return squash(current_identity.get(), self.root_squash)

    def authenticate(self, method: str, context: Ctx) -> Identity:
        """The caller of ``method`` (UnauthenticatedError, or
        PermissionDeniedError when it may not call it); ANONYMOUS with
        security off."""
        if self.auth is None:
            return ANONYMOUS
        token = token_from_metadata(context.invocation_metadata())
        sm = self._r.state_machine
        users = sm.users if isinstance(sm, MetaStateMachine) else {}
        try:
            ident = self.auth.identify(token, users, lambda: self.now_ns() if self._leading() else self._clock())
        except UnauthenticatedError:
            # A follower may not have applied a user (or token) the leader
            # just made: send leader work there rather than refuse it here.
            # The leader decides; replica-local calls are decided here.
            if method not in _LOCAL_RPCS and token.startswith("tfu1.") and not self._leading():
                leader = self._r.status().leader
                if leader:
                    raise NotLeaderError(leader=leader) from None
            raise
        check_allowed(method, ident)
        return ident

    def _op(self, kind: str, req: Message, client: str = "", request_id: int = 0) -> pb.MetaOp:
        # Field caps first (the clearer error), then the whole request as it
        # came, unknown fields included.
        check_caps(req, kind)
        check_op_size(req.ByteSize(), kind)
        op = pb.MetaOp(now_ns=self.now_ns(), client_id=client, request_id=request_id,
                       lease_ms=int(self.lease_duration * 1000), gc_grace_ms=int(self.gc_grace * 1000),
                       purge_grace_ms=int(self.purge_grace * 1000))
        getattr(op, kind).CopyFrom(req)
        # Who the leader authenticated (set by the auth layer for this call),
        # root-squashed, never the request. Absent = root: security off (and
        # the periodic tick, which runs as ANONYMOUS) logs what it always did.
        ident = self.identity()
        if ident != ANONYMOUS:
            op.caller.CopyFrom(caller_pb(ident))
        op.kv_planned = True  # this leader plans KV pool groups itself (tierfs.meta.kvplan)
        op.min_format = OP_FORMAT  # older replicas stop rather than apply it their way
        if kind == "register_node" and self.kv_default_pool is not None:
            op.kv_default_pool.CopyFrom(self.kv_default_pool)
        op.DiscardUnknownFields()  # what this version does not know does not go into the log
        return op

    async def submit_result(self, op: pb.MetaOp) -> pb.MetaResult:
        """Validate, replicate and apply ``op``; the state machine's result.
        When the op bumped the map, the KV pools' groups are fitted to it
        (a KVGroups op, tierfs.meta.kvplan) before this returns."""
        version = self.state.map_version  # refuse before logging an op that another state machine cannot read
        validate_op(op)
        kind = str(op.WhichOneof("body"))
        data = op.SerializeToString(deterministic=True)
        check_op_size(len(data), kind)
        res = pb.MetaResult.FromString(await self._r.submit(data, self.submit_timeout))
        if not res.error.code and kind != "kv_groups" and op.kv_planned and self.state.map_version != version:
            try:
                await self.kv_planner.settle()
            except TierFSError as err:  # the op is done; the planner's loop retries
                log.debug("kv pool planning after %s failed: %s", kind, err)
        self._map_changed()  # wake the storage daemons watching the map
        return res

    async def submit(self, op: pb.MetaOp, reply_cls: type[_R]) -> _R:
        """Validate, replicate and apply ``op``; its reply or its error."""
        res = await self.submit_result(op)
        if res.error.code:
            raise error_from_code(res.error.code, res.error.message, leader=res.error.leader)
        return reply_cls.FromString(res.reply)

    async def _mutate(self, context: Ctx, kind: str, req: Message, reply_cls: type[_R]) -> _R:
        client, rid = _ids(context)
        return await self.submit(self._op(kind, req, client, rid), reply_cls)

    async def _read(self, request: Message) -> MetaStateMachine:
        """The state, once the read barrier passed; ``request`` is checked
        against the caps first (nothing is read for an oversized one)."""
        check_caps(request, request.DESCRIPTOR.name)
        check_op_size(request.ByteSize(), request.DESCRIPTOR.name)
        await self._r.read_barrier(self.submit_timeout)
        return self.state

    # ---- forwarding to the leader (docs/meta.md, "Followers forward") ----------

    def _is_leader(self) -> bool:
        fn = getattr(self._r, "is_leader", None)  # RaftReplicator; LocalReplicator always leads
        return True if fn is None else bool(fn())

    def should_forward(self, method: str, context: Ctx) -> bool:
        """Whether this call goes to the leader instead of being answered
        here: a leader call on a follower, not already forwarded once."""
        if not self.forward_enabled or method not in _FORWARDABLE or self._is_leader():
            return False
        return not any(item[0] == FORWARDED_KEY for item in context.invocation_metadata() or ())

    def _forward_addr(self) -> str:
        fn = getattr(self._r, "forward_addr", None)
        return str(fn()) if fn is not None else self._r.status().leader

    def _peer(self, addr: str) -> tuple[grpc.aio.Channel, Any]:
        if self._peer_tls_stamp.changed():
            for peer, (ch, _) in list(self._peer_stubs.items()):  # renewed TLS files: new channels
                self._drop_peer(peer, ch)
        entry = self._peer_stubs.get(addr)
        if entry is None:
            ch = grpc_channel(addr, self._peer_tls, options=[("grpc.enable_retries", 0),
                                                             ("grpc.max_send_message_length", MAX_REQUEST_BYTES)])
            entry = self._peer_stubs[addr] = (ch, meta_pb2_grpc.MetaServiceStub(ch))
        return entry

    def _drop_peer(self, addr: str, ch: grpc.aio.Channel) -> None:
        """Forget the channel to a peer that did not answer: the next call
        dials afresh (gRPC would wait out its reconnect backoff, up to
        minutes, once the address answers again). It is closed in the
        background, with a grace: other calls held for the same leader may
        still be on it, and closing with no grace cancels them - their
        handlers died with CancelledError and their callers got no answer
        until their own deadline (a 1 s stall in the failover benchmark)."""
        entry = self._peer_stubs.get(addr)
        if entry is None or entry[0] is not ch:
            return  # another call dropped it already
        del self._peer_stubs[addr]
        task = asyncio.get_running_loop().create_task(ch.close(2 * self.submit_timeout))
        self._peer_closing[task] = ch
        task.add_done_callback(lambda t: self._peer_closing.pop(t, None))

    async def close_peers(self) -> None:
        peers, self._peer_stubs = self._peer_stubs, {}
        for ch, _ in peers.values():
            await ch.close(None)
        closing, self._peer_closing = self._peer_closing, {}
        for task, ch in closing.items():
            task.cancel()
            await ch.close(None)

    async def forward(self, method: str, request: Message, context: Ctx) -> Message | None:
        """Forward one call to the leader and return its reply unchanged (a
        failure is passed on with the leader's status, message and trailing
        metadata). The caller's own metadata goes along (its token: the
        leader authenticates it again; its client and request ids: a retry
        of the same call is deduplicated there), with the caller's deadline.

        While no leader is known, or the leader this replica knows does not
        answer (it died; an election is under way), the call is held up to
        ``forward_wait`` for the next leader and then sent there, which makes
        a failover cost the client no retry round. Returns None when this
        replica itself became the leader meanwhile (answer it here)."""
        left = context.time_remaining()
        # Keep some of the caller's time to answer in: a forward that gets
        # no answer is reported with the leader's address, which the caller
        # must receive before its own deadline to use.
        end = time.monotonic() + (left - max(0.05, min(0.5, left * 0.2)) if left is not None
                                  else 2 * self.submit_timeout)
        hold = min(end, time.monotonic() + self.forward_wait)
        md = tuple((str(k), v) for k, v in (context.invocation_metadata() or ()) if k in _FORWARD_MD)
        md += ((FORWARDED_KEY, getattr(self._r, "grpc_addr", "") or "follower"),)
        failed: set[str] = set()
        last = ""
        while True:
            addr = self._forward_addr()
            while not addr or addr in failed:
                if self._is_leader():
                    return None
                if time.monotonic() >= hold:
                    hint = self._r.status().leader
                    msg = f"not the leader, and the leader {hint} does not answer from here ({last})" \
                        if hint and last else ""
                    raise NotLeaderError(msg, leader=hint)
                await asyncio.sleep(0.01)
                addr = self._forward_addr()
            timeout = end - time.monotonic()
            if timeout <= 0:
                raise TimeoutError_(f"{method}: no time left to forward to the leader {addr}")
            ch, stub = self._peer(addr)
            call = getattr(stub, method)(request, timeout=timeout, metadata=md)
            try:
                reply: Message = await call
            except grpc.RpcError as exc:
                raw: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
                trailing: tuple[tuple[str, str | bytes], ...] = tuple((str(item[0]), item[1]) for item in raw or ())
                if any(k == ERROR_CODE_KEY for k, _ in trailing):
                    # The leader's answer (an error of the call itself): as it came.
                    await context.abort(exc.code(), exc.details() or "", trailing_metadata=trailing)
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # A slow leader, or one cut off from here that the caller
                    # may still reach (a partial partition; the connection
                    # stalls rather than fails). Name it: the client retries
                    # there with the same request id, deduplicated if this
                    # one did apply. The next forward dials afresh.
                    self._drop_peer(addr, ch)
                    raise NotLeaderError(f"{method} forwarded to the leader {addr}: no answer in time "
                                         "(outcome unknown; ask it directly, with the same request id)",
                                         leader=addr) from None
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    await context.abort(exc.code(), exc.details() or "", trailing_metadata=trailing)
                # Not reachable (dead, or cut off from here): wait for another
                # leader. A resend is safe: the same request id is deduplicated.
                failed.add(addr)
                last = f"{exc.code().name}: {exc.details()}"
                self._drop_peer(addr, ch)
                continue
            hint = self._r.status().leader
            if hint:
                context.set_trailing_metadata(((LEADER_KEY, hint),))
            FORWARDED.labels(method).inc()
            return reply

    # ---- data-plane capabilities (docs/security-caps.md) ---------------------
    #
    # Minted here, on the replica that answers, never in the state machine:
    # apply must stay deterministic, and a capability is a reply, not state.

    def _epoch_key(self) -> tuple[int, bytes, int]:
        """(epoch, its key, now in ms) for minting."""
        assert self._secret is not None
        now_ms = self._cap_clock() // 1_000_000
        epoch = capmod.epoch_at(now_ms, self.cap_key_rotation)
        if epoch != self._cap_epoch:
            self._cap_keys = capmod.keys_around(self._secret, epoch)
            self._cap_epoch = epoch
        return epoch, self._cap_keys[epoch], now_ms

    def cap_keys(self) -> list[pb.CapabilityKey]:
        """What storage daemons get in RegisterNodeReply/HeartbeatReply:
        the keys of epochs e-1, e and e+1 (none without a cluster secret)."""
        if self._secret is None:
            return []
        epoch, _, _ = self._epoch_key()
        # The accepted secrets' keys first: a daemon keeps the last key it
        # gets for an epoch as the one it signs with (and a daemon of an
        # older version keeps only that one).
        out = [pb.CapabilityKey(epoch=e, key=k) for s in self._accepted_secrets
               for e, k in sorted(capmod.keys_around(s, epoch).items())]
        return out + [pb.CapabilityKey(epoch=e, key=k) for e, k in sorted(self._cap_keys.items())]

    def _mint(self, kind: int, ops: int, scope: int, principal: int, ttl: float) -> bytes:
        epoch, key, now_ms = self._epoch_key()
        return capmod.encode(capmod.mint(key, kind=kind, ops=ops, epoch=epoch, scope=scope, principal=principal,
                                         expiry_ms=now_ms + int(ttl * 1000)))

    def _with_read_cap(self, info: pb.FileInfo) -> pb.FileInfo:
        """``info`` with a read capability when it is a file the caller may read."""
        a = info.attr
        if self._secret is None or a.type != pb.INODE_TYPE_FILE:
            return info
        ident = self.identity()
        if self.state.may_read(ident, a.inode):
            info.capability = self._mint(capmod.KIND_FILE, capmod.OP_READ, a.inode, ident.uid, self.file_cap_ttl)
        return info

    def _write_cap(self, session_id: int) -> bytes:
        """A write capability for write session ``session_id``'s inode, when
        the session is live and the caller may write through it now (none
        otherwise: a reply the retry table answered for a repeated request
        id mints nothing by itself)."""
        if self._secret is None:
            return b""
        ident = self.identity()
        sm = self.state
        inode = sm.may_write_session(ident, session_id)
        if inode is None:
            return b""
        s = sm.sessions[session_id]
        # For this session's fragments only, and for its lease and a minute
        # more (a minute of clock difference between meta and the daemons),
        # not file_cap_ttl: its holder writes nothing once the session has
        # ended. The writer renews it with the lease. Until stop 48 it
        # covered the whole inode for file_cap_ttl (600 s): its holder could
        # overwrite or delete the committed fragments of other sessions after
        # this one ended and after its write permission was taken away.
        ttl = min(self.file_cap_ttl, max(0.0, (s.expiry - sm.clock) / 1e9) + WRITE_CAP_SLACK)
        return self._mint(capmod.KIND_FILE, capmod.OP_WRITE, inode, capmod.write_principal(ident.uid, s.version), ttl)

    def kv_capability(self, pool_name: str) -> pb.GetKVCapabilityReply:
        """A KV capability (read + write) for the caller's tenant of a pool."""
        sm = self.state
        pool = next((p for p in sm.kv_pools.values() if p.name == pool_name), None)
        if pool is None:
            raise NotFoundError(f"no KV pool {pool_name!r}")
        ident = self.identity()
        tenant = capmod.tenant_of(ident.uid, ident.gid, pool.tenant)
        reply = pb.GetKVCapabilityReply(pool_id=pool.id, tenant=tenant)
        if self._secret is not None:
            raw = self._mint(capmod.KIND_KV, capmod.OP_READ | capmod.OP_WRITE, pool.id, tenant, self.kv_cap_ttl)
            reply.capability = raw
            reply.expiry_ms = capmod.decode(raw).expiry_ms
        return reply

    # ---- the periodic tick --------------------------------------------------

    def _leading(self) -> bool:
        return self._leadership()

    def silent_nodes(self) -> list[int]:
        """Online nodes this leader has not heard from for heartbeat_timeout,
        or, if not at all yet, for NEW_LEADER_GRACE x heartbeat_timeout from
        its start as leader."""
        if not self.heartbeat_timeout or not self._leadership():
            return []
        timeout = int(self.heartbeat_timeout * 1e9)
        now = self._mono()
        limit = now - timeout
        # Not heard from yet in this leadership: twice the timeout from its
        # start, since a daemon must first find the new leader (docs/meta.md).
        first = now - NEW_LEADER_GRACE * timeout
        return [n.id for _, n in sorted(self.state.nodes.items())
                if n.state == pb.NODE_STATE_ONLINE
                and (self._hb_seen[n.id] < limit if n.id in self._hb_seen else self._lead_since < first)]

    async def tick(self, force: bool = False) -> bool:
        """Submit one Tick op (expire silent nodes and leases, replace
        long-down targets) unless the local state says it would change
        nothing (``force`` submits anyway). Only meaningful on the leader,
        whose state is current. Returns whether it submitted."""
        req = pb.TickRequest(replace_after_ms=int(self.replace_after * 1000), offline_nodes=self.silent_nodes()[:MAX_OFFLINE_PER_TICK])
        req.replaced.planned = True  # apply never plans replacements itself for this leader's ticks
        op = self._op("tick", req)
        if req.replace_after_ms:
            down = self.state.down_for(op.now_ns, req.replace_after_ms)
            key = (self.state.map_version, tuple(down))
            if down and key != self._replace_idle:
                rep = await self._plan_replacements(down, [], hold=True)
                if rep.moves:
                    op.tick.replaced.CopyFrom(rep)
                else:
                    self._replace_idle = key  # nothing to do until the map or the down set changes
        if not force and not req.offline_nodes and not op.tick.replaced.moves \
                and not self.state.tick_due(op.now_ns, 0, 0):
            return False
        await self.submit(op, pb.Empty)
        return True

    async def heartbeat(self, req: pb.HeartbeatRequest, client: str = "", request_id: int = 0) -> pb.HeartbeatReply:
        """A storage node's heartbeat: remembered here; a log entry only when
        it changes replicated state (see the module docstring)."""
        sm = self.state
        if not self._leadership():
            raise NotLeaderError(leader=self._r.status().leader)
        op = self._op("heartbeat", req, client, request_id)
        validate_op(op)
        del op.heartbeat.kv_usage[:]  # leader memory only (below), never the log
        for rep in op.heartbeat.targets:
            rep.free = 0  # the same
        node = sm.nodes.get(req.node_id)
        mono = self._mono()
        if node is None or self._heartbeat_changes(sm, req, mono):
            # Unknown nodes and foreign targets are refused by apply, with
            # its messages; everything else is a state change to commit.
            before = set(sm.eligible_targets())
            reply = await self.submit(op, pb.HeartbeatReply)
            self._usage_logged[req.node_id] = mono
            if set(sm.eligible_targets()) - before:
                await self.rebalancer.top_up()  # targets back online get their groups
                self.rebalancer.trigger()
        else:
            if req.kv_leases and self.kv_lease:
                # A lease must come from a leader that still leads after the
                # heartbeat was sent (a deposed one, paused and resumed, would
                # grant it on its own stale map); a committed op proves it too.
                await self._r.read_barrier(self.submit_timeout)
            reply = pb.HeartbeatReply(map_version=sm.map_version, state=node.state)  # type: ignore[arg-type]
        self._hb_seen[req.node_id] = mono
        if req.kv_leases and self.kv_lease and sm.nodes.get(req.node_id) is not None:
            if req.kv_map_version < sm.map_version:
                self._kv_lagging += 1  # may lower kv_published: computed again
            self._kv_applied[req.node_id] = req.kv_map_version
            if req.kv_map_version >= self._kv_told.get(req.node_id, 0):
                # A lease only to a node that applied the map this leader's
                # previous answer named: one that cannot fetch maps holds
                # changes back for one lease, not for as long as it beats.
                self._kv_granted[req.node_id] = self._mono()
                reply.kv_lease_granted = True
            self._kv_told[req.node_id] = reply.map_version
            reply.kv_lease_ms = int(self.kv_lease * 1000)
        reply.kv_published = self.kv_published(sm)
        KV_MAP_VERSION.set(sm.map_version)
        KV_PUBLISHED.set(reply.kv_published)
        first = req.node_id not in self._hb_used
        self._hb_used[req.node_id] = {t.target_id: t.used for t in req.targets}
        self._hb_free[req.node_id] = {t.target_id: t.free for t in req.targets if t.free}
        if first and node is not None and set(node.targets) & set(sm.eligible_targets()):
            # Its targets were left out of the rebalancer's rounds until now
            # (_unreported_targets): a round at once, not at the next interval.
            self.rebalancer.wake()
        self._remember_kv_usage(sm, req)
        reply.cap_keys.extend(self.cap_keys())
        return reply

    def _targets_free(self) -> dict[int, int]:
        """Free bytes per target as the nodes last reported (for the rebalancer)."""
        return {t: free for per_node in self._hb_free.values() for t, free in per_node.items()}

    def _unreported_targets(self, sm: MetaStateMachine) -> set[int]:
        """Targets whose node has not heartbeated to this leader since it
        registered (or since this leader took over): their state is not
        known yet (for the rebalancer)."""
        return {t.id for t in sm.targets.values() if t.node not in self._hb_used}

    def kv_published(self, sm: MetaStateMachine) -> int:
        """The latest map version no storage node can still act against on
        an older map (docs/kv.md, "Map leases"): the current one, or, while
        a node whose lease is running has not reported applying it, the
        oldest such node's map. A node this leader has not heard from counts
        as leased for a lease from when it started leading (an earlier
        leader's grants came before that). Nodes without leases (releases
        before them, or ``kv_lease`` 0) are not waited for."""
        v = sm.map_version
        if not self.kv_lease or not self._leadership():
            return v if not self.kv_lease else 0
        # O(nodes) below, and every heartbeat asks: at 1,000 nodes beating
        # once a second that was a fifth of the leader's loop. Once every
        # node has applied the current map the answer is that map until the
        # map moves, a node joins or leaves, leadership changes or a node
        # reports an older map (the key); the lease clock only raises it.
        key = (v, self._lead_since, len(sm.nodes), self._kv_lagging)
        memo = self._kv_pub_memo
        if memo is not None and memo[0] == key and memo[1] == v:
            return v
        now = self._mono()
        span = int(self.kv_lease * 1e9 * (1 + LEASE_DRIFT)) + LEASE_MARGIN_NS
        pub = v
        for nid in set(sm.nodes) | set(self._kv_granted):
            applied = self._kv_applied.get(nid)
            if applied is not None and applied >= v:
                continue
            if now >= max(self._kv_granted.get(nid, 0), self._lead_since) + span:
                continue  # its lease has run out
            pub = min(pub, applied if applied is not None else 0)
        self._kv_pub_memo = (key, pub)
        return pub

    def _remember_kv_usage(self, sm: MetaStateMachine, req: pb.HeartbeatRequest) -> None:
        """Keep the node's latest KV usage. Entries for pools removed or
        targets not the node's are dropped, not refused: a pool removed a
        moment ago must not fail a heartbeat."""
        node = sm.nodes.get(req.node_id)
        mine = set(node.targets) if node is not None else set()
        kept: dict[tuple[int, int], pb.KVTargetUsage] = {}
        for u in req.kv_usage:
            if u.pool_id in sm.kv_pools and u.target_id in mine:
                kept[(u.pool_id, u.target_id)] = u
        self._kv_used[req.node_id] = kept

    def kv_pools(self) -> pb.ListKVPoolsReply:
        """Every KV pool with the usage last reported to this leader."""
        sm = self.state
        reply = pb.ListKVPoolsReply(pools=sm.kv_pool_list())
        if not self._leadership():
            return reply
        # A pool or node removed since the report: its entries go with it.
        usage = [u for per_node in self._kv_used.values() for (pool, target), u in per_node.items()
                 if pool in sm.kv_pools and target in sm.targets]
        reply.usage.extend(sorted(usage, key=lambda u: (u.pool_id, u.target_id)))
        if self.kv_lease:
            reply.leases_on, reply.map_version = True, sm.map_version
            reply.kv_published = self.kv_published(sm)
            reply.leases.extend(self.kv_leases(sm))
        return reply

    def kv_leases(self, sm: MetaStateMachine) -> list[pb.KVNodeLease]:
        """Each storage node that asks for KV map leases, as this leader
        sees it: leased now, the map it applied, and stalled (it beats but
        has held no lease for two lease spans: its KV requests are refused
        or miss, and `tierfs status` calls the cluster degraded)."""
        now = self._mono()
        span = int(self.kv_lease * 1e9)
        out = []
        for nid in sorted(n for n in self._kv_applied if n in sm.nodes):
            granted = self._kv_granted.get(nid, 0)
            node = sm.nodes[nid]
            beating = node.state == pb.NODE_STATE_ONLINE and now - self._hb_seen.get(nid, 0) < span
            stalled = beating and now - max(granted, self._lead_since) >= 2 * span
            out.append(pb.KVNodeLease(node_id=nid, leased=bool(granted) and now - granted < span,
                                      applied_map_version=self._kv_applied[nid],
                                      granted_ms_ago=(now - granted) // 1_000_000 if granted else 0,
                                      stalled=stalled))
        return out

    def _heartbeat_changes(self, sm: MetaStateMachine, req: pb.HeartbeatRequest, mono: int) -> bool:
        node = sm.nodes[req.node_id]
        if node.state != pb.NODE_STATE_ONLINE:
            return True
        usage_due = mono - self._usage_logged.get(req.node_id, self._lead_since) >= int(self.usage_interval * 1e9)
        for rep in req.targets:
            t = sm.targets.get(rep.target_id)
            if t is None or t.node != node.id:
                return True
            if t.capacity != rep.capacity or t.reported != (rep.state or pb.TARGET_STATE_ONLINE):
                return True
            if t.used != rep.used and usage_due:
                return True
        return False

    def cluster_map(self, known_version: int = 0) -> pb.ClusterMap:
        """The state's cluster map, with the leader's fresher heartbeat
        memory (last heartbeat time, reported usage) laid over it.

        For callers that hold a map (``known_version`` set: storage
        daemons' map watches, clients' and repair's refreshes) a whole map
        is built at most once per map version and ``MAP_MEMO_S``: a map
        change sends every daemon's watch, and every client's next refresh,
        here at once, and each build is O(nodes + targets + groups) (9 ms
        at 1,000 targets, 75 ms at 10,000: 9 s of the leader's loop per
        change with 1,000 daemons). Everything placement reads bumps the
        map version; what may be up to ``MAP_MEMO_S`` old in a kept map is
        usage and heartbeat times. A caller without a map (the CLI's
        ``status``, ``df``) gets them fresh."""
        sm = self.state
        if known_version and known_version == sm.map_version:
            return pb.ClusterMap(version=sm.map_version, unchanged=True)
        leading = self._leadership()
        if not known_version:
            return self._build_map(sm, leading)
        key = (id(sm), sm.map_version, leading)
        now_mono = time.monotonic()
        memo = self._map_memo
        if memo is not None and memo[0] == key and now_mono - memo[1] < MAP_MEMO_S:
            return memo[2]
        cmap = self._build_map(sm, leading)
        self._map_memo = (key, now_mono, cmap)
        return cmap

    def _build_map(self, sm: MetaStateMachine, leading: bool) -> pb.ClusterMap:
        cmap = sm.cluster_map()
        if not leading:
            return cmap
        now, mono = self.now_ns(), self._mono()
        for n in cmap.nodes:
            seen = self._hb_seen.get(n.node_id)
            if seen is not None:
                n.last_heartbeat_ns = max(n.last_heartbeat_ns, now - (mono - seen))
        for t in cmap.targets:
            used = self._hb_used.get(t.node_id, {}).get(t.target_id)
            if used is not None:
                t.used = used
            else:  # the committed figure: up to usage_interval old (status marks it)
                t.used_unreported = True
            t.free = self._hb_free.get(t.node_id, {}).get(t.target_id, 0)
        return cmap

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval)
            if not self._leading():
                continue
            try:
                await self.tick()
            except TierFSError as err:  # lost leadership mid-tick, timeouts: next tick retries
                log.debug("tick failed: %s", err)

    async def start(self) -> None:
        """Start the periodic tick task and the rebalancer (idempotent)."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_loop(), name="meta-tick")
        if isinstance(self._r.state_machine, MetaStateMachine):
            self.rebalancer.start()
            self.kv_planner.start()

    async def stop(self) -> None:
        await self.rebalancer.stop()
        await self.kv_planner.stop()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None

    # ---- namespace ------------------------------------------------------------

    @grpc_errors
    async def Mkdir(self, request: pb.MkdirRequest, context: Ctx) -> pb.FileInfo:
        return await self._mutate(context, "mkdir", request, pb.FileInfo)

    @grpc_errors
    async def Create(self, request: pb.CreateRequest, context: Ctx) -> pb.FileInfo:
        sm = self.state
        w = sm.create_width(request.loc, request.layout if request.has_layout else None)
        if w and w not in sm.widths and self._leadership():
            await self.rebalancer.top_up(w)  # a new width: its groups before the file
        return self._with_read_cap(await self._mutate(context, "create", request, pb.FileInfo))

    @grpc_errors
    async def Lookup(self, request: pb.LookupRequest, context: Ctx) -> pb.FileInfo:
        return self._with_read_cap((await self._read(request)).lookup(request.parent, request.name,
                                                                     ident=self.identity()))

    @grpc_errors
    async def Stat(self, request: pb.StatRequest, context: Ctx) -> pb.FileInfo:
        return self._with_read_cap((await self._read(request)).stat(request.loc, ident=self.identity()))

    @grpc_errors
    async def Readdir(self, request: pb.ReaddirRequest, context: Ctx) -> pb.ReaddirReply:
        return (await self._read(request)).readdir(request.loc, request.cursor, request.limit,
                                                   ident=self.identity())

    @grpc_errors
    async def Rename(self, request: pb.RenameRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "rename", request, pb.Empty)

    @grpc_errors
    async def Unlink(self, request: pb.UnlinkRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "unlink", request, pb.Empty)

    @grpc_errors
    async def Rmdir(self, request: pb.RmdirRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "rmdir", request, pb.Empty)

    @grpc_errors
    async def Symlink(self, request: pb.SymlinkRequest, context: Ctx) -> pb.FileInfo:
        return await self._mutate(context, "symlink", request, pb.FileInfo)

    @grpc_errors
    async def Batch(self, request: pb.BatchRequest, context: Ctx) -> pb.BatchReply:
        """Independent mutations in one call (docs/meta.md, "Batched
        mutations"): each item is checked, logged and applied exactly as its
        own RPC would be, with its own request id, and gets its own result
        or error; the items are queued for the log in their order, so they
        are applied in it (one Raft entry when they fit)."""
        # Only the count here: an item over a cap fails alone, with the error
        # its own RPC would give (checked in _op).
        cap("Batch.items", len(request.items), MAX_BATCH_ITEMS)
        client, _ = _ids(context)
        results = await asyncio.gather(*(self._batch_item(item, client) for item in request.items))
        return pb.BatchReply(results=results)

    async def _batch_item(self, item: pb.BatchItem, client: str) -> pb.MetaResult:
        try:
            kind = item.WhichOneof("op")
            if kind is None:
                raise InvalidArgumentError("Batch: an item names no operation")
            check_allowed(BATCH_RPCS[kind], current_identity.get())  # as if called on its own
            return await self.submit_result(self._op(kind, getattr(item, kind), client, item.request_id))
        except TierFSError as err:
            return error_result(err)

    @grpc_errors
    async def Readlink(self, request: pb.ReadlinkRequest, context: Ctx) -> pb.ReadlinkReply:
        return pb.ReadlinkReply(target=(await self._read(request)).readlink(request.loc, ident=self.identity()))

    @grpc_errors
    async def SetAttr(self, request: pb.SetAttrRequest, context: Ctx) -> pb.FileInfo:
        return self._with_read_cap(await self._mutate(context, "setattr", request, pb.FileInfo))

    @grpc_errors
    async def Truncate(self, request: pb.TruncateRequest, context: Ctx) -> pb.FileInfo:
        return self._with_read_cap(await self._mutate(context, "truncate", request, pb.FileInfo))

    @grpc_errors
    async def SetLayout(self, request: pb.SetLayoutRequest, context: Ctx) -> pb.LayoutReply:
        reply = await self._mutate(context, "set_layout", request, pb.LayoutReply)
        await self.rebalancer.top_up()  # a new width can be written at once
        return reply

    @grpc_errors
    async def GetLayout(self, request: pb.GetLayoutRequest, context: Ctx) -> pb.LayoutReply:
        return pb.LayoutReply(layout=(await self._read(request)).get_layout(request.loc, ident=self.identity()))

    # ---- write sessions ---------------------------------------------------------

    @grpc_errors
    async def OpenWrite(self, request: pb.OpenWriteRequest, context: Ctx) -> pb.OpenWriteReply:
        reply = await self._mutate(context, "open_write", request, pb.OpenWriteReply)
        self._with_read_cap(reply.file)
        reply.write_capability = self._write_cap(reply.session_id)
        if self._secret is not None and not reply.write_capability:
            # The session ended between its op and this reply (the file was
            # unlinked or replaced meanwhile): a reply without a capability
            # made the writer's first fragment fail as UnauthenticatedError.
            raise SessionExpiredError(f"write session {reply.session_id} ended as it was opened (the file was "
                                      f"removed or replaced meanwhile): open the file again")
        return reply

    @grpc_errors
    async def RenewLease(self, request: pb.RenewLeaseRequest, context: Ctx) -> pb.RenewLeaseReply:
        reply = await self._mutate(context, "renew_lease", request, pb.RenewLeaseReply)
        reply.write_capability = self._write_cap(request.session_id)
        return reply

    @grpc_errors
    async def CommitWrite(self, request: pb.CommitWriteRequest, context: Ctx) -> pb.FileInfo:
        return self._with_read_cap(await self._mutate(context, "commit_write", request, pb.FileInfo))

    @grpc_errors
    async def AbortWrite(self, request: pb.AbortWriteRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "abort_write", request, pb.Empty)

    # ---- cluster map --------------------------------------------------------------

    @grpc_errors
    async def RegisterNode(self, request: pb.RegisterNodeRequest, context: Ctx) -> pb.RegisterNodeReply:
        # Here, not in validate_op: the log may hold registrations from before
        # the check, and replaying them must give what it gave then. An
        # address that is not host:port would be in every client's cluster
        # map, and every client's map refresh would fail on it.
        check_caps(request, "register_node")
        check_addr(request.data_addr, "register_node: data_addr")
        check_addr(request.control_addr, "register_node: control_addr", required=False)
        self._refuse_identity_in_use(request)
        before = set(self.state.eligible_targets())
        reply = await self._mutate(context, "register_node", request, pb.RegisterNodeReply)
        # The version with the KV pools' groups committed after it (submit).
        reply.map_version = max(reply.map_version, self.state.map_version)
        self._hb_seen[reply.node_id] = self._mono()  # a registration is a heartbeat
        # ... but it carries no target state or usage: until the node's
        # first heartbeat the rebalancer leaves its targets out (a target
        # full already would otherwise get moves), and status marks their
        # usage as the committed figure.
        self._hb_used.pop(reply.node_id, None)
        self._hb_free.pop(reply.node_id, None)
        await self.rebalancer.top_up()  # the node's targets get groups before it is answered
        if set(self.state.eligible_targets()) - before:
            self.rebalancer.trigger()  # targets joined or came back: they get their share
        reply.cap_keys.extend(self.cap_keys())
        return reply

    def _refuse_identity_in_use(self, request: pb.RegisterNodeRequest) -> None:
        """``BusyError`` for a registration under the uuid of a node that is
        online at another data address and heartbeated within
        heartbeat_timeout from another host: a second daemon with a copy of
        that node's data_dir (a cloned disk or image). Until stop 47 it took the node's
        place in the map, its targets went offline and every group rebuilt
        onto the copy's. A node that really moved registers once its old
        registration has gone silent for heartbeat_timeout."""
        if not self.heartbeat_timeout:
            return
        node = next((n for n in self.state.nodes.values() if n.uuid == request.node_uuid), None)
        if node is None or node.state != pb.NODE_STATE_ONLINE or not node.data_addr \
                or node.data_addr == request.data_addr or node.hostname == request.hostname:
            # (One host: the daemon restarted on another port; a second one
            # with the same data_dir there is refused by its LOCK.)
            return
        seen = self._hb_seen.get(node.id)
        age = (self._mono() - seen) / 1e9 if seen is not None else None
        if age is not None and age < self.heartbeat_timeout:
            raise BusyError(
                f"node uuid {request.node_uuid} is node {node.id}, online at {node.data_addr} (heard from "
                f"{age:.1f} s ago), not at {request.data_addr}: two daemons with one data_dir (a copied disk "
                f"or image?). Give this one its own data_dir (a new node.uuid), or stop the other; a node that "
                f"moved is let in once the old address is silent for {self.heartbeat_timeout:g} s")

    @grpc_errors
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Ctx) -> pb.HeartbeatReply:
        return await self.heartbeat(request, *_ids(context))

    @grpc_errors
    async def GetClusterMap(self, request: pb.GetClusterMapRequest, context: Ctx) -> pb.ClusterMap:
        sm = await self._read(request)
        if request.wait_ms and request.known_version and sm.map_version == request.known_version:
            await self._wait_map_change(request.known_version, min(request.wait_ms, MAX_MAP_WAIT_MS) / 1000)
        return self.cluster_map(request.known_version)

    async def _wait_map_change(self, known: int, timeout: float) -> None:
        """Until the map is past ``known`` or ``timeout`` passed (a storage
        daemon watching the map: docs/kv.md, "Map leases")."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.state.map_version == known:
            left = end - loop.time()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                # Woken by this leader's commits; the cap catches a change
                # applied without one (an earlier leader's entries).
                await asyncio.wait_for(self._map_event.wait(), min(left, 0.5))

    def _map_changed(self) -> None:
        sm = self._r.state_machine
        v = sm.map_version if isinstance(sm, MetaStateMachine) else None
        if v is not None and v != self._map_notified:
            self._map_notified = v
            ev, self._map_event = self._map_event, asyncio.Event()
            ev.set()

    @grpc_errors
    async def ListGroupChunks(self, request: pb.ListGroupChunksRequest, context: Ctx) -> pb.ListGroupChunksReply:
        return (await self._read(request)).list_group_chunks(request.group_id, request.after_inode, request.limit,
                                                             gc_holder=request.gc_holder,
                                                             after_gc_id=request.after_gc_id, now_ns=self.now_ns())

    @grpc_errors
    async def FinishRebuild(self, request: pb.FinishRebuildRequest, context: Ctx) -> pb.Empty:
        reply = await self._mutate(context, "finish_rebuild", request, pb.Empty)
        self.rebalancer.wake()  # a move done: room for the next batch
        return reply

    @grpc_errors
    async def RemoveTarget(self, request: pb.RemoveTargetRequest, context: Ctx) -> pb.ReplaceReply:
        req = pb.RemoveTargetRequest(target_id=request.target_id, force=request.force)
        t = self.state.targets.get(req.target_id)
        if t is not None and not t.removed:  # else apply refuses it, with its message
            if not request.force:
                self._refuse_losing_removal(t.id)
            req.replaced.CopyFrom(await self._plan_replacements([t.id], [t.id]))
        return await self._mutate(context, "remove_target", req, pb.ReplaceReply)

    @grpc_errors
    async def DrainNode(self, request: pb.DrainNodeRequest, context: Ctx) -> pb.ReplaceReply:
        req = pb.DrainNodeRequest(node_id=request.node_id)
        node = self.state.nodes.get(req.node_id)
        if node is not None:
            mine = sorted(node.targets)
            req.replaced.CopyFrom(await self._plan_replacements(mine, mine))
        return await self._mutate(context, "drain_node", req, pb.ReplaceReply)

    @grpc_errors
    async def UndrainNode(self, request: pb.UndrainNodeRequest, context: Ctx) -> pb.UndrainNodeReply:
        reply = await self._mutate(context, "undrain_node", pb.UndrainNodeRequest(node_id=request.node_id),
                                   pb.UndrainNodeReply)
        if reply.was_draining:
            self.rebalancer.trigger()  # its targets may take fragments again
        return reply

    def _refuse_losing_removal(self, tid: int) -> None:
        """``BusyError`` when removing target ``tid`` would lose data it still
        serves: it is readable (online or read-only) and some group of it has
        no other member to rebuild from (width 1: ``replica:1``), or has
        another member down or being rebuilt. The rebuild of a removed target
        decodes from the survivors; a healthy target's fragments can be
        copied off instead (``tierfs node drain``). ``force`` skips this."""
        sm = self.state
        t = sm.targets[tid]
        readable = (pb.TARGET_STATE_ONLINE, pb.TARGET_STATE_READ_ONLY)
        if sm._target_state(t) not in readable:
            # Down: unreadable now, but its node may come back with them.
            # Where no other member can rebuild what it holds, removing it
            # gives that up for good (it did without a word until stop 47).
            lost = sorted(g for g, members in sm.groups.items()
                          if tid in members and sm.rebuild_would_lose(g, tid))
            if lost:
                raise BusyError(
                    f"target {tid} is down and the only source left for what it holds in {len(lost)} group(s) "
                    f"({', '.join(map(str, lost[:5]))}{', ...' if len(lost) > 5 else ''}: replica:1 data, or too "
                    f"few other members readable): removing it loses that data for good. Bring its node back if "
                    f"it can come back; else remove it anyway with --force")
            return
        alone: list[int] = []
        weak: list[int] = []
        for gid, members in sm.groups.items():
            if tid not in members or not sm.ginv.get(gid):
                continue  # (a group that holds no file's chunks loses nothing: refused until stop 48)
            others = [m for m in members if m != tid]
            if not others:
                alone.append(gid)
            elif any(m in sm.rebuilding.get(gid, ()) or m not in sm.targets
                     or sm._target_state(sm.targets[m]) not in readable for m in others):
                weak.append(gid)
        if not alone and not weak:
            return
        why = []
        if alone:
            why.append(f"the only member of {len(alone)} group(s) ({', '.join(map(str, sorted(alone)[:5]))}"
                       f"{', ...' if len(alone) > 5 else ''}: replica:1 data has no other copy)")
        if weak:
            why.append(f"a member of {len(weak)} group(s) whose other members are down or being rebuilt "
                       f"({', '.join(map(str, sorted(weak)[:5]))}{', ...' if len(weak) > 5 else ''})")
        raise BusyError(f"target {tid} is online and {' and '.join(why)}: removing it would lose what only it "
                        f"still serves. Copy it off first (`tierfs node drain {t.node}`), or remove it anyway "
                        f"with --force")

    async def _plan_replacements(self, tids: list[int], leaving: list[int], *,
                                 hold: bool = False) -> pb.Replacements:
        """The replacements of ``tids`` (tierfs.meta.replace): inputs copied
        here on the event loop, planned in a worker thread; apply checks
        them against the state it finds. ``hold``: not where it would lose
        data (the tick's)."""
        inp = replace_input(self.state, tids, leaving=leaving, hold=hold)
        if inp.held and inp.held != self._held_logged:
            self._held_logged = inp.held
            log.warning("holding %d down target(s) in their groups (%s): the other members cannot rebuild what "
                        "they hold (replica:1, or too few readable), so they are not replaced automatically; "
                        "bring them back, or `tierfs target rm` one (its data is lost)", len(inp.held),
                        ", ".join(f"target {t} in group {g}" for g, t in sorted(inp.held)[:5]))
        moves, stuck = await asyncio.to_thread(plan_replacements, inp)
        return replacements_pb(moves, stuck)

    @grpc_errors
    async def RemoveNode(self, request: pb.RemoveNodeRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "remove_node", request, pb.Empty)

    @grpc_errors
    async def LabelNode(self, request: pb.LabelNodeRequest, context: Ctx) -> pb.Empty:
        reply = await self._mutate(context, "label_node", request, pb.Empty)
        self.rebalancer.trigger()  # groups that now break the rack rule move
        return reply

    @grpc_errors
    async def GetRebalanceStatus(self, request: pb.Empty, context: Ctx) -> pb.RebalanceStatus:
        await self._read(request)
        if not self._leadership():
            raise NotLeaderError(leader=self._r.status().leader)
        return self.rebalancer.status()

    # ---- garbage collection ---------------------------------------------------------

    @grpc_errors
    async def ListGC(self, request: pb.ListGCRequest, context: Ctx) -> pb.ListGCReply:
        state = await self._read(request)
        now = self.now_ns()
        items = state.list_gc(request.target_ids, request.after_id, request.limit, now_ns=now)
        return pb.ListGCReply(items=items, purges=state.list_purges(request.target_ids, now_ns=now)
                              if request.purges else ())

    @grpc_errors
    async def AckGC(self, request: pb.AckGCRequest, context: Ctx) -> pb.AckGCReply:
        return await self._mutate(context, "ack_gc", request, pb.AckGCReply)

    # ---- the repair queue -------------------------------------------------------------

    @grpc_errors
    async def ListRepairs(self, request: pb.ListRepairsRequest, context: Ctx) -> pb.ListRepairsReply:
        reply = (await self._read(request)).list_repairs(request.target_ids, request.limit)
        ident = self.identity()
        if ident.kind != "node" and not ident.admin:
            # A user sees how much is pending (tierfs status), not which
            # files' chunks (their inodes and generations) need repair.
            del reply.items[:]
        return reply

    @grpc_errors
    async def MarkFragments(self, request: pb.MarkFragmentsRequest, context: Ctx) -> pb.MarkFragmentsReply:
        return await self._mutate(context, "mark_fragments", request, pb.MarkFragmentsReply)

    # ---- KV pools ------------------------------------------------------------------------

    @grpc_errors
    async def CreateKVPool(self, request: pb.CreateKVPoolRequest, context: Ctx) -> pb.KVPool:
        from tierfs.kv.policy import policy_names

        if request.name and any(p.name == request.name for p in self.state.kv_pools.values()):
            # Before the budgets are checked: "give a per-target budget" was
            # the answer to a second `kv pool create hot`, not "exists".
            raise AlreadyExistsError(f"KV pool {request.name!r} already exists")
        # Checked here, not in apply (which checks the name's form only), so
        # that a journal replays the same whatever policies a release has.
        # Every storage daemon must be able to build the pool: an unknown
        # name used to fail each one's map update (KV leases lapsed, every
        # pool's gets missed and puts were refused).
        check_kv_budget_floor(request)
        if (request.policy or "lru") not in policy_names():
            raise InvalidArgumentError(f"create_kv_pool {request.name!r}: unknown eviction policy "
                                       f"{request.policy[:40]!r}; known: {', '.join(policy_names())}")
        reply = await self._mutate(context, "create_kv_pool", request, pb.KVPool)
        # Apply made it without groups; the planner gave it some since.
        pool = self.state.kv_pools.get(reply.pool_id)
        return pool.to_pb() if pool is not None and pool.name == reply.name else reply

    @grpc_errors
    async def ListKVPools(self, request: pb.Empty, context: Ctx) -> pb.ListKVPoolsReply:
        await self._read(request)
        return self.kv_pools()

    @grpc_errors
    async def GetKVCapability(self, request: pb.GetKVCapabilityRequest,
                              context: Ctx) -> pb.GetKVCapabilityReply:
        await self._read(request)
        if not self._leadership():
            raise NotLeaderError(leader=self._r.status().leader)
        return self.kv_capability(request.pool)

    @grpc_errors
    async def RemoveKVPool(self, request: pb.RemoveKVPoolRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "remove_kv_pool", request, pb.Empty)

    # ---- replica status and membership (local, no leader needed) ----------------

    @grpc_errors
    async def GetStatus(self, request: pb.Empty, context: Ctx) -> pb.GetStatusReply:
        st = self._r.status()
        reply = pb.GetStatusReply(id=st.id, role=st.role, leader=st.leader, term=st.term,
                                  commit_index=st.commit_index, applied_index=st.applied_index,
                                  members=st.members, pid=os.getpid(), auth=self.auth is not None)
        details = getattr(self._r, "details", None)  # RaftReplicator only
        if details is not None:
            d = details()
            reply.raft.CopyFrom(pb.RaftStatus(
                raft_addr=d.raft_addr, grpc_addr=d.grpc_addr, raft_members=d.raft_members,
                addr_map=d.addr_map, ready=d.ready, log_len=d.log_len, journal_syncs=d.journal_syncs,
                snapshots=d.snapshots, fatal=d.fatal, truncation=d.truncation,
            ))
        return reply

    @grpc_errors
    async def Digest(self, request: pb.Empty, context: Ctx) -> pb.DigestReply:
        sm = self._r.state_machine
        forked = getattr(self._r, "digest", None)
        if forked is not None:  # RaftReplicator: a large state is hashed off the loop
            digest, applied, ops = await forked()
            return pb.DigestReply(digest=digest, applied_index=applied, ops_applied=ops)
        return pb.DigestReply(digest=sm.digest(), applied_index=self._r.status().applied_index,
                              ops_applied=int(getattr(sm, "ops_applied", 0)))

    @grpc_errors
    async def ForceSnapshot(self, request: pb.Empty, context: Ctx) -> pb.Empty:
        fn = getattr(self._r, "force_snapshot", None)
        if fn is None:
            raise UnsupportedError(f"this meta replica ({type(self._r).__name__}) takes no snapshots")
        fn()
        return pb.Empty()

    async def _membership(self, name: str, request: pb.MetaMemberRequest) -> pb.Empty:
        fn = getattr(self._r, name, None)
        if fn is None:
            raise UnsupportedError(f"this meta replica ({type(self._r).__name__}) cannot change membership")
        check_caps(request, name)
        check_addr(request.raft_addr, f"{name}: raft_addr")
        check_addr(request.grpc_addr, f"{name}: grpc_addr", required=False)
        # A change waits for this term's no-op and any previous change to
        # apply (BusyError retries inside): allow more than one commit's time.
        await fn(request.raft_addr, request.grpc_addr, timeout=2 * self.submit_timeout)
        return pb.Empty()

    @grpc_errors
    async def AddMetaMember(self, request: pb.MetaMemberRequest, context: Ctx) -> pb.Empty:
        return await self._membership("add_member", request)

    @grpc_errors
    async def RemoveMetaMember(self, request: pb.MetaMemberRequest, context: Ctx) -> pb.Empty:
        return await self._membership("remove_member", request)

    # ---- users and tokens (tierfs.meta.users; admin only, see tierfs.meta.auth) ----

    async def _with_token(self, context: Ctx, kind: str, req: pb.AddUserRequest | pb.IssueTokenRequest,
                          name: str) -> pb.UserTokenReply:
        # A bad name gets a dummy hash here and its clear refusal from the state machine.
        token = new_user_token(name) if USER_NAME_RE.match(name) else ""
        req.token_hash = hash_token(token)  # whatever the client sent is replaced
        reply = await self._mutate(context, kind, req, pb.UserTokenReply)
        u = self.state.users.get(reply.user.name)
        rec = next((t for t in u.tokens if t.id == reply.token_id), None) if u is not None else None
        if rec is None or rec.hash != req.token_hash:
            # The answer of an earlier attempt of this request (its reply was
            # lost): that attempt's token was never shown; this one is not it.
            raise InternalError(f"{kind}: the token was issued by an earlier attempt of this request whose "
                                f"reply was lost; revoke token {reply.token_id} and issue a new one")
        reply.token = token
        return reply

    @grpc_errors
    async def AddUser(self, request: pb.AddUserRequest, context: Ctx) -> pb.UserTokenReply:
        return await self._with_token(context, "add_user", request, request.name)

    @grpc_errors
    async def ListUsers(self, request: pb.Empty, context: Ctx) -> pb.ListUsersReply:
        return pb.ListUsersReply(users=(await self._read(request)).user_list())

    @grpc_errors
    async def RemoveUser(self, request: pb.RemoveUserRequest, context: Ctx) -> pb.Empty:
        return await self._mutate(context, "remove_user", request, pb.Empty)

    @grpc_errors
    async def IssueToken(self, request: pb.IssueTokenRequest, context: Ctx) -> pb.UserTokenReply:
        return await self._with_token(context, "issue_token", request, request.name)

    @grpc_errors
    async def RevokeToken(self, request: pb.RevokeTokenRequest, context: Ctx) -> pb.RevokeTokenReply:
        return await self._mutate(context, "revoke_token", request, pb.RevokeTokenReply)

    @grpc_errors
    async def WhoAmI(self, request: pb.Empty, context: Ctx) -> pb.Caller:
        me = current_identity.get()
        return pb.Caller(name=me.name, uid=me.uid, gid=me.gid, groups=me.groups, admin=me.admin, kind=me.kind)


#: Answered by any replica from its own state (no leader involved).
_LOCAL_RPCS = frozenset({"GetStatus", "Digest", "ForceSnapshot", "WhoAmI"})
_METHODS = frozenset(m.name for m in pb.DESCRIPTOR.services_by_name["MetaService"].methods)
#: What a follower forwards to the leader: every call but the replica-local ones.
_FORWARDABLE = _METHODS - _LOCAL_RPCS
KV_MAP_VERSION = Gauge("tierfs_meta_kv_map_version", "The cluster map version, on the leader (last heartbeat)")
KV_PUBLISHED = Gauge("tierfs_meta_kv_published_version",
                     "The latest map version every storage node holding a KV map lease has applied "
                     "(docs/kv.md, 'Map leases'); below tierfs_meta_kv_map_version while a change waits")
FORWARDED = Counter("tierfs_meta_forwarded_total", "Calls this follower forwarded to the leader", ["method"])
RPCS = Counter("tierfs_meta_rpcs_total", "MetaService calls answered, by method and gRPC status", ["method", "code"])
RPC_SECONDS = Histogram("tierfs_meta_rpc_seconds", "MetaService call latency on this replica (forwarding included)",
                        ["method"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
                                             2.5, 5.0))


class _Guarded:
    """What is registered with gRPC: every MetaService method of the
    servicer behind the auth layer (:meth:`MetaServicer.authenticate`), which
    sets ``current_identity`` for the handler. Built from the service
    descriptor, so a new RPC cannot be left unauthenticated."""

    def __init__(self, svc: MetaServicer) -> None:
        self._svc = svc

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._svc, name)
        if name not in _METHODS:
            return fn

        svc = self._svc

        async def forwarded(request: Message, context: Ctx, *, unchecked: bool = False) -> Any:
            try:
                reply = await svc.forward(name, request, context)
                if reply is not None:
                    return reply
                if not unchecked:
                    return await fn(request, context)
                # This replica became the leader while it held a call whose
                # caller it could not identify: identify it now, as the
                # leader, never run it as whoever the context holds.
                token = current_identity.set(svc.authenticate(name, context))
            except TierFSError as err:
                await abort(context, err)
            try:
                return await fn(request, context)
            finally:
                current_identity.reset(token)

        # Bound once per method (gRPC looks each handler up once).
        seconds, ok = RPC_SECONDS.labels(name), RPCS.labels(name, "OK")

        async def guarded(request: Message, context: Ctx) -> Any:
            t0 = time.perf_counter()
            try:
                reply = await checked(request, context)
            except BaseException:
                c = context.code()
                RPCS.labels(name, c.name if isinstance(c, grpc.StatusCode) else "UNKNOWN").inc()
                raise
            finally:
                seconds.observe(time.perf_counter() - t0)
            ok.inc()
            return reply

        async def checked(request: Message, context: Ctx) -> Any:
            if svc.auth is None:
                # Security off: whoever the context says (ANONYMOUS, unless a
                # server embedding the servicer set one).
                if svc.should_forward(name, context):
                    return await forwarded(request, context)
                return await fn(request, context)
            try:
                ident = svc.authenticate(name, context)
            except NotLeaderError as err:
                # A user token this follower cannot check yet (its user not
                # applied here): the leader decides.
                if not svc.should_forward(name, context):
                    await abort(context, err)
                return await forwarded(request, context, unchecked=True)
            except TierFSError as err:
                await abort(context, err)
            token = current_identity.set(ident)
            try:
                # Checked here too (refused early), and again by the leader.
                if svc.should_forward(name, context):
                    return await forwarded(request, context)
                return await fn(request, context)
            finally:
                current_identity.reset(token)

        return guarded


def add_meta_service(server: grpc.aio.Server, replicator: Replicator, **opts: Any) -> MetaServicer:
    """Create a :class:`MetaServicer` (``opts``: heartbeat_timeout,
    lease_duration, tick_interval, submit_timeout, replace_after, gc_grace, purge_grace,
    usage_interval, kv_default_pool, root_squash, clock, monotonic, cluster_secret,
    cap_key_rotation, file_cap_ttl, kv_cap_ttl, cap_clock, auth) and register it
    on ``server``, every method behind the auth layer. Call ``await servicer.start()`` once the server runs, to
    start the periodic tick, and ``await servicer.stop()`` before shutdown."""
    servicer = MetaServicer(replicator, **opts)
    meta_pb2_grpc.add_MetaServiceServicer_to_server(_Guarded(servicer), server)  # type: ignore[arg-type]
    return servicer
