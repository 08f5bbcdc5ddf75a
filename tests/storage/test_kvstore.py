"""The per-target KV store on real files: placement, eviction, pins, TTLs, restart, corruption, races."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tierfs.buffers import BufferPool
from tierfs.chunk import crc32c
from tierfs.errors import InvalidArgumentError, NoSpaceError, NotFoundError
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine
from tierfs.storage.io import IOBackend, PosixBackend
from tierfs.storage.kvstore import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    PIN_HARD,
    PIN_SOFT,
    RUNNING_FILE,
    KVPoolSpec,
    KVPoolUsage,
    KVStore,
    object_file_length,
)

KiB = 1 << 10
MiB = 1 << 20

Body = Callable[[KVStore], Awaitable[None]]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def pattern(key: bytes, size: int, version: int = 0) -> bytes:
    """Deterministic contents of (key, version): a reader can tell which object it got."""
    return random.Random(crc32c(key, version)).randbytes(size)


def mem_pool(pid: int = 1, memory: int = 1 * MiB, **kw: object) -> KVPoolSpec:
    return KVPoolSpec(pool_id=pid, name=f"mem{pid}", memory_bytes=memory, disk_bytes=0, **kw)  # type: ignore[arg-type]


def disk_pool(pid: int = 2, memory: int = 256 * KiB, disk: int = 2 * MiB, **kw: object) -> KVPoolSpec:
    return KVPoolSpec(pool_id=pid, name=f"disk{pid}", memory_bytes=memory, disk_bytes=disk, **kw)  # type: ignore[arg-type]


async def put(store: KVStore, pid: int, key: bytes, data: bytes, **kw: object) -> bool:
    buf = store.alloc(len(data))
    buf[:] = data
    return await store.put(pid, key, buf, crc32c(data), **kw)  # type: ignore[arg-type]


async def get(store: KVStore, pid: int, key: bytes) -> bytes | None:
    got = await store.get(pid, key)
    if got is None:
        return None
    view, crc = got
    try:
        data = bytes(view)
    finally:
        store.release(view)
    assert crc32c(data) == crc
    return data


def usage(store: KVStore, pid: int) -> KVPoolUsage:
    return next(u for u in store.usage() if u.pool_id == pid)


def object_files(root: Path, pid: int) -> list[Path]:
    d = root / "kv" / str(pid)
    return sorted(f for f in d.glob("*/*") if f.parent.name != "tmp") if d.exists() else []


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def run(
    root: Path,
    pool: BufferPool,
    specs: list[KVPoolSpec],
    body: Body,
    *,
    clock: Callable[[], float] = time.time,
    sweep_interval: float = 0,
    backend: Callable[[], IOBackend] | None = None,
) -> None:
    async def main() -> None:
        be = backend() if backend is not None else None
        store = KVStore(root, target_id=3, pool=pool, backend=be, clock=clock, sweep_interval=sweep_interval)
        await store.open()
        try:
            store.configure(specs)
            await body(store)
        finally:
            await store.close()
            if be is not None:
                await be.aclose()

    asyncio.run(main())
    # nothing leaks: every alloc()/get() buffer went back to the pool
    assert pool.stats().in_use_buffers == 0


# -- basics -------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", [mem_pool(), disk_pool(), disk_pool(memory=0)], ids=["memory", "both", "disk"])
def test_roundtrip(tmp_path: Path, pool: BufferPool, spec: KVPoolSpec) -> None:
    pid = spec.pool_id

    async def body(s: KVStore) -> None:
        for i, size in enumerate([0, 1, 4095, 4096, 4097, 100 * KiB]):
            key = f"k{i}".encode()
            data = pattern(key, size)
            assert await put(s, pid, key, data)
            assert await get(s, pid, key) == data
        assert s.contains(pid, [b"k0", b"nope", b"k5"]) == [True, False, True]
        # the stored CRC32Cs (a replica get's witness), from the index
        assert s.crcs(pid, [b"k0", b"nope", b"k5"]) == [crc32c(b""), None, crc32c(pattern(b"k5", 100 * KiB))]
        # immutable: a second put is a no-op, the old bytes stay
        assert not await put(s, pid, b"k1", b"other")
        assert await get(s, pid, b"k1") == pattern(b"k1", 1)
        assert await put(s, pid, b"k1", b"other", overwrite=True)
        assert await get(s, pid, b"k1") == b"other"
        # a foreign (non-alloc) buffer is copied, and the caller keeps it
        mine = bytearray(pattern(b"foreign", 5000))
        assert await s.put(pid, b"foreign", memoryview(mine), crc32c(mine))
        mine[:] = bytes(5000)
        assert await get(s, pid, b"foreign") == pattern(b"foreign", 5000)
        assert await s.delete(pid, b"k2")
        assert not await s.delete(pid, b"k2")
        assert await get(s, pid, b"k2") is None
        u = usage(s, pid)
        assert u.objects == 6 and u.puts == 8 and u.hits >= 8 and u.misses == 1
        assert u.bytes_in == sum([0, 1, 4095, 4096, 4097, 100 * KiB, 5, 5000])

    run(tmp_path, pool, [spec], body)


@pytest.mark.timeout(60)
def test_bad_input_changes_nothing(tmp_path: Path, pool: BufferPool) -> None:
    async def body(s: KVStore) -> None:
        assert await put(s, 1, b"a", b"x")
        assert await put(s, 1, b"k" * MAX_KEY_BYTES, b"max key")
        assert await get(s, 1, b"k" * MAX_KEY_BYTES) == b"max key"
        assert await s.delete(1, b"k" * MAX_KEY_BYTES)
        before = s.usage()
        for key in (b"", b"k" * (MAX_KEY_BYTES + 1)):
            with pytest.raises(InvalidArgumentError, match=rf"1\.\.{MAX_KEY_BYTES} bytes"):
                await put(s, 1, key, b"x")
            with pytest.raises(InvalidArgumentError):
                await s.get(1, key)
            with pytest.raises(InvalidArgumentError):
                s.contains(1, [key])
        with pytest.raises(NotFoundError, match="no KV pool 9 on target 3"):
            await put(s, 9, b"a", b"x")
        with pytest.raises(NotFoundError):
            await s.get(9, b"a")
        with pytest.raises(NotFoundError):
            await s.delete(9, b"a")
        with pytest.raises(NotFoundError):
            s.pin(9, b"a", PIN_SOFT)
        with pytest.raises(InvalidArgumentError, match="pin kind"):
            s.pin(1, b"a", 7)
        with pytest.raises(InvalidArgumentError, match="unknown pin kind"):
            await put(s, 1, b"b", b"x", pin=5)
        with pytest.raises(InvalidArgumentError, match="TTL"):
            await put(s, 1, b"b", b"x", ttl_ms=-1)
        # larger than the pool can ever hold: a clear error, not an eviction storm
        with pytest.raises(InvalidArgumentError, match=r"KV pool 'mem1' on target 3: a 1048576-byte object can never fit"):
            await put(s, 1, b"big", bytes(MiB))
        with pytest.raises(InvalidArgumentError, match="can never fit"):
            await put(s, 2, b"big", bytes(2 * MiB))
        assert s.usage() == before
        assert await get(s, 1, b"a") == b"x"
        before = s.usage()
        with pytest.raises(ValueError, match="not handed out"):
            s.release(memoryview(bytearray(10)))
        # a bad spec is refused as a whole
        with pytest.raises(InvalidArgumentError, match="watermarks"):
            s.configure([mem_pool(), mem_pool(3, high_watermark=0.5, low_watermark=0.9)])
        with pytest.raises(InvalidArgumentError, match="unknown eviction policy"):
            s.configure([mem_pool(policy="nope")])
        with pytest.raises(InvalidArgumentError, match="listed twice"):
            s.configure([mem_pool(), mem_pool()])
        assert s.usage() == before

    run(tmp_path, pool, [mem_pool(), disk_pool()], body)


# -- capacity and placement -----------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", [mem_pool(memory=1 * MiB), disk_pool(memory=256 * KiB, disk=1 * MiB)], ids=["memory", "disk"])
def test_three_times_capacity(tmp_path: Path, pool: BufferPool, spec: KVPoolSpec) -> None:
    pid = spec.pool_id
    size = 16 * KiB
    budget = spec.disk_bytes or spec.memory_bytes
    per_obj = object_file_length(size) if spec.disk_bytes else size
    n = 3 * budget // size

    async def body(s: KVStore) -> None:
        for i in range(n):
            key = f"obj{i}".encode()
            assert await put(s, pid, key, pattern(key, size))
            u = usage(s, pid)
            assert u.memory_used <= spec.high_watermark * spec.memory_bytes
            assert u.disk_used <= spec.high_watermark * spec.disk_bytes
        u = usage(s, pid)
        assert u.evictions > 0 and u.puts == n
        # the most recent working set (what fits under the low watermark) is all there
        recent = int(spec.low_watermark * budget) // per_obj - 1
        for i in range(n - recent, n):
            key = f"obj{i}".encode()
            assert await get(s, pid, key) == pattern(key, size), i
        assert await get(s, pid, b"obj0") is None
        if spec.disk_bytes:
            await wait_for(lambda: len(object_files(tmp_path, pid)) == usage(s, pid).objects)

    run(tmp_path, pool, [spec], body)


@pytest.mark.timeout(60)
def test_memory_and_disk_placement(tmp_path: Path, pool: BufferPool) -> None:
    specs = [mem_pool(1), disk_pool(2, memory=64 * KiB, disk=1 * MiB), disk_pool(3, memory=0)]

    async def body(s: KVStore) -> None:
        # memory-only: nothing on disk
        assert await put(s, 1, b"m", pattern(b"m", 10 * KiB))
        assert not (tmp_path / "kv" / "1").exists()
        assert usage(s, 1).disk_used == 0 and usage(s, 1).memory_used == 12 * KiB
        # both: a small object is on disk and in memory; one above the memory budget only on disk
        assert await put(s, 2, b"small", pattern(b"small", 8 * KiB))
        assert await put(s, 2, b"large", pattern(b"large", 100 * KiB))
        u = usage(s, 2)
        assert u.memory_objects == 1 and u.memory_used == 8 * KiB
        assert u.disk_used == object_file_length(8 * KiB) + object_file_length(100 * KiB)
        assert len(object_files(tmp_path, 2)) == 2
        # a memory hit is zero-copy: two gets share the pages of the one copy
        g1, g2 = await s.get(2, b"small"), await s.get(2, b"small")
        assert g1 is not None and g2 is not None
        assert g1[0].obj is g2[0].obj and g1[0].readonly
        s.release(g1[0])
        s.release(g2[0])
        assert await get(s, 2, b"large") == pattern(b"large", 100 * KiB)
        # disk only: reads come from disk every time, memory stays empty
        assert await put(s, 3, b"d", pattern(b"d", 20 * KiB))
        assert await get(s, 3, b"d") == pattern(b"d", 20 * KiB)
        assert usage(s, 3).memory_used == 0 and usage(s, 3).memory_objects == 0
        # the file is exactly header + padded payload, key in the header
        (f,) = object_files(tmp_path, 3)
        raw = f.read_bytes()
        assert len(raw) == HEADER_BYTES + 20 * KiB and raw[HEADER_BYTES:] == pattern(b"d", 20 * KiB)
        assert raw[:8] == b"TFSKVOB1" and b"d" in raw[:HEADER_BYTES]

    run(tmp_path, pool, specs, body)


@pytest.mark.timeout(60)
def test_disk_hit_is_promoted_and_memory_evicts_to_disk(tmp_path: Path, pool: BufferPool) -> None:
    spec = disk_pool(2, memory=64 * KiB, disk=1 * MiB)

    async def body(s: KVStore) -> None:
        keys = [f"k{i}".encode() for i in range(12)]
        for k in keys:
            assert await put(s, 2, k, pattern(k, 16 * KiB))
        u = usage(s, 2)
        assert u.objects == 12 and u.memory_used <= 0.95 * 64 * KiB and u.memory_evictions > 0
        # an evicted memory copy is still on disk; a hit brings it back into memory
        assert await get(s, 2, keys[0]) == pattern(keys[0], 16 * KiB)
        before = usage(s, 2).memory_objects
        got = await s.get(2, keys[0])
        assert got is not None
        s.release(got[0])
        assert usage(s, 2).memory_objects == before
        assert usage(s, 2).evictions == 0

    run(tmp_path, pool, [spec], body)


# -- restart and corruption -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_restart_keeps_disk_objects(tmp_path: Path, pool: BufferPool) -> None:
    specs = [mem_pool(1), disk_pool(2, pin_quota_bytes=1 * MiB)]
    clock = FakeClock()
    keys = [f"key-{i}".encode() for i in range(20)]

    async def first(s: KVStore) -> None:
        for k in keys:
            assert await put(s, 2, k, pattern(k, 3000 + len(k)))
            assert await put(s, 1, k, b"memory only")
        assert await put(s, 2, keys[0], b"new", overwrite=True)
        assert await put(s, 2, b"ttl", b"short lived", ttl_ms=5000)
        assert await put(s, 2, b"hard", b"pinned", pin=PIN_HARD)
        assert s.pin(2, keys[1], PIN_HARD)  # a pin after the put is written into the header

    async def second(s: KVStore) -> None:
        u = usage(s, 2)
        assert u.objects == len(keys) + 2 and u.torn_discarded == 0
        assert await get(s, 2, keys[0]) == b"new"
        for k in keys[1:]:
            assert await get(s, 2, k) == pattern(k, 3000 + len(k))
        assert u.hard_pinned_bytes == len(b"pinned") + 3000 + len(keys[1])
        assert await get(s, 2, b"ttl") == b"short lived"
        assert usage(s, 1).objects == 0  # memory-only pools start empty
        assert await get(s, 1, keys[3]) is None
        assert len(object_files(tmp_path, 2)) == len(keys) + 2  # the overwritten file is gone

    run(tmp_path, pool, specs, first, clock=clock)
    run(tmp_path, pool, specs, second, clock=clock)
    clock.t += 10  # the TTL (a wall-clock time in the header) holds across restarts

    async def third(s: KVStore) -> None:
        assert await get(s, 2, b"ttl") is None
        assert usage(s, 2).expired == 1 and usage(s, 2).objects == len(keys) + 1

    run(tmp_path, pool, specs, third, clock=clock)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", [mem_pool(), disk_pool(), disk_pool(memory=0)], ids=["memory", "both", "disk"])
def test_placement_stamps(tmp_path: Path, pool: BufferPool, spec: KVPoolSpec) -> None:
    """A copy put with an earlier placement stamp than a get requires is a
    miss (docs/kv.md, "Overwrites and map changes"), for get, the size-only
    path and contains; a put without overwrite replaces it rather than being
    a no-op; the stamp survives a restart (in the header, past the key's CRC)."""
    pid = spec.pool_id

    async def first(s: KVStore) -> None:
        assert await put(s, pid, b"a", b"old", stamp=5)
        assert await get(s, pid, b"a") == b"old"  # no stamp asked: as before
        got = await s.get(pid, b"a", since=5)
        assert got is not None and bytes(got[0]) == b"old"
        s.release(got[0])
        assert await s.get(pid, b"a", since=6) is None
        assert await s.get_with_ttl(pid, b"a", since=6) is None
        assert s.contains(pid, [b"a"], since=5) == [True] and s.contains(pid, [b"a"], since=6) == [False]
        assert s.crcs(pid, [b"a"], since=5) == [crc32c(b"old")] and s.crcs(pid, [b"a"], since=6) == [None]
        assert usage(s, pid).objects == 1
        assert not await put(s, pid, b"a", b"same", stamp=5)  # a no-op, as always
        assert await put(s, pid, b"a", b"new", stamp=7)  # the old copy is stale for this writer
        got = await s.get(pid, b"a", since=7)
        assert got is not None and bytes(got[0]) == b"new"
        s.release(got[0])
        assert await put(s, pid, b"b", b"kept", stamp=(1 << 56) - 1)

    async def second(s: KVStore) -> None:
        if not spec.disk_bytes:
            return
        got = await s.get(pid, b"a", since=7)
        assert got is not None and bytes(got[0]) == b"new"
        s.release(got[0])
        assert await s.get(pid, b"a", since=8) is None
        assert s.contains(pid, [b"b"], since=(1 << 56) - 1) == [True]

    run(tmp_path, pool, [spec], first)
    run(tmp_path, pool, [spec], second)


@pytest.mark.timeout(60)
def test_stamped_header_torn_and_unstamped_files(tmp_path: Path, pool: BufferPool) -> None:
    """A header whose stamp fails its CRC is torn (discarded at open); a
    file with zeros past the key's CRC (written before stamps) reads as stamp 0."""
    spec = disk_pool(2, memory=0)

    async def first(s: KVStore) -> None:
        assert await put(s, 2, b"torn", b"x" * 100, stamp=9)
        assert await put(s, 2, b"plain", b"y" * 100, stamp=9)

    run(tmp_path, pool, [spec], first)
    torn = plain = None
    for f in object_files(tmp_path, 2):
        data = bytearray(f.read_bytes())
        klen = int.from_bytes(data[12:16], "little")
        at = 60 + klen + 4  # past the key and its CRC
        if data[60:60 + klen].endswith(b"torn"):
            data[at] ^= 0xFF  # the stamp's first byte
            torn = f
        else:
            data[at:at + 12] = bytes(12)  # as a file from before stamps
            plain = f
        f.write_bytes(bytes(data))
    assert torn is not None and plain is not None

    async def second(s: KVStore) -> None:
        assert usage(s, 2).torn_discarded == 1
        assert await get(s, 2, b"torn") is None
        assert s.contains(2, [b"plain"], since=0) == [True] and s.contains(2, [b"plain"], since=1) == [False]

    run(tmp_path, pool, [spec], second)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["overwritten", "evicted"])
def test_a_deleted_key_does_not_come_back_from_a_file_left_for_the_reaper(tmp_path: Path, pool: BufferPool,
                                                                          how: str) -> None:
    """An overwrite or an eviction leaves the key's old file to the reaper
    (in the background). A delete of the key acknowledged before the reaper
    got to it left that file on disk, and a daemon that died then found it
    at its next open as the key's newest file: the deleted key was served
    again. The reaper is kept busy here with a large dropped pool (its
    directory is removed first), and the "crash" is a second store opened
    over the same directory right after the delete."""
    junk = tmp_path / "kv" / "5" / "00"
    junk.mkdir(parents=True)
    for i in range(20000):  # not object files: open() leaves them, the drop's rmtree takes a while
        (junk / f"junk-{i}").touch()
    spec = disk_pool(2, memory=0, disk=64 * KiB)
    key = b"the-key"

    async def main() -> None:
        s = KVStore(tmp_path, target_id=3, pool=pool)
        await s.open()
        try:
            s.configure([spec])  # pool 5 is not listed: its directory goes to the reaper
            assert await put(s, 2, key, pattern(key, 9000))
            if how == "overwritten":
                assert await put(s, 2, key, pattern(key, 9000, 1), overwrite=True)
                assert await s.delete(2, key)
            else:
                for i in range(12):  # the key is the oldest: evicted first
                    assert await put(s, 2, b"other-%d" % i, pattern(b"x", 9000, i))
                assert not s.contains(2, [key])[0]
                assert not await s.delete(2, key)
            assert s._reaper is not None and not s._reaper.done(), "the reaper was not busy"
            again = KVStore(tmp_path, target_id=4, pool=pool)  # the daemon died here, and started again
            await again.open()
            try:
                again.configure([disk_pool(2, memory=0, disk=1 * MiB)])  # room for every file it finds
                assert await get(again, 2, key) is None
            finally:
                await again.close()
        finally:
            await s.close()

    asyncio.run(main())
    assert pool.stats().in_use_buffers == 0


@pytest.mark.timeout(60)
def test_restart_over_io_backend(tmp_path: Path, pool: BufferPool, make_backend: Callable[..., IOBackend]) -> None:
    spec = disk_pool(2, memory=0)

    async def first(s: KVStore) -> None:
        for i in range(10):
            k = f"k{i}".encode()
            assert await put(s, 2, k, pattern(k, i * 5000))

    async def second(s: KVStore) -> None:
        for i in range(10):
            k = f"k{i}".encode()
            assert await get(s, 2, k) == pattern(k, i * 5000)

    run(tmp_path, pool, [spec], first, backend=make_backend)
    run(tmp_path, pool, [spec], second, backend=make_backend)


@pytest.mark.timeout(60)
def test_torn_objects_dropped_at_open(tmp_path: Path, pool: BufferPool) -> None:
    spec = disk_pool(2, memory=0)
    keys = [f"k{i}".encode() for i in range(6)]

    async def first(s: KVStore) -> None:
        for k in keys:
            assert await put(s, 2, k, pattern(k, 10_000))

    run(tmp_path, pool, [spec], first)
    files = object_files(tmp_path, 2)
    assert len(files) == 6
    with open(files[0], "r+b") as f:  # cut short: a crash before the data reached the disk
        f.truncate(HEADER_BYTES + 4096)
    with open(files[1], "r+b") as f:  # garbage in the header
        f.seek(20)
        f.write(b"\xff" * 16)
    with open(files[2], "r+b") as f:  # header only
        f.truncate(100)
    (tmp_path / "kv" / "2" / "tmp" / "00000000000000ff.tmp").write_bytes(b"half a put")
    (files[3].parent / "junk").write_bytes(b"not an object")

    async def second(s: KVStore) -> None:
        u = usage(s, 2)
        assert u.torn_discarded == 3 and u.objects == 3
        assert sum(s.contains(2, keys)) == 3
        found = [await get(s, 2, k) for k in keys]
        assert sum(d is not None for d in found) == 3
        for k, d in zip(keys, found, strict=True):
            assert d is None or d == pattern(k, 10_000)
        assert u.corrupt == 0
        assert not any((tmp_path / "kv" / "2" / "tmp").iterdir())
        assert len(object_files(tmp_path, 2)) == 4  # the 3 survivors and the stray junk file

    run(tmp_path, pool, [spec], second)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("memory", [0, 256 * KiB])
def test_bit_flip_is_a_miss(tmp_path: Path, pool: BufferPool, memory: int) -> None:
    spec = disk_pool(2, memory=memory)

    async def first(s: KVStore) -> None:
        assert await put(s, 2, b"victim", pattern(b"victim", 50_000))
        assert await put(s, 2, b"fine", pattern(b"fine", 50_000))

    run(tmp_path, pool, [spec], first)
    victim = next(f for f in object_files(tmp_path, 2) if b"victim" in f.read_bytes()[:HEADER_BYTES])
    with open(victim, "r+b") as f:
        f.seek(HEADER_BYTES + 12345)
        b = f.read(1)
        f.seek(HEADER_BYTES + 12345)
        f.write(bytes([b[0] ^ 0x10]))

    async def second(s: KVStore) -> None:
        assert await get(s, 2, b"victim") is None
        u = usage(s, 2)
        assert u.corrupt == 1 and u.objects == 1 and u.misses == 1
        assert s.contains(2, [b"victim", b"fine"]) == [False, True]
        assert await get(s, 2, b"fine") == pattern(b"fine", 50_000)
        await wait_for(lambda: not victim.exists())
        assert await put(s, 2, b"victim", pattern(b"victim", 50_000))  # a fresh copy may come back
        assert await get(s, 2, b"victim") == pattern(b"victim", 50_000)

    run(tmp_path, pool, [spec], second)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_a_directory_where_an_object_was_is_corrupt_and_dropped(
        tmp_path: Path, pool: BufferPool, make_backend: Callable[..., IOBackend], kind: str) -> None:
    """Something other than a file where an object's file was (a new user's
    `rm F && mkdir F`): a get is a miss that counts it corrupt and drops it
    (the directory goes, with what it holds), like an object failing its
    CRC; a fresh put of the key works again. Found at open, it is torn and
    dropped, and the store opens. Before, every get was an InternalError
    ("Is a directory") and the entry was never dropped; at open the unlink
    failed and the store did not open at all. A FIFO there: until stop 50
    a get's open (on the event loop) and the store's open waited for a
    writer for ever."""
    spec = disk_pool(2, memory=0)

    async def first(s: KVStore) -> None:
        for k in (b"victim", b"fine", b"later"):
            assert await put(s, 2, k, pattern(k, 50_000))

    def to_dir(key: bytes) -> Path:
        f = next(f for f in object_files(tmp_path, 2) if key in f.read_bytes()[:HEADER_BYTES])
        f.unlink()
        if kind == "fifo":
            os.mkfifo(f)
            return f
        f.mkdir()
        (f / "inside").write_bytes(b"x")
        return f

    run(tmp_path, pool, [spec], first, backend=make_backend)

    async def second(s: KVStore) -> None:
        victim = to_dir(b"victim")
        for _ in range(2):
            assert await get(s, 2, b"victim") is None
        u = usage(s, 2)
        assert u.corrupt == 1 and u.objects == 2 and u.misses == 2, u
        assert s.contains(2, [b"victim", b"fine"]) == [False, True]
        assert await get(s, 2, b"fine") == pattern(b"fine", 50_000)
        await wait_for(lambda: not victim.exists())
        assert await put(s, 2, b"victim", pattern(b"victim", 50_000))
        assert await get(s, 2, b"victim") == pattern(b"victim", 50_000)
        to_dir(b"later")  # found by the next open

    run(tmp_path, pool, [spec], second, backend=make_backend)

    async def third(s: KVStore) -> None:
        u = usage(s, 2)
        assert u.torn_discarded == 1 and u.objects == 2, u
        assert await get(s, 2, b"later") is None
        for k in (b"victim", b"fine"):
            assert await get(s, 2, k) == pattern(k, 50_000)
        assert all(f.is_file() for f in object_files(tmp_path, 2))

    run(tmp_path, pool, [spec], third, backend=make_backend)


# -- races ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "spec",
    [mem_pool(1, memory=256 * KiB), disk_pool(2, memory=64 * KiB, disk=512 * KiB), disk_pool(3, memory=0, disk=512 * KiB)],
    ids=["memory", "both", "disk"],
)
def test_gets_racing_eviction_delete_overwrite(tmp_path: Path, pool: BufferPool, spec: KVPoolSpec) -> None:
    """Readers, writers, deleters and overwriters on a pool that evicts all the
    time: every hit has exactly the bytes of some version of its key."""
    pid = spec.pool_id
    nkeys, versions = 60, 3
    sizes = {f"r{i}".encode(): 1000 + 997 * i for i in range(nkeys)}
    stats = {"hits": 0, "misses": 0}

    async def body(s: KVStore) -> None:
        stop = asyncio.Event()

        async def writer(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                k = rng.choice(list(sizes))
                v = rng.randrange(versions)
                await put(s, pid, k, pattern(k, sizes[k], v), overwrite=rng.random() < 0.3)
                await asyncio.sleep(0)  # a memory-only put never waits: let the others run

        async def deleter(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                await s.delete(pid, rng.choice(list(sizes)))
                await asyncio.sleep(0)

        async def reader(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                k = rng.choice(list(sizes))
                got = await s.get(pid, k)
                if got is None:
                    stats["misses"] += 1
                    await asyncio.sleep(0)
                    continue
                view, crc = got
                # hold the view across other tasks' evictions before checking it
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                data = bytes(view)
                s.release(view)
                assert crc32c(data) == crc
                assert any(data == pattern(k, sizes[k], v) for v in range(versions)), k
                stats["hits"] += 1

        tasks = [asyncio.create_task(writer(i)) for i in range(4)]
        tasks += [asyncio.create_task(deleter(100))]
        tasks += [asyncio.create_task(reader(200 + i)) for i in range(8)]
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*tasks)
        u = usage(s, pid)
        assert u.evictions > 0
        assert stats["hits"] > 50 and stats["misses"] > 0
        assert u.memory_used <= spec.high_watermark * spec.memory_bytes
        assert u.disk_used <= spec.high_watermark * spec.disk_bytes

    run(tmp_path, pool, [spec], body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", [mem_pool(1, memory=128 * KiB), disk_pool(2, memory=128 * KiB, disk=256 * KiB)], ids=["memory", "both"])
def test_view_survives_eviction_delete_overwrite(tmp_path: Path, pool: BufferPool, spec: KVPoolSpec) -> None:
    pid = spec.pool_id

    async def body(s: KVStore) -> None:
        for k in (b"evicted", b"deleted", b"replaced"):
            assert await put(s, pid, k, pattern(k, 20_000))
        views = {}
        for k in (b"evicted", b"deleted", b"replaced"):
            got = await s.get(pid, k)
            assert got is not None
            views[k] = got[0]
        assert await s.delete(pid, b"deleted")
        assert await put(s, pid, b"replaced", pattern(b"replaced", 20_000, 1), overwrite=True)
        assert await get(s, pid, b"replaced") == pattern(b"replaced", 20_000, 1)
        for i in range(40):  # several times the pool: b"evicted" goes
            k = f"filler{i}".encode()
            assert await put(s, pid, k, pattern(k, 20_000))
        assert not s.contains(pid, [b"evicted"])[0]
        # new puts reuse freed buffers; the held views must not be among them
        for k, view in views.items():
            assert bytes(view) == pattern(k, 20_000), k
            s.release(view)

    run(tmp_path, pool, [spec], body)


# -- pins and TTLs --------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", [mem_pool(1, memory=128 * KiB, pin_quota_bytes=MiB), disk_pool(2, memory=32 * KiB, disk=128 * KiB, pin_quota_bytes=MiB)], ids=["memory", "disk"])
def test_all_pinned_is_no_space_and_changes_nothing(tmp_path: Path, pool: BufferPool, spec: KVPoolSpec) -> None:
    pid = spec.pool_id

    async def body(s: KVStore) -> None:
        i = 0
        while True:
            k = f"p{i}".encode()
            try:
                await put(s, pid, k, pattern(k, 12_000), pin=PIN_HARD)
            except NoSpaceError as exc:
                assert f"KV pool {spec.name!r} on target 3" in str(exc)
                assert "nothing evictable" in str(exc)
                break
            i += 1
            assert i < 100
        before = s.usage()
        files = object_files(tmp_path, pid)
        with pytest.raises(NoSpaceError, match="nothing evictable"):
            await put(s, pid, b"unpinned", b"x" * 12_000)
        with pytest.raises(NoSpaceError):  # an overwrite of a pinned object that would not fit either
            await put(s, pid, b"p0", b"y" * 100_000, overwrite=True)
        assert s.usage() == before
        assert object_files(tmp_path, pid) == files
        assert not s.contains(pid, [b"unpinned"])[0]
        for j in range(i):
            k = f"p{j}".encode()
            assert await get(s, pid, k) == pattern(k, 12_000)
        # unpinning makes room again: the put evicts and succeeds
        assert s.unpin(pid, b"p0")
        assert await put(s, pid, b"unpinned", b"x" * 12_000)
        assert not s.contains(pid, [b"p0"])[0]

    run(tmp_path, pool, [spec], body)


@pytest.mark.timeout(60)
def test_ttl_expiry(tmp_path: Path, pool: BufferPool) -> None:
    clock = FakeClock()

    async def body(s: KVStore) -> None:
        for pid in (1, 2):
            assert await put(s, pid, b"short", b"a" * 5000, ttl_ms=1000)
            assert await put(s, pid, b"long", b"b" * 5000, ttl_ms=60_000)
            assert await put(s, pid, b"forever", b"c" * 5000)
        clock.t += 2
        for pid in (1, 2):
            assert s.contains(pid, [b"short", b"long", b"forever"]) == [False, True, True]
            assert await get(s, pid, b"short") is None
            # expired: a new put of the key is stored, not a no-op
            assert await put(s, pid, b"short", b"again", ttl_ms=1000)
        clock.t += 100
        assert s.sweep() == 4  # "short" again and "long", in both pools
        for pid in (1, 2):
            u = usage(s, pid)
            assert u.objects == 1 and u.expired == 3
            assert await get(s, pid, b"forever") == b"c" * 5000
        await wait_for(lambda: len(object_files(tmp_path, 2)) == 1)

    run(tmp_path, pool, [mem_pool(1), disk_pool(2)], body, clock=clock)


@pytest.mark.timeout(60)
def test_background_sweep_reclaims_expired(tmp_path: Path, pool: BufferPool) -> None:
    async def body(s: KVStore) -> None:
        assert await put(s, 1, b"k", b"v", ttl_ms=50)
        await wait_for(lambda: usage(s, 1).objects == 0)
        assert usage(s, 1).expired == 1

    run(tmp_path, pool, [mem_pool(1)], body, sweep_interval=0.05)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", [mem_pool(1, memory=100 * KiB), disk_pool(2, memory=0, disk=100 * KiB)], ids=["memory", "disk"])
def test_soft_pins_expire(tmp_path: Path, pool: BufferPool, spec: KVPoolSpec) -> None:
    pid = spec.pool_id
    clock = FakeClock()

    async def body(s: KVStore) -> None:
        n = 0
        while True:
            k = f"s{n}".encode()
            try:
                await put(s, pid, k, pattern(k, 10_000), pin=PIN_SOFT, pin_ttl_ms=5000)
            except NoSpaceError:
                break
            n += 1
        assert usage(s, pid).pinned_bytes == n * 10_000
        with pytest.raises(NoSpaceError):
            await put(s, pid, b"new", b"n" * 10_000)
        clock.t += 3
        with pytest.raises(NoSpaceError):
            await put(s, pid, b"new", b"n" * 10_000)
        # a soft pin renewed by pin() lasts from now
        assert s.pin(pid, b"s0", PIN_SOFT, ttl_ms=10_000)
        clock.t += 3  # the first pins have lapsed: the put evicts them (not s0)
        assert await put(s, pid, b"new", b"n" * 10_000)
        assert s.contains(pid, [b"s0", b"new"]) == [True, True]
        assert usage(s, pid).evictions >= 1
        assert usage(s, pid).pinned_bytes == 10_000

    run(tmp_path, pool, [spec], body, clock=clock)


@pytest.mark.timeout(60)
def test_hard_pin_quota(tmp_path: Path, pool: BufferPool) -> None:
    spec = disk_pool(2, pin_quota_bytes=25_000)

    async def body(s: KVStore) -> None:
        for k in (b"a", b"b", b"c"):
            assert await put(s, 2, k, b"x" * 10_000)
        assert s.pin(2, b"a", PIN_HARD)
        assert s.pin(2, b"b", PIN_HARD)
        assert s.pin(2, b"a", PIN_HARD)  # already hard: not counted twice
        with pytest.raises(NoSpaceError, match=r"pin quota \(20000 of 25000"):
            s.pin(2, b"c", PIN_HARD)
        with pytest.raises(NoSpaceError, match="pin quota"):
            await put(s, 2, b"d", b"x" * 10_000, pin=PIN_HARD)
        assert not s.contains(2, [b"d"])[0]
        assert usage(s, 2).hard_pinned_bytes == 20_000
        assert s.pin(2, b"c", PIN_SOFT)  # soft pins are not limited by the quota
        assert not s.pin(2, b"missing", PIN_HARD)
        assert not s.unpin(2, b"missing")
        assert s.unpin(2, b"a")
        assert s.pin(2, b"c", PIN_HARD)
        assert await s.delete(2, b"b")
        u = usage(s, 2)
        assert u.hard_pinned_bytes == 10_000 and u.pinned_bytes == 10_000

    run(tmp_path, pool, [spec], body)


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_configure_resize_and_remove(tmp_path: Path, pool: BufferPool) -> None:
    async def body(s: KVStore) -> None:
        for i in range(40):
            k = f"k{i}".encode()
            assert await put(s, 1, k, pattern(k, 10_000))
            assert await put(s, 2, k, pattern(k, 10_000))
        # shrink both pools: they evict down at once, newest kept
        s.configure([mem_pool(1, memory=128 * KiB), disk_pool(2, memory=0, disk=128 * KiB)])
        for pid, spec_mem, spec_disk in ((1, 128 * KiB, 0), (2, 0, 128 * KiB)):
            u = usage(s, pid)
            assert u.memory_used <= 0.95 * spec_mem and u.disk_used <= 0.95 * spec_disk
            assert u.objects < 40 and s.contains(pid, [b"k39"]) == [True]
        assert usage(s, 2).memory_objects == 0
        # a removed pool is gone at once; its files go in the background
        s.configure([mem_pool(1, memory=128 * KiB)])
        with pytest.raises(NotFoundError):
            await s.get(2, b"k39")
        assert [u.pool_id for u in s.usage()] == [1]
        # (the mark of an open store stays while it is open)
        await wait_for(lambda: [p.name for p in (tmp_path / "kv").iterdir()] == [RUNNING_FILE])
        s.configure([mem_pool(1, memory=128 * KiB), disk_pool(2)])
        assert await get(s, 2, b"k39") is None
        assert usage(s, 2).objects == 0

    run(tmp_path, pool, [mem_pool(1), disk_pool(2)], body)


@pytest.mark.timeout(60)
def test_pool_removed_during_put(tmp_path: Path, pool: BufferPool) -> None:
    async def body(s: KVStore) -> None:
        put_task = asyncio.create_task(put(s, 2, b"k", pattern(b"k", 4 * MiB)))
        await asyncio.sleep(0)  # the put has reserved space and is writing
        s.configure([])
        with pytest.raises(NotFoundError):
            await put_task
        s.configure([disk_pool(2)])
        assert await get(s, 2, b"k") is None

    run(tmp_path, pool, [disk_pool(2, disk=16 * MiB)], body)


@pytest.mark.timeout(60)
def test_chunk_engine_shares_the_target(tmp_path: Path, pool: BufferPool) -> None:
    """The chunk engine opens, scans and serves a target that holds a kv/ tree."""

    async def kv(s: KVStore) -> None:
        assert await put(s, 2, b"k", b"kv bytes")

    run(tmp_path, pool, [disk_pool(2)], kv)

    async def engine() -> None:
        be = PosixBackend(pool)
        eng = ChunkEngine(tmp_path, 3, be, pool)
        await eng.open()
        try:
            key = FragmentKey(1, 0, 0, 1)
            await eng.write(key, memoryview(b"fragment"), crc32c(b"fragment"))
            assert len(eng) == 1
        finally:
            await eng.close()
            await be.aclose()

    asyncio.run(engine())
    assert os.path.exists(tmp_path / "frags")

    async def kv_again(s: KVStore) -> None:
        assert await get(s, 2, b"k") == b"kv bytes"

    run(tmp_path, pool, [disk_pool(2)], kv_again)


@pytest.mark.timeout(60)
def test_file_removed_behind_the_store_is_a_miss(tmp_path: Path, pool: BufferPool) -> None:
    async def body(s: KVStore) -> None:
        assert await put(s, 3, b"k", b"v" * 9000)
        (f,) = object_files(tmp_path, 3)
        f.unlink()
        assert await get(s, 3, b"k") is None
        assert usage(s, 3).objects == 0 and usage(s, 3).disk_used == 0
        assert await put(s, 3, b"k", b"w" * 9000)
        assert await get(s, 3, b"k") == b"w" * 9000

    run(tmp_path, pool, [disk_pool(3, memory=0)], body)


@pytest.mark.timeout(60)
def test_pin_header_rewrites_racing_gets(tmp_path: Path, pool: BufferPool) -> None:
    """Pins are written into the object's header in place; reads racing those
    rewrites never report corruption (nor drop the object)."""
    spec = disk_pool(3, memory=0, pin_quota_bytes=MiB)
    keys = [f"k{i}".encode() for i in range(8)]

    async def body(s: KVStore) -> None:
        for k in keys:
            assert await put(s, 3, k, pattern(k, 30_000))
        stop = asyncio.Event()

        async def pinner() -> None:
            i = 0
            while not stop.is_set():
                k = keys[i % len(keys)]
                assert s.pin(3, k, PIN_HARD if i % 2 else PIN_SOFT, ttl_ms=60_000)
                if i % 3 == 0:
                    assert s.unpin(3, k)
                i += 1
                await asyncio.sleep(0)

        async def reader(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                k = rng.choice(keys)
                assert await get(s, 3, k) == pattern(k, 30_000)

        tasks = [asyncio.create_task(pinner())] + [asyncio.create_task(reader(i)) for i in range(4)]
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*tasks)
        u = usage(s, 3)
        assert u.corrupt == 0 and u.objects == len(keys) and u.hits > 20
        pins.update(pinned=u.pinned_bytes, hard=u.hard_pinned_bytes)

    pins: dict[str, int] = {}
    run(tmp_path, pool, [spec], body)

    async def after(s: KVStore) -> None:
        # the last pin states reached the headers: a restart sees them
        u = usage(s, 3)
        assert u.objects == len(keys) and u.torn_discarded == 0
        assert (u.pinned_bytes, u.hard_pinned_bytes) == (pins["pinned"], pins["hard"])
        for k in keys:
            assert await get(s, 3, k) == pattern(k, 30_000)

    run(tmp_path, pool, [spec], after)


# -- a real process killed mid-stream ------------------------------------------------------

_CHILD = textwrap.dedent("""
    import asyncio, random, sys
    from tierfs.buffers import BufferPool
    from tierfs.chunk import crc32c
    from tierfs.storage.kvstore import KVPoolSpec, KVStore

    async def main(root, first):
        pool = BufferPool(64 << 20)
        s = KVStore(root, target_id=3, pool=pool)
        await s.open()
        s.configure([KVPoolSpec(2, "disk2", 1 << 20, 64 << 20)])
        print("READY", flush=True)
        counter = iter(range(first, 1 << 40))

        async def writer():
            while True:
                seed = next(counter)
                data = random.Random(seed).randbytes(random.Random(-seed).choice([1, 4097, 70_000, 300_000]))
                buf = s.alloc(len(data))
                buf[:] = data
                await s.put(2, b"key-%d" % seed, buf, crc32c(data))
                sys.stdout.write(f"ACK {seed}\\n")
                sys.stdout.flush()

        await asyncio.gather(*(writer() for _ in range(8)))

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


def _put_until_killed(root: Path, first: int, acks_wanted: int) -> set[int]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), str(first)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    acked: set[int] = set()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", line + (proc.stderr.read() if proc.stderr else "")
        while len(acked) < acks_wanted:
            line = proc.stdout.readline()
            assert line.startswith("ACK "), f"writer died: {line!r}"
            acked.add(int(line.split()[1]))
        proc.send_signal(signal.SIGKILL)  # with 8 puts in flight
        rest, _ = proc.communicate(timeout=30)
        acked.update(int(x.split()[1]) for x in rest.splitlines() if x.startswith("ACK "))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    return acked


@pytest.mark.timeout(120)
def test_sigkill_during_puts_keeps_every_acknowledged_object(tmp_path: Path, pool: BufferPool) -> None:
    """No fsync, but the process (not the machine) dies: every acknowledged
    put is there with its bytes, no half-written object is visible, tmp/ is
    emptied at open."""
    acked = _put_until_killed(tmp_path, 1, 150)
    acked |= _put_until_killed(tmp_path, 10_000, 150)

    def data(seed: int) -> bytes:
        return random.Random(seed).randbytes(random.Random(-seed).choice([1, 4097, 70_000, 300_000]))

    async def check(s: KVStore) -> None:
        u = usage(s, 2)
        assert u.torn_discarded == 0
        for seed in acked:
            assert await get(s, 2, b"key-%d" % seed) == data(seed), seed
        # objects put but not acknowledged before the kill are whole or absent
        tried = [seed for base in (1, 10_000) for seed in range(base, max(a for a in acked if a >= base) + 20)
                 if base == 10_000 or seed < 10_000]
        present = [seed for seed, there in zip(tried, s.contains(2, [b"key-%d" % t for t in tried]), strict=True) if there]
        assert len(present) == u.objects >= len(acked)
        for seed in set(present) - acked:
            assert await get(s, 2, b"key-%d" % seed) == data(seed), seed
        assert not any((tmp_path / "kv" / "2" / "tmp").iterdir())

    run(tmp_path, pool, [KVPoolSpec(2, "disk2", 1 << 20, 64 << 20)], check)
