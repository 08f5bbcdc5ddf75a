"""Contracts between the metadata state machine and its replication layer.

The state machine (``tierfs.meta.state``) is deterministic: the same ops in
the same order give the same state and the same digest on every replica. Ops
and results are opaque bytes to the replicator (serialized protobuf). Anything
time-dependent (mtime, lease expiry) travels inside the op, stamped by the
leader, never read from the local clock inside ``apply``.

The replicator (``tierfs.meta.raft.RaftReplicator`` in production,
:class:`LocalReplicator` for single-process tests) orders ops, makes them
durable on a majority, applies them, and answers the submitter.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol


class ReplicaTooOldError(Exception):
    """Raised by :meth:`StateMachine.apply` for an entry written by newer code
    than this replica runs: the replica must stop, neither skip the entry
    nor apply it its own way (the replicas' states would differ)."""


class LegacyEntryError(ReplicaTooOldError):
    """Raised by :meth:`StateMachine.apply` for an entry of an older release
    that this code cannot apply the way that release did (it relied on
    behaviour since removed): the replica stops rather than build a
    different state. The way out is a snapshot taken by the older release
    (docs/operations.md, "Upgrading meta replicas")."""


class StateMachine(Protocol):
    def apply(self, op: bytes) -> bytes:
        """Apply one committed op and return its serialized result. Must not
        raise for bad input: errors are part of the result, so every replica
        records the same outcome. The one exception: ReplicaTooOldError."""

    def snapshot(self) -> bytes:
        """Serialize the whole state (used for Raft snapshots)."""

    def restore(self, data: bytes) -> None:
        """Replace the whole state with a snapshot."""

    def digest(self) -> str:
        """A stable hash of the whole state, equal on replicas that applied
        the same ops."""


@dataclass
class ReplicaStatus:
    id: str
    role: str  # "leader" | "follower" | "candidate" | "standalone"
    leader: str  # gRPC address of the leader, "" if unknown
    term: int = 0
    commit_index: int = 0
    applied_index: int = 0
    members: list[str] = field(default_factory=list)  # gRPC addresses


class Replicator(Protocol):
    @property
    def state_machine(self) -> StateMachine: ...

    async def submit(self, op: bytes, timeout: float) -> bytes:
        """Replicate ``op``; return its result once it is committed (durable
        on a majority) and applied. Raises NotLeaderError (with the leader's
        gRPC address) on a follower, TimeoutError_ past ``timeout``."""

    async def read_barrier(self, timeout: float) -> None:
        """Return once the local state reflects every op committed before the
        call (linearizable reads). Raises NotLeaderError on a follower."""

    def status(self) -> ReplicaStatus: ...


class LocalReplicator:
    """A single-process, non-replicated Replicator for unit tests of the
    service and state machine. Not durable; never used by the daemon."""

    def __init__(self, sm: StateMachine, addr: str = "local") -> None:
        self._sm = sm
        self._addr = addr
        self._index = 0
        self._lock = asyncio.Lock()

    @property
    def state_machine(self) -> StateMachine:
        return self._sm

    async def submit(self, op: bytes, timeout: float) -> bytes:
        async with self._lock:
            self._index += 1
            return self._sm.apply(op)

    async def read_barrier(self, timeout: float) -> None:
        return None

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(
            id=self._addr, role="standalone", leader=self._addr,
            commit_index=self._index, applied_index=self._index, members=[self._addr],
        )
