"""BufferPool: alignment, exact sizes, size classes, reuse, bounds, misuse."""

from __future__ import annotations

import threading

import pytest

from tierfs.buffers import ALIGN, BufferPool, buffer_address, is_aligned, round_up


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 100_000, (1 << 20) + 1, 64 << 20])
def test_exact_size_over_an_aligned_region(size: int) -> None:
    pool = BufferPool(1 << 30)
    try:
        v = pool.get(size)
        assert v.nbytes == size and not v.readonly
        cap = pool.capacity(v)
        assert cap >= max(round_up(size), ALIGN) and cap % ALIGN == 0
        assert cap <= max(ALIGN * 4, int(round_up(size) * 1.25) + ALIGN)  # waste bounded
        ext = pool.extent(v, round_up(size))
        assert ext is not None and is_aligned(ext)
        if size:
            addr = buffer_address(v)
            assert addr is not None and addr % ALIGN == 0
            v[-1] = 7
        pool.put(v)
    finally:
        pool.close()


def test_reuse_and_idle_bound() -> None:
    pool = BufferPool(max_idle_bytes=3 * (64 << 10))
    try:
        views = [pool.get(64 << 10) for _ in range(5)]
        for v in views:
            pool.put(v)
        st = pool.stats()
        assert st.idle_bytes == 3 * (64 << 10) and st.in_use_bytes == 0  # two were unmapped
        again = pool.get(60_000)  # same size class: reused, not allocated
        assert pool.stats().reuses == 1 and pool.stats().allocations == 5
        pool.put(again[10:20])  # a slice returns the whole region
        assert pool.stats().in_use_buffers == 0
        assert pool.trim() == 3 * (64 << 10) and pool.stats().idle_bytes == 0
    finally:
        pool.close()


def test_misuse_is_refused() -> None:
    pool, other = BufferPool(1 << 20), BufferPool(1 << 20)
    try:
        v = pool.get(100)
        with pytest.raises(ValueError):
            other.put(v)
        with pytest.raises(ValueError):
            pool.put(memoryview(bytearray(100)))
        pool.put(v)
        with pytest.raises(ValueError):
            pool.put(v)  # twice
        with pytest.raises(ValueError):
            pool.get(-1)
        assert pool.extent(memoryview(bytearray(10)), 4096) is None
        w = pool.get(8192)
        assert pool.extent(w[4096:], 4096) is None  # not at the region start
        pool.put(w)
    finally:
        pool.close()
        other.close()
    with pytest.raises(RuntimeError):
        pool.get(1)


def test_threads_share_a_pool() -> None:
    pool = BufferPool(8 << 20)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(300):
                v = pool.get(1000 * ((seed + i) % 50 + 1))
                v[:1] = bytes([seed])
                assert v[0] == seed
                pool.put(v)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors
        st = pool.stats()
        assert st.in_use_buffers == 0 and st.idle_bytes <= 8 << 20
    finally:
        pool.close()


def test_total_bytes_are_bounded() -> None:
    from tierfs.errors import UnavailableError

    pool = BufferPool(max_idle_bytes=1 << 20, max_total_bytes=256 << 10)
    try:
        a = pool.get(128 << 10)
        b = pool.get(64 << 10)
        pool.put(b)  # idle now, but counts toward the total
        c = pool.get(100 << 10)  # fits only once the idle 64 KiB region is dropped
        assert pool.stats().idle_bytes == 0
        with pytest.raises(UnavailableError, match="exhausted"):
            pool.get(64 << 10)
        st = pool.stats()
        assert st.in_use_bytes + st.idle_bytes <= 256 << 10
        pool.put(a)
        d = pool.get(64 << 10)  # room again
        for v in (c, d):
            pool.put(v)
    finally:
        pool.close()


@pytest.mark.parametrize("size", [0, 1, 100, 4096, 4097, 20_000, 64 * 1024 + 1, 3 << 20, 300 << 20])
def test_region_size_is_what_get_maps(size: int) -> None:
    """``region_size`` (what a read cache counts a buffer as) is the size of
    the region ``get`` maps, pooled size classes and unpooled sizes alike."""
    pool = BufferPool(1 << 20, max_pooled_size=256 << 20)
    buf = pool.get(size)
    try:
        assert len(buf) == size and pool.region_size(size) == pool.capacity(buf) >= max(size, 1)
    finally:
        pool.put(buf)
