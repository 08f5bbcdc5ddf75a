"""The chunk math of repair and the whole-chunk scrub, in process (the real
ISA-L codec, no daemons): rebuilding fragments at their recorded lengths,
refusing sources that do not decode to the chunk's CRC32C, and finding
which fragments of a chunk are wrong when each one's own CRC holds."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

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


# ---- the rebuild worker's in-place path (ISA-L on pooled buffers) -----------------


@pytest.mark.parametrize(("k", "m"), [(4, 2), (6, 3), (2, 1), (10, 4)])
def test_isal_rebuilds_what_pyeclib_encoded(k: int, m: int) -> None:
    """tierfs.isal computes the code pyeclib's isa_l_rs_cauchy encodes: any
    K fragments give back every other one byte for byte."""
    from tierfs import isal
    from tierfs.chunk import parity_size

    assert isal.available()
    codec = Codec("ec", k, m)
    cs = k * 8 * KiB
    length = cs - 777
    buf = bytearray(codec.encode_size(cs))
    buf[:length] = random_bytes(length, 7)
    frags = codec.encode(memoryview(buf), length, cs)
    p = parity_size(k, cs, length)
    full = [bytes(v) + bytes(p - len(v)) for v in frags]
    for src in itertools.islice(itertools.combinations(range(k + m), k), 40):
        lost = [j for j in range(k + m) if j not in src]
        outs = {j: memoryview(bytearray(p)) for j in lost}
        isal.rebuild_into(k, m, {i: memoryview(bytearray(full[i])) for i in src}, outs)
        assert {j: bytes(v) for j, v in outs.items()} == {j: full[j] for j in lost}, src
    with pytest.raises(ValueError):
        isal.rebuild_into(k, m, {i: memoryview(bytearray(p)) for i in range(k - 1)}, {k: memoryview(bytearray(p))})


def test_crc32c_combine_matches_the_crc_of_the_joined_bytes() -> None:
    from tierfs.chunk import chunk_crc_of, crc32c, crc32c_combine

    for n1, n2 in [(0, 0), (1, 1), (5, 0), (0, 7), (1000, 4096), (1 << 20, (1 << 20) - 3), (12345, 77777)]:
        a, b = random_bytes(n1, n1 + 1), random_bytes(n2, n2 + 2)
        assert crc32c_combine(crc32c(a), crc32c(b), n2) == crc32c(a + b), (n1, n2)
    _, rec, frags = _chunk(40 * KiB)
    assert chunk_crc_of((crc32c(v), len(v)) for v in frags[:4]) == rec.crc


def _in_place(f: _File, rec: ChunkRecord, frags: list[bytes], src: Sequence[int], j: int,
              crcs: dict[int, int] | None = None) -> tuple[memoryview, int, dict[int, memoryview]]:
    from tierfs.chunk import crc32c, parity_size
    from tierfs.storage.repair import rebuild_in_place

    p = parity_size(f.k, f.chunk_size, rec.length)
    rooms = {i: memoryview(bytearray(max(p, len(frags[i])) + 1)) for i in src}
    for i in src:
        rooms[i][: len(frags[i])] = frags[i]
        rooms[i][len(frags[i]):] = b"\xff" * (len(rooms[i]) - len(frags[i]))  # not zeros: the tail is the callee's
    have = {i: rooms[i][: len(frags[i])] for i in src}
    outs = {i: memoryview(bytearray(p)) for i in sorted(({*range(f.k)} | {j}) - set(src))}
    crcs = crcs if crcs is not None else {i: crc32c(frags[i]) for i in src}
    payload, crc = rebuild_in_place(f, rec, have, crcs, rooms, outs, j)
    return payload, crc, outs


@pytest.mark.parametrize("length", [1, 3000, 16 * KiB + 5, 40 * KiB, CS])
def test_rebuild_in_place_writes_the_fragment_into_the_given_buffer(length: int) -> None:
    """The rebuild worker's path: any lost fragment from any K others, byte
    for byte, in the caller's (pooled) buffer, with its CRC32C; a short data
    source is zero-extended in its own buffer."""
    from tierfs.chunk import crc32c

    f, rec, frags = _chunk(length, seed=3)
    for j in range(6):
        for src in itertools.combinations([i for i in range(6) if i != j], 4):
            payload, crc, outs = _in_place(f, rec, frags, src, j)
            assert bytes(payload) == frags[j], (j, src)
            assert crc == crc32c(frags[j])
            assert payload.obj is outs[j].obj  # no copy: the caller's buffer


def test_rebuild_in_place_refuses_sources_that_do_not_match_the_chunk_crc() -> None:
    """The chunk CRC32C check holds on the in-place path too: wrong bytes in
    a source (whose own CRC32C, as fetched, holds) or a wrong fetched CRC32C
    are refused, nothing is returned."""
    from tierfs.chunk import crc32c

    f, rec, frags = _chunk(40 * KiB)
    bad = list(frags)
    bad[4] = _flip(bad[4])
    with pytest.raises(CorruptError, match="crc32c"):
        _in_place(f, rec, bad, (1, 2, 3, 4), 0, {i: crc32c(bad[i]) for i in (1, 2, 3, 4)})
    bad = list(frags)
    bad[2] = _flip(bad[2])  # a data source: its fetched CRC32C is its own
    with pytest.raises(CorruptError, match="crc32c"):
        _in_place(f, rec, bad, (0, 2, 3, 4), 1, {i: crc32c(bad[i]) for i in (0, 2, 3, 4)})
    wrong = ChunkRecord(rec.generation, rec.length, rec.valid, rec.crc ^ 1)
    with pytest.raises(CorruptError, match="crc32c"):
        _in_place(f, wrong, frags, (0, 2, 3, 5), 1)
