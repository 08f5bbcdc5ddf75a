"""Raft replication of a :class:`~tierfs.meta.interfaces.StateMachine` with pysyncobj.

:class:`RaftReplicator` is the production :class:`~tierfs.meta.interfaces.Replicator`.
It owns one pysyncobj ``SyncObj`` (its own tick thread, its own TCP transport)
and bridges it to asyncio:

* ``submit(op)`` hands the op to pysyncobj's command queue (non-blocking) and
  awaits a future that the tick thread resolves after the entry is committed.
* The state machine is applied **on the event loop thread**, not on the tick
  thread: the tick thread posts each committed op to the loop in log order.
  So the gRPC service reads the state without locks and never sees an op
  half-applied. Snapshot and restore also run on the loop (the tick thread
  waits for them), which makes a snapshot exactly the state at its index.
* ``read_barrier()`` commits a no-op through the log and waits until it is
  applied here (log-based linearizable reads, no clock assumptions);
  concurrent readers share one no-op.
* The journal is :class:`tierfs.meta.journal.DurableJournal`; it is synced
  before every outgoing Raft message and at the end of every tick (see
  docs/raft.md for why that is enough).
* Every frame on the Raft port is sealed (AES-256-GCM) with a key derived
  from the cluster secret (:class:`FrameSealer`); a
  frame whose MAC does not verify is dropped, with its connection, before
  pysyncobj unpickles anything (docs/raft.md, "Authenticated frames").
* A replicated raft->gRPC address map lets a follower answer
  :class:`~tierfs.errors.NotLeaderError` with the leader's gRPC address; each
  new leader registers itself, :meth:`RaftReplicator.add_member` registers
  the new member.
"""

from __future__ import annotations

import _socket
import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import gc
import logging
import os
import random
import signal
import socket
import struct
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pysyncobj.syncobj as _syncobj_mod
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from prometheus_client import Counter, Gauge, Histogram
from pysyncobj import FAIL_REASON, SERIALIZER_STATE, SyncObj, SyncObjConf, replicated
from pysyncobj.monotonic import monotonic as _raft_clock
from pysyncobj.node import TCPNode
from pysyncobj.transport import TCPTransport

from tierfs.errors import (
    BusyError,
    CorruptError,
    InternalError,
    InvalidArgumentError,
    NotLeaderError,
    TierFSError,
    TimeoutError_,
    UnavailableError,
)
from tierfs.fsutil import make_private, makedirs_durable
from tierfs.meta.interfaces import ReplicaStatus, ReplicaTooOldError, StateMachine
from tierfs.meta.journal import (
    DurableJournal,
    SnapshotFile,
    fsync_dir,
    read_snapshot,
    write_snapshot,
)

# pysyncobj.tcp_connection imports its win_inet_pton, which replaces
# socket.inet_ntop on every platform with a Windows-only function
# (SystemError/TypeError on Linux), in the whole process: psutil's
# net_connections, among others, fails after it. Put the real one back.
socket.inet_ntop = _socket.inet_ntop

__all__ = ["KEEPALIVE", "FrameSealer", "RaftDetails", "RaftReplicator", "RaftTimings", "leader_lost_window"]

log = logging.getLogger(__name__)
T = TypeVar("T")

SNAPSHOT_FILE = "snapshot.bin"
#: Largest op submit() accepts, whatever the state machine (the meta
#: service's own cap, tierfs.meta.ops.MAX_OP_BYTES, is not above it).
MAX_ENTRY_BYTES = 256 * 1024
#: pysyncobj sends an entry whose command is at least this long in pieces
#: ("transmission"), and marks the last piece by the command's length instead
#: of the length of the pickle it cuts (protocol 2 pickles bytes as latin-1
#: text: up to twice as long). The follower then unpickles a truncated entry,
#: fails on every retry and never catches up again. Kept above any command an
#: entry of MAX_ENTRY_BYTES makes (at most twice that), so that path is never
#: taken. It also bounds how much one AppendEntries bundles (plus one entry).
_APPEND_BATCH_BYTES = 4 * MAX_ENTRY_BYTES
#: Group commit: at most this many ops share one entry (and together at most
#: MAX_ENTRY_BYTES, counting _BATCH_OP_OVERHEAD each for their pickling).
MAX_BATCH_OPS = 256
_BATCH_OP_OVERHEAD = 16
#: Entries a leader keeps uncommitted before further ops wait (and so join
#: the next entry). With 1, the next entry goes out as soon as the previous
#: one is applied, so its commit overlaps the replies; 2 made entries half
#: as large (2 ops instead of 4 for 16 callers) and cost more CPU per op on
#: this CPU-bound host (docs/raft.md, "Group commit, measured").
MAX_INFLIGHT_ENTRIES = 1
#: From this many inodes on, :meth:`RaftReplicator.digest` hashes the state
#: in a forked child instead of on the event loop.
FORK_DIGEST_INODES = 20_000

COMMIT_LATENCY = Histogram(
    "tierfs_meta_commit_seconds", "submit() to applied result, on the leader",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
OPS = Counter("tierfs_meta_ops_total", "Ops submitted to Raft, by outcome", ["outcome"])
READ_BARRIERS = Counter("tierfs_meta_read_barriers_total", "No-op commits made for linearizable reads")
JOURNAL_SYNCS = Gauge("tierfs_meta_journal_syncs", "fdatasync calls of the Raft journal")
RAFT_TERM = Gauge("tierfs_meta_raft_term", "Current Raft term")
IS_LEADER = Gauge("tierfs_meta_is_leader", "1 on the leader")
SNAPSHOTS = Counter("tierfs_meta_snapshots_total", "Snapshots written")
# The replica's Raft state for dashboards (docs/operations.md, "Metrics"):
# read at scrape time from the replicator that serves this process.
TERM = Gauge("tierfs_meta_term", "Current Raft term of this replica")
ROLE = Gauge("tierfs_meta_role", "1 for this replica's current Raft role", ["role"])
APPLY_LAG = Gauge("tierfs_meta_apply_lag", "Committed log entries this replica has not applied yet")
COMMIT_INDEX = Gauge("tierfs_meta_commit_index", "Raft commit index of this replica")
APPLIED_INDEX = Gauge("tierfs_meta_applied_index", "Last log index applied to this replica's state machine")
JOURNAL_BYTES = Gauge("tierfs_meta_journal_bytes", "Size of this replica's Raft journal file (bytes)")
LEADER_CHANGES = Counter("tierfs_meta_leader_changes_total",
                         "Times this replica saw the leader change (to a new leader, or to none)")
PRE_VOTE_ROUNDS = Counter("tierfs_meta_pre_vote_rounds_total",
                          "Pre-vote rounds this replica started, by outcome (won: a real election followed; "
                          "the others did not disturb the cluster)", ["outcome"])
for _outcome in ("won", "lost", "leader_heard", "newer_term"):
    PRE_VOTE_ROUNDS.labels(_outcome)  # exported from the start, at 0
FRAMES_REFUSED = Counter("tierfs_meta_raft_frames_refused_total",
                         "Raft-port frames dropped (with their connection) because they were not "
                         "sealed with this cluster's secret")

ENTRY_OPS = Histogram(
    "tierfs_meta_entry_ops", "Ops per Raft entry submitted by this leader (group commit)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)

_RAFT_ROLES = {0: "follower", 1: "candidate", 2: "leader"}
_SER_IDLE: int = SERIALIZER_STATE.NOT_SERIALIZING
_SER_BUSY: int = SERIALIZER_STATE.SERIALIZING
_SER_DONE: int = SERIALIZER_STATE.SUCCESS
_SER_FAILED: int = SERIALIZER_STATE.FAILED

# --- the one hook into pysyncobj's journal creation --------------------------
# SyncObj builds its log with ``createJournal(conf.journalFile)``. We pass a
# ready DurableJournal as ``journalFile`` and let anything else through.
_orig_create_journal = _syncobj_mod.createJournal


def _create_journal(journal_file: Any) -> Any:
    if isinstance(journal_file, DurableJournal):
        return journal_file
    return _orig_create_journal(journal_file)


_syncobj_mod.createJournal = _create_journal


class FrameSealer:
    """Seals and opens Raft frames with a key derived from the cluster secret.

    pysyncobj's ``TcpConnection`` calls its ``encryptor`` on every frame:
    ``encrypt_at_time`` when sending; ``extract_timestamp`` then ``decrypt``
    when receiving, and only then ``pickle.loads``. Both receive calls
    verify the AES-GCM tag, so a frame that was not sealed with this key
    raises in ``extract_timestamp``, pysyncobj drops the connection, and no
    byte of it reaches the unpickler. Within a connection pysyncobj also
    checks that timestamps do not go backwards and that every frame carries
    the random key the receiver chose at connect time, so a frame recorded
    from another connection is refused too.

    Frame: ``version (1) | timestamp (8) | nonce (12) | AES-256-GCM(ciphertext + tag)``,
    the first 9 bytes authenticated as associated data. The key is
    HKDF-SHA256 of the secret (the secret is random: no slow password hash;
    pysyncobj's own ``password`` would run PBKDF2 and Fernet, about ten
    times the CPU per frame, measured in docs/raft.md). Nonces are a random
    64-bit prefix per sealer plus a 32-bit counter, a new prefix when the
    counter wraps, so no nonce repeats under one key in practice.
    """

    _INFO = b"tierfs raft frames v1"
    _VERSION = 1
    _HEAD = struct.Struct(">BQ")
    _NONCE = 12
    _LOG_EVERY = 10.0

    def __init__(self, secret: bytes, node_id: str = "", accepted: Sequence[bytes] = ()) -> None:
        """``secret`` seals; frames sealed with it or with one of
        ``accepted`` (a secret being rotated in or out: docs/security.md,
        "Rotating the cluster secret") are opened."""
        if not secret or not all(accepted):
            raise ValueError("empty cluster secret")
        self._aeads = [AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=self._INFO).derive(s))
                       for s in (secret, *accepted)]
        self._aead = self._aeads[0]
        self._node_id = node_id
        self._lock = threading.Lock()
        self._prefix = os.urandom(8)
        self._counter = 0
        self._last_log = 0.0
        self._unlogged = 0
        self.refused = 0

    def _nonce(self) -> bytes:
        with self._lock:
            self._counter += 1
            if self._counter >= 1 << 32:
                self._prefix, self._counter = os.urandom(8), 1
            return self._prefix + self._counter.to_bytes(4, "big")

    def encrypt_at_time(self, data: bytes, current_time: int) -> bytes:
        head = self._HEAD.pack(self._VERSION, max(0, current_time))
        nonce = self._nonce()
        return head + nonce + self._aead.encrypt(nonce, data, head)

    def _open(self, token: bytes) -> tuple[int, bytes]:
        hn = self._HEAD.size + self._NONCE
        try:
            if len(token) < hn + 16 or token[0] != self._VERSION:
                raise InvalidTag
            head, nonce = token[:self._HEAD.size], token[self._HEAD.size:hn]
            data = self._aead.decrypt(nonce, token[hn:], head)
        except (InvalidTag, TypeError, ValueError):
            opened = self._open_accepted(token, hn)
            if opened is None:
                self._refuse()
                raise InvalidTag from None
            head, data = token[:self._HEAD.size], opened
        return self._HEAD.unpack(head)[1], data

    def _open_accepted(self, token: bytes, hn: int) -> bytes | None:
        """A frame the current key did not open, tried with the accepted ones."""
        if len(self._aeads) == 1 or len(token) < hn + 16 or token[0] != self._VERSION:
            return None
        head, nonce = token[:self._HEAD.size], token[self._HEAD.size:hn]
        for aead in self._aeads[1:]:
            try:
                return bytes(aead.decrypt(nonce, token[hn:], head))
            except (InvalidTag, TypeError, ValueError):
                continue
        return None

    def extract_timestamp(self, token: bytes) -> int:
        # Verified here (not only in decrypt): pysyncobj acts on the
        # timestamp before it calls decrypt.
        return self._open(token)[0]

    def decrypt(self, token: bytes) -> bytes:
        return self._open(token)[1]

    def _refuse(self) -> None:
        # pysyncobj drops the connection without a word; say why, but a peer
        # with the wrong secret reconnects twice a second: not every time.
        FRAMES_REFUSED.inc()
        with self._lock:
            self.refused += 1
            self._unlogged += 1
            now = time.monotonic()
            if now - self._last_log < self._LOG_EVERY:
                return
            n, self._unlogged, self._last_log = self._unlogged, 0, now
        log.warning("raft %s: dropped %d Raft connection(s) whose frames were not sealed with this "
                    "cluster's secret (a peer with another secret, or not a peer)", self._node_id, n)


#: Type of the keepalive frame (docs/raft.md, "Failover"): sent on a Raft
#: connection that carried nothing for a while, dropped by the receiving
#: transport before pysyncobj sees it (an older replica's pysyncobj ignores
#: a message type it does not know).
KEEPALIVE = "tfs_keepalive"

#: Types of the pre-vote request and its answer (docs/raft.md, "Pre-vote").
#: Neither carries a ``term`` key: pysyncobj (an older replica's too) acts
#: on every message's term, and a pre-vote must change no one's term. An
#: older replica ignores both types.
PRE_VOTE = "tfs_pre_vote"
PRE_VOTE_REPLY = "tfs_pre_vote_reply"


def pre_vote_grant(*, cand_term: int, cand_last: tuple[int, int], my_term: int, my_last: tuple[int, int],
                   leading: bool, leader_alive: bool, recovering: bool) -> bool:
    """Whether to answer yes to a pre-vote (Raft thesis, 9.6): a replica
    that would campaign at ``cand_term`` (its term + 1) with a log ending at
    ``cand_last`` = (term, index) asks first whether it could win. Yes only
    if it would get this replica's vote in a real election at that term -
    its term is newer than ours and its log at least as up to date - *and*
    this replica believes there is no working leader: it does not lead
    itself, and it has not heard from a leader lately through a connection
    that is still open (``leader_alive``). Nothing changes on either side:
    no term, no vote."""
    if recovering or leading or leader_alive:
        return False
    return cand_term > my_term and cand_last >= my_last


def leader_lost_window(self_id: str, members: list[str], leader_id: str, leader_lost: float) -> tuple[float, float]:
    """Seconds after the leader's connection closed between which replica
    ``self_id`` campaigns (docs/raft.md, "Failover").

    The surviving members (``members`` without ``leader_id``), sorted by
    Raft address, get windows spread evenly over [leader_lost / 5,
    leader_lost]: rank 0 at the start, the last rank at the end, each an
    eighth of the spacing wide. Every survivor computes the same ranks, so
    no two campaign within 7/8 of the spacing of each other (with 3
    replicas: 50-72 ms and 228-250 ms, at least 155 ms apart): the first
    one's vote request reaches the others before their own deadlines even
    when a loaded host runs their ticks 100 ms late (a random point in the
    whole range let two survivors campaign in the same few ms, a split
    vote that cost another election timeout). The later ranks campaign
    only if the first did not win (its log was behind, it is cut off)."""
    survivors = sorted({m for m in members if m != leader_id} | {self_id})
    lo = leader_lost / 5
    step = (leader_lost - lo) / (len(survivors) - 1 + 1 / 8)
    start = lo + survivors.index(self_id) * step
    return start, start + step / 8


class _SyncingTransport(TCPTransport):  # type: ignore[misc]
    """TCP transport that enforces the journal's durability rule
    (docs/raft.md, "Durability"):

    * AppendEntries acks (``next_node_idx``) are held back and sent at the
      end of the tick, right after one ``fdatasync`` of everything received
      in that tick (follower group commit);
    * the leader's own AppendEntries go out at once: the leader may persist
      in parallel with replication, it only must not *count itself* before
      its copy is durable - the journal is synced at the end of every tick
      and after every incoming message that appended on the leader, and the
      commit index is computed at the start of the next tick;
    * anything else (vote requests and grants, forwarded commands) is sent
      only after a sync, so a term or vote is never announced before it is
      durable.

    It also keeps idle connections alive (:meth:`_tfs_keepalive`).
    """

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:
        self._tfs_deferred: list[tuple[Any, Any]] = []
        #: nodes whose connection finished its handshake (pysyncobj's own
        #: "connected"), and when we last sent each of them something
        self._tfs_up: set[Any] = set()
        self._tfs_sent: dict[Any, float] = {}
        super().__init__(syncObj, selfNode, otherNodes)
        syncObj.addOnTickCallback(self._tfs_flush)
        syncObj.addOnTickCallback(self._tfs_keepalive)

    def _tfs_journal(self) -> DurableJournal | None:
        return getattr(self._syncObj, "tfs_journal", None)

    def send(self, node: Any, message: Any) -> bool:
        journal = self._tfs_journal()
        if journal is not None:
            mtype = message.get("type") if isinstance(message, dict) else None
            if mtype == "next_node_idx":
                self._tfs_deferred.append((node, message))
                return True
            if mtype != "append_entries":
                journal.sync()
        self._tfs_sent[node] = time.monotonic()
        return bool(super().send(node, message))

    def tfs_flush_acks(self) -> None:
        """Start of a tick: acks waiting (appends read by the last poll) go
        out now, after one fdatasync, before the tick posts committed
        entries to the event loop. Otherwise the loop thread applies them
        while this thread is in fdatasync, and this thread waits for the
        GIL (the apply's length, several ms on a loaded host) before it can
        send the ack that the leader's commit waits for (docs/raft.md,
        "Where the time of one create goes")."""
        if self._tfs_deferred:
            self._tfs_flush()

    def _tfs_flush(self) -> None:
        """Tick callback: one fdatasync, then the acks it made true."""
        journal = self._tfs_journal()
        if journal is not None:
            journal.sync()
        deferred, self._tfs_deferred = self._tfs_deferred, []
        for node, message in deferred:
            super().send(node, message)

    def _tfs_keepalive(self) -> None:
        """Tick callback: send a keepalive frame on every connection that
        carried nothing from us for a quarter of ``connectionTimeout``.

        pysyncobj closes a connection on which it *read* nothing for
        ``connectionTimeout``, and it checks that only when the connection
        next sends or receives. Two followers exchange nothing while a
        leader is up, so their connection was always "timed out" by the
        time the leader died: the first vote request on it closed it on
        the sending side (or, on the receiving side, before it was read), the
        vote was lost, and the election waited for a reconnect and a whole
        election timeout (docs/raft.md, "Failover"). The keepalive keeps
        every connection read from well within the timeout; a peer that is
        really gone still times out."""
        every = self._syncObj.conf.connectionTimeout / 4
        now = time.monotonic()
        for node in list(self._tfs_up):
            if now - self._tfs_sent.get(node, 0.0) >= every:
                self._tfs_sent[node] = now
                super().send(node, {"type": KEEPALIVE})

    def _onNodeConnected(self, node: Any) -> None:
        self._tfs_up.add(node)
        self._tfs_sent[node] = time.monotonic()
        super()._onNodeConnected(node)

    def dropNode(self, node: Any) -> None:
        self._tfs_up.discard(node)
        self._tfs_sent.pop(node, None)
        super().dropNode(node)

    def _onNodeDisconnected(self, node: Any) -> None:
        if node in self._tfs_up:
            self._tfs_up.discard(node)
            owner = getattr(self._syncObj, "tfs_owner", None)
            log.info("raft %s: connection to %s closed", getattr(owner, "node_id", "?"), getattr(node, "id", node))
        super()._onNodeDisconnected(node)
        hook = getattr(self._syncObj, "tfs_on_disconnect", None)
        if hook is not None:
            hook(node)

    def _onMessageReceived(self, node: Any, message: Any) -> None:
        if isinstance(message, dict) and message.get("type") == KEEPALIVE:
            return  # it was read: that is all it is for
        fix = getattr(self._syncObj, "tfs_on_message", None)
        if fix is None:
            super()._onMessageReceived(node, message)
        else:
            fix(node, message, super()._onMessageReceived, self)
        journal = self._tfs_journal()
        if journal is not None and journal.dirty and self._syncObj._isLeader():
            # e.g. the no-op appended on winning an election, inside poll():
            # durable before the next tick's commit computation counts it.
            journal.sync()


class _Pending:
    """Result slot of one committed op, filled on the loop thread."""

    __slots__ = ("exc", "result")

    def __init__(self) -> None:
        self.result: bytes = b""
        self.exc: BaseException | None = None


class _Node(SyncObj):  # type: ignore[misc]
    """The SyncObj; its replicated methods run on the tick thread."""

    def __init__(self, owner: RaftReplicator, self_addr: str, others: list[str], conf: SyncObjConf,
                 journal: DurableJournal, sealer: FrameSealer | None) -> None:
        self.tfs_owner = owner
        self.tfs_journal = journal
        self.tfs_on_message: Callable[..., None] | None = owner._on_message
        # Read by the transport (created in SyncObj.__init__) for every
        # connection: set first.
        self.tfs_sealer = sealer
        self.tfs_leader_seen: str | None = None
        # Pre-vote (docs/raft.md, "Pre-vote"), all on the tick thread: when
        # this replica last heard from a leader (raft clock), whether its
        # connection to that leader has closed since, and the round running:
        # the term it is for (0: none), the ids that said yes, and the term
        # a round was won for (the real election at that term may go ahead).
        self.tfs_leader_heard = 0.0
        self.tfs_leader_conn_lost = False
        self.tfs_pre_vote_term = 0
        self.tfs_pre_votes: set[str] = set()
        self.tfs_pre_vote_won = 0
        self.tfs_pre_vote_logged = False  # one log line per period without a leader
        super().__init__(self_addr, others, conf, transportClass=_SyncingTransport)

    @property
    def encryptor(self) -> FrameSealer | None:
        """The one place pysyncobj's transport gets its frame codec from
        (instead of building Fernet from ``conf.password``)."""
        return self.tfs_sealer

    def _onTick(self, timeToWait: float = 0.0) -> None:
        # pysyncobj checks the election deadline *before* reading the socket:
        # a follower that was not scheduled for an election timeout (a loaded
        # host, a long GC) started an election although the leader's
        # heartbeats were waiting in its buffer - seen as elections every few
        # seconds under load. Read what is there first.
        transport = self._SyncObj__transport
        if self._SyncObj__raftState != 2 and transport.ready:
            self._poller.poll(0)
        transport.tfs_flush_acks()
        if self.tfs_owner.recovering:
            self.tfs_owner._recovery_tick(self)
        if self._SyncObj__raftState != 2 and self.tfs_owner._timings.pre_vote:
            self._tfs_pre_vote_tick()
        if self._SyncObj__raftState != 2:
            # The tick ends in a poll of up to timeToWait (50 ms); the
            # election deadline is only looked at after it. Wake at the
            # deadline instead, so an early election (tfs_on_disconnect)
            # starts when it was planned, not on the next 50 ms tick - two
            # survivors woken by the same disconnect tick in step, and
            # their deadlines fell into the same tick (a split vote).
            left = float(getattr(self, "_SyncObj__raftElectionDeadline", 0.0)) - _raft_clock()
            if 0 < left < timeToWait:
                timeToWait = left + 0.001
        if (self._SyncObj__raftState != 2 and self.tfs_owner._timings.pre_vote and self._SyncObj__otherNodes
                and self.tfs_pre_vote_won != self._SyncObj__raftCurrentTerm + 1
                and not self._SyncObj__transferInProgress):
            # pysyncobj campaigns at the start of its tick when the deadline
            # has passed by its clock: a deadline that passed between the
            # pre-vote check above and that one (a preempted tick thread on a
            # loaded host) raised the term with no pre-vote round. A new
            # member did so once and sat as a candidate of a term the others
            # never heard of, refusing the leader's older term (stop 47,
            # docs/raft.md, "Pre-vote"). Only a won round (deadline 0, above)
            # lets it campaign; otherwise the next tick's pre-vote check runs.
            planned: float = getattr(self, "_SyncObj__raftElectionDeadline", 0.0)
            self._SyncObj__raftElectionDeadline = max(planned, _raft_clock() + 0.005)
        super()._onTick(timeToWait)
        leader = self._getLeader()
        leader_id = leader.id if leader is not None else None
        if leader_id != self.tfs_leader_seen:
            self.tfs_leader_seen = leader_id
            LEADER_CHANGES.inc()

    def _tfs_pre_vote_tick(self) -> None:
        """Before pysyncobj's election check: a follower (or a candidate
        whose election failed) whose election deadline has passed asks the
        others whether it could win (``PRE_VOTE``) instead of raising its
        term at once, and moves its deadline to when it will ask again. Only
        when a majority said yes (:meth:`tfs_on_pre_vote_reply` then sets the
        deadline to 0 and ``tfs_pre_vote_won``) does the real election run,
        in pysyncobj's tick. A replica cut off from the leader, alone or
        with a minority, therefore never raises its term, and rejoining it
        does not depose a working leader (docs/raft.md, "Pre-vote")."""
        now = _raft_clock()
        deadline: float = getattr(self, "_SyncObj__raftElectionDeadline", 0.0)
        if deadline >= now or self._SyncObj__selfNode is None:
            return
        others = self._SyncObj__otherNodes
        nxt = self._SyncObj__raftCurrentTerm + 1
        if not others or self.tfs_pre_vote_won == nxt or self._SyncObj__transferInProgress:
            # One replica alone; a round won; or the leader asked this one to
            # take over (TimeoutNow): the election goes ahead now.
            return
        if not self._SyncObj__connectedToAnyone():
            return  # pysyncobj does not campaign either
        if self.tfs_pre_vote_term:
            PRE_VOTE_ROUNDS.labels("lost").inc()  # the last round ran out without a majority
        self.tfs_pre_vote_term = nxt
        self.tfs_pre_votes = {self._SyncObj__selfNode.id}
        if self.tfs_leader_conn_lost:
            # The leader's process is likely gone: ask again soon (a survivor
            # that had not yet seen its own connection close said no).
            lost = self.tfs_owner._timings.leader_lost
            retry = random.uniform(lost / 2, lost) if lost > 0 else self._SyncObj__generateRaftTimeout()
        else:
            retry = self._SyncObj__generateRaftTimeout()
        self._SyncObj__raftElectionDeadline = now + retry
        if not self.tfs_pre_vote_logged:
            self.tfs_pre_vote_logged = True
            log.info("raft %s: no leader heard from; asking the others for pre-votes for term %d before "
                     "campaigning", self.tfs_owner.node_id, nxt)
        ask = {"type": PRE_VOTE, "tfs_term": nxt, "last_log_term": self._SyncObj__getCurrentLogTerm(),
               "last_log_index": self._SyncObj__getCurrentLogIndex()}
        transport = self._SyncObj__transport
        for node in others:
            transport.send(node, ask)

    def tfs_heard_leader(self) -> None:
        """Tick thread: an AppendEntries of the current term (or newer) came
        in: a leader works. A pre-vote round still running is void."""
        self.tfs_leader_heard = _raft_clock()
        self.tfs_leader_conn_lost = False
        self.tfs_pre_vote_logged = False
        self.tfs_pre_vote_won = 0  # a round won before the leader was heard again counts no more
        if self.tfs_pre_vote_term:
            PRE_VOTE_ROUNDS.labels("leader_heard").inc()
            self.tfs_pre_vote_term = 0

    def tfs_on_pre_vote(self, src: Any, message: dict[str, Any], transport: Any) -> None:
        """Tick thread: answer a ``PRE_VOTE`` (see :func:`pre_vote_grant`). A
        leader counts as alive while its last AppendEntries is younger than
        half the minimum election timeout (10 heartbeats by default) and its
        connection has not closed since."""
        timings = self.tfs_owner._timings
        leader = self._SyncObj__raftLeader
        alive = (leader is not None and not self.tfs_leader_conn_lost
                 and _raft_clock() - self.tfs_leader_heard < timings.election_min / 2)
        try:
            cand_term = int(message["tfs_term"])
            cand_last = (int(message["last_log_term"]), int(message["last_log_index"]))
        except (KeyError, TypeError, ValueError):
            return
        granted = pre_vote_grant(
            cand_term=cand_term, cand_last=cand_last, my_term=self._SyncObj__raftCurrentTerm,
            my_last=(self._SyncObj__getCurrentLogTerm(), self._SyncObj__getCurrentLogIndex()),
            leading=self._SyncObj__raftState == 2, leader_alive=alive, recovering=self.tfs_owner.recovering)
        if not granted:
            log.debug("raft %s: pre-vote for term %d refused to %s (its log ends at %s, ours at %s; term %d; "
                      "leader %s, heard from %.3f s ago, connection closed: %s)", self.tfs_owner.node_id, cand_term,
                      getattr(src, "id", src), cand_last,
                      (self._SyncObj__getCurrentLogTerm(), self._SyncObj__getCurrentLogIndex()),
                      self._SyncObj__raftCurrentTerm, getattr(leader, "id", None),
                      _raft_clock() - self.tfs_leader_heard, self.tfs_leader_conn_lost)
        # Our term goes with the answer (not as ``term``: see PRE_VOTE): a
        # candidate whose term is behind learns it, else a replica with an
        # older term but a longer log could never be elected by one with a
        # newer term but a shorter log, nor the other way round.
        transport.send(src, {"type": PRE_VOTE_REPLY, "tfs_term": cand_term, "granted": granted,
                             "tfs_voter_term": self._SyncObj__raftCurrentTerm})

    def tfs_on_pre_vote_reply(self, src: Any, message: dict[str, Any]) -> None:
        """Tick thread: count a yes for the round running; at a majority,
        campaign now (pysyncobj's next tick raises the term and asks for
        real votes). A refusal from a replica whose term is newer than ours
        moves us to that term as a follower (as any Raft message with a newer
        term does), so that the next round asks for a term it can grant."""
        voter_term = message.get("tfs_voter_term")
        if (isinstance(voter_term, int) and voter_term > self._SyncObj__raftCurrentTerm
                and self._SyncObj__raftState != 2 and src in self._SyncObj__otherNodes):
            log.info("raft %s: %s is at term %d, newer than our %d: taking it (as a follower)",
                     self.tfs_owner.node_id, getattr(src, "id", src), voter_term, self._SyncObj__raftCurrentTerm)
            PRE_VOTE_ROUNDS.labels("newer_term").inc()
            self._SyncObj__setCurrentTerm(voter_term, None)
            self._SyncObj__setState(0)  # follower (onStateChanged runs as for pysyncobj's own changes)
            self._SyncObj__raftLeader = None
            self.tfs_pre_vote_term = 0
            self.tfs_pre_vote_won = 0
            return
        term = self.tfs_pre_vote_term
        if not term or message.get("tfs_term") != term or not message.get("granted") \
                or term != self._SyncObj__raftCurrentTerm + 1 or self._SyncObj__raftState == 2 \
                or src not in self._SyncObj__otherNodes:
            return
        self.tfs_pre_votes.add(src.id)
        if len(self.tfs_pre_votes) > (len(self._SyncObj__otherNodes) + 1) / 2:
            PRE_VOTE_ROUNDS.labels("won").inc()
            log.info("raft %s: pre-vote for term %d won (%s); campaigning", self.tfs_owner.node_id, term,
                     ", ".join(sorted(self.tfs_pre_votes)))
            self.tfs_pre_vote_term = 0
            self.tfs_pre_vote_won = term
            self._SyncObj__raftElectionDeadline = 0.0

    def tfs_on_disconnect(self, node: Any) -> None:
        """Tick thread: a peer connection closed. If it was the leader's,
        campaign soon instead of after a whole election timeout: a closed
        connection (not a silent one) is what a dead leader process leaves,
        and a failover then costs ~leader_lost instead of 0.4-0.8 s. A live
        leader that only lost the connection is back with a heartbeat
        before that fires only if it reconnects in time; otherwise this
        replica's election replaces it a little early (docs/raft.md,
        "Failover")."""
        delay = self.tfs_owner._timings.leader_lost
        leader = self._SyncObj__raftLeader
        if leader is not None and leader.id == getattr(node, "id", None):
            self.tfs_leader_conn_lost = True  # pre-vote: this replica no longer counts the leader alive
        if delay <= 0 or self.tfs_owner.recovering or self._SyncObj__raftState != 0 or leader is None \
                or leader.id != getattr(node, "id", None):
            return
        members = [n.id for n in self._SyncObj__otherNodes] + [self._SyncObj__selfNode.id]
        lo, hi = leader_lost_window(self._SyncObj__selfNode.id, members, leader.id, delay)
        # pysyncobj's deadlines are on its own clock (CLOCK_MONOTONIC_RAW),
        # which drifts from time.monotonic (seen: ~0.2 s after 15 h).
        now = _raft_clock()
        soon = now + random.uniform(lo, hi)
        deadline: float = getattr(self, "_SyncObj__raftElectionDeadline", 0.0)
        if soon < deadline:
            self._SyncObj__raftElectionDeadline = soon
            log.info("raft %s: connection to the leader %s closed; campaigning in %.0f ms unless it is back",
                     self.tfs_owner.node_id, leader.id, (soon - now) * 1000)

    @replicated  # type: ignore[misc,untyped-decorator,unused-ignore]
    def tfs_apply(self, op: bytes) -> _Pending:
        return self.tfs_owner._apply_committed(op, self.raftLastApplied + 1)

    @replicated  # type: ignore[misc,untyped-decorator,unused-ignore]
    def tfs_submit_batch(self, ops: list[bytes]) -> list[_Pending]:
        # Several ops in one entry (group commit). pysyncobj numbers the
        # replicated methods in name order, and logs carry those numbers:
        # this name sorts after the older ones so their numbers stay put
        # (tests/meta/test_raft_batch.py checks them).
        return self.tfs_owner._apply_committed_batch(ops, self.raftLastApplied + 1)

    @replicated  # type: ignore[misc,untyped-decorator,unused-ignore]
    def tfs_barrier(self) -> None:
        return None

    @replicated  # type: ignore[misc,untyped-decorator,unused-ignore]
    def tfs_register(self, raft_addr: str, grpc_addr: str) -> None:
        self.tfs_owner._registered[raft_addr] = grpc_addr
        self.tfs_owner._addr_map[raft_addr] = grpc_addr


@dataclass
class RaftDetails:
    """Raft internals of one replica (``GetStatusReply.raft`` on the wire)."""

    raft_addr: str
    grpc_addr: str
    raft_members: list[str]
    addr_map: dict[str, str]
    ready: bool
    log_len: int
    journal_syncs: int
    snapshots: int
    fatal: str
    truncation: dict[str, int]


class RaftTimings:
    """pysyncobj timing knobs, tuned for metadata (see docs/raft.md)."""

    def __init__(
        self,
        heartbeat: float = 0.05,
        election_min: float = 0.4,
        election_max: float = 0.8,
        connection_timeout: float = 1.0,
        connection_retry: float = 0.5,
        step_down: float = 1.5,
        leader_lost: float = 0.25,
        pre_vote: bool = True,
    ) -> None:
        """``leader_lost``: when a follower's connection to its leader closes
        (the leader's process died and its kernel closed the socket), it
        campaigns after a delay in [leader_lost / 5, leader_lost], staggered
        by rank (:func:`leader_lost_window`), instead of a whole election
        timeout; 0 turns that off. ``pre_vote``: ask the others before
        campaigning (docs/raft.md, "Pre-vote"); off only for tests that show
        what it prevents."""
        self.pre_vote = pre_vote
        self.leader_lost = leader_lost
        self.heartbeat = heartbeat
        self.election_min = election_min
        self.election_max = election_max
        self.connection_timeout = connection_timeout
        self.connection_retry = connection_retry
        self.step_down = step_down


def make_conf(timings: RaftTimings, **extra: Any) -> SyncObjConf:
    """The SyncObjConf every TierFS Raft node uses (also used by the bench)."""
    return SyncObjConf(
        appendEntriesUseBatch=False,  # ~0.6 ms per commit instead of ~100 ms
        appendEntriesBatchSizeBytes=_APPEND_BATCH_BYTES,
        appendEntriesPeriod=timings.heartbeat,
        raftMinTimeout=timings.election_min,
        raftMaxTimeout=timings.election_max,
        connectionTimeout=timings.connection_timeout,
        connectionRetryTime=timings.connection_retry,
        leaderFallbackTimeout=timings.step_down,
        autoTickPeriod=min(0.05, timings.heartbeat),
        commandsWaitLeader=False,
        dynamicMembershipChange=True,
        **extra,
    )


class RaftReplicator:
    """Replicates ``sm`` over a pysyncobj cluster. Create it inside a running
    event loop; call :meth:`start` then use it; :meth:`stop` at the end."""

    def __init__(
        self,
        sm: StateMachine,
        *,
        raft_addr: str,
        grpc_addr: str,
        peers: dict[str, str],
        raft_bind_addr: str = "",
        data_dir: str | os.PathLike[str],
        timings: RaftTimings | None = None,
        snapshot_min_entries: int = 10000,
        snapshot_min_interval: float = 600.0,
        fsync: bool = True,
        node_id: str = "",
        exit_on_fatal: bool = False,
        cluster_secret: bytes | None = None,
        journal_recovery: str = "refuse",
        accepted_secrets: Sequence[bytes] = (),
    ) -> None:
        """``cluster_secret``: the secret every replica shares
        (:mod:`tierfs.meta.secret`); ``None`` leaves the Raft port
        unauthenticated, which only in-process tests should do.
        ``accepted_secrets``: frames sealed with these are accepted too (a
        rotation under way)."""
        self._sm = sm
        self._raft_addr = raft_addr
        # pysyncobj listens on every interface unless told: listen where
        # the replica is known (or where the operator says).
        self._raft_bind_addr = raft_bind_addr or raft_addr
        self._grpc_addr = grpc_addr
        self._peers = dict(peers)
        self._dir = Path(data_dir)
        self._timings = timings or RaftTimings()
        self._snap_entries = snapshot_min_entries
        self._snap_interval = snapshot_min_interval
        self._fsync = fsync
        self.node_id = node_id or raft_addr
        self._exit_on_fatal = exit_on_fatal
        self._sealer = (FrameSealer(cluster_secret, self.node_id, accepted_secrets)
                        if cluster_secret is not None else None)
        if journal_recovery not in ("refuse", "resync"):
            raise InvalidArgumentError(f"journal_recovery must be 'refuse' or 'resync', not {journal_recovery!r}")
        self._journal_recovery = journal_recovery
        #: True while this replica rebuilds from its peers after moving a
        #: corrupt journal aside: it neither campaigns nor votes until it has
        #: caught up with a leader (it no longer knows its term, its vote or
        #: the entries it acknowledged; see docs/raft.md).
        self.recovering = False
        # raft -> gRPC: configured seeds, then whatever the log registered.
        self._addr_map: dict[str, str] = {r: g for r, g in self._peers.items() if g}
        self._addr_map[raft_addr] = grpc_addr
        #: the replicated part of the map (from the log and snapshots)
        self._registered: dict[str, str] = {}
        self._node: _Node | None = None
        self._journal: DurableJournal | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._raft_state = 0
        self._applied_ops = 0
        # The log index of the last op the state machine applied (loop thread).
        self._sm_index = 0
        self._barrier_waiters: asyncio.Future[None] | None = None
        self._barrier_running = False
        self._bg_tasks: set[asyncio.Task[None]] = set()
        # group commit (loop thread): ops waiting for an entry, their bytes,
        # entries handed to pysyncobj and not yet resolved
        self._batch: collections.deque[tuple[bytes, asyncio.Future[_Pending]]] = collections.deque()
        self._batch_bytes = 0
        self._inflight: dict[int, tuple[int, float]] = {}  # entry seq -> (term, monotonic start)
        self._entry_seq = 0
        self._flush_scheduled = False
        #: see _check_append; TIERFS_RAFT_STOCK_TRUNCATION=1 turns the fix off
        #: (only to demonstrate the problem in tests)
        self._fix_truncation = os.environ.get("TIERFS_RAFT_STOCK_TRUNCATION", "") != "1"
        self.truncation_stats: collections.Counter[str] = collections.Counter()
        self.snapshots_written = 0
        #: seconds the loop spent forking / the whole snapshot took, last one
        self.last_snapshot_stats: dict[str, float] = {}
        self._snap_pid = 0
        self._fork_failures = 0
        self._snap_started: tuple[float, float, int] = (0.0, 0.0, 0)
        #: the file the running snapshot child writes (its own name each time)
        self._snap_tmp: Path | None = None
        self._snap_seq = 0
        #: tick thread: the leader whose snapshot is being installed, while
        #: its last piece is delivered (_on_message, _deserialize)
        self._install_from: str | None = None
        self.fatal: str = ""
        #: stopped at an entry of newer code (_halt_too_old): applies nothing more
        self.too_old = False

    # --- lifecycle -----------------------------------------------------------

    @property
    def state_machine(self) -> StateMachine:
        return self._sm

    @property
    def raft_addr(self) -> str:
        return self._raft_addr

    @property
    def grpc_addr(self) -> str:
        return self._grpc_addr

    @grpc_addr.setter
    def grpc_addr(self, value: str) -> None:
        """Set once the gRPC server has bound (port 0)."""
        self._grpc_addr = value
        self._addr_map[self._raft_addr] = value

    @property
    def journal(self) -> DurableJournal:
        assert self._journal is not None
        return self._journal

    async def start(self) -> None:
        """Open the journal, bind the Raft port and start the tick thread."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        if self._fsync:
            # The directory's own name (and any new parent's) must be durable
            # too: the journal and the snapshot live in it.
            makedirs_durable(self._dir)
        else:
            self._dir.mkdir(parents=True, exist_ok=True)
        make_private(self._dir)  # the journal and snapshots: the whole namespace
        snap_path = self._dir / SNAPSHOT_FILE
        self._remove_stale_snapshot_files()
        anchor = None
        try:
            if snap_path.exists():
                try:
                    anchor = read_snapshot(snap_path).anchor
                except CorruptError as exc:
                    raise CorruptError(
                        f"{exc.message}. Refusing to start: the snapshot holds the state the journal was "
                        f"compacted into. To rebuild this replica from its peers, start it once with "
                        f"--journal-recovery resync (docs/raft.md, \"Journal corruption\").") from exc
            self._journal = DurableJournal(self._dir, fsync=self._fsync, anchor=anchor)
            self._check_journal_start(snap_path, anchor)
        except CorruptError as exc:
            if self._journal_recovery != "resync":
                raise
            others = [r for r in self._peers if r != self._raft_addr]
            if not others:
                raise CorruptError(f"{exc.message} Cannot re-sync: this replica has no peers.") from exc
            aside = self._move_aside(exc)
            self.recovering = True
            self._journal = DurableJournal(self._dir, fsync=self._fsync)
            log.warning("raft %s: moved the corrupt journal and snapshot to %s; rejoining as an empty member "
                        "that catches up from the leader (no votes until then)", self.node_id, aside)
        self._journal.on_fatal = self._on_journal_error
        conf = make_conf(
            self._timings,
            journalFile=self._journal,
            bindAddress=self._raft_bind_addr,
            fullDumpFile=str(snap_path),
            serializer=self._serialize,
            serializeChecker=self._check_snapshot,
            deserializer=self._deserialize,
            logCompactionMinEntries=self._snap_entries,
            logCompactionMinTime=self._snap_interval,
            onStateChanged=self._on_state_changed,
            maxBindRetries=0,
        )
        others = [r for r in self._peers if r != self._raft_addr]
        if self._sealer is None:
            log.warning("raft replica %s runs WITHOUT a cluster secret: anyone who reaches %s can run "
                        "code as this user (docs/raft.md)", self.node_id, self._raft_addr)
        self._node = _Node(self, self._raft_addr, others, conf, self._journal, self._sealer)
        # The configured peers are the members at first start only: a journal
        # that recorded membership changes (meta-replica add/rm) replays them.
        log.info("raft replica %s started (raft %s, grpc %s, configured peers %s; membership changes in the "
                 "journal apply on top)", self.node_id, self._raft_addr, self._grpc_addr,
                 ", ".join(others) or "none")

    def _remove_stale_snapshot_files(self) -> None:
        """Snapshot files a child of an earlier run of this replica left half
        written (it died, or was killed with its parent). Never renamed into
        place, so never counted on; removed so they do not pile up."""
        for p in self._dir.glob(SNAPSHOT_FILE + ".new*"):
            with contextlib.suppress(OSError):
                p.unlink()
                log.info("raft %s: removed %s, a snapshot an earlier run did not finish", self.node_id, p.name)

    def _check_journal_start(self, snap_path: Path, anchor: tuple[int, int, int, int] | None) -> None:
        """A compacted journal starts where its snapshot ends (pysyncobj keeps
        the snapshot's last two entries in the log). One that starts later
        than the snapshot it needs (none: entry 1) misses every entry between:
        replayed, it would leave the state at the empty namespace (or an old
        snapshot's) while the log claims to be up to date, and this replica
        would never apply another entry, nor be sent a snapshot."""
        journal = self.journal
        if not len(journal):
            return
        first = int(journal[0][1])
        covered = anchor[2] + 1 if anchor is not None else 1
        if first <= covered:
            return
        self._journal = None
        journal.close()
        what = (f"the snapshot {snap_path} ends at entry {anchor[2]}" if anchor is not None
                else f"there is no snapshot ({snap_path} is missing)")
        raise CorruptError(
            f"raft journal {journal.path} starts at entry {first} but {what}: entries before {first} were "
            f"folded into a snapshot that is gone. Refusing to start, since this replica would serve "
            f"a namespace without them. To rebuild it from its peers, start it once with "
            f"--journal-recovery resync (docs/raft.md, \"Journal corruption\").")

    def _move_aside(self, exc: CorruptError) -> Path:
        """Move the journal and snapshot into ``corrupt-<time>/`` in the data
        dir (kept for inspection; nothing is deleted)."""
        aside = self._dir / time.strftime("corrupt-%Y%m%dT%H%M%SZ", time.gmtime())
        aside.mkdir()
        for name in (DurableJournal.FILE, SNAPSHOT_FILE):
            if (self._dir / name).exists():
                os.replace(self._dir / name, aside / name)
        (aside / "REASON").write_text(f"{exc.message}\n")
        if self._fsync:
            fsync_dir(aside)
            fsync_dir(self._dir)
        return aside

    def _recovery_tick(self, node: _Node) -> None:
        """Tick thread, while recovering: keep the election timer from firing
        until this replica has caught up with a leader."""
        if node.isReady():
            self.recovering = False
            log.info("raft %s: caught up with the leader after journal recovery; voting again", self.node_id)
            return
        node._SyncObj__raftElectionDeadline = _raft_clock() + 10 * self._timings.election_max

    async def stop(self) -> None:
        """Stop the tick thread and close the journal (everything synced)."""
        node, self._node = self._node, None
        if node is None:
            return
        node.destroy()
        # The tick thread may be waiting for the loop (snapshot): keep the loop
        # running while joining it.
        await asyncio.get_running_loop().run_in_executor(None, _join_tick_thread, node)
        if self._journal is not None:
            self._journal.close()
        if self._barrier_waiters is not None and not self._barrier_waiters.done():
            self._barrier_waiters.set_exception(UnavailableError("replica stopped"))
        while self._batch:
            _, fut = self._batch.popleft()
            if not fut.done():
                fut.set_exception(UnavailableError("replica stopped"))
        log.info("raft replica %s stopped", self.node_id)

    # --- Replicator API ------------------------------------------------------

    async def submit(self, op: bytes, timeout: float) -> bytes:
        if len(op) > MAX_ENTRY_BYTES:
            raise InvalidArgumentError(f"op of {len(op)} bytes exceeds the cap of {MAX_ENTRY_BYTES} bytes "
                                       "for one Raft log entry")
        self._require_leader()
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_Pending] = loop.create_future()
        self._queue_op(op, fut)
        # A timer rather than asyncio.wait_for, which makes a task per op.
        expiry = loop.call_later(timeout, _expire, fut, timeout)
        try:
            pending = await fut
        except TierFSError as err:
            OPS.labels(type(err).__name__).inc()
            raise
        finally:
            expiry.cancel()
        COMMIT_LATENCY.observe(time.perf_counter() - t0)
        OPS.labels("ok").inc()
        if pending.exc is not None:
            raise InternalError(f"state machine failed to apply: {pending.exc!r}")
        return pending.result

    # --- group commit (loop thread) ---------------------------------------------
    #
    # Ops that wait while earlier entries are in flight go into ONE Raft entry
    # (docs/raft.md, "Group commit"): one log append, one fdatasync per
    # replica, one replication round and one hop to the loop for all of them,
    # instead of one each. Every replica applies the ops of an entry in their
    # order, each with its own result (and its own dedup record).

    def _queue_op(self, op: bytes, fut: asyncio.Future[_Pending]) -> None:
        self._batch.append((op, fut))
        self._batch_bytes += len(op) + _BATCH_OP_OVERHEAD
        if self._batch_bytes >= MAX_ENTRY_BYTES or len(self._batch) >= MAX_BATCH_OPS:
            self._flush_batch(force=True)
        elif not self._flush_scheduled and self._inflight_entries() < MAX_INFLIGHT_ENTRIES:
            # Flushed after the callbacks already queued on the loop ran, so
            # requests that arrived together share the entry.
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush_batch)

    def _flush_batch(self, force: bool = False) -> None:
        """Hand the queued ops to pysyncobj: one entry, or as many as the
        size caps need. Waits (the ops stay queued) while MAX_INFLIGHT_ENTRIES
        entries are uncommitted, unless ``force`` (the queue is full)."""
        if not force:
            self._flush_scheduled = False
        while self._batch and (force or self._inflight_entries() < MAX_INFLIGHT_ENTRIES):
            force = False
            take: list[tuple[bytes, asyncio.Future[_Pending]]] = []
            size = 0
            while self._batch and len(take) < MAX_BATCH_OPS:
                op, fut = self._batch[0]
                if take and size + len(op) + _BATCH_OP_OVERHEAD > MAX_ENTRY_BYTES:
                    break
                self._batch.popleft()
                self._batch_bytes -= len(op) + _BATCH_OP_OVERHEAD
                if fut.done():  # timed out (or cancelled) while queued: never submitted
                    continue
                take.append((op, fut))
                size += len(op) + _BATCH_OP_OVERHEAD
            if take:
                self._submit_entry(take)

    def _inflight_entries(self) -> int:
        """Uncommitted entries this leader submitted in its current term.
        An entry of an earlier term (or one stuck for long) resolves only
        when its index is applied, which can take a while: it does not hold
        new ops back."""
        node = self._node
        term = node.raftCurrentTerm if node is not None else -1
        old = time.monotonic() - 2 * self._timings.step_down
        for seq, (t, since) in list(self._inflight.items()):
            if t != term or since < old:
                del self._inflight[seq]
        return len(self._inflight)

    def _submit_entry(self, take: list[tuple[bytes, asyncio.Future[_Pending]]]) -> None:
        futs = [f for _, f in take]
        try:
            node = self._require_leader()
        except TierFSError as err:
            for f in futs:
                if not f.done():
                    f.set_exception(err)
            return
        loop = self._loop
        assert loop is not None
        self._entry_seq += 1
        seq = self._entry_seq
        self._inflight[seq] = (node.raftCurrentTerm, time.monotonic())
        ENTRY_OPS.observe(len(take))

        def resolve(res: Any, err: int) -> None:  # loop thread
            self._inflight.pop(seq, None)
            if err == FAIL_REASON.SUCCESS:
                results = res if isinstance(res, list) else [res]
                for f, pending in zip(futs, results, strict=True):
                    if not f.done():
                        f.set_result(pending)
            else:
                exc = self._fail_error(err)
                for f in futs:
                    if not f.done():
                        f.set_exception(exc)
            if self._batch and not self._flush_scheduled:
                self._flush_batch()

        def callback(res: Any, err: int) -> None:  # tick thread
            with contextlib.suppress(RuntimeError):  # loop closed: nobody waits any more
                loop.call_soon_threadsafe(resolve, res, err)

        if len(take) == 1:
            # The entry format of a single op is unchanged (old logs replay).
            node.tfs_apply(take[0][0], callback=callback)
        else:
            node.tfs_submit_batch([op for op, _ in take], callback=callback)

    async def read_barrier(self, timeout: float) -> None:
        self._require_leader()
        loop = asyncio.get_running_loop()
        # Join the next barrier: it is started only after every waiter queued
        # for it arrived, so it is committed after each of their calls began.
        if self._barrier_waiters is None:
            self._barrier_waiters = loop.create_future()
        fut = self._barrier_waiters
        self._kick_barrier()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise TimeoutError_(f"read barrier not committed within {timeout:.1f}s") from None

    def _kick_barrier(self) -> None:
        if self._barrier_running or self._barrier_waiters is None:
            return
        fut, self._barrier_waiters = self._barrier_waiters, None
        self._barrier_running = True
        node = self._node

        async def run() -> None:
            try:
                if node is None or not node._isLeader():
                    raise NotLeaderError(leader=self._leader_grpc())
                await self._call(lambda cb: node.tfs_barrier(callback=cb), 30.0)
                READ_BARRIERS.inc()
                if not fut.done():
                    fut.set_result(None)
            except BaseException as exc:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else UnavailableError(str(exc)))
                    fut.exception()  # waiters may all have timed out: mark retrieved
            finally:
                self._barrier_running = False
                self._kick_barrier()

        task = asyncio.get_running_loop().create_task(run())
        self._bg_tasks.add(task)
        task.add_done_callback(self._bg_tasks.discard)

    def status(self) -> ReplicaStatus:
        node = self._node
        if node is None:
            return ReplicaStatus(id=self.node_id, role="stopped", leader="")
        role = _RAFT_ROLES.get(self._raft_state, "follower")
        if node._isLeader():
            role = "leader"
        members = [self._raft_addr, *sorted(n.id for n in node.otherNodes)]
        return ReplicaStatus(
            id=self.node_id,
            role=role,
            leader=self._leader_grpc(),
            term=node.raftCurrentTerm,
            commit_index=node.raftCommitIndex,
            # pysyncobj counts an entry applied only after its result's
            # callback ran, so a handler resumed by that result can see the
            # count one short of the op it just applied: the state machine's
            # own index covers that.
            applied_index=max(node.raftLastApplied, self._sm_index),
            members=[self._addr_map.get(m, m) for m in members],
        )

    def raft_members(self) -> list[str]:
        node = self._node
        if node is None:
            return []
        return [self._raft_addr, *sorted(n.id for n in node.otherNodes)]

    def addr_map(self) -> dict[str, str]:
        return dict(self._addr_map)

    def details(self) -> RaftDetails:
        """What :meth:`status` leaves out: addresses, journal and snapshot counters."""
        j = self._journal
        return RaftDetails(
            raft_addr=self._raft_addr, grpc_addr=self._grpc_addr, raft_members=self.raft_members(),
            addr_map=self.addr_map(), ready=self.is_ready(), log_len=len(j) if j is not None else 0,
            journal_syncs=j.syncs if j is not None else 0, snapshots=self.snapshots_written,
            fatal=self.fatal, truncation=dict(self.truncation_stats),
        )

    def is_ready(self) -> bool:
        """True once this replica has caught up with the leader at least once."""
        return self._node is not None and bool(self._node.isReady())

    async def add_member(self, raft_addr: str, grpc_addr: str, timeout: float) -> None:
        """Add a replica (started with the current members as its peers). It
        catches up by log replay or snapshot install."""
        node = self._require_leader()
        if raft_addr == self._raft_addr or any(n.id == raft_addr for n in node.otherNodes):
            raise InvalidArgumentError(f"{raft_addr} is already a member")
        deadline = time.monotonic() + timeout
        if grpc_addr:
            await self._call(lambda cb: node.tfs_register(raft_addr, grpc_addr, callback=cb), timeout)
        await self._membership(lambda cb: node.addNodeToCluster(raft_addr, callback=cb), deadline)
        log.info("added meta replica %s (grpc %s)", raft_addr, grpc_addr)

    async def remove_member(self, raft_addr: str, grpc_addr: str, timeout: float) -> None:
        """Remove a replica. Removing the leader itself first hands leadership
        to the most caught-up follower and answers NotLeaderError (retry there)."""
        node = self._require_leader()
        if raft_addr == self._raft_addr:
            await self.transfer_leadership(timeout)
            raise NotLeaderError(leader=self._leader_grpc())
        if not any(n.id == raft_addr for n in node.otherNodes):
            raise InvalidArgumentError(f"{raft_addr} is not a member")
        known = self._addr_map.get(raft_addr)
        if grpc_addr and known and known != grpc_addr:
            # The operator is told to stop the replica at grpc_addr next: a
            # mismatch would stop the wrong one (stop 47).
            raise InvalidArgumentError(f"the member at raft {raft_addr} serves gRPC on {known}, not {grpc_addr}: "
                                       f"give its own pair ({raft_addr}={known})")
        deadline = time.monotonic() + timeout
        await self._membership(lambda cb: node.removeNodeFromCluster(raft_addr, callback=cb), deadline)
        log.info("removed meta replica %s", raft_addr)

    async def transfer_leadership(self, timeout: float) -> None:
        node = self._require_leader()
        deadline = time.monotonic() + timeout
        while node._isLeader():
            # pysyncobj only reports "request sent" (or denied while the target
            # catches up): poll until someone else leads.
            node.transferLeadership()
            await asyncio.sleep(0.1)
            if time.monotonic() > deadline:
                raise TimeoutError_("leadership transfer did not complete")

    def force_snapshot(self) -> None:
        """Take a snapshot (and compact the journal) on the next tick."""
        if self._node is not None:
            self._node.forceLogCompaction()

    # --- internals: the asyncio <-> tick-thread bridge ------------------------

    def _require_leader(self) -> _Node:
        node = self._node
        if node is None:
            raise UnavailableError("meta replica is not running")
        if self.fatal:
            raise UnavailableError(f"meta replica failed: {self.fatal}")
        if not node._isLeader():
            raise NotLeaderError(leader=self._leader_grpc())
        return node

    def _leader_grpc(self) -> str:
        node = self._node
        leader = node._getLeader() if node is not None else None
        if leader is None:
            return ""
        return self._addr_map.get(leader.id, "")

    def is_leader(self) -> bool:
        node = self._node
        return node is not None and bool(node._isLeader())

    def forward_addr(self) -> str:
        """Where a follower forwards calls: the leader's gRPC address as this
        replica's own ``--peer RAFT=GRPC`` names it (the replica-to-replica
        path), else as the leader registered it (what clients are told).
        "" while no leader is known, or when this replica leads."""
        node = self._node
        leader = node._getLeader() if node is not None else None
        if leader is None or leader.id == self._raft_addr:
            return ""
        return self._peers.get(leader.id) or self._addr_map.get(leader.id, "")

    def export_metrics(self) -> None:
        """Make this replica the one the process's Raft gauges describe
        (read at every scrape; the daemon has one replica)."""
        def role(name: str) -> Callable[[], float]:
            return lambda: 1.0 if self.status().role == name else 0.0

        def lag() -> float:
            node = self._node
            return float(max(0, node.raftCommitIndex - max(node.raftLastApplied, self._sm_index))) if node else 0.0

        def journal_bytes() -> float:
            try:
                return float((self._dir / DurableJournal.FILE).stat().st_size)
            except OSError:
                return 0.0

        TERM.set_function(lambda: float(self._node.raftCurrentTerm) if self._node is not None else 0.0)
        for name in ("leader", "follower", "candidate"):
            ROLE.labels(name).set_function(role(name))
        APPLY_LAG.set_function(lag)
        COMMIT_INDEX.set_function(lambda: float(self._node.raftCommitIndex) if self._node is not None else 0.0)
        APPLIED_INDEX.set_function(lambda: float(self.status().applied_index))
        JOURNAL_BYTES.set_function(journal_bytes)

    async def _call(self, start: Callable[[Callable[[Any, int], None]], None], timeout: float) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def resolve(res: Any, err: int) -> None:
            if fut.done():
                return
            if err == FAIL_REASON.SUCCESS:
                fut.set_result(res)
            else:
                fut.set_exception(self._fail_error(err))

        def callback(res: Any, err: int) -> None:  # tick thread
            with contextlib.suppress(RuntimeError):  # loop closed: nobody waits any more
                loop.call_soon_threadsafe(resolve, res, err)

        start(callback)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError_(f"not committed within {timeout:.1f}s (outcome unknown)") from None

    def _fail_error(self, err: int) -> TierFSError:
        if err in (FAIL_REASON.NOT_LEADER, FAIL_REASON.LEADER_CHANGED, FAIL_REASON.DISCARDED,
                   FAIL_REASON.MISSING_LEADER):
            return NotLeaderError(leader=self._leader_grpc())
        if err == FAIL_REASON.QUEUE_FULL:
            return BusyError("raft command queue full")
        if err == FAIL_REASON.REQUEST_DENIED:
            return BusyError("request denied (a membership change is in progress)")
        return UnavailableError(f"raft outcome unknown (reason {err}); retry")

    async def _membership(self, start: Callable[[Callable[[Any, int], None]], None], deadline: float) -> None:
        while True:
            try:
                await self._call(start, max(0.1, deadline - time.monotonic()))
                return
            except BusyError:
                # Denied until this term's no-op and the previous change apply.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the event loop thread and wait (from the tick thread)."""
        loop = self._loop
        assert loop is not None
        if threading.get_ident() == self._loop_thread:
            return fn()
        cf: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                cf.set_result(fn())
            except BaseException as exc:
                cf.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return cf.result(timeout=120)

    def _apply_committed(self, op: bytes, index: int) -> _Pending:
        """Tick thread: queue a committed op for the loop thread, in log order."""
        return self._apply_committed_batch([op], index)[0]

    def _apply_committed_batch(self, ops: list[bytes], index: int) -> list[_Pending]:
        """Tick thread: queue the ops of one committed entry for the loop
        thread, in log order; they are applied in one callback, in order."""
        pendings = [_Pending() for _ in ops]
        sm = self._sm

        def run() -> None:
            if self.too_old:
                # Stopped at an entry of newer code: nothing after it is
                # applied either (in order or not at all).
                for pending in pendings:
                    pending.exc = UnavailableError(self.fatal)
                return
            for i, (op, pending) in enumerate(zip(ops, pendings, strict=True)):
                try:
                    pending.result = sm.apply(op)
                except ReplicaTooOldError as exc:
                    self._halt_too_old(exc, index)
                    for p in pendings[i:]:
                        p.exc = UnavailableError(self.fatal)
                    return
                except Exception as exc:  # the SM contract says never; keep replicas alike
                    log.exception("state machine raised applying index %d", index)
                    pending.exc = exc
            self._applied_ops += len(ops)
            self._sm_index = max(self._sm_index, index)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(run)
        return pendings

    def _halt_too_old(self, exc: ReplicaTooOldError, index: int) -> None:
        """Loop thread: the log holds an entry this code cannot apply the way
        its writer did. Stop here (the process exits in the daemon) rather
        than skip it or apply it differently: a restart with the same code
        stops at the same entry, one with the newer code applies it."""
        self.too_old = True
        self.fatal = f"cannot apply log index {index}: {exc}"
        log.critical("raft %s: %s", self.node_id, self.fatal)
        if self._exit_on_fatal:
            logging.shutdown()
            os._exit(70)

    def _on_journal_error(self, exc: BaseException) -> None:
        # After a failed fsync the page cache can no longer be trusted
        # (fsyncgate): stop serving; the process restarts from disk.
        self.fatal = f"journal write failed: {exc!r}"
        if self._exit_on_fatal:
            log.critical("raft %s: %s; exiting", self.node_id, self.fatal)
            os._exit(70)

    def _on_state_changed(self, old: int, new: int) -> None:  # tick thread
        self._raft_state = new
        node = self._node
        IS_LEADER.set(1 if new == 2 else 0)
        if node is not None:
            RAFT_TERM.set(node.raftCurrentTerm)
        log.info("raft %s: %s -> %s (term %s)", self.node_id, _RAFT_ROLES.get(old), _RAFT_ROLES.get(new),
                 node.raftCurrentTerm if node is not None else "?")
        if new == 2 and node is not None and self._registered.get(self._raft_addr) != self._grpc_addr:
            # Tell the followers where clients should go.
            node.tfs_register(self._raft_addr, self._grpc_addr)

    def _on_message(self, src: Any, message: Any, deliver: Callable[[Any, Any], None], transport: Any) -> None:
        """Tick thread: every incoming Raft message passes here.

        Works around pysyncobj truncating its log on *every* AppendEntries
        whose prevLogIdx is below its last entry, conflict or not (the
        "truncating already-applied log entries" warning; docs/raft.md)."""
        node = self._node
        ack: int | None = None
        mtype = message.get("type") if isinstance(message, dict) else None
        if self.recovering and mtype == "request_vote":
            return  # it forgot whom it voted for: no vote until caught up
        if mtype in (PRE_VOTE, PRE_VOTE_REPLY):
            if node is not None:
                if mtype == PRE_VOTE:
                    node.tfs_on_pre_vote(src, message, transport)
                else:
                    node.tfs_on_pre_vote_reply(src, message)
            return  # pysyncobj never sees them
        if node is not None and mtype == "append_entries" and message.get("term", -1) >= node.raftCurrentTerm:
            node.tfs_heard_leader()
        if node is not None and mtype == "append_entries" and "prevLogIdx" in message \
                and "transmission" not in message and message["term"] >= node.raftCurrentTerm:
            message, ack = self._check_append(message, node.raftLastApplied)
        if node is not None and mtype == "next_node_idx" and self._fix_truncation \
                and message.get("success") and not message.get("reset") and node._isLeader():
            # A late ack for an older AppendEntries must not pull nextIndex back
            # below what was already sent (that makes the leader resend entries
            # the follower holds, and pysyncobj then truncates them).
            next_index = getattr(node, "_SyncObj__raftNextIndex", None)
            before = next_index.get(src) if next_index is not None else None
            deliver(src, message)
            if next_index is not None and before is not None and next_index.get(src, before) < before:
                next_index[src] = before
                self.truncation_stats["next_index_kept"] += 1
        elif mtype == "append_entries" and message.get("serialized") is not None:
            # A piece of a snapshot from the leader; the last one installs it
            # (_deserialize), which must not drop the leader (see there).
            self._install_from = getattr(src, "id", None)
            try:
                deliver(src, message)
            finally:
                self._install_from = None
        else:
            deliver(src, message)
        if ack is not None:
            transport.send(src, {"type": "next_node_idx", "next_node_idx": ack, "reset": False, "success": True})
        journal = self._journal
        if journal is not None:
            JOURNAL_SYNCS.set(journal.syncs)

    def _check_append(self, msg: dict[str, Any], last_applied: int) -> tuple[dict[str, Any], int | None]:
        """Classify an AppendEntries that would make pysyncobj truncate, and
        rewrite it so that only a real conflict truncates (Raft fig. 2, step 3)."""
        j = self._journal
        assert j is not None
        if not len(j):
            return msg, None
        p = msg["prevLogIdx"]
        first, n = j[0][1], j[-1][1]
        if p is None or n <= p or p < first or j[p - first][2] != msg["prevLogTerm"]:
            return msg, None  # no truncation here (or pysyncobj rejects / resets)
        entries = msg.get("entries", [])
        for e in entries:
            idx, term = e[1], e[2]
            if idx > n:
                break
            if j[idx - first][2] != term:
                self.truncation_stats["conflict"] += 1
                if idx <= last_applied:
                    log.critical("raft %s: leader conflicts with applied entry %d", self.node_id, idx)
                return msg, None  # a real conflict: Raft truncates from there
        m = entries[-1][1] if entries else p
        needless = p + 1 <= last_applied
        if needless:
            self.truncation_stats["stale_resend_applied"] += 1
        else:
            self.truncation_stats["stale_resend"] += 1
        if not self._fix_truncation:
            return msg, None
        if m >= n:
            new = [e for e in entries if e[1] > n]
            return {**msg, "prevLogIdx": n, "prevLogTerm": j[n - first][2], "entries": new}, None
        if j[n - first][2] == msg["term"]:
            # Our last entry came from this very leader: by log matching our
            # whole log equals its prefix.
            return {**msg, "prevLogIdx": n, "prevLogTerm": msg["term"], "entries": []}, None
        # A tail from an older term that this message does not cover: keep it
        # (unverified, so do not vouch for it) - deliver as a heartbeat with
        # the commit index clamped to what was verified, and ack up to m.
        hb = {k: v for k, v in msg.items() if k not in ("prevLogIdx", "prevLogTerm", "entries")}
        hb["commit_index"] = min(msg["commit_index"], m)
        self.truncation_stats["kept_old_tail"] += 1
        return hb, m + 1

    # --- snapshots (tick thread) -------------------------------------------------

    def _serialize(self, tmp_path: str, data: tuple[Any, Any, Any]) -> None:
        """Tick thread: start a snapshot, off the critical path.

        The state is exactly at the snapshot's index on the loop thread
        between two callbacks (committed ops are posted there in order), so
        the loop forks there - a copy-on-write image of the state, made in
        milliseconds - and goes on; the child serializes, writes and fsyncs
        the snapshot and exits, :meth:`_check_snapshot` (pysyncobj's
        ``serializeChecker``, polled every tick) reaps it and renames the file
        into place. Neither the event loop nor the Raft tick waits for the
        serialization (docs/raft.md, "Snapshots"). pysyncobj then tries to
        rename ``tmp_path``, which does not exist: it fails quietly and only
        the checker's verdict counts."""
        last, prev, cluster = data
        if self._snap_pid:
            return
        snap = SnapshotFile(
            last=tuple(last), prev=tuple(prev),  # type: ignore[arg-type]
            members=sorted(n.id for n in cluster), addr_map=dict(self._registered), state=b"",
        )
        # Each child writes a file of its own: a child orphaned by a replica
        # killed mid-snapshot (it dies with its parent now, but the kernel
        # takes a moment) must never write into the file a later child's
        # checker renames into place - an old state under a new snapshot's
        # index, sent to followers as the state at that index.
        self._snap_seq += 1
        tmp = self._dir / f"{SNAPSHOT_FILE}.new.{os.getpid()}.{self._snap_seq}"
        self._snap_tmp = tmp
        path = str(tmp)
        t0 = time.monotonic()
        self._snap_started = (t0, 0.0, int(last[1]))
        if self._fork_failures >= 2:
            # Forked children keep failing: serialize here, blocking (the
            # pre-fork behaviour) rather than never compacting.
            snap.state = self._on_loop(self._sm.snapshot)
            write_snapshot(path, snap, fsync=self._fsync)
            self._snap_pid = -1
            self._fork_failures = 0
            return
        self._snap_pid = self._on_loop(lambda: self._fork_snapshot(path, snap))
        self._snap_started = (t0, time.monotonic() - t0, int(last[1]))

    async def digest(self) -> tuple[str, int, int]:
        """Loop thread: (state digest, applied index, ops applied) now. A
        state of FORK_DIGEST_INODES inodes or more is hashed by a forked
        child (a copy-on-write image, made in milliseconds), as snapshots
        are: serializing 200k inodes on the loop holds the GIL for seconds,
        the Raft tick thread waits, and the followers elect (seen in the
        200k growth test, tests/meta/test_snapshot_growth.py)."""
        sm = self._sm
        applied = self.status().applied_index
        ops = int(getattr(sm, "ops_applied", 0))
        if len(getattr(sm, "inodes", ())) < FORK_DIGEST_INODES:
            return sm.digest(), applied, ops
        r, w = os.pipe()
        try:
            pid = _fork_child(lambda: os.write(w, sm.digest().encode()), keep_fd=w)
        finally:
            os.close(w)

        def collect() -> tuple[bytes, int]:
            try:
                chunks = []
                while chunk := os.read(r, 4096):
                    chunks.append(chunk)
            finally:
                os.close(r)
            return b"".join(chunks), os.waitpid(pid, 0)[1]

        out, status = await asyncio.to_thread(collect)
        if status != 0 or len(out) != 64:
            raise InternalError(f"the digest child failed (wait status {status})")
        return out.decode(), applied, ops

    def _fork_snapshot(self, path: str, snap: SnapshotFile) -> int:
        """Loop thread: fork a child that writes ``snap`` with the current
        state. Returns the child's pid."""

        def write() -> None:
            snap.state = self._sm.snapshot()
            write_snapshot(path, snap, fsync=self._fsync)

        return _fork_child(write)

    def _check_snapshot(self) -> int:
        """Tick thread (pysyncobj's ``serializeChecker``): the state of the
        snapshot child, renaming its file into place once it succeeded."""
        pid = self._snap_pid
        if not pid:
            return _SER_IDLE
        if pid == -1:
            rpid, status = pid, 0  # written in-process
        else:
            try:
                rpid, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                rpid, status = pid, -1
        if rpid == 0:
            return _SER_BUSY
        self._snap_pid = 0
        t0, fork_s, index = self._snap_started
        new = self._snap_tmp if self._snap_tmp is not None else self._dir / (SNAPSHOT_FILE + ".new")
        self._snap_tmp = None
        if status != 0:
            self._fork_failures += 1
            log.error("raft %s: snapshot child for index %d failed (wait status %d)", self.node_id, index, status)
            with contextlib.suppress(OSError):
                new.unlink()
            return _SER_FAILED
        if pid != -1:
            self._fork_failures = 0
        # The directory is fsynced by the journal rewrite that follows, before
        # the journal drops the entries folded into this snapshot.
        try:
            os.replace(new, self._dir / SNAPSHOT_FILE)
            size = (self._dir / SNAPSHOT_FILE).stat().st_size
        except OSError as exc:
            # The data directory failed under us (a dead disk or mount: seen
            # in the power-loss test). The journal still holds every entry
            # (it is compacted only after _SER_DONE), so this is a failed
            # snapshot, not lost data: pysyncobj tries again later, and a
            # disk that is really gone fails the next journal write, which
            # stops the replica.
            log.error("raft %s: snapshot for index %d not put in place: %s", self.node_id, index, exc)
            return _SER_FAILED
        self.snapshots_written += 1
        self.last_snapshot_stats = {"fork_s": fork_s, "total_s": time.monotonic() - t0}
        SNAPSHOTS.inc()
        log.info("raft %s: snapshot at index %d (%d bytes; fork %.1f ms, %.2f s in all)", self.node_id, index,
                 size, fork_s * 1000, time.monotonic() - t0)
        return _SER_DONE

    def _deserialize(self, path: str) -> tuple[Any, Any, list[TCPNode]]:
        try:
            if self._fsync:
                # An installed snapshot arrives via a plain write+rename: make it
                # durable before the journal is cleared on its account.
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                fsync_dir(Path(path).parent)
            snap = read_snapshot(path)
            self._on_loop(lambda: self._sm.restore(snap.state))
        except Exception as exc:
            self.fatal = f"cannot load snapshot {path}: {exc!r}"
            log.critical("raft %s: %s", self.node_id, self.fatal)
            if self._exit_on_fatal:
                os._exit(70)
            raise
        self._registered = dict(snap.addr_map)
        self._addr_map.update(snap.addr_map)
        self._addr_map[self._raft_addr] = self._grpc_addr
        members = list(snap.members)
        src = self._install_from
        if src is not None and src not in members:
            # The members a snapshot records are those of when it was taken.
            # The leader sending it may have joined since (by an entry after
            # the snapshot's index, which it sends next): pysyncobj would set
            # the members to the snapshot's, drop its connection to the
            # leader and refuse it from then on, and this replica would never
            # catch up. Keep the leader; the entries that follow add it again
            # (a no-op) and remove whoever left (docs/raft.md, "Membership").
            log.info("raft %s: snapshot at index %d names members %s; keeping the leader %s that sent it",
                     self.node_id, snap.last[1], ", ".join(members), src)
            members.append(src)
        log.info("raft %s: loaded snapshot at index %d", self.node_id, snap.last[1])
        return snap.last, snap.prev, [TCPNode(m) for m in members]


def _fork_child(work: Callable[[], object], keep_fd: int = -1) -> int:
    """Loop thread: fork a child that runs ``work`` on a copy-on-write image
    of this process (the state as it is now) and exits, 0 if ``work``
    returned. Returns the child's pid. Used for snapshots and digests of a
    large state, which would hold the GIL for seconds on the loop."""
    # Move every object alive now out of the cyclic GC's reach (freed by
    # refcount as usual): a full collection walks and writes every object -
    # with 200k inodes that is a long GIL stall for the Raft tick, and while
    # a child runs it would copy every page. The state holds no reference
    # cycles; young garbage is collected first.
    gc.collect(1)
    gc.freeze()
    parent = os.getpid()
    with warnings.catch_warnings():
        # The child only computes, writes and exits (no threads, no locks of
        # the parent's other threads are needed): fork is safe here.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            # Die with the parent: a replica killed (SIGKILL, OOM) while this
            # child works must not leave it writing on - at nice 19 on a busy
            # host it can outlive the restart that follows.
            _die_with_parent(parent)
            # Nothing may run that touches the parent's other threads'
            # objects: a garbage collection would finalize gRPC objects whose
            # threads do not exist here (seen: SIGSEGV).
            gc.disable()
            # Let go of every inherited socket and file at once (but
            # ``keep_fd``): a peer must see this replica's connections close
            # when the parent dies, and a restarted replica must be able to
            # bind its ports while this child still works.
            top = os.sysconf("SC_OPEN_MAX")
            if keep_fd >= 3:
                os.closerange(3, keep_fd)
                os.closerange(keep_fd + 1, top)
            else:
                os.closerange(3, top)
            # Background work: the parent's event loop and Raft tick (and the
            # other replicas on a shared host) go first.
            os.nice(19)
            work()
            code = 0
        finally:
            os._exit(code)
    return pid


_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in the parent: dlopen in a child forked from
    a threaded process could wait for ever on a loader lock another thread
    held at the fork."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None  # not Linux: a child finishes on its own


_prctl = _load_prctl()


def _die_with_parent(parent: int) -> None:  # pragma: no cover - runs in the child
    """Child: ask the kernel for SIGKILL when the parent (the thread that
    forked, here the event loop's, which lives as long as the process) dies;
    exit at once if it is already gone."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _expire(fut: asyncio.Future[Any], timeout: float) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError_(f"not committed within {timeout:.1f}s (outcome unknown)"))


def _join_tick_thread(node: SyncObj) -> None:
    thread = getattr(node, "_SyncObj__thread", None)
    if thread is not None:
        thread.join(timeout=30)
