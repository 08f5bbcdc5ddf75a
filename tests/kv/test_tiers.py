"""DramTier and SsdTier: the conformance suite, plus what is particular to each
(the extent allocator, slot pinning, CRC32C on the SSD, the pre-allocated file)."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kv.conformance import DemotingTierConformance, MiB, TierFactory, pattern, run
from tests.kv.test_stack import WriteGate
from tierfs.buffers import BufferPool
from tierfs.errors import ConfigError, InvalidArgumentError
from tierfs.kv.tiers import DramTier, ExtentAllocator, SsdTier, Tier
from tierfs.storage.io import PosixBackend


class TestDramTier(DemotingTierConformance):
    @pytest.fixture
    def make_tier(self) -> TierFactory:
        return lambda cap: DramTier(cap)


class TestSsdTier(DemotingTierConformance):
    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> TierFactory:
        counter = iter(range(1 << 30))
        return lambda cap: SsdTier(tmp_path / f"ssd{next(counter)}.bin", cap)


# -- the extent allocator -----------------------------------------------------------


@pytest.mark.timeout(60)
def test_extent_allocator_against_a_model() -> None:
    total = 1000
    a = ExtentAllocator(total)
    used: dict[int, int] = {}  # start -> length
    rng = random.Random(3)
    for _ in range(20_000):
        if used and rng.random() < 0.45:
            start = rng.choice(list(used))
            a.free(start, used.pop(start))
        else:
            n = rng.choice([1, 2, 3, 7, 16, 17, 50, 120])
            got = a.alloc(n)
            taken = sorted(used.items())
            if got is None:
                # only when no hole of n units exists
                edges = [0] + [s + n_ for s, n_ in taken]
                starts = [s for s, _ in taken] + [total]
                assert all(b - e < n for e, b in zip(edges, starts, strict=True))
                continue
            assert got >= 0 and got + n <= total
            for s, length in taken:
                assert got + n <= s or s + length <= got, "overlapping extents"
            used[got] = n
        assert a.free_units == total - sum(used.values())
        # free extents are coalesced: no two touch
        ext = a.extents()
        assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in itertools.pairwise(ext))
    for s, n in list(used.items()):
        a.free(s, n)
    assert a.extents() == [(0, total)]


def test_extent_allocator_reuses_a_same_sized_hole_and_refuses_double_free() -> None:
    a = ExtentAllocator(100)
    x, y, z = a.alloc(10), a.alloc(10), a.alloc(10)
    assert (x, y, z) == (0, 10, 20)
    a.free(10, 10)
    assert a.alloc(10) == 10  # the hole, not the big free tail
    a.free(10, 10)
    with pytest.raises(ValueError, match="double free"):
        a.free(10, 10)
    with pytest.raises(ValueError, match="outside"):
        a.free(95, 10)
    assert a.alloc(71) is None and a.alloc(70) == 30


# -- DRAM particulars ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_dram_reuses_its_arena() -> None:
    async def main() -> None:
        t = DramTier(1 * MiB)
        arena = t._mv
        for i in range(100):  # 100 x 64 KiB through a 1 MiB arena
            k = f"r{i}".encode()
            assert await t.put(k, memoryview(pattern(k, 65536)))
            b = t.borrow(k)
            assert b is not None
            # the object lives inside the one arena mapped at construction
            assert b.view.obj is arena.obj
            b.release()
        assert t.stats().evictions == 100 - 16
        await t.close()

    run(main())


@pytest.mark.timeout(30)
def test_dram_borrowed_slot_survives_delete_and_eviction() -> None:
    async def main() -> None:
        t = DramTier(256 << 10)
        data = pattern(b"pinned", 64 << 10)
        await t.put(b"pinned", memoryview(data))
        b = t.borrow(b"pinned")
        assert b is not None and b.view.readonly
        assert await t.delete(b"pinned")
        # fill the tier over and over: the borrowed slot must not be reused
        for i in range(20):
            k = f"f{i}".encode()
            assert await t.put(k, memoryview(pattern(k, 64 << 10)))
        assert bytes(b.view) == data
        assert t.stats().objects == 3  # 4 slots, one still held by the borrow
        b.release()
        await t.put(b"again", memoryview(b"x" * (64 << 10)))
        assert t.stats().objects == 4
        await t.close()

    run(main())


def test_dram_config_errors() -> None:
    with pytest.raises(ConfigError, match="granule"):
        DramTier(1 * MiB, granule=1000)
    with pytest.raises(ConfigError, match="capacity"):
        DramTier(100)
    with pytest.raises(ConfigError, match="pin"):
        DramTier(1 * MiB, pin="yes")
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy"):
        DramTier(1 * MiB, policy="nope")


# -- SSD particulars ---------------------------------------------------------------------------


@pytest.fixture
def ssd_path(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "tier.bin"


@pytest.mark.timeout(30)
def test_ssd_file_is_preallocated_locked_and_direct(ssd_path: Path) -> None:
    async def main() -> None:
        t = SsdTier(ssd_path, 8 * MiB + 100)
        st = os.stat(ssd_path)
        assert st.st_size == 8 * MiB == t.capacity
        assert st.st_blocks * 512 >= 8 * MiB  # allocated, not sparse
        with pytest.raises(ConfigError, match="in use"):
            SsdTier(ssd_path, 8 * MiB)
        await t.put(b"k", memoryview(b"v" * 10))
        assert t.direct  # tmp_path is on a disk that takes O_DIRECT here
        await t.close()
        # closed: its space is given back, the file can be taken again, and starts empty
        assert os.stat(ssd_path).st_size == 0
        t2 = SsdTier(ssd_path, 4 * MiB)
        assert await t2.contains([b"k"]) == [False]
        await t2.close()
        with pytest.raises(ConfigError, match=r"no directory .* make it first"):
            SsdTier(ssd_path.parent / "nope" / "tier.bin", 4 * MiB)

    run(main())


@pytest.mark.timeout(30)
def test_ssd_directory_path(tmp_path: Path) -> None:
    """A tier on a directory names its file by pid and removes it on close;
    a new one there removes the files that no live tier holds (left by
    killed processes: each restart of an engine left one, pre-allocated)."""
    # a file held by a live tier in another process, and one a killed process left
    held = tmp_path / "kvtier-999999.bin"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], "
                               "os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print(flush=True); "
                               "sys.stdin.read()", str(held)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"\n"
        stale = tmp_path / "kvtier-999998.bin"
        stale.write_bytes(b"x" * 4096)
        t = SsdTier(tmp_path, 1 * MiB)
        assert t.path == tmp_path / f"kvtier-{os.getpid()}.bin" and t.path.exists()
        assert held.exists() and not stale.exists()
        run(t.close())
        assert not t.path.exists() and held.exists()
    finally:
        holder.communicate(timeout=10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [100, 4096, 65536, 70_001, (256 << 10) + 5])
@pytest.mark.parametrize("at", ["middle", "last"])
def test_ssd_corrupt_byte_is_a_miss_and_dropped(ssd_path: Path, size: int, at: str) -> None:
    async def main() -> None:
        t = SsdTier(ssd_path, 4 * MiB)
        data = pattern(b"c", size)
        await t.put(b"c", memoryview(data))
        await t.put(b"ok", memoryview(pattern(b"ok", size)))
        where = t.locate(b"c")
        assert where is not None
        off, n = where
        rel = n // 2 if at == "middle" else n - 1
        flip = off + rel
        fd = os.open(ssd_path, os.O_RDWR)
        try:
            old = os.pread(fd, 1, flip)
            os.pwrite(fd, bytes([old[0] ^ 0x40]), flip)
            os.fsync(fd)
        finally:
            os.close(fd)
        # an aligned destination (the direct path) and an unaligned one (bounce)
        pool = BufferPool(16 * MiB)
        for dest in (pool.get(size), memoryview(bytearray(size + 1))[1:]):
            assert await t.get_into(b"c", dest) is None
            await t.put(b"c", memoryview(data))  # stored afresh, on another extent or the same
            again = t.locate(b"c")
            assert again is not None
            fd = os.open(ssd_path, os.O_RDWR)
            try:
                o2, _ = again
                b = os.pread(fd, 1, o2 + rel)
                os.pwrite(fd, bytes([b[0] ^ 0x40]), o2 + rel)
                os.fsync(fd)
            finally:
                os.close(fd)
        st = t.stats()
        assert st.corrupt == 2 and st.hits == 0
        out = bytearray(size)
        assert await t.get_into(b"ok", memoryview(out)) == size and out == pattern(b"ok", size)
        await t.close()
        pool.close()

    run(main())


class GatedBackend(PosixBackend):
    """The posix backend with reads held at a gate: a read can be made to wait
    for the disk as long as a test needs (the I/O itself is real)."""

    def __init__(self, pool: BufferPool) -> None:
        super().__init__(pool, threads=4)
        self.gate = asyncio.Event()
        self.waiting = 0

    async def _pread(self, fd: int, buf: memoryview, offset: int) -> int:
        self.waiting += 1
        await self.gate.wait()
        return await super()._pread(fd, buf, offset)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["delete", "put"])
def test_ssd_write_in_flight_is_undone_by_a_delete_or_a_newer_put(ssd_path: Path, then: str) -> None:
    """A put still writing (a fill or a demotion of the old value) when the
    key is deleted, or put again with other bytes (an overwrite): the write
    in flight must not land afterwards. Until stop 47 the delete found
    nothing (False), the newer put was refused, and the older value was
    inserted when its write finished: served after an acknowledged
    overwrite or delete (a new user's race on a client with an SSD tier)."""

    async def main() -> None:
        pool = BufferPool(16 * MiB)
        be = WriteGate(pool)  # writes held at a gate (tests/kv/test_stack.py)
        t = SsdTier(ssd_path, 4 * MiB, backend=be, pool=pool)
        size = 256 << 10
        old, new = pattern(b"old", size), pattern(b"new", size)
        first = asyncio.ensure_future(t.put(b"k", memoryview(old)))
        while be.waiting < 1:
            await asyncio.sleep(0)
        if then == "delete":
            assert await t.delete(b"k")  # the write in flight counts
        else:
            assert not await t.put(b"k", memoryview(new))  # not stored: neither value lands
        be.gate.set()
        assert await first is False
        assert await t.get_into(b"k", memoryview(bytearray(size))) is None
        assert t.stats().objects == 0
        # The key can be stored again, and its extent came back.
        assert await t.put(b"k", memoryview(new))
        got = bytearray(size)
        assert await t.get_into(b"k", memoryview(got)) == size and bytes(got) == new
        for i in range(15):
            k = f"f{i}".encode()
            assert await t.put(k, memoryview(pattern(k, size)))
        assert t.stats().objects == 16
        await t.close()
        await be.aclose()
        pool.close()

    run(main())


@pytest.mark.timeout(60)
def test_a_promotion_of_a_key_deleted_during_its_read_is_skipped(ssd_path: Path) -> None:
    """A get that found the key in the SSD tier, still reading it when the
    key is deleted, must not promote it into DRAM afterwards: until stop 47
    the deleted value was put back there and served by the next get."""
    from tierfs.kv.stack import TierStack

    async def main() -> None:
        pool = BufferPool(16 * MiB)
        be = GatedBackend(pool)
        ssd = SsdTier(ssd_path, 4 * MiB, backend=be, pool=pool)
        ssd.inline_max = 0  # every read through the backend, where it can wait
        dram = DramTier(4 * MiB)
        stack = TierStack([dram, ssd])
        size = 256 << 10
        be.gate.set()
        assert await ssd.put(b"k", memoryview(pattern(b"k", size)))  # below only
        be.gate.clear()
        out = bytearray(size)
        get = asyncio.ensure_future(stack.get_into(b"k", memoryview(out)))
        while be.waiting < 1:
            await asyncio.sleep(0)
        assert await stack.delete(b"k")
        be.gate.set()
        assert await get == size and bytes(out) == pattern(b"k", size)  # it began before the delete
        assert await stack.get_into(b"k", memoryview(bytearray(size))) is None
        assert await dram.get_into(b"k", memoryview(bytearray(size))) is None
        await stack.close()
        await be.aclose()
        pool.close()

    run(main())


@pytest.mark.timeout(60)
def test_ssd_read_in_flight_keeps_its_extent(ssd_path: Path) -> None:
    """A get that is waiting for the disk while its object is deleted and the
    tier refilled must still return the object's own bytes."""

    async def main() -> None:
        pool = BufferPool(16 * MiB)
        be = GatedBackend(pool)
        t = SsdTier(ssd_path, 1 * MiB, backend=be, pool=pool)
        t.inline_max = 0  # every read through the backend, where it can wait
        size = 256 << 10
        be.gate.set()
        await t.put(b"victim", memoryview(pattern(b"victim", size)))
        be.gate.clear()
        outs = [bytearray(size), pool.get(size)]  # the bounce path and the direct path
        reads = [asyncio.ensure_future(t.get_into(b"victim", memoryview(o))) for o in outs]
        while be.waiting < 2:
            await asyncio.sleep(0)
        assert await t.delete(b"victim")
        for i in range(8):  # refill the whole tier twice while the reads wait
            k = f"fill{i}".encode()
            assert await t.put(k, memoryview(pattern(k, size)))
        assert t.stats().objects == 3  # the fourth extent is still the readers'
        be.gate.set()
        got = await asyncio.gather(*reads)
        assert got == [size, size]
        for o in outs:
            assert bytes(o) == pattern(b"victim", size)
        assert await t.put(b"last", memoryview(pattern(b"last", size)))
        assert t.stats().objects == 4  # the extent came back
        await t.close()
        await be.aclose()
        pool.put(outs[1])  # type: ignore[arg-type]
        pool.close()

    run(main())


@pytest.mark.timeout(60)
def test_ssd_small_reads_are_inline_only_when_alone(ssd_path: Path) -> None:
    """A small object read alone (no other read of the tier in flight, none
    gathered with it) is read in the calling thread (no backend hop); while
    another read is in flight, or with gets gathered together, it goes
    through the backend with them, so reads still overlap on the device.
    All return the object's bytes, into an aligned destination and an
    unaligned one."""

    async def main() -> None:
        pool = BufferPool(16 * MiB)
        be = GatedBackend(pool)
        t = SsdTier(ssd_path, 4 * MiB, backend=be, pool=pool)
        be.gate.set()
        small, big = 64 << 10, (1 << 20) + 3
        for k, n in ((b"s", small), (b"u", 5000), (b"b", big)):
            assert await t.put(k, memoryview(pattern(k, n)))
        be.gate.clear()
        aligned, unaligned = pool.get(small), memoryview(bytearray(5001))[1:]
        assert await t.get_into(b"s", aligned) == small and bytes(aligned) == pattern(b"s", small)
        assert await t.get_into(b"u", unaligned) == 5000 and bytes(unaligned) == pattern(b"u", 5000)
        assert be.waiting == 0  # inline: the gated backend was not asked
        held = asyncio.ensure_future(t.get_into(b"b", memoryview(bytearray(big))))
        while be.waiting < 1:
            await asyncio.sleep(0)
        queued = asyncio.ensure_future(t.get_into(b"s", aligned))
        while be.waiting < 2:  # behind the read in flight, through the backend
            await asyncio.sleep(0)
        assert not queued.done()
        be.gate.set()
        assert await asyncio.gather(held, queued) == [big, small]
        assert bytes(aligned) == pattern(b"s", small)
        # Gets gathered together (a batch) with nothing in flight: through
        # the backend together, not one inline read after another.
        be.gate.clear()
        outs = [pool.get(small) for _ in range(3)]
        batch = asyncio.gather(*(t.get_into(b"s", o) for o in outs))
        while be.waiting < 5:
            await asyncio.sleep(0)
        be.gate.set()
        assert await batch == [small] * 3
        assert all(bytes(o) == pattern(b"s", small) for o in outs)
        assert t.stats().hits == 7
        for o in outs:
            pool.put(o)
        pool.put(aligned)
        await t.close()
        await be.aclose()
        pool.close()

    run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [(256 << 10) + 5, (4 << 20) + 3, 300_000 - 1])
def test_ssd_aligned_destination_of_partial_pages(ssd_path: Path, size: int) -> None:
    async def main() -> None:
        pool = BufferPool(32 * MiB)
        t = SsdTier(ssd_path, 16 * MiB, pool=pool)
        data = pattern(b"p", size)
        await t.put(b"p", memoryview(data))
        for extra in (0, 5000):
            dest = pool.get(size + extra)
            dest[size:] = b"\x77" * extra
            assert await t.get_into(b"p", dest) == size
            assert bytes(dest[:size]) == data and bytes(dest[size:]) == b"\x77" * extra
            pool.put(dest)
        await t.close()
        pool.close()

    run(main())


@pytest.mark.timeout(30)
def test_ssd_reads_straight_into_an_aligned_destination(ssd_path: Path) -> None:
    async def main() -> None:
        pool = BufferPool(16 * MiB)
        t = SsdTier(ssd_path, 8 * MiB, pool=pool)
        data = pattern(b"a", 1 * MiB)
        await t.put(b"a", memoryview(data))
        dest = pool.get(1 * MiB)
        before = pool.stats().allocations + pool.stats().reuses
        assert await t.get_into(b"a", dest) == 1 * MiB
        assert bytes(dest) == data
        after = pool.stats().allocations + pool.stats().reuses
        assert after == before  # no bounce buffer taken
        pool.put(dest)
        await t.close()
        pool.close()

    run(main())


def test_ssd_config_errors(ssd_path: Path) -> None:
    with pytest.raises(ConfigError, match="page_size"):
        SsdTier(ssd_path, 1 * MiB, page_size=1000)
    with pytest.raises(ConfigError, match="capacity"):
        SsdTier(ssd_path, 100)


def test_tier_is_abstract() -> None:
    with pytest.raises(TypeError):
        Tier("x")  # type: ignore[abstract]


def test_ssd_inline_size_comes_from_the_client_config(tmp_path: Path) -> None:
    """``kv_ssd_inline_bytes`` (``TIERFS_KV_SSD_INLINE_BYTES``) sets the
    client's SSD tier's ``inline_max``: 256 KiB by default, 0 turns inline
    reads off; a negative size is refused, naming the field."""
    from types import SimpleNamespace

    from tierfs.client.config import ClientConfig
    from tierfs.config import load
    from tierfs.kv.client import LocalTiers

    base = {"meta": "127.0.0.1:1", "kv_ssd_bytes": "4MiB"}
    for env, want in (({}, 256 << 10), ({"TIERFS_KV_SSD_INLINE_BYTES": "64KiB"}, 64 << 10),
                      ({"TIERFS_KV_SSD_INLINE_BYTES": "0"}, 0)):
        cfg = load(ClientConfig, env=env, overrides={**base, "kv_ssd_path": str(tmp_path / f"ssd{want}")})
        tiers = LocalTiers(SimpleNamespace(config=cfg))  # type: ignore[arg-type]
        [ssd] = tiers.tiers
        assert isinstance(ssd, SsdTier) and ssd.inline_max == want
        run(tiers.close())
    with pytest.raises(ConfigError) as ei:
        load(ClientConfig, env={"TIERFS_KV_SSD_INLINE_BYTES": "-1"}, overrides=base)
    assert ei.value.field == "kv_ssd_inline_bytes"
