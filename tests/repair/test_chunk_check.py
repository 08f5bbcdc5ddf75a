"""The chunk math of repair and the whole-chunk scrub, in process (the real
ISA-L codec, no daemons): rebuilding fragments at their recorded lengths,
refusing sources that do not decode to the chunk's CRC32C, and finding
which fragments of a chunk are wrong when each one's own CRC holds."""

from __future__ import annotations

import itertools

import pytest

from tests.repair.util import random_bytes
from tierfs.chunk import ChunkRecord, chunk_crc
from tierfs.client.codec import Codec
from tierfs.errors import CorruptError
from tierfs.storage.repair import _File, find_bad_fragments, reencode_chunk, solve_chunk

pytestmark = pytest.mark.timeout(60)

KiB = 1024
CS = 64 * KiB


def _chunk(length: int, seed: int = 1) -> tuple[_File, ChunkRecord, list[bytes]]:
    codec = Codec("ec", 4, 2)
    buf = bytearray(codec.encode_size(CS))
    buf[:length] = random_bytes(length, seed)
    frags = [bytes(v) for v in codec.encode(memoryview(buf), length, CS)]
    rec = ChunkRecord(generation=1 << 20, length=length, valid=length, crc=chunk_crc(frags[:4]))
    f = _File(kind=1, k=4, m=2, chunk_size=CS, size=length, groups=[1], chunks={0: rec}, writing=False,
              data_version=1)
    return f, rec, frags


def _flip(b: bytes) -> bytes:
    return bytes([b[0] ^ 1]) + b[1:]


@pytest.mark.parametrize("length", [1, 3000, 16 * KiB + 5, 40 * KiB, CS])
def test_fragments_are_rebuilt_at_their_recorded_length(length: int) -> None:
    f, rec, frags = _chunk(length)
    assert [len(v) for v in frags] == f.sizes(rec)
    # Any two lost, from the four others: byte for byte the originals.
    for lost in itertools.combinations(range(6), 2):
        have = {i: frags[i] for i in range(6) if i not in lost}
        out = solve_chunk(f, rec, have, lost)
        assert {i: bytes(out[i]) for i in lost} == {i: frags[i] for i in lost}, lost
    # A truncate lowers valid, not length: the rebuild does not change.
    short = ChunkRecord(rec.generation, rec.length, 6, rec.crc)
    assert bytes(solve_chunk(f, short, {i: frags[i] for i in (1, 2, 3, 4)}, [0])[0]) == frags[0]


def test_sources_that_do_not_match_the_chunk_crc_are_refused() -> None:
    f, rec, frags = _chunk(40 * KiB)
    have = {i: frags[i] for i in (1, 2, 3, 4)}
    have[4] = _flip(have[4])  # a parity fragment with valid CRCs of its own, wrong bytes
    with pytest.raises(CorruptError, match="crc32c"):
        solve_chunk(f, rec, have, [0])
    wrong = ChunkRecord(rec.generation, rec.length, rec.valid, rec.crc ^ 1)
    with pytest.raises(CorruptError, match="crc32c"):
        solve_chunk(f, wrong, {i: frags[i] for i in range(4)})


@pytest.mark.parametrize("length", [3000, 40 * KiB, CS])
def test_bad_fragments_are_found_by_leaving_fragments_out(length: int) -> None:
    f, rec, frags = _chunk(length, seed=2)
    have = dict(enumerate(frags))
    assert find_bad_fragments(f, rec, have) == {}
    assert [bytes(v) for v in reencode_chunk(f, rec, solve_chunk(f, rec, have))] == frags
    stored = [i for i in range(6) if frags[i]]  # zero-length fragments cannot differ
    for n in (1, 2):
        for bad in itertools.combinations(stored, n):
            h = {i: _flip(v) if i in bad else v for i, v in have.items()}
            assert set(find_bad_fragments(f, rec, h) or {}) == set(bad), bad
    # Three wrong of six: no four-of-six subset explains them all.
    h = {i: _flip(v) if i in stored[:3] else v for i, v in have.items()}
    if len(stored) >= 3:
        assert find_bad_fragments(f, rec, h) is None
