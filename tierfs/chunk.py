"""Chunk records: generations, valid bytes and fragment lengths, in one place.

The invariant TierFS is built around: every acknowledged byte maps to
exactly one *generation* of exactly one set of fragments, and a reader,
scrubber or rebuilder can tell a fragment of the right generation from any
other. The rules that uphold it live here and nowhere else; the client's
read and write paths, the repair worker, the scrubber and meta all call
these functions (STYLE.md 13: one rule, one place).

* **Generation.** Every upload of a chunk gets its own generation,
  ``(data_version << GEN_SHIFT) | seq``: ``data_version`` is the write
  session's (bumped by every ``open_write``), ``seq`` counts the uploads of
  that chunk within the session. Fragments carry the generation as their
  version, so a fragment left behind by an earlier upload (a node that was
  down while the chunk was rewritten) has another key and is never read as
  this one. Meta commits the generation of each chunk at close.
* **Length and valid bytes.** ``length`` is the logical length encoded into
  the fragments at upload: it fixes every fragment's stored length
  (:func:`fragment_size`), which is what decode, rebuild and scrub need.
  ``valid`` (at most ``length``) is how many of the chunk's bytes read as
  data: a truncate lowers it without rewriting fragments, and bytes from
  ``valid`` to the chunk's end in the file read as zeros
  (:func:`valid_bytes`). Rebuilds never trim to ``valid`` or to the file
  size: a rebuilt fragment must match its parity, so it is rebuilt at its
  stored length.
* **Checksum.** ``crc`` is the CRC32C of chunk bytes ``[0, length)``: the
  K data fragments' stored bytes in order (:func:`chunk_crc`), or a whole
  replica. Degraded reads, rebuilds and the scrubber's whole-chunk check
  compare against it.
* **Placement.** Fragment ``j`` is valid only on the group's current
  member at position ``j``. A writer whose group changed during its session
  (a rebalance move, a drain, a replacement) has some fragments on former
  members (:func:`moved_positions`): it sends those to the current members
  before it commits; meta marks any it still finds on a member announced
  after the writer's map missing at commit (``pos_epoch``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c

__all__ = [
    "GEN_SHIFT",
    "MAX_UPLOAD_SEQ",
    "ChunkRecord",
    "chunk_crc",
    "crc32c",
    "fragment_size",
    "generation",
    "moved_positions",
    "parity_size",
    "session_version",
    "valid_bytes",
]

#: Bits of a generation that count the uploads of one chunk in one session.
GEN_SHIFT = 20
MAX_UPLOAD_SEQ = (1 << GEN_SHIFT) - 1


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli), chainable: crc32c(b, crc32c(a)) == crc32c(a + b)."""
    return int(_crc32c.crc32c(data, value, 1))


def generation(data_version: int, seq: int) -> int:
    """The generation of upload ``seq`` (0, 1, ...) of a chunk in the write
    session tagged ``data_version``."""
    if not 0 <= seq <= MAX_UPLOAD_SEQ:
        raise ValueError(f"upload sequence {seq} outside [0, {MAX_UPLOAD_SEQ}]")
    return (data_version << GEN_SHIFT) | seq


def session_version(gen: int) -> int:
    """The ``data_version`` of the session that made generation ``gen``."""
    return gen >> GEN_SHIFT


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """What meta records about one committed chunk (``pb.ChunkRecord``)."""

    generation: int
    length: int
    valid: int
    crc: int
    missing: tuple[int, ...] = ()

    @classmethod
    def from_pb(cls, r: Any) -> ChunkRecord:
        return cls(int(r.generation), int(r.length), int(r.valid), int(r.crc32c), tuple(sorted(r.missing)))

    def fill_pb(self, out: Any, index: int) -> Any:
        out.index, out.generation, out.length, out.valid, out.crc32c = (
            index, self.generation, self.length, self.valid, self.crc)
        del out.missing[:]
        out.missing.extend(self.missing)
        return out


def valid_bytes(rec: ChunkRecord, idx: int, chunk_size: int, file_size: int) -> int:
    """How many leading bytes of chunk ``idx`` read as data. Everything after
    them, up to the chunk's end in the file, reads as zeros."""
    return max(0, min(rec.valid, rec.length, chunk_size, file_size - idx * chunk_size))


def parity_size(k: int, chunk_size: int, length: int) -> int:
    """P: the stored length of every parity fragment (and the longest data
    fragment) of an EC chunk of logical ``length``."""
    return min(-(-chunk_size // k), length)


def fragment_size(j: int, k: int, chunk_size: int, length: int, *, replicated: bool = False) -> int:
    """Stored bytes of fragment ``j`` of a chunk of logical ``length``
    (fragments are stored trimmed: see tierfs.client.codec)."""
    if replicated:
        return length
    f = -(-chunk_size // k)
    p = min(f, length)
    return max(0, min(length - j * f, p)) if j < k else p


def moved_positions(placed: Sequence[int], members: Sequence[int], missing: Iterable[int]) -> list[int]:
    """Positions of a chunk whose fragment was stored on ``placed[j]`` and
    whose group member there is now another target (``members``, the
    group in a newer map): they no longer count until sent to the new
    member. Positions the chunk's record lists as not stored are not
    fragments to move."""
    if len(placed) != len(members):
        raise ValueError(f"group width changed from {len(placed)} to {len(members)}")
    skip = set(missing)
    return [j for j, (a, b) in enumerate(zip(placed, members, strict=True)) if a != b and j not in skip]


def chunk_crc(data_fragments: Sequence[Any] | Iterable[Any]) -> int:
    """CRC32C of a chunk's logical bytes from its K data fragments' stored
    bytes, in order (a replica: the one copy)."""
    c = 0
    for frag in data_fragments:
        c = crc32c(frag, c)
    return c
