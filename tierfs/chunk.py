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

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c

__all__ = [
    "GEN_SHIFT",
    "MAX_UPLOAD_SEQ",
    "ChunkRecord",
    "chunk_crc",
    "chunk_crc_of",
    "chunk_records",
    "crc32c",
    "crc32c_combine",
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


def chunk_records(info: Any) -> dict[int, ChunkRecord]:
    """A file's committed chunks, by index (``FileInfo.chunks``)."""
    return {r.index: ChunkRecord.from_pb(r) for r in info.chunks}


def chunk_crc_of(pieces: Iterable[tuple[int, int]]) -> int:
    """:func:`chunk_crc` from the data fragments' own CRC32Cs: ``pieces`` is
    (CRC32C, stored length) of each data fragment, in order. No pass over
    the bytes (a rebuild knows the CRC of every fragment it fetched: the data
    plane checked it on arrival)."""
    c = 0
    for crc, n in pieces:
        c = crc32c_combine(c, crc, n)
    return c


# GF(2) operators "append 2**i zero bytes" for CRC32C (reflected polynomial
# 0x82F63B78), each as 32 column vectors; built once, on first use.
_ZEROS_OPS: list[list[int]] = []


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _zeros_ops() -> list[list[int]]:
    if not _ZEROS_OPS:
        op = [0x82F63B78] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):  # -> one zero byte
            op = [_gf2_times(op, op[n]) for n in range(32)]
        ops = [op]
        for _ in range(1, 64):
            op = [_gf2_times(op, op[n]) for n in range(32)]
            ops.append(op)
        _ZEROS_OPS[:] = ops
    return _ZEROS_OPS


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``a + b`` from ``crc1 = crc32c(a)``, ``crc2 = crc32c(b)``
    and ``len2 = len(b)`` (zlib's crc32_combine, for CRC32C), without the
    bytes: O(bits set in len2) small steps."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros_op(len2), crc1) ^ crc2


@functools.lru_cache(maxsize=256)
def _zeros_op(n: int) -> tuple[int, ...]:
    """The operator "append ``n`` zero bytes", composed once per length (a
    chunk's fragments repeat a handful of lengths): one small step per
    combine instead of one per bit set in ``n``."""
    ops = _zeros_ops()
    op: tuple[int, ...] | None = None
    i = 0
    while n:
        if n & 1:
            op = tuple(ops[i]) if op is None else tuple(_gf2_times(ops[i], c) for c in op)
        n >>= 1
        i += 1
    assert op is not None
    return op
