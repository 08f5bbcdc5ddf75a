"""Reads never return a fragment that is wrong but self-consistent.

Each fragment carries its own CRC32C, which the data plane checks on
arrival; a fragment file replaced by a well-formed one under the same key
(a firmware bug, a misdirected write, an operator's copy) passes that check.
The chunk record's CRC32C covers the chunk's data: the client checks it on
every read of a whole chunk (the data fragments' CRCs combined, no pass over
the bytes) and on every decode, and when it does not match it fetches every
fragment, finds the ones that differ from what the others decode to, and
returns the chunk from the rest. Against a real cluster (six storage
daemons), with the wrong fragments planted through the data plane.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.repair.util import KiB, grant_all, map_now, random_bytes, start
from tierfs.client import AsyncClient
from tierfs.errors import CorruptError
from tierfs.local import LocalCluster
from tierfs.net import DataClient
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine, _prefix_crcs

pytestmark = pytest.mark.timeout(120)

CS = 64 * KiB
#: The clients here do not hedge: under load a hedged read may take parity
#: instead of the fragment planted wrong, and then the counts asserted below
#: (which fragments were found wrong) would depend on timing. Hedging has
#: its own tests (tests/faults/test_hedged_reads.py).
OPTS = {"request_timeout": 2.0, "hedged_reads": False}


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cl = start(tmp_path_factory.mktemp("verify") / "c", n_storage=6, storage_args=("--gc-interval=1h",))
    try:
        yield cl
    finally:
        cl.stop()


async def _plant(cl: LocalCluster, info: pb.FileInfo, frags: dict[tuple[int, int], bytes | None]) -> None:
    """Replace fragment (chunk, position) of the file's committed generation
    with the given bytes (a well-formed fragment: its CRC is its own), or
    delete it (None)."""
    cmap = await map_now(cl)
    addr = {n.node_id: n.data_addr for n in cmap.nodes}
    routes = {t.target_id: addr[t.node_id] for t in cmap.targets}
    async with grant_all(DataClient(routes=routes), cl) as dc:
        for (chunk, j), payload in frags.items():
            gid = info.layout.groups[chunk % len(info.layout.groups)]
            target = next(g.target_ids for g in cmap.groups if g.group_id == gid)[j]
            gen = next(r.generation for r in info.chunks if r.index == chunk)
            key = FragmentKey(info.attr.inode, chunk, j, gen)
            if payload is None:
                await dc.delete(target, key)
            else:
                await dc.write(target, key, payload)


async def _members(cl: LocalCluster, info: pb.FileInfo) -> tuple[int, ...]:
    """The targets of the group holding the file's chunk 0, by position."""
    cmap = await map_now(cl)
    return tuple(next(g.target_ids for g in cmap.groups if g.group_id == info.layout.groups[0]))


async def _file(ac: AsyncClient, path: str, redundancy: str, data: bytes) -> pb.FileInfo:
    d = os.path.dirname(path)
    await ac.mkdir(d, exist_ok=True)
    await ac.set_layout(d, chunk_size=CS, redundancy=redundancy)
    await ac.write_bytes(path, data)
    return await ac.meta.stat(path)


def test_a_wrong_data_fragment_is_read_around_and_a_decode_heals_itself(six: LocalCluster) -> None:
    data = random_bytes(3 * CS, 11)

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, "/ec/f", "ec:4+2", data)
            assert await ac.read_bytes("/ec/f") == data and ac.corrupt_fragments == 0
            # Chunk 0: data fragment 1 replaced by other bytes of its length.
            # Chunk 1: data fragment 0 replaced, and data fragment 2 gone, so
            # the read decodes from 0 (wrong), 1, 3 and a parity fragment.
            await _plant(six, info, {(0, 1): os.urandom(16 * KiB), (1, 0): os.urandom(16 * KiB), (1, 2): None})
            assert await ac.read_bytes("/ec/f") == data
            assert ac.corrupt_fragments == 2
            # A range of chunk 1 in the missing fragment 2 is decoded too.
            part, at = bytearray(5000), CS + 2 * 16 * KiB + 100
            assert await ac.read_into("/ec/f", part, at) == 5000
            assert part == data[at: at + 5000]
            assert ac.corrupt_fragments == 3

    asyncio.run(go())


#: Per layout: the fragment replaced by other bytes of its length and a
#: read inside it; the fragment cut short and a read inside it. EC: data
#: fragments 1 of chunk 0 and 3 of chunk 1 (16 KiB each); replicas: the
#: copy each chunk is read from first (copy ``chunk % 3``).
PARTIAL = {
    "ec:4+2": ((0, 1), 16 * KiB, 16 * KiB + 500, (1, 3), 8 * KiB, CS + 3 * 16 * KiB + 10),
    "replica:3": ((0, 0), CS, 500, (1, 1), CS // 2, CS + 10),
}


@pytest.mark.parametrize("redundancy", sorted(PARTIAL))
def test_a_partial_read_checks_the_stored_crcs_once_per_chunk_generation(six: LocalCluster, redundancy: str) -> None:
    data = random_bytes(2 * CS, 14)
    wrong, wrong_size, at, short, short_size, short_at = PARTIAL[redundancy]
    path = f"/part-{redundancy.replace(':', '-')}/f"

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac, \
                AsyncClient(six.meta_addrs, **OPTS, verify_partial_reads=False) as unchecked:
            info = await _file(ac, path, redundancy, data)
            part = bytearray(3000)
            # Chunk 1 read in part while it is right: remembered as verified
            # (EC: its data fragments; replicas: the copy read).
            assert await ac.read_into(path, part, CS + 10) == 3000 and part == data[CS + 10: CS + 3010]
            assert len(ac._verified) == 1
            await _plant(six, info, {wrong: os.urandom(wrong_size)})
            assert await ac.read_into(path, part, at) == 3000
            assert part == data[at: at + 3000] and ac.corrupt_fragments == 1
            # Without the check the bytes read are the planted fragment's own.
            assert await unchecked.read_into(path, part, at) == 3000
            assert part != data[at: at + 3000] and unchecked.corrupt_fragments == 0
            # A fragment cut short is caught by its stored length.
            await _plant(six, info, {short: os.urandom(short_size)})
            ac._verified.clear()
            rereads = ac.whole_chunk_rereads
            assert await ac.read_into(path, part, short_at) == 3000 and part == data[short_at: short_at + 3000]
            # Caught by its stored length; or, where the STAT answer lagged
            # the read (on a loaded host: more than three times the read's
            # time), by reading the whole chunk instead (CI saw that once).
            assert ac.corrupt_fragments == 2 or ac.whole_chunk_rereads > rereads

    asyncio.run(go())


@pytest.mark.parametrize("redundancy", sorted(PARTIAL))
def test_a_verified_chunk_is_checked_again_once_a_fragment_file_is_replaced(six: LocalCluster,
                                                                            redundancy: str) -> None:
    """A partial read that was verified is remembered with the serials of the
    fragment files it read; a later partial read of the same chunk whose
    answer comes from another file (here: one planted wrong, with its own
    CRC32C) is verified again. The file checker soak (seed 15017) found
    it: remembered per chunk generation, the planted bytes were returned,
    and an ``r+`` write of the chunk committed them into its next
    generation."""
    data = random_bytes(2 * CS, 15)
    wrong, wrong_size, _, _, _, _ = PARTIAL[redundancy]
    path = f"/reverify-{redundancy.replace(':', '-')}/f"
    at = wrong[1] * 16 * KiB + 700 if redundancy.startswith("ec") else 700  # inside the fragment planted

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, path, redundancy, data)
            part = bytearray(3000)
            for _ in range(2):  # verified, then read again from the same files
                assert await ac.read_into(path, part, at) == 3000 and part == data[at: at + 3000]
            assert len(ac._verified) == 1 and ac.corrupt_fragments == 0
            await _plant(six, info, {wrong: os.urandom(wrong_size)})
            assert await ac.read_into(path, part, at) == 3000
            assert part == data[at: at + 3000], "the planted fragment's bytes were returned"
            assert ac.corrupt_fragments == 1 and ac.whole_chunk_rereads == 0

    asyncio.run(go())


def _forge_on_disk(cl: LocalCluster, info: pb.FileInfo, chunk: int) -> int:
    """Rewrite, in place and behind the daemons' backs, every fragment file
    of the chunk's committed generation with other bytes under a header
    that is right for them (its key, its own CRC32Cs): a file that passes
    every check a fragment has of itself. Returns how many were rewritten."""
    gen = next(r.generation for r in info.chunks if r.index == chunk)
    ino = info.attr.inode
    files = sorted(cl.dir.glob(f"storage-*/t*/frags/{ino & 0xFF:02x}/{ino:016x}/{chunk:x}.*.{gen:x}"))
    for f in files:
        raw = f.read_bytes()
        hdr_len = int.from_bytes(raw[12:16], "little")
        size = int.from_bytes(raw[48:56], "little")
        ino_, chunk_, frag, ver = (int.from_bytes(raw[o:o + 8], "little") for o in (16, 24, 32, 40))
        payload = bytes(b ^ 0x5A for b in raw[hdr_len:hdr_len + size])
        prefix = _prefix_crcs(memoryview(payload))
        hdr = bytearray(hdr_len)
        ChunkEngine._fill_header(memoryview(hdr), FragmentKey(ino_, chunk_, frag, ver), size,
                                 prefix[-1] if prefix else 0, prefix)
        body = bytes(hdr) + payload
        before = f.stat().st_ctime_ns
        deadline = time.monotonic() + 10
        # The same file (inode), rewritten; again until its ctime moves (the
        # kernel's file times tick every few ms: a rewrite within the tick of
        # the daemon's last look cannot be told from no rewrite at all).
        while True:
            with open(f, "r+b") as fh:
                fh.write(body + bytes(-len(body) % 4096))
            if f.stat().st_ctime_ns != before or time.monotonic() > deadline:
                break
            time.sleep(0.001)
    return len(files)


@pytest.mark.parametrize("redundancy", sorted(PARTIAL))
def test_a_fragment_file_forged_on_disk_after_a_verified_read_is_checked_again(six: LocalCluster,
                                                                               redundancy: str) -> None:
    """A long-lived client (a FUSE mount) verified a chunk, then its
    fragment files were rewritten on disk, not through the daemon, with
    other bytes and headers right for them. The daemon's serial for a file
    changed only when it installed one itself, so the client's verdict
    still covered the forged files and its partial reads returned their
    bytes (seen through a mount: 6 of 40 ranged reads wrong). A file that
    changed on disk now gets a new serial: the read is verified again and
    fails rather than return them."""
    data = random_bytes(2 * CS, 16)
    path = f"/forged-on-disk-{redundancy.replace(':', '-')}/f"

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, path, redundancy, data)
            part = bytearray(3000)
            for at in (700, 9000, CS - 3000):
                assert await ac.read_into(path, part, at) == 3000 and part == data[at: at + 3000]
            assert _forge_on_disk(six, info, 0) == (6 if redundancy.startswith("ec") else 3)
            for at in (700, 9000, CS - 3000, 20000):
                try:
                    n = await ac.read_into(path, part, at)
                except CorruptError:
                    continue
                assert n == 3000 and part == data[at: at + 3000], f"forged bytes returned at {at}"

    asyncio.run(go())


def test_a_partial_read_whose_stats_cannot_be_had_reads_the_whole_chunk(six: LocalCluster) -> None:
    """ec:4+2: partial reads inside data fragment 0 while the target of data
    fragment 2 (not read, but its stored CRC32C is part of the check) is
    marked failed, so no STAT round can be had. Each such read reads the
    whole chunk instead (decoded around fragment 2, checked against the
    record's CRC32C), and the data fragment files that check covered are
    remembered: the next partial read from them needs neither. Then
    fragment 0 is planted wrong (with its own CRC32C): the next partial read
    comes from another file, cannot be verified by STATs, and the whole
    chunk, read again, is found wrong and read around. Until stop 39 such a
    read returned its bytes checked only against their own CRC32C: the
    planted fragment's bytes."""
    data = random_bytes(CS, 16)

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, "/unverified/f", "ec:4+2", data)
            members = await _members(six, info)
            router = ac._parts()[2]
            router.mark_failed(members[2], factor=100.0)
            part = bytearray(1000)
            for _ in range(3):
                assert await ac.read_into("/unverified/f", part, 100) == 1000 and part == data[100:1100]
                assert ac.whole_chunk_rereads == 1 and len(ac._verified) == 1
            await _plant(six, info, {(0, 0): os.urandom(CS // 4)})
            assert await ac.read_into("/unverified/f", part, 100) == 1000
            assert part == data[100:1100], "the planted fragment's bytes were returned"
            assert ac.whole_chunk_rereads == 2 and ac.corrupt_fragments == 1

    asyncio.run(go())


def test_a_partial_read_of_a_copy_whose_stat_cannot_be_had_reads_the_whole_copy(six: LocalCluster) -> None:
    """replica:3: every copy's target marked failed, so a partial read still
    reads the first copy (nothing better is left) but asks no STAT of it.
    Copy 0 is planted wrong (with its own CRC32C): the whole copy is read
    instead, found wrong, and the next copy read (also whole). Until stop
    39 the planted copy's bytes were returned."""
    data = random_bytes(CS, 17)

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, "/unverified-rep/f", "replica:3", data)
            members = await _members(six, info)
            await _plant(six, info, {(0, 0): os.urandom(CS)})
            router = ac._parts()[2]
            for t in members:
                router.mark_failed(t, factor=100.0)
            part = bytearray(1000)
            assert await ac.read_into("/unverified-rep/f", part, 100) == 1000
            assert part == data[100:1100], "the planted copy's bytes were returned"
            assert ac.corrupt_fragments == 1 and ac.whole_chunk_rereads == 2

    asyncio.run(go())


def test_a_write_into_a_chunk_never_carries_a_wrong_fragment_into_its_next_generation(six: LocalCluster) -> None:
    """An ``r+`` write into part of a chunk reads the chunk's other bytes back
    and commits them in the chunk's next generation. That read is of the
    whole stored chunk (checked against the record's CRC32C every time),
    not of the file's part of it (checked only when every STAT answers):
    here (ec:4+2) the file ends inside chunk 0 (truncated), data fragment 0
    is planted wrong, and the target of data fragment 2 (not read for the
    file's first bytes, but its stored CRC32C is part of the check) is
    marked failed, so no STAT round can be had. Before, the planted bytes
    were committed into the new generation, valid CRC and all."""
    data = random_bytes(CS, 17)
    path = "/rmw/f"
    size = CS // 2

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, path, "ec:4+2", data)
            await ac.truncate(path, size)
            info = await ac.meta.stat(path)
            members = await _members(six, info)
            await _plant(six, info, {(0, 0): os.urandom(16 * KiB)})
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            ac._parts()[2].mark_failed(members[2])
            f = await ac.open(path, "r+")
            await f.write(b"new!")
            await f.close()
            assert ac.corrupt_fragments == 1
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            got = await ac.read_bytes(path)
            assert got[:4] == b"new!"
            assert got[4:] == data[4:size], "a planted fragment's bytes were committed into the new generation"

    asyncio.run(go())


def test_a_wrong_replica_copy_is_read_around(six: LocalCluster) -> None:
    data = random_bytes(2 * CS + 999, 12)

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, "/rep/f", "replica:3", data)
            # Every copy of chunk 0 but one, and the copy of chunk 1 read
            # first, are self-consistent and wrong.
            await _plant(six, info, {(0, 0): os.urandom(CS), (0, 1): os.urandom(CS), (1, 1): os.urandom(CS)})
            assert await ac.read_bytes("/rep/f") == data
            assert ac.corrupt_fragments == 3

    asyncio.run(go())


def test_a_position_listed_missing_helps_tell_a_wrong_fragment_from_the_rest(six: LocalCluster) -> None:
    """ec:4+2, one chunk: position 1 is listed missing although its holder
    has the fragment (a degraded write's fragment that landed late),
    position 2 is wrong but self-consistent, position 5 is gone. Counting 1
    there are five fragments to judge from, and the chunk reads right from
    0, 1, 3 and 4. The read failed with CorruptError: the heal judged only
    the positions not listed missing (four, one of them wrong). Now those
    are its last resort, as they are the plain read's, judged like the rest."""
    data = random_bytes(CS, 21)

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, "/lm/f", "ec:4+2", data)
            gen = info.chunks[0].generation
            # Planted before position 1 is listed: with four good sources its
            # holder's repair queue would rebuild it at once and unlist it.
            await _plant(six, info, {(0, 2): os.urandom(16 * KiB), (0, 5): None})
            await ac.meta.mark_fragments([pb.RepairItem(inode=info.attr.inode, chunk=0, version=gen, fragment=1)],
                                         done=False)
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            assert list((await ac.meta.stat("/lm/f")).chunks[0].missing) == [1]
            assert await ac.read_bytes("/lm/f") == data
            assert ac.corrupt_fragments == 1

    asyncio.run(go())


def test_a_target_found_slow_helps_tell_a_wrong_fragment_from_the_rest(six: LocalCluster) -> None:
    """ec:4+2, one chunk: position 2 wrong but self-consistent, position 5
    gone, and the target of position 0 found slow a moment ago (a hedged
    read lagged there), so reads go around it. Five targets looked usable,
    enough to tell a wrong fragment from the rest, and the heal skipped the
    slow one; but only four answered, one of them wrong, and the read failed
    with CorruptError although 0, 1, 3 and 4 were good (the file checker
    soak, seed 12012, with a corrupt fragment for the deleted one). Now the
    targets skipped are a last resort there."""
    data = random_bytes(CS, 22)

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, "/slow/f", "ec:4+2", data)
            await _plant(six, info, {(0, 2): os.urandom(16 * KiB), (0, 5): None})
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            cmap = await map_now(six)
            gid = info.layout.groups[0]
            router = ac._parts()[2]
            router.mark_slow(next(g.target_ids for g in cmap.groups if g.group_id == gid)[0], 60.0)
            assert await ac.read_bytes("/slow/f") == data
            assert ac.corrupt_fragments == 1

    asyncio.run(go())


def test_too_many_wrong_fragments_fail_the_read_instead_of_returning_them(six: LocalCluster) -> None:
    data = random_bytes(2 * CS, 13)

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, "/bad/f", "ec:4+2", data)
            # Three of six wrong: no four of the six decode to the chunk's CRC.
            await _plant(six, info, {(1, j): os.urandom(16 * KiB) for j in (0, 1, 3)})
            with pytest.raises(CorruptError, match="decode to it: not returned"):
                await ac.read_bytes("/bad/f")
            # The other chunk still reads.
            first = bytearray(CS)
            assert await ac.read_into("/bad/f", first, 0) == CS and first == data[:CS]
            rep = await _file(ac, "/bad/r", "replica:2", data)
            await _plant(six, rep, {(0, 0): os.urandom(CS), (0, 1): os.urandom(CS)})
            with pytest.raises(CorruptError, match="matches its record: not returned"):
                await ac.read_bytes("/bad/r")

    asyncio.run(go())


def test_a_write_whose_old_bytes_cannot_be_read_aborts_its_session(six: LocalCluster) -> None:
    """A partial write reads the chunk's old bytes first; when that fails,
    the call fails part-way, and the session aborts (docs/client.md, "Any
    failure"): close raises and nothing of it becomes visible."""
    data = random_bytes(2 * CS, 15)

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, "/rmw/f", "replica:3", data)
            await _plant(six, info, {(1, j): os.urandom(CS) for j in range(3)})
            f = await ac.open("/rmw/f", "r+b")
            f.seek(100)
            await f.write(b"x" * 1000)  # chunk 0 only: staged, not yet sent
            f.seek(CS - 10)
            with pytest.raises(CorruptError):  # 10 bytes to chunk 0, then chunk 1's old bytes are unreadable
                await f.write(b"y" * 1000)
            with pytest.raises(CorruptError):
                await f.close()
            after = await ac.meta.stat("/rmw/f")
            assert [(r.index, r.generation) for r in after.chunks] == [(r.index, r.generation) for r in info.chunks]
            first = bytearray(CS)
            assert await ac.read_into("/rmw/f", first, 0) == CS and first == data[:CS]

    asyncio.run(go())


def test_a_stalled_target_costs_a_wrong_fragment_s_heal_a_hedge_not_a_timeout(six: LocalCluster) -> None:
    """ec:4+2, one chunk: data fragment 1 wrong but self-consistent, and the
    daemon of parity position 5 stalled (SIGSTOP). The whole-chunk read finds
    the data fragments' CRCs do not combine to the record's and fetches every
    fragment to tell which one is wrong. Until stop 51 that fetch waited for
    every fragment with the whole request timeout (here far longer than the
    test's own timeout); now, hedged, it goes on once K + 1 have answered
    and returns the chunk decoded without the wrong one."""
    data = random_bytes(CS, 23)

    async def go() -> None:
        async with AsyncClient(six.meta_addrs, **OPTS) as ac:
            info = await _file(ac, "/stall/f", "ec:4+2", data)
            await _plant(six, info, {(0, 1): os.urandom(16 * KiB)})
            members = await _members(six, info)
        cmap = await map_now(six)
        node = next(t.node_id for t in cmap.targets if t.target_id == members[5])
        addr = next(n.data_addr for n in cmap.nodes if n.node_id == node)
        victim = next(p.name for p in six.procs if p.kind == "storage" and p.addr == addr)
        async with AsyncClient(six.meta_addrs, request_timeout=600.0, hedged_reads=True) as ac:
            await ac.meta.stat("/stall/f")
            pid = six.kill(victim, signal.SIGSTOP)
            try:
                assert await ac.read_bytes("/stall/f") == data
                assert ac.corrupt_fragments == 1
            finally:
                os.kill(pid, signal.SIGCONT)
        await six.wait_healthy(60)

    asyncio.run(go())
