"""The durable Raft journal and the snapshot file format of the meta service.

pysyncobj's own ``FileJournal`` writes through ``mmap`` and never syncs, and
it stores ``currentTerm``/``votedFor`` with a plain rename: a power loss can
lose acknowledged entries or let a replica vote twice in one term. This
module replaces it.

:class:`DurableJournal` implements pysyncobj's ``Journal`` interface over one
append-only file of CRC32C-framed records (entries, truncations, term/vote,
commit index). Mutations only fill an in-memory buffer; :meth:`DurableJournal.sync`
writes the buffer and ``fdatasync``\\ s it. The replicator calls ``sync()``
before any Raft message leaves the process and at the end of every tick, so

* a follower's AppendEntries success, a vote and a candidate's vote request
  are sent only once the entries / term / vote they vouch for are on disk;
* the leader's own copy of an entry is durable before its next commit
  computation counts it (several entries added in one tick share one
  ``fdatasync``: group commit).

Dropping a prefix (log compaction) or clearing the log (snapshot install)
rewrites the file: temp file, fsync, rename, fsync of the directory; the
directory is fsynced *before* the rewrite so that the snapshot the prefix was
folded into is durable first.

A torn tail (a crash in the middle of a write that was never acknowledged) is
detected by its CRC and cut off on open. A bad record that intact records
follow is not a torn tail but damage to synced data: opening fails with
:class:`JournalCorruptError` (file and offset) instead of dropping the rest.

Snapshots (:func:`write_snapshot` / :func:`read_snapshot`) hold the state
machine's ``snapshot()`` bytes plus the Raft bookkeeping pysyncobj needs (the
last two log entries folded in, the cluster members, the raft->gRPC address
map), framed with a CRC32C.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
from pysyncobj.journal import Journal

from tierfs.errors import CorruptError
from tierfs.fsutil import fsync_dir, makedirs_durable

__all__ = [
    "DurableJournal",
    "JournalCorruptError",
    "SnapshotFile",
    "fsync_dir",
    "read_snapshot",
    "write_snapshot",
]

log = logging.getLogger(__name__)

#: (command, index, term): pysyncobj's in-memory log entry.
Entry = tuple[bytes, int, int]

_MAGIC = b"TFSJRNL1"
_REC_HDR = struct.Struct("<II")  # payload length, crc32c(payload)
_ENTRY = struct.Struct("<QQ")  # index, term
_U64 = struct.Struct("<Q")
_T_ENTRY = 1
_T_TRUNCATE = 2  # drop entries with index >= value
_T_VOTE = 3  # term + votedFor
_T_COMMIT = 4  # commit index
_MAX_RECORD = 1 << 30
_TYPES = (_T_ENTRY, _T_TRUNCATE, _T_VOTE, _T_COMMIT)


def _record(rtype: int, body: bytes) -> bytes:
    payload = bytes((rtype,)) + body
    return _REC_HDR.pack(len(payload), crc32c.crc32c(payload)) + payload


def _entry_record(command: bytes, idx: int, term: int) -> bytes:
    return _record(_T_ENTRY, _ENTRY.pack(idx, term) + command)


def _vote_record(term: int, voted_for: str | None) -> bytes:
    who = b"\xff" if voted_for is None else b"\x00" + voted_for.encode()
    return _record(_T_VOTE, _U64.pack(term) + who)


class JournalCorruptError(CorruptError):
    """A record in the middle of the journal (not its tail) failed its CRC."""

    def __init__(self, message: str, *, path: Path, offset: int) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset


def _next_valid_record(data: bytes, start: int) -> int | None:
    """Offset of the first intact record (plausible length and type, CRC
    matching) at or after ``start``, or None. Only run on a bad record; a
    torn tail is short, so this is cheap where it matters."""
    n = len(data)
    for off in range(start, n - _REC_HDR.size):
        length, crc = _REC_HDR.unpack_from(data, off)
        end = off + _REC_HDR.size + length
        if length < 2 or end > n or data[off + _REC_HDR.size] not in _TYPES:
            continue
        if crc32c.crc32c(data[off + _REC_HDR.size : end]) == crc:
            return off
    return None


class DurableJournal(Journal):  # type: ignore[misc]
    """pysyncobj ``Journal`` backed by an fsynced append-only record file.

    Thread-safety: pysyncobj calls every method from its tick thread; the
    lock only guards :meth:`sync` against a concurrent :meth:`close`.
    """

    FILE = "raft.log"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: bool = True,
        anchor: tuple[int, int, int, int] | None = None,
    ) -> None:
        """Open (or create) the journal in ``directory``.

        ``anchor`` is ``(prev_idx, prev_term, last_idx, last_term)`` of the
        newest durable snapshot: entries before ``prev_idx`` are already
        folded into it and are dropped on open, so a crash between writing a
        snapshot and compacting the journal cannot make pysyncobj discard the
        journal's tail (see docs/raft.md, "divergence").
        """
        self._dir = Path(directory)
        if fsync:
            # The directory's own name (and any new parent's) must be durable too.
            makedirs_durable(self._dir)
        else:
            self._dir.mkdir(parents=True, exist_ok=True)
        self._path = self._dir / self.FILE
        self._fsync = fsync
        self._lock = threading.Lock()
        self._entries: list[Entry] = []
        self._term = 0
        self._voted_for: str | None = None
        self._commit = 1
        self._commit_written = 1
        self._pending = bytearray()
        self._rewrite = False
        self._closed = False
        self._failed: BaseException | None = None
        #: called (tick thread) when a write or fdatasync fails
        self.on_fatal: Callable[[BaseException], None] | None = None
        #: counters for metrics and tests
        self.syncs = 0
        self.slow_syncs = 0  # syncs that took over 0.2 s
        self.bytes_written = 0
        self._load()
        if anchor is not None:
            self._apply_anchor(anchor)
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self._rewrite:
            self.sync()

    # --- loading -------------------------------------------------------------

    def _load(self) -> None:
        if not self._path.exists():
            self._rewrite = True  # writes the magic + state atomically
            return
        data = self._path.read_bytes()
        if not data.startswith(_MAGIC):
            raise CorruptError(f"{self._path}: not a TierFS raft journal")
        pos = len(_MAGIC)
        good = pos
        why = ""
        while pos + _REC_HDR.size <= len(data):
            length, crc = _REC_HDR.unpack_from(data, pos)
            end = pos + _REC_HDR.size + length
            if length == 0 or length > _MAX_RECORD or end > len(data):
                why = f"bad record length {length}"
                break
            payload = data[pos + _REC_HDR.size : end]
            if crc32c.crc32c(payload) != crc:
                why = "CRC mismatch"
                break
            self._replay(payload)
            pos = good = end
        if good != len(data):
            later = _next_valid_record(data, good + 1)
            if later is not None:
                # Not a torn tail: intact records follow the bad one, so it is
                # damage to data that was synced (and maybe acknowledged).
                # Cutting here would silently drop every later entry.
                raise JournalCorruptError(
                    f"raft journal {self._path} is corrupt in the middle: record at byte {good} "
                    f"({why or 'truncated header'}) is followed by intact records (the next at byte "
                    f"{later}, file size {len(data)}). Refusing to start, since dropping the rest "
                    f"could lose acknowledged entries. To rebuild this replica from its peers, "
                    f"start it once with --journal-recovery resync (docs/raft.md, "
                    f"\"Journal corruption\").", path=self._path, offset=good)
            # A torn tail: written but never synced, hence never acknowledged.
            log.warning("raft journal %s: cutting torn tail at byte %d of %d", self._path, good, len(data))
            with open(self._path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        self._commit = self._commit_written = min(self._commit, self._last_index())

    def _replay(self, payload: bytes) -> None:
        rtype = payload[0]
        body = payload[1:]
        if rtype == _T_ENTRY:
            idx, term = _ENTRY.unpack_from(body)
            self._entries.append((bytes(body[_ENTRY.size :]), idx, term))
        elif rtype == _T_TRUNCATE:
            (idx,) = _U64.unpack_from(body)
            while self._entries and self._entries[-1][1] >= idx:
                self._entries.pop()
        elif rtype == _T_VOTE:
            (self._term,) = _U64.unpack_from(body)
            who = body[_U64.size :]
            self._voted_for = None if who[:1] == b"\xff" else who[1:].decode()
        elif rtype == _T_COMMIT:
            (self._commit,) = _U64.unpack_from(body)
        else:
            raise CorruptError(f"{self._path}: unknown record type {rtype}")

    def _apply_anchor(self, anchor: tuple[int, int, int, int]) -> None:
        prev_idx, prev_term, last_idx, last_term = anchor
        if not self._entries or self._entries[0][1] >= prev_idx:
            return
        pos = prev_idx - self._entries[0][1]
        if (
            pos + 1 < len(self._entries)
            and self._entries[pos][1:] == (prev_idx, prev_term)
            and self._entries[pos + 1][1:] == (last_idx, last_term)
        ):
            log.info("raft journal: dropping %d entries already in snapshot at %d", pos, last_idx)
            del self._entries[:pos]
            self._rewrite = True

    def _last_index(self) -> int:
        return self._entries[-1][1] if self._entries else 0

    # --- pysyncobj Journal interface ----------------------------------------

    def add(self, command: bytes, idx: int, term: int) -> None:
        self._entries.append((command, idx, term))
        if not self._rewrite:
            self._pending += _entry_record(command, idx, term)

    def clear(self) -> None:
        self._entries = []
        self._pending.clear()
        self._rewrite = True

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        if entryFrom >= len(self._entries):
            return
        first_removed = self._entries[entryFrom][1]
        del self._entries[entryFrom:]
        if not self._rewrite:
            self._pending += _record(_T_TRUNCATE, _U64.pack(first_removed))

    def deleteEntriesTo(self, entryTo: int) -> None:
        del self._entries[:entryTo]
        self._pending.clear()
        self._rewrite = True

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        self.close()

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        # Volatile in Raft; persisted lazily (piggybacked on the next sync,
        # or by the one-second timer) only to re-apply faster on restart.
        self._commit = raftCommitIndex

    def getRaftCommitIndex(self) -> int:
        return max(1, min(self._commit, self._last_index()))

    def setCurrentTerm(self, term: int, votedForNodeId: str | None) -> None:
        self._term = term
        self._voted_for = votedForNodeId
        if not self._rewrite:
            self._pending += _vote_record(term, votedForNodeId)

    def getCurrentTerm(self) -> int:
        return self._term

    def getVotedForNodeId(self) -> str | None:
        return self._voted_for

    def onOneSecondTimer(self) -> None:
        if self._commit != self._commit_written:
            self.sync(force_commit=True)

    # --- durability ------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        return bool(self._pending) or self._rewrite

    def sync(self, force_commit: bool = False) -> None:
        """Write everything buffered and make it durable (one fdatasync)."""
        with self._lock:
            if self._closed:
                return
            if self._failed is not None:
                raise OSError(f"raft journal unusable after an earlier failure: {self._failed!r}")
            t0 = time.monotonic()
            try:
                self._sync_locked(force_commit)
            except OSError as exc:
                self._failed = exc
                log.critical("raft journal %s: write/fsync failed: %r", self._path, exc)
                if self.on_fatal is not None:
                    self.on_fatal(exc)
                raise
            took = time.monotonic() - t0
            if took > 0.2:
                # The tick thread waits for this: long enough and followers elect.
                self.slow_syncs += 1
                log.warning("raft journal %s: sync took %.2f s", self._path, took)

    def _sync_locked(self, force_commit: bool) -> None:
        if self._rewrite:
            self._do_rewrite()
            return
        if not self._pending and not force_commit:
            return
        if self._commit != self._commit_written and self._commit <= self._last_index():
            self._pending += _record(_T_COMMIT, _U64.pack(self._commit))
            self._commit_written = self._commit
        if not self._pending:
            return
        buf = bytes(self._pending)
        self._pending.clear()
        view = memoryview(buf)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self._fsync:
            os.fdatasync(self._fd)
        self.syncs += 1
        self.bytes_written += len(buf)

    def _do_rewrite(self) -> None:
        if self._fsync:
            fsync_dir(self._dir)  # a snapshot renamed just before must be durable first
        parts = [_MAGIC, _vote_record(self._term, self._voted_for)]
        parts.extend(_entry_record(*e) for e in self._entries)
        commit = min(self._commit, self._last_index())
        parts.append(_record(_T_COMMIT, _U64.pack(commit)))
        data = b"".join(parts)
        tmp = self._path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        os.replace(tmp, self._path)
        if self._fsync:
            fsync_dir(self._dir)
        if hasattr(self, "_fd"):
            os.close(self._fd)
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)
        self._commit_written = commit
        self._pending.clear()
        self._rewrite = False
        self.syncs += 1
        self.bytes_written += len(data)

    def close(self) -> None:
        self.sync()
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._fd)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def last_index(self) -> int:
        return self._last_index()


# --- snapshots -----------------------------------------------------------------

_SNAP_MAGIC = b"TFSSNAP1"
_SNAP_HDR = struct.Struct("<QQI")  # header json length, state length, crc32c of both


@dataclass
class SnapshotFile:
    """The decoded content of a snapshot file."""

    last: Entry  # the last entry folded into the state
    prev: Entry  # the entry before it (pysyncobj keeps both in the log)
    members: list[str]  # raft addresses of the cluster at that point
    addr_map: dict[str, str]  # raft address -> gRPC address
    state: bytes  # StateMachine.snapshot()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def anchor(self) -> tuple[int, int, int, int]:
        return (self.prev[1], self.prev[2], self.last[1], self.last[2])


def write_snapshot(path: str | os.PathLike[str], snap: SnapshotFile, *, fsync: bool = True) -> int:
    """Write ``snap`` to ``path`` and fsync it (the caller renames it into
    place). Returns the number of bytes written."""
    header = json.dumps(
        {
            "members": snap.members,
            "addr_map": snap.addr_map,
            "extra": snap.extra,
            "entries": pickle.dumps((snap.last, snap.prev), protocol=4).hex(),
        },
        sort_keys=True,
    ).encode()
    crc = crc32c.crc32c(snap.state, crc32c.crc32c(header))
    with open(path, "wb") as f:
        f.write(_SNAP_MAGIC + _SNAP_HDR.pack(len(header), len(snap.state), crc))
        f.write(header)
        f.write(snap.state)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        return f.tell()


def read_snapshot(path: str | os.PathLike[str]) -> SnapshotFile:
    """Read and verify a snapshot file (CorruptError on a bad checksum)."""
    data = Path(path).read_bytes()
    if not data.startswith(_SNAP_MAGIC) or len(data) < len(_SNAP_MAGIC) + _SNAP_HDR.size:
        raise CorruptError(f"{path}: not a TierFS meta snapshot")
    hlen, slen, crc = _SNAP_HDR.unpack_from(data, len(_SNAP_MAGIC))
    start = len(_SNAP_MAGIC) + _SNAP_HDR.size
    header = data[start : start + hlen]
    state = data[start + hlen : start + hlen + slen]
    if len(state) != slen or crc32c.crc32c(state, crc32c.crc32c(header)) != crc:
        raise CorruptError(f"{path}: snapshot checksum mismatch")
    h = json.loads(header)
    last, prev = pickle.loads(bytes.fromhex(h["entries"]))
    return SnapshotFile(
        last=tuple(last), prev=tuple(prev), members=list(h["members"]),  # type: ignore[arg-type]
        addr_map=dict(h["addr_map"]), state=state, extra=dict(h.get("extra", {})),
    )
