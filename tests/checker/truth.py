"""The truth about what the storage targets hold, computed independently of
the scrubber: fragment files parsed and checked straight from the targets'
directories, compared with meta's chunk records.

For each committed chunk of each live file (``meta.stat(inode).chunks``) and
each position of its placement group: is there a fragment file of the
*committed generation* on the target that holds that position, with a valid
header and payload CRC32C, of the stored length the chunk record gives it?
Positions without one are *missing* (or *corrupt* when a file is there but
fails its checks). The fragments of a chunk must also agree with each other:
the K data fragments' bytes must match the record's CRC32C, and re-encoding
them must give the stored parity (every replica identical): otherwise the
chunk is *mismatched*. Any other fragment file is *stale*: another
generation of a live chunk (unless it belongs to a write session still
open), a chunk the file no longer has, a file that no longer exists, or a
target that no longer holds that position.

The fragment file format is read from its description in docs/storage.md,
not through the storage engine, so that a bug there cannot hide itself.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c as _crc32c

from tierfs.client.codec import Codec, codec_for
from tierfs.errors import NotFoundError
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["Rec", "Truth", "chunk_table", "in_session", "parse_fragment", "scan"]

# magic, format, flags, hdr_len, inode, chunk, fragment, version, size, crc, block, nblocks (docs/storage.md)
_FIXED = struct.Struct("<8sHHIQQQQQIII")
_BLOCK = 64 << 10


def _crc(data: Any, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value, 1))


@dataclass(frozen=True)
class Rec:
    """A committed chunk as meta records it. ``length``/``valid``/``crc`` are
    None on code that predates chunk records (0a0eac0: version runs only)."""

    generation: int
    length: int | None
    valid: int | None
    crc: int | None
    missing: tuple[int, ...] = ()


def chunk_table(info: pb.FileInfo) -> dict[int, Rec]:
    """A file's committed chunks by index, from ``FileInfo.chunks`` (chunk
    records, or the older runs of (first, count, version))."""
    out: dict[int, Rec] = {}
    r: Any
    for r in info.chunks:
        if hasattr(r, "generation"):
            out[int(r.index)] = Rec(int(r.generation), int(r.length), int(r.valid), int(r.crc32c),
                                    tuple(sorted(int(j) for j in r.missing)))
        else:
            for i in range(int(r.first), int(r.first + r.count)):
                out[i] = Rec(int(r.version), None, None, None)
    return out


def in_session(gen: int, data_version: int) -> bool:
    """Generation ``gen`` was made by the session tagged ``data_version``
    (``(dv << 20) | seq``; on 0a0eac0 the version was ``dv`` itself)."""
    return gen == data_version or gen >> 20 == data_version


@dataclass
class Fragment:
    target: int
    node: str  # storage-<i>
    path: Path
    inode: int
    chunk: int
    fragment: int
    version: int
    payload: bytes | None  # None: the file fails its checks
    problem: str = ""


def parse_fragment(path: Path, target: int, node: str) -> Fragment | None:
    """A fragment file, its header and payload checked; None if the name is
    not a fragment's (``<chunk:x>.<fragment:x>.<version:x>``)."""
    try:
        chunk, frag, ver = (int(x, 16) for x in path.name.split("."))
        inode = int(path.parent.name, 16)
    except ValueError:
        return None
    f = Fragment(target, node, path, inode, chunk, frag, ver, None)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None  # deleted (GC, scrub) while we looked
    if len(raw) < _FIXED.size:
        f.problem = f"{len(raw)} bytes: truncated header"
        return f
    magic, fmt, _flags, hdr_len, ino, ch, fr, vr, size, crc, block, nblocks = _FIXED.unpack_from(raw, 0)
    end = _FIXED.size + 4 * nblocks
    if magic != b"TFSFRAG1" or fmt != 1 or block != _BLOCK or nblocks != -(-size // _BLOCK) or len(raw) < end + 4:
        f.problem = f"bad header (magic {magic!r}, format {fmt}, {nblocks} blocks of {block}, size {size})"
        return f
    if struct.unpack_from("<I", raw, end)[0] != _crc(raw[:end]):
        f.problem = "header CRC mismatch"
        return f
    if (ino, ch, fr, vr) != (inode, chunk, frag, ver):
        f.problem = f"header names {(ino, ch, fr, vr)}, the file name {(inode, chunk, frag, ver)}"
        return f
    payload = raw[hdr_len: hdr_len + size]
    if len(payload) != size:
        f.problem = f"payload {len(payload)} of {size} bytes"
        return f
    if _crc(payload) != crc:
        f.problem = "payload CRC mismatch"
        return f
    f.payload = payload
    return f


@dataclass
class Truth:
    """What is wrong on disk, each entry a readable line."""

    missing: list[str] = field(default_factory=list)  # a position without a valid committed-generation fragment
    corrupt: list[str] = field(default_factory=list)  # a fragment file failing its own checks
    mismatched: list[str] = field(default_factory=list)  # fragments that disagree with each other or the record
    stale: list[str] = field(default_factory=list)  # fragments no committed chunk needs
    in_flight: int = 0  # fragments of open write sessions (not counted against cleanliness)
    waiting_gc: int = 0  # fragments of generations whose GC grace runs (readers may hold them; not stale)
    chunks: int = 0
    fragments: int = 0
    #: (inode, chunk) -> positions holding a valid committed fragment, and on which node each.
    valid: dict[tuple[int, int], dict[int, str]] = field(default_factory=dict)
    #: (inode, chunk, position) -> CRC32C of the payload of each valid position.
    payload_crc: dict[tuple[int, int, int], int] = field(default_factory=dict)
    records: dict[int, dict[int, Rec]] = field(default_factory=dict)
    widths: dict[int, tuple[Codec, int]] = field(default_factory=dict)  # inode -> codec, chunk size

    @property
    def clean(self) -> bool:
        return not (self.missing or self.corrupt or self.mismatched or self.stale)

    def summary(self, n: int = 8) -> str:
        parts = [f"{len(getattr(self, k))} {k}" for k in ("missing", "corrupt", "mismatched", "stale")]
        lines = [f"truth: {', '.join(parts)}; {self.chunks} chunks, {self.fragments} fragments, "
                 f"{self.in_flight} of open sessions"]
        for k in ("missing", "corrupt", "mismatched", "stale"):
            for x in getattr(self, k)[:n]:
                lines.append(f"  {k}: {x}")
        return "\n".join(lines)


def _targets_on_disk(cluster_dir: Path) -> dict[int, tuple[Path, str]]:
    out: dict[int, tuple[Path, str]] = {}
    for tj in sorted(cluster_dir.glob("storage-*/t*/target.json")):
        try:
            tid = int(json.loads(tj.read_text())["target_id"])
        except (ValueError, KeyError, OSError):
            continue
        out[tid] = (tj.parent, tj.parent.parent.name)
    return out


async def _scan(meta: list[str], cluster_dir: Path, inodes: Iterable[int], sessions: dict[int, int],
                skip: set[int], gc_before: set[GCKey]) -> Truth:
    t = Truth()
    targets = {tid: v for tid, v in _targets_on_disk(cluster_dir).items() if tid not in skip}
    frags: list[Fragment] = []
    for tid, (root, node) in sorted(targets.items()):
        for p in sorted(root.glob("frags/*/*/*")):
            f = parse_fragment(p, tid, node)
            if f is not None:
                frags.append(f)
    t.fragments = len(frags)
    async with MetaClient(meta, deadline=20) as mc:
        cmap = await mc.get_cluster_map()
        groups = {g.group_id: list(g.target_ids) for g in cmap.groups}
        infos: dict[int, pb.FileInfo | None] = {}
        for ino in sorted(set(inodes) | {f.inode for f in frags}):
            try:
                infos[ino] = await mc.stat(ino)
            except NotFoundError:
                infos[ino] = None
        # Asked after the records: a generation they show replaced or gone
        # has its GC item by then (the same op queued it). Fragments GC
        # accounts for: kept while the grace runs, then GC deletes them.
        waiting = await _gc_known(mc, targets) | gc_before
    by_key: dict[tuple[int, int, int, int], list[Fragment]] = {}
    for f in frags:
        by_key.setdefault((f.inode, f.chunk, f.fragment, f.version), []).append(f)
    for f in frags:
        info = infos.get(f.inode)
        rec = chunk_table(info).get(f.chunk) if info is not None else None
        where = f"inode {f.inode} chunk {f.chunk} fragment {f.fragment} v{f.version:#x} on {f.node} (target {f.target})"
        if f.payload is None and rec is not None and rec.generation == f.version:
            t.corrupt.append(f"{where}: {f.problem}")
            continue
        gc_wait = (f.inode, f.chunk, f.fragment, f.version, f.target) in waiting
        if info is None:
            if gc_wait:
                t.waiting_gc += 1
            else:
                t.stale.append(f"{where}: the file is gone")
            continue
        if rec is None or rec.generation != f.version:
            if f.inode in sessions and in_session(f.version, sessions[f.inode]):
                t.in_flight += 1
            elif gc_wait:
                t.waiting_gc += 1
            elif rec is None:
                t.stale.append(f"{where}: the file has no committed chunk {f.chunk}")
            else:
                t.stale.append(f"{where}: committed generation is {rec.generation:#x}")
            continue
        lay = info.layout
        members = groups.get(lay.groups[f.chunk % len(lay.groups)], []) if lay.groups else []
        if f.fragment >= len(members) or members[f.fragment] != f.target:
            t.stale.append(f"{where}: that position now lives on target "
                           f"{members[f.fragment] if f.fragment < len(members) else '?'}")
    for ino, info in sorted(infos.items()):
        if info is None or info.attr.type != pb.INODE_TYPE_FILE:
            continue
        recs = chunk_table(info)
        lay = info.layout
        codec, cs = codec_for(lay), int(lay.chunk_size)
        t.records[ino] = recs
        t.widths[ino] = (codec, cs)
        for idx, rec in sorted(recs.items()):
            t.chunks += 1
            members = groups.get(lay.groups[idx % len(lay.groups)], [])
            have: dict[int, bytes] = {}
            nodes: dict[int, str] = {}
            for j in range(codec.width):
                tid = members[j] if j < len(members) else -1
                found = [f for f in by_key.get((ino, idx, j, rec.generation), []) if f.target == tid]
                good = [f for f in found if f.payload is not None]
                where = f"inode {ino} chunk {idx} fragment {j} v{rec.generation:#x} (target {tid})"
                if not good:
                    t.missing.append(where + (": only a corrupt copy" if found else ": no file"))
                    continue
                payload = good[0].payload
                assert payload is not None
                if rec.length is not None:
                    want = _stored(codec, cs, rec.length, j)
                    if len(payload) != want:
                        t.mismatched.append(f"{where}: {len(payload)} bytes, the record gives it {want}")
                        continue
                have[j] = payload
                nodes[j] = good[0].node
                t.payload_crc[(ino, idx, j)] = _crc32c.crc32c(payload)
            t.valid[(ino, idx)] = nodes
            problem = _consistency(codec, cs, rec, have)
            if problem:
                t.mismatched.append(f"inode {ino} chunk {idx} v{rec.generation:#x}: {problem}")
    return t


def _stored(codec: Codec, cs: int, length: int, j: int) -> int:
    if codec.replicated:
        return length
    f = -(-cs // codec.k)
    p = min(f, length)
    return max(0, min(length - j * f, p)) if j < codec.k else p


def _consistency(codec: Codec, cs: int, rec: Rec, have: dict[int, bytes]) -> str:
    """'' when the fragments present agree with each other and the record."""
    if codec.replicated:
        copies = set(have.values())
        if len(copies) > 1:
            return f"replicas differ ({len(copies)} distinct copies among positions {sorted(have)})"
        if copies and rec.crc is not None and _crc(next(iter(copies))) != rec.crc:
            return "replica does not match the record's CRC32C"
        return ""
    k, f = codec.k, codec.frag_size(cs)
    data = [have.get(j) for j in range(k)]
    if any(d is None for d in data):
        if len(have) < k:
            return ""  # not enough to check; the missing positions are reported
        # Rebuild the lost data fragments from any K present, then check as below.
        length = rec.length
        if length is None:
            return ""
        p = min(f, length)
        lost = [j for j in range(k) if j not in have]
        rebuilt = codec.reconstruct({j: memoryview(b) for j, b in have.items()}, p, lost)
        data = [have[j] if j in have else bytes(rebuilt[j])[: _stored(codec, cs, length, j)] for j in range(k)]
    length = sum(len(d) for d in data if d is not None)
    if rec.length is not None and length != rec.length:
        return f"data fragments hold {length} bytes, the record says {rec.length}"
    chunk = b"".join(d for d in data if d is not None)
    if rec.crc is not None and _crc(chunk) != rec.crc:
        return f"data fragments' CRC32C {_crc(chunk):#010x} != the record's {rec.crc:#010x}"
    if length == 0:
        return "empty chunk"
    buf = bytearray(codec.encode_size(cs))
    # Data fragment j covers chunk bytes [j*F, j*F + len) (positional format).
    for j, d in enumerate(data):
        assert d is not None
        buf[j * f: j * f + len(d)] = d
    want = codec.encode(memoryview(buf), length, cs)
    bad = [j for j, b in sorted(have.items()) if bytes(want[j]) != b]
    if bad:
        return f"fragments {bad} do not match the re-encoding of the data fragments (parity disagrees)"
    return ""


GCKey = tuple[int, int, int, int, int]  # inode, chunk, fragment, version, target


async def _gc_known(mc: MetaClient, targets: Iterable[int]) -> set[GCKey]:
    """Fragments meta's GC items account for, on ``targets``: those still
    pending there, and those of items whose position the target now serves
    (a move's copy), ready or not (what scrub leaves to GC)."""
    out: set[GCKey] = set()
    for tid in sorted(targets):
        after = 0
        while True:
            page = await mc.list_group_chunks(0, gc_holder=tid, after_gc_id=after)
            out.update((c.inode, c.chunk, c.fragment, c.version, tid) for c in page.chunks)
            if not page.next_gc_id:
                break
            after = page.next_gc_id
    return out


def gc_known(meta: list[str], cluster_dir: Path) -> set[GCKey]:
    """:func:`_gc_known` for every target on disk, now: taken before a
    scrub, the fragments it left to GC (a grace that ends between the
    scrub and the scan lets GC remove the item before every copy is gone:
    the next scrub deletes such a copy as an orphan)."""
    async def run() -> set[GCKey]:
        async with MetaClient(meta, deadline=20) as mc:
            return await _gc_known(mc, _targets_on_disk(cluster_dir))
    return asyncio.run(run())


def scan(meta: list[str], cluster_dir: Path, inodes: Iterable[int] = (), sessions: dict[int, int] | None = None,
         removed: Iterable[int] = (), gc_before: set[GCKey] | None = None) -> Truth:
    """The truth now. ``inodes``: files to check even if no fragment of them
    is on disk; ``sessions``: inode -> data_version of write sessions still
    open (their uploads are in flight, not stale); ``removed``: targets
    declared dead (``target rm``), whose disks are ignored; ``gc_before``:
    fragments GC items accounted for when the scrub looked
    (:func:`gc_known`), not stale either."""
    return asyncio.run(_scan(meta, cluster_dir, inodes, sessions or {}, set(removed), gc_before or set()))
