"""TierStack over real tiers: DRAM -> SSD (a file under tmp_path) -> a second
DRAM tier standing in for the cluster at the bottom."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import numpy as np
import pytest

from tests.kv.conformance import MiB, before, pattern, run
from tierfs.buffers import BufferPool
from tierfs.errors import ConfigError, InvalidArgumentError
from tierfs.kv.stack import TierStack
from tierfs.kv.tiers import DramTier, SsdTier
from tierfs.storage.io import PosixBackend

SIZE = 64 << 10


def three(tmp_path: Path, *, dram: int = 1 * MiB, ssd: int = 2 * MiB, bottom: int = 16 * MiB) -> list:
    return [
        DramTier(dram, name="dram"),
        SsdTier(tmp_path / "ssd.bin", ssd, name="ssd"),
        DramTier(bottom, name="bottom"),
    ]


def key(i: int) -> bytes:
    return f"blk{i:05d}".encode()


@pytest.mark.timeout(60)
def test_hit_below_promotes_upward(tmp_path: Path) -> None:
    async def main() -> None:
        dram, ssd, bottom = three(tmp_path)
        s = TierStack([dram, ssd, bottom])
        # in the bottom tier only
        assert await bottom.put(b"cold", memoryview(pattern(b"cold", SIZE)))
        out = bytearray(SIZE)
        assert await s.get_into(b"cold", out) == SIZE and out == pattern(b"cold", SIZE)
        assert await dram.contains([b"cold"]) == [True]
        assert await ssd.contains([b"cold"]) == [True]
        st = {t.name: t for t in s.stats()}
        assert st["dram"].promotions == 1 and st["ssd"].promotions == 1
        assert st["dram"].misses == 1 and st["ssd"].misses == 1 and st["bottom"].hits == 1
        # the next get is a DRAM hit and touches nothing below
        out[:] = bytes(SIZE)
        assert await s.get_into(b"cold", out) == SIZE and out == pattern(b"cold", SIZE)
        st = {t.name: t for t in s.stats()}
        assert st["dram"].hits == 1 and st["ssd"].hits == 0 and st["bottom"].hits == 1
        # a miss everywhere
        assert await s.get_into(b"nowhere", out) is None
        await s.close()

    run(main())


@pytest.mark.timeout(60)
def test_an_expiry_goes_with_every_copy(tmp_path: Path) -> None:
    """An object put with an expiry keeps it when it is promoted from the
    bottom or demoted from the top; write-back copies carry it too. Past it,
    no tier serves the object."""
    async def main() -> None:
        for write_back in (False, True):
            (tmp_path / str(write_back)).mkdir()
            dram, ssd, bottom = three(tmp_path / str(write_back))
            s = TierStack([dram, ssd, bottom], write_back=write_back)
            deadline = time.monotonic() + 3.0
            assert await bottom.put(b"cold", memoryview(pattern(b"cold", SIZE)), expires=deadline)
            out = bytearray(SIZE)
            # (each check that an object is there holds only if it ran before
            # the deadline: under a heavy load the test could pass it)
            n = await s.get_into(b"cold", out)  # promoted into dram and ssd
            if before(deadline):
                assert n == SIZE and dram.expiry_of(b"cold") == ssd.expiry_of(b"cold") == deadline
            await s.put(b"hot", memoryview(pattern(b"hot", SIZE)), expires=deadline)
            await s.flush()
            if before(deadline):
                assert bottom.expiry_of(b"hot") == ssd.expiry_of(b"hot") == deadline
            # fill dram: both are demoted into ssd (which has them) or beyond
            for i in range(40):
                assert await s.put(key(i), memoryview(pattern(key(i), SIZE)))
            await s.flush()
            assert await dram.contains([b"cold", b"hot"]) == [False, False]
            n = await s.get_into(b"hot", out)
            if before(deadline):
                assert n == SIZE and out == pattern(b"hot", SIZE) and dram.expiry_of(b"hot") == deadline
            while time.monotonic() <= deadline:
                await asyncio.sleep(0.05)
            assert await s.get_into(b"hot", out) is None and await s.get_into(b"cold", out) is None
            assert await s.contains([b"hot", b"cold", key(39)]) == [False, False, True]
            await s.close()

    run(main())


@pytest.mark.timeout(60)
def test_eviction_demotes_down_the_chain(tmp_path: Path) -> None:
    """Objects put into the top tier only fall DRAM -> SSD -> bottom as each
    fills; none is lost while the bottom has room, and all keep their bytes."""

    async def main() -> None:
        dram, ssd, bottom = three(tmp_path)  # 16 + 32 blocks above a 256-block bottom
        s = TierStack([dram, ssd, bottom])
        n = 100
        for i in range(n):
            assert await dram.put(key(i), memoryview(pattern(key(i), SIZE)))
        st = {t.name: t for t in s.stats()}
        assert st["dram"].objects == 16 and st["ssd"].objects == 32
        assert st["ssd"].demotions == st["dram"].evictions == n - 16
        assert st["bottom"].demotions == st["ssd"].evictions == n - 16 - 32
        assert all(await s.contains([key(i) for i in range(n)]))
        # the oldest are only in the bottom tier now, the newest in DRAM
        assert await bottom.contains([key(0)]) == [True]
        assert await dram.contains([key(0), key(n - 1)]) == [False, True]
        out = bytearray(SIZE)
        for i in range(n):
            assert await s.get_into(key(i), out) == SIZE
            assert out == pattern(key(i), SIZE), i
        await s.close()

    run(main())


@pytest.mark.timeout(60)
def test_demotion_into_a_tier_that_has_it_is_a_noop(tmp_path: Path) -> None:
    async def main() -> None:
        dram, ssd, bottom = three(tmp_path)
        s = TierStack([dram, ssd, bottom])  # write-through: every tier has every object
        for i in range(40):
            assert await s.put(key(i), pattern(key(i), SIZE))
        st = {t.name: t for t in s.stats()}
        assert st["dram"].evictions == 40 - 16
        assert st["ssd"].demotions == 0 and st["bottom"].demotions == 0
        assert st["bottom"].objects == 40 and st["bottom"].puts == 40
        await s.close()

    run(main())


@pytest.mark.timeout(60)
def test_write_through_stores_everywhere_before_returning(tmp_path: Path) -> None:
    async def main() -> None:
        tiers = three(tmp_path)
        s = TierStack(tiers)
        buf = bytearray(pattern(b"wt", SIZE))
        assert await s.put(b"wt", buf) is True
        buf[:] = bytes(SIZE)  # the caller reuses its buffer at once
        for t in tiers:
            out = bytearray(SIZE)
            assert await t.get_into(b"wt", out) == SIZE and out == pattern(b"wt", SIZE), t.name
        assert await s.put(b"wt", buf) is False  # present: a no-op
        await s.close()

    run(main())


@pytest.mark.timeout(60)
def test_write_back_returns_at_the_top_and_flush_fills_the_rest(tmp_path: Path) -> None:
    async def main() -> None:
        dram, ssd, bottom = three(tmp_path, dram=8 * MiB, ssd=8 * MiB)
        s = TierStack([dram, ssd, bottom], write_back=True, queue_size=4)
        bufs = [bytearray(pattern(key(i), SIZE)) for i in range(30)]
        for i, b in enumerate(bufs):
            assert await s.put(key(i), b)
            assert await dram.contains([key(i)]) == [True]  # in the top tier on return
            b[:] = b"\xff" * SIZE  # reused by the caller: lower tiers must not see this
        await s.flush()
        for t in (ssd, bottom):
            out = bytearray(SIZE)
            for i in range(30):
                assert await t.get_into(key(i), out) == SIZE, (t.name, i)
                assert out == pattern(key(i), SIZE), (t.name, i)
        assert s.write_back_errors == 0
        await s.close()

    run(main())


@pytest.mark.timeout(60)
def test_write_back_delete_is_not_undone_by_a_queued_write(tmp_path: Path) -> None:
    async def main() -> None:
        tiers = three(tmp_path, dram=8 * MiB, ssd=8 * MiB)
        s = TierStack(tiers, write_back=True)
        for i in range(20):
            await s.put(key(i), pattern(key(i), SIZE))
            assert await s.delete(key(i))  # the write-back of it may still be queued
        await s.flush()
        for t in tiers:
            assert not any(await t.contains([key(i) for i in range(20)])), t.name
        await s.close()

    run(main())


class WriteGate(PosixBackend):
    """The posix backend with writes held at a gate (the I/O itself is real)."""

    def __init__(self, pool: BufferPool) -> None:
        super().__init__(pool, threads=2)
        self.gate = asyncio.Event()
        self.waiting = 0

    async def _pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        self.waiting += 1
        await self.gate.wait()
        return await super()._pwrite(fd, buf, offset)


@pytest.mark.timeout(60)
def test_write_back_delete_during_the_copy_down(tmp_path: Path) -> None:
    """A delete that lands while the write-back is writing the object into the
    SSD tier: the object must not stay there afterwards."""

    async def main() -> None:
        pool = BufferPool(16 * MiB)
        gate = WriteGate(pool)
        dram = DramTier(1 * MiB)
        ssd = SsdTier(tmp_path / "s.bin", 1 * MiB, backend=gate, pool=pool)
        s = TierStack([dram, ssd], write_back=True)
        await s.put(b"d", pattern(b"d", SIZE))
        while gate.waiting < 1:  # the copy-down is at the disk
            await asyncio.sleep(0.001)
        assert await s.delete(b"d")
        gate.gate.set()
        await s.flush()
        assert await ssd.contains([b"d"]) == [False]
        assert await s.contains([b"d"]) == [False]
        # and a put after the delete is written down as usual
        await s.put(b"d", pattern(b"d", SIZE))
        await s.flush()
        assert await ssd.contains([b"d"]) == [True]
        await s.close()
        await gate.aclose()
        pool.close()

    run(main())


@pytest.mark.timeout(30)
def test_write_back_needs_a_lending_top_tier(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path / "s.bin", 1 * MiB)
    with pytest.raises(ConfigError, match="write-back"):
        TierStack([ssd, DramTier(1 * MiB)], write_back=True)
    with pytest.raises(ConfigError, match="at least one"):
        TierStack([])
    d = DramTier(1 * MiB)
    with pytest.raises(ConfigError, match="twice"):
        TierStack([d, d])
    run(ssd.close())


@pytest.mark.timeout(60)
def test_delete_removes_from_every_tier(tmp_path: Path) -> None:
    async def main() -> None:
        tiers = three(tmp_path)
        s = TierStack(tiers)
        await s.put(b"x", b"payload")
        assert await s.contains([b"x"]) == [True]
        assert await s.delete(b"x") is True
        for t in tiers:
            assert await t.contains([b"x"]) == [False]
        assert await s.delete(b"x") is False
        await s.close()

    run(main())


@pytest.mark.timeout(60)
def test_batches(tmp_path: Path) -> None:
    async def main() -> None:
        dram, ssd, bottom = three(tmp_path)
        s = TierStack([dram, ssd, bottom])
        keys = [key(i) for i in range(10)]
        bufs = [np.frombuffer(pattern(k, 5000), dtype=np.uint8) for k in keys]
        assert await s.batch_put(keys, bufs, parents=[None, *keys[:-1]]) == [True] * 10
        assert await s.batch_put(keys[:2], bufs[:2]) == [False, False]
        await dram.delete(keys[3])  # one of them only below the top
        outs = [bytearray(5000) for _ in range(11)]
        got = await s.batch_get_into([*keys, b"absent"], outs)
        assert got == [5000] * 10 + [None]
        for k, o in zip(keys, outs, strict=False):
            assert o == pattern(k, 5000)
        assert await dram.contains([keys[3]]) == [True]  # promoted back
        assert await s.batch_contains([keys[0], b"absent", keys[9]]) == [True, False, True]
        with pytest.raises(InvalidArgumentError):
            await s.batch_put(keys, bufs[:3])
        with pytest.raises(InvalidArgumentError):
            await s.batch_get_into(keys, outs[:2])
        # a bad buffer anywhere in the batch: nothing of it is stored
        with pytest.raises(InvalidArgumentError):
            await s.batch_put([b"n1", b"n2"], [b"ok", 17])
        assert await s.contains([b"n1", b"n2"]) == [False, False]
        await s.close()

    run(main())


@pytest.mark.timeout(120)
def test_concurrent_stack_traffic_returns_right_bytes(tmp_path: Path) -> None:
    """Many gets and puts at once through a stack small enough that promotion,
    eviction and demotion all run under them."""

    async def main() -> None:
        dram, ssd, bottom = three(tmp_path, dram=512 << 10, ssd=1 * MiB, bottom=4 * MiB)
        s = TierStack([dram, ssd, bottom], write_back=True, queue_size=8)
        keys = [key(i) for i in range(48)]
        sizes = {k: (i % 3 + 1) * 20_000 for i, k in enumerate(keys)}
        hits = 0

        async def worker(seed: int) -> None:
            nonlocal hits
            r = random.Random(seed)
            out = bytearray(60_000)
            for _ in range(30):
                k = r.choice(keys)
                if r.random() < 0.4:
                    await s.put(k, pattern(k, sizes[k]))
                else:
                    n = await s.get_into(k, out)
                    if n is not None:
                        assert n == sizes[k] and out[:n] == pattern(k, n), k
                        hits += 1

        await asyncio.gather(*(worker(i) for i in range(12)))
        await s.flush()
        assert hits > 0
        st = {t.name: t for t in s.stats()}
        assert st["dram"].evictions > 0 and st["ssd"].demotions > 0
        for t in s.stats():
            assert t.used <= t.capacity
        await s.close()

    run(main())


@pytest.mark.timeout(30)
def test_single_tier_stack_and_str_keys() -> None:
    async def main() -> None:
        s = TierStack([DramTier(1 * MiB)], write_back=True)  # nothing below: write-back is moot
        assert await s.put("a/str/key", b"v") is True
        out = bytearray(1)
        assert await s.get_into("a/str/key", out) == 1 and out == b"v"
        with pytest.raises(InvalidArgumentError):
            await s.put(b"", b"v")
        assert len(s.stats()) == 1
        await s.close()

    run(main())
