"""The chunk engine on real files, over every working I/O backend."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tierfs.buffers import BufferPool
from tierfs.errors import ConfigError, CorruptError, InvalidArgumentError, NotFoundError
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import (
    BLOCK_SIZE,
    ChunkEngine,
    TargetState,
    crc32c,
    fragment_path,
    header_length,
)
from tierfs.storage.io import IOBackend

Body = Callable[[ChunkEngine], Awaitable[None]]


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _run(make_backend: Callable[..., IOBackend], pool: BufferPool, root: Path, body: Body, target_id: int = 7) -> None:
    async def main() -> None:
        be = make_backend()
        eng = ChunkEngine(root, target_id, be, pool)
        await eng.open()
        try:
            await body(eng)
        finally:
            await eng.close()
            await be.aclose()

    asyncio.run(main())


async def _put(eng: ChunkEngine, key: FragmentKey, data: bytes) -> None:
    await eng.write(key, memoryview(data), crc32c(data))


async def _get(eng: ChunkEngine, key: FragmentKey, offset: int = 0, length: int = -1) -> bytes:
    view = await eng.read(key, offset, length)
    try:
        return bytes(view)
    finally:
        eng.release(view)


SIZES = [0, 1, 4095, 4096, 4097, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, (1 << 20) + 3, 5 << 20]


@pytest.mark.timeout(60)
def test_round_trip_awkward_sizes(make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path) -> None:
    async def body(eng: ChunkEngine) -> None:
        for i, size in enumerate(SIZES):
            data = _data(size, i)
            key = FragmentKey(1, i, 0, 1)
            await _put(eng, key, data)  # from a read-only bytes object (copied into the pool)
            assert await _get(eng, key) == data
            info = await eng.stat(key)
            assert (info.size, info.crc32c) == (size, crc32c(data))
            # from a pool buffer handed out by alloc() (no copy)
            buf = eng.alloc(size)
            buf[:] = data
            key2 = FragmentKey(2, i, 3, 1)
            await eng.write(key2, buf, crc32c(data))
            eng.release(buf)
            assert await _get(eng, key2) == data
            on_disk = os.stat(fragment_path(tmp_path, key2)).st_size
            assert on_disk == header_length(size) + (size + 4095) // 4096 * 4096
        assert not os.listdir(tmp_path / "tmp")

    baseline = pool.stats().in_use_bytes
    _run(make_backend, pool, tmp_path, body)
    assert pool.stats().in_use_bytes == baseline  # every buffer came back


@pytest.mark.timeout(30)
def test_ranged_reads(make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path) -> None:
    size = 300 * 1024 + 17
    data = _data(size, 5)
    key = FragmentKey(9, 0, 1, 1)
    ranges = [(0, 1), (1, 4096), (BLOCK_SIZE - 1, 2), (BLOCK_SIZE, BLOCK_SIZE), (100_000, -1),
              (size - 1, 10), (size, -1), (0, size), (0, size + 100), (12345, 0), (5, 3 * BLOCK_SIZE)]

    async def body(eng: ChunkEngine) -> None:
        await _put(eng, key, data)
        for off, ln in ranges:
            want = data[off:] if ln == -1 else data[off : off + ln]
            assert await _get(eng, key, off, ln) == want, (off, ln)
        with pytest.raises(InvalidArgumentError):
            await eng.read(key, size + 1, 1)
        with pytest.raises(InvalidArgumentError):
            await eng.read(key, -1, 1)
        with pytest.raises(InvalidArgumentError):
            await eng.read(key, 0, -2)

    _run(make_backend, pool, tmp_path, body)


@pytest.mark.timeout(30)
def test_write_with_wrong_crc_stores_nothing(
    make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path
) -> None:
    key = FragmentKey(3, 0, 0, 1)

    async def body(eng: ChunkEngine) -> None:
        data = _data(5000)
        with pytest.raises(CorruptError):
            await eng.write(key, memoryview(data), crc32c(data) ^ 1)
        assert key not in eng and eng.counters["rejected_crc"] == 1
        with pytest.raises(NotFoundError):
            await eng.read(key)
        assert not fragment_path(tmp_path, key).exists()
        assert not os.listdir(tmp_path / "tmp")

    _run(make_backend, pool, tmp_path, body)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.timeout(30)
def test_flipped_byte_on_disk_is_detected(
    make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path
) -> None:
    size = 3 * BLOCK_SIZE + 100
    data = _data(size, 2)
    key = FragmentKey(4, 1, 2, 3)

    async def body(eng: ChunkEngine) -> None:
        await _put(eng, key, data)
        path = fragment_path(tmp_path, key)
        hdr = header_length(size)
        _flip(path, hdr + BLOCK_SIZE + 10)  # inside block 1
        with pytest.raises(CorruptError):
            await eng.read(key)
        assert eng.counters["corrupt"] == 1
        with pytest.raises(CorruptError):
            await eng.read(key, BLOCK_SIZE + 5, 100)
        assert eng.counters["corrupt"] == 2
        with pytest.raises(CorruptError):
            await eng.verify(key)
        # blocks 0 and 2 are intact and still readable on their own
        assert await _get(eng, key, 0, 1000) == data[:1000]
        assert await _get(eng, key, 2 * BLOCK_SIZE, 50) == data[2 * BLOCK_SIZE : 2 * BLOCK_SIZE + 50]
        # repair: rewriting the same key replaces the bad copy atomically
        await _put(eng, key, data)
        assert await _get(eng, key) == data
        # a damaged header is caught too
        _flip(path, 40)
        with pytest.raises(CorruptError):
            await eng.read(key)
        with pytest.raises(CorruptError):
            await eng.read(key, 10, 10)
        assert eng.counters["corrupt"] == 5

    _run(make_backend, pool, tmp_path, body)


@pytest.mark.timeout(30)
def test_misplaced_file_is_not_served(make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path) -> None:
    a, b = FragmentKey(5, 0, 0, 1), FragmentKey(5, 0, 1, 1)

    async def body(eng: ChunkEngine) -> None:
        await _put(eng, a, _data(9000, 1))
        await _put(eng, b, _data(9000, 2))
        os.replace(fragment_path(tmp_path, a), fragment_path(tmp_path, b))
        with pytest.raises(CorruptError, match="holds fragment"):
            await eng.read(b)

    _run(make_backend, pool, tmp_path, body)


@pytest.mark.timeout(30)
def test_versions_and_delete(make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path) -> None:
    v1, v2 = FragmentKey(6, 2, 0, 1), FragmentKey(6, 2, 0, 2)

    async def body(eng: ChunkEngine) -> None:
        await _put(eng, v1, b"old" * 1000)
        await _put(eng, v2, b"new" * 2000)
        assert await _get(eng, v1) == b"old" * 1000
        assert await _get(eng, v2) == b"new" * 2000
        assert sorted(eng.keys(inode=6)) == [v1, v2]
        used = eng.stats().used
        assert await eng.delete(v1) is True
        assert await eng.delete(v1) is False
        assert eng.stats().used == used - (header_length(3000) + 4096)
        with pytest.raises(NotFoundError):
            await eng.read(v1)
        with pytest.raises(NotFoundError):
            await eng.stat(v1)
        assert not fragment_path(tmp_path, v1).exists()
        assert await _get(eng, v2) == b"new" * 2000
        lone = FragmentKey(66, 0, 0, 1)
        await _put(eng, lone, b"x")
        assert await eng.delete(lone)
        # same key rewritten with different contents: the new one wins, whole
        await _put(eng, v2, b"newer" * 10)
        assert await _get(eng, v2) == b"newer" * 10
        assert len(eng) == 1
        assert fragment_path(tmp_path, lone).parent.is_dir()  # empty inode dir stays while running

    async def reopened(eng: ChunkEngine) -> None:
        assert not fragment_path(tmp_path, FragmentKey(66, 0, 0, 1)).parent.exists()  # swept at start
        assert await _get(eng, v2) == b"newer" * 10
        await _put(eng, FragmentKey(66, 1, 0, 1), b"back")  # the directory comes back on demand
        assert await _get(eng, FragmentKey(66, 1, 0, 1)) == b"back"

    _run(make_backend, pool, tmp_path, body)
    _run(make_backend, pool, tmp_path, reopened)


@pytest.mark.timeout(60)
def test_restart_rebuilds_index_and_cleans_temp(
    make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path
) -> None:
    keys = {FragmentKey(i % 5, i, i % 3, 1 + i % 2): _data(1000 * i + 1, i) for i in range(40)}
    stats_before: list[int] = []

    async def first(eng: ChunkEngine) -> None:
        await asyncio.gather(*(_put(eng, k, d) for k, d in keys.items()))
        stats_before.append(eng.stats().used)

    _run(make_backend, pool, tmp_path, first)
    (tmp_path / "tmp" / "deadbeef.tmp").write_bytes(b"half a fragment")
    (tmp_path / "tmp" / "cafe.tmp").write_bytes(b"")

    async def second(eng: ChunkEngine) -> None:
        assert eng.counters["temp_cleaned"] == 2
        assert not os.listdir(tmp_path / "tmp")
        assert set(eng.keys()) == set(keys)
        assert eng.stats().used == stats_before[0]
        # stat before any read: the header is loaded lazily
        k0 = next(iter(keys))
        info = await eng.stat(k0)
        assert info.size == len(keys[k0]) and info.crc32c == crc32c(keys[k0])
        for k, d in keys.items():
            assert await _get(eng, k, 1, 100) == d[1:101]
            assert await _get(eng, k) == d

    _run(make_backend, pool, tmp_path, second)
    assert json.loads((tmp_path / "target.json").read_text())["target_id"] == 7
    with pytest.raises(ConfigError, match="belongs to target 7"):
        _run(make_backend, pool, tmp_path, second, target_id=8)


@pytest.mark.timeout(60)
def test_concurrent_writers(make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path) -> None:
    async def body(eng: ChunkEngine) -> None:
        blobs = {FragmentKey(100 + i % 4, i, 0, 1): _data(64 * 1024 + i, i) for i in range(64)}
        await asyncio.gather(*(_put(eng, k, d) for k, d in blobs.items()))
        same = FragmentKey(999, 0, 0, 1)
        variants = [bytes([i]) * 70_000 for i in range(8)]
        await asyncio.gather(*(_put(eng, same, v) for v in variants))
        assert await _get(eng, same) in variants
        got = await asyncio.gather(*(_get(eng, k) for k in blobs))
        assert got == list(blobs.values())
        st = eng.stats()
        assert st.state == TargetState.ONLINE and st.fragments == 65 and st.capacity > 0

    _run(make_backend, pool, tmp_path, body)


@pytest.mark.timeout(30)
def test_typed_and_foreign_buffers(make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path) -> None:
    import array

    async def body(eng: ChunkEngine) -> None:
        arr = array.array("I", range(5000))  # a typed (format "I") buffer
        raw = arr.tobytes()
        await eng.write(FragmentKey(8, 0, 0, 1), memoryview(arr), crc32c(raw))
        assert await _get(eng, FragmentKey(8, 0, 0, 1)) == raw
        ba = bytearray(b"unaligned source" * 999)
        await eng.write(FragmentKey(8, 1, 0, 1), memoryview(ba)[3:], crc32c(bytes(ba[3:])))
        assert await _get(eng, FragmentKey(8, 1, 0, 1)) == bytes(ba[3:])
        eng.max_fragment_size = 1 << 20
        with pytest.raises(InvalidArgumentError):
            await eng.write(FragmentKey(8, 2, 0, 1), memoryview(bytes((1 << 20) + 1)), 0)
        with pytest.raises(ValueError):
            eng.release(memoryview(bytearray(10)))  # not a pool buffer

    _run(make_backend, pool, tmp_path, body)


@pytest.mark.timeout(30)
def test_read_with_crc(make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path) -> None:
    data = _data(200_000, 11)
    key = FragmentKey(12, 0, 0, 1)

    async def body(eng: ChunkEngine) -> None:
        await _put(eng, key, data)
        for off, ln, whole in [(0, -1, True), (0, len(data), True), (0, 10**9, True), (1, -1, False), (0, 100, False)]:
            view, crc = await eng.read_with_crc(key, off, ln)
            try:
                assert bytes(view) == (data[off:] if ln == -1 else data[off : off + ln])
                assert crc == (crc32c(data) if whole else None), (off, ln)
            finally:
                eng.release(view)

    _run(make_backend, pool, tmp_path, body)


@pytest.mark.timeout(60)
def test_a_fragment_file_has_a_serial_that_changes_when_it_is_replaced(
    make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path
) -> None:
    """READ and STAT answers carry the serial of the fragment file they read
    or describe (docs/dataplane.md, "Serials"): a client that verified a
    copy once trusts later partial reads only while it stays the same file."""
    key, other = FragmentKey(12, 0, 0, 1), FragmentKey(12, 1, 0, 1)
    a, b = _data(100_000, 1), _data(100_000, 2)
    seen: list[int] = []

    async def read_serial(eng: ChunkEngine, off: int, ln: int) -> tuple[bytes, int]:
        view, _, serial = await eng.read_with_info(key, off, ln)
        try:
            return bytes(view), serial
        finally:
            eng.release(view)

    async def first(eng: ChunkEngine) -> None:
        await _put(eng, key, a)
        await _put(eng, other, a)
        got, s1 = await read_serial(eng, 10, 500)
        assert got == a[10:510] and s1 > 0
        assert (await eng.stat(key)).serial == s1 == eng.serial(key)
        assert (await read_serial(eng, 0, -1))[1] == s1  # whole or part: the same file
        assert (await eng.stat(other)).serial not in (0, s1)  # another file
        await _put(eng, key, b)  # replaced (a repair, or other bytes under the same key)
        got, s2 = await read_serial(eng, 10, 500)
        assert got == b[10:510] and s2 not in (0, s1)
        assert (await eng.stat(key)).serial == s2
        seen.extend((s1, s2))

    _run(make_backend, pool, tmp_path, first)

    async def second(eng: ChunkEngine) -> None:
        # A restarted daemon indexes the file anew: a serial of this run.
        got, s3 = await read_serial(eng, 10, 500)
        assert got == b[10:510] and s3 not in (0, *seen)

    _run(make_backend, pool, tmp_path, second)


@pytest.mark.timeout(30)
def test_scrub_quarantines_what_reads_found_corrupt(
    make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path
) -> None:
    bad, good = FragmentKey(13, 0, 0, 1), FragmentKey(13, 0, 1, 1)
    data = _data(150_000, 13)

    async def first(eng: ChunkEngine) -> None:
        await _put(eng, bad, data)
        await _put(eng, good, data)
        _flip(fragment_path(tmp_path, bad), header_length(len(data)) + 100_000)
        with pytest.raises(CorruptError):
            await eng.read(bad, 99_000, 10)
        assert eng.suspects() == [bad]
        used = eng.stats().used
        assert await eng.scrub_one(good) == len(data)  # intact: left alone
        assert await eng.scrub_one(bad) > 0
        assert eng.suspects() == [] and bad not in eng and eng.counters["quarantined"] == 1
        assert eng.stats().used == used - os.path.getsize(next((tmp_path / "quarantine").iterdir()))
        with pytest.raises(NotFoundError):
            await eng.read(bad)  # reads as missing: degraded reads and repair take over
        assert await _get(eng, good) == data
        # repair writes it back under the same key
        await _put(eng, bad, data)
        assert await _get(eng, bad) == data

    _run(make_backend, pool, tmp_path, first)

    async def second(eng: ChunkEngine) -> None:  # the quarantined copy is never served again
        assert sorted(eng.keys()) == [bad, good]
        assert await _get(eng, bad) == data

    _run(make_backend, pool, tmp_path, second)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_a_directory_where_a_fragment_was_is_corrupt_and_quarantined(
    make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path, kind: str
) -> None:
    """Something other than a file where a fragment's file was (a new
    user's `rm F && mkdir F`): reads and stats say corrupt, scrub moves it to
    quarantine, and the key reads as missing (repair rebuilds it). Until stop
    49 every read and every scrub was an InternalError ("Is a directory") and
    the fragment was never rebuilt. A FIFO there: until stop 50 the read's
    open waited for a writer for ever, on the event loop (the daemon hung)."""
    key = FragmentKey(14, 0, 0, 1)
    data = _data(20_000, 14)

    async def body(eng: ChunkEngine) -> None:
        await _put(eng, key, data)
        path = fragment_path(tmp_path, key)
        os.unlink(path)
        (os.mkdir if kind == "dir" else os.mkfifo)(path)
        with pytest.raises(CorruptError, match="not a regular file"):
            await eng.read(key)
        with pytest.raises(CorruptError, match="not a regular file"):
            await eng.read(key, 100, 10)
        with pytest.raises(CorruptError, match="not a regular file"):
            await eng.stat(key)
        await eng.scrub_one(key)
        assert key not in eng and eng.counters["quarantined"] == 1 and not path.exists()
        with pytest.raises(NotFoundError):
            await eng.read(key)
        await _put(eng, key, data)  # repair writes it back
        assert await _get(eng, key) == data

    _run(make_backend, pool, tmp_path, body)


@pytest.mark.timeout(60)
def test_multi_page_header_after_restart(
    make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path
) -> None:
    size = (64 << 20) + 3  # 1025 blocks: the header needs two pages
    data = _data(size, 17)
    key = FragmentKey(14, 0, 0, 1)
    assert header_length(size) == 8192

    async def first(eng: ChunkEngine) -> None:
        await _put(eng, key, data)

    async def second(eng: ChunkEngine) -> None:  # nothing known but the file length
        assert await _get(eng, key, size - 70_000, 100) == data[size - 70_000 : size - 69_900]
        assert (await eng.stat(key)).size == size
        assert await _get(eng, key) == data

    _run(make_backend, pool, tmp_path, first)
    _run(make_backend, pool, tmp_path, second)


@pytest.mark.timeout(30)
def test_one_engine_per_target_directory(
    make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path
) -> None:
    async def body(eng: ChunkEngine) -> None:
        other = ChunkEngine(tmp_path, 7, eng.backend, pool)
        with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()}"):
            await other.open()

    _run(make_backend, pool, tmp_path, body)
    _run(make_backend, pool, tmp_path, body)  # the first engine's close released it
