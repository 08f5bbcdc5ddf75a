"""The client side of issue 8, against a real cluster: every upload of a
chunk is its own generation (a returning node's older fragment is never
read as data), truncate zeroes what it cut, the acknowledgement rules, and
a reader whose generation was collected looks the file up again.

The storage side (the repair queue rebuilding what a degraded write
recorded missing, scrub counting stale fragments) is tested in
tests/repair/; the model-based checker in tests/checker/ explores the same
paths at random.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import fragment_files, wait_node_state
from tierfs.chunk import session_version
from tierfs.client import AsyncClient, Client
from tierfs.errors import TierFSError, UnavailableError
from tierfs.local import LocalCluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cl(tmp_path: Path) -> Iterator[LocalCluster]:
    # A short GC grace: one test waits for an old generation to be collected.
    c = LocalCluster(tmp_path / "c", n_storage=6, gc_grace=1.0)
    c.up(timeout=90)
    try:
        yield c
    finally:
        c.stop()


def _meta(cl: LocalCluster) -> list[str]:
    return cl.meta_addrs


async def _holder(ac: AsyncClient, path: str, chunk: int, frag: int) -> str:
    """The LocalCluster process name of the node holding ``frag`` of ``chunk``."""
    info = await ac.meta.stat(path)
    cmap = await ac.meta.get_cluster_map()
    gid = info.layout.groups[chunk % len(info.layout.groups)]
    tid = next(g.target_ids[frag] for g in cmap.groups if g.group_id == gid)
    node = next(t.node_id for t in cmap.targets if t.target_id == tid)
    addr = next(n.data_addr for n in cmap.nodes if n.node_id == node)
    return addr


def _name(cl: LocalCluster, addr: str) -> str:
    return next(p.name for p in cl.procs if p.kind == "storage" and p.addr == addr)


def test_degraded_reupload_never_reads_the_stale_fragment(cl: LocalCluster) -> None:
    """Reproduction 1 of issue 8: the returning node's fragment of the first
    upload (CRC-valid, right key under the old scheme) must not be read."""
    with Client(_meta(cl), request_timeout=3.0) as c:
        f = c.open("/y", "wb")
        f.write(b"A" * 1000)
        f.flush()
        victim = _name(cl, c._run(_holder(c.aclient, "/y", 0, 0)))
        cl.kill(victim)
        f.write(b"B" * 1000)
        f.close()
        info = c._run(c.aclient.meta.stat("/y"))
        (rec,) = info.chunks
        assert info.attr.size == 2000 and list(rec.missing) == [0]
        assert rec.generation & 0xFFFFF == 1  # the second upload of chunk 0 in the session
        assert session_version(rec.generation) == info.attr.data_version
        cl.start(names=[victim])
        wait_node_state(cl, victim, "online")
        # Whatever the returned node holds of chunk 0 (the first upload's
        # fragment, until GC) is never read: whole, ranged or cached reads.
        assert c.read_bytes("/y") == b"A" * 1000 + b"B" * 1000
        buf = bytearray(10)
        assert c.read_into("/y", buf, 995) == 10 and bytes(buf) == b"AAAAABBBBB"
        with c.open("/y", "rb") as r:
            assert r.read(1) == b"A"
            r.seek(1500)
            assert r.read(3) == b"BBB"


def test_truncate_shrink_then_grow_reads_zeros(cl: LocalCluster) -> None:
    """Reproduction 2 of issue 8, for ec:4+2 and replica:3, through every
    read path, and a write into the grown region keeps the zeros."""
    with Client(_meta(cl)) as c:
        for red in ("ec:4+2", "replica:3"):
            d = f"/t-{red.replace(':', '-').replace('+', '-')}"
            c.mkdir(d)
            c.set_layout(d, redundancy=red, chunk_size=64 << 10)
            for size in (3000, 200_000):  # one chunk; several, the cut in the middle of one
                p = f"{d}/s{size}"
                secret = (b"SECRET" * (size // 6 + 1))[:size]
                c.write_bytes(p, secret)
                c.truncate(p, 6)
                c.truncate(p, size)
                want = secret[:6] + bytes(size - 6)
                assert c.read_bytes(p) == want
                with c.open(p, "rb") as f:  # the cached small-read path
                    got = b"".join(iter(lambda f=f: f.read(777), b""))  # type: ignore[misc]
                assert got == want
                # cut inside a later chunk too
                c.write_bytes(p, secret)
                c.truncate(p, 70_000 if size > 70_000 else 2000)
                c.truncate(p, size)
                cut = 70_000 if size > 70_000 else 2000
                assert c.read_bytes(p) == secret[:cut] + bytes(size - cut)
                # a write into the grown region: read-modify-write keeps the zeros around it
                with c.open(p, "r+b") as f:
                    f.seek(cut + 10)
                    f.write(b"xyz")
                assert c.read_bytes(p) == secret[:cut] + bytes(10) + b"xyz" + bytes(size - cut - 13)


def test_replica2_needs_two_durable_copies(cl: LocalCluster) -> None:
    """replica:N acknowledges only with 2 durable copies by default: with
    one of the two down a write fails cleanly instead of leaving a single
    copy."""
    meta = _meta(cl)
    with Client(meta, request_timeout=2.0, retries=2) as c:
        c.mkdir("/r2")
        c.set_layout("/r2", redundancy="replica:2", chunk_size=64 << 10)
        c.write_bytes("/r2/a", b"one" * 1000)
        addr = c._run(_holder(c.aclient, "/r2/a", 0, 0))
        name = _name(cl, addr)
        cl.kill(name)
        # The chunk write finds one copy only: nothing is acknowledged.
        with pytest.raises((UnavailableError, TierFSError)), c.open("/r2/a", "wb") as f:
            f.write(b"two" * 1000)
        with contextlib.suppress(TierFSError):
            assert c.stat("/r2/a").size in (0, 3000)
        cl.start(names=[name])
        wait_node_state(cl, name, "online")
    with Client(meta, request_timeout=2.0, min_write_fragments=1) as c:
        c.write_bytes("/r2/b", b"x")  # configurable: one copy when asked for
        assert c.read_bytes("/r2/b") == b"x"


CS = 64 << 10
OLD, NEW = bytes([1]) * (4 * CS), bytes([2]) * (4 * CS)


def _write_old(c: Client, d: str) -> tuple[str, int, set[int]]:
    """``d/f`` written with OLD (four 64 KiB chunks, ec:4+2): its path,
    inode and the generations of its chunks."""
    c.mkdir(d)
    c.set_layout(d, chunk_size=CS, redundancy="ec:4+2")
    path = f"{d}/f"
    c.write_bytes(path, OLD)
    info = c._run(c.aclient.meta.stat(path))
    return path, info.attr.inode, {r.generation for r in info.chunks}


def _rewrite_and_collect(cl: LocalCluster, c: Client, path: str, ino: int, gens: set[int]) -> None:
    """Rewrite ``path`` with NEW and wait until no fragment of the old
    generations is left on any target's disk."""
    c.write_bytes(path, NEW)

    def old_left() -> int:
        return sum(1 for p in fragment_files(cl) if p.parent.name == f"{ino:016x}"
                   and int(p.name.rsplit(".", 1)[1], 16) in gens)

    deadline = time.monotonic() + 60
    while old_left():
        assert time.monotonic() < deadline, f"{old_left()} fragments of the old generation never collected"
        time.sleep(0.2)


def test_reader_whose_generation_was_collected_reads_the_new_one(cl: LocalCluster) -> None:
    """A reader holds a file open while it is rewritten; once the old
    generation has been garbage-collected, its next read gets NotFound from
    every fragment, looks the file up again and reads the new contents (one
    retry), instead of failing."""
    with Client(_meta(cl)) as c:
        path, ino, gens = _write_old(c, "/g")
        with c.open(path, "rb") as r:
            assert r.read(CS) == OLD[:CS]
            _rewrite_and_collect(cl, c, path, ino, gens)
            assert r.read(CS) == NEW[CS: 2 * CS]  # re-stat and retry, on the new generation
            assert r.read() == NEW[2 * CS:]


def test_small_read_across_a_collected_generation_is_never_a_mix(cl: LocalCluster) -> None:
    """A reader's cache holds chunks of the old generation; the file is
    rewritten and the old generation collected; a small read spanning a
    cached old chunk and one loaded now (from the new generation, after a
    fresh look-up) returns one generation's bytes. It used to return the
    old chunk's bytes followed by the new one's (found by the checker soak,
    seed 9876)."""
    with Client(_meta(cl)) as c:
        path, ino, gens = _write_old(c, "/m")
        with c.open(path, "rb") as r:
            # Chunks 0 and 1 read through the cache, chunk 2 read ahead: all old.
            r.seek(CS - 5)
            assert r.read(10) == OLD[CS - 5: CS + 5]
            _rewrite_and_collect(cl, c, path, ino, gens)
            # Chunk 2 is cached (old), chunk 3 must be loaded (the new generation).
            r.seek(3 * CS - 5)
            got = r.read(10)
            assert got == NEW[3 * CS - 5: 3 * CS + 5], got
            # And from then on the new generation, cached chunks included.
            r.seek(CS - 5)
            assert r.read(10) == NEW[CS - 5: CS + 5]
            assert r.read() == NEW[CS + 5:]
