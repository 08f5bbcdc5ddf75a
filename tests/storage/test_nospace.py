"""A target on a small, really full file system: NoSpaceError, nothing
corrupted, reads still served, the target recovers when space is freed."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierfs.buffers import BufferPool
from tierfs.errors import NoSpaceError
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine, TargetState, crc32c
from tierfs.storage.io import IOBackend

FS_SIZE = 24 << 20


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if not _can_mount():
        pytest.skip("needs root to mount a small file system")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if request.param == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={FS_SIZE}", "tmpfs", str(mnt)]
    else:
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("mkfs.ext4 not installed")
        img = tmp_path / "disk.img"
        with open(img, "wb") as f:
            f.truncate(FS_SIZE)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True, capture_output=True)
        cmd = ["mount", "-o", "loop", str(img), str(mnt)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount {request.param}: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


async def _read(eng: ChunkEngine, key: FragmentKey) -> bytes:
    v = await eng.read(key)
    try:
        return bytes(v)
    finally:
        eng.release(v)


@pytest.mark.timeout(60)
def test_full_target_refuses_writes_and_keeps_serving(
    small_fs: Path, make_backend: Callable[..., IOBackend], pool: BufferPool
) -> None:
    async def main() -> None:
        be = make_backend()
        eng = ChunkEngine(small_fs / "t", 3, be, pool, reserved_bytes=0)
        await eng.open()
        try:
            stored: dict[FragmentKey, bytes] = {}
            with pytest.raises(NoSpaceError):
                for i in range(100):
                    data = random.Random(i).randbytes((1 << 20) + i)
                    key = FragmentKey(1, i, 0, 1)
                    await eng.write(key, memoryview(data), crc32c(data))
                    stored[key] = data
            assert len(stored) >= 5
            assert eng.counters["no_space"] >= 1
            assert not os.listdir(small_fs / "t" / "tmp")
            assert eng.state() == TargetState.READ_ONLY
            for k, d in stored.items():
                assert await _read(eng, k) == d

            # past the pre-check, the kernel's own ENOSPC is turned into
            # NoSpaceError too, and the half-written temp file is removed
            eng._check_space = lambda need: None  # type: ignore[method-assign]
            big = random.Random(99).randbytes(8 << 20)
            with pytest.raises(NoSpaceError):
                await eng.write(FragmentKey(2, 0, 0, 1), memoryview(big), crc32c(big))
            assert FragmentKey(2, 0, 0, 1) not in eng
            assert not os.listdir(small_fs / "t" / "tmp")
            del eng._check_space
            st = eng.stats()
            assert st.state != TargetState.FAILED and st.fragments == len(stored)
            for k, d in stored.items():
                assert await _read(eng, k) == d

            # freeing space brings the target back to taking writes
            for k in list(stored)[:4]:
                assert await eng.delete(k)
                del stored[k]
            assert eng.state() == TargetState.ONLINE
            small = b"fits again" * 1000
            await eng.write(FragmentKey(3, 0, 0, 1), memoryview(small), crc32c(small))
            assert await _read(eng, FragmentKey(3, 0, 0, 1)) == small
        finally:
            await eng.close()
            await be.aclose()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_min_free_sets_read_only_without_refusing_writes(tmp_path: Path, pool: BufferPool) -> None:
    # min_free above the disk's free space: READ_ONLY (clients and placement
    # skip it) although a write still fits; a percentage works the same way.
    from tierfs.storage.io.posix import PosixBackend

    async def main() -> None:
        be = PosixBackend(pool, threads=2)
        free = shutil.disk_usage(tmp_path).free
        eng = ChunkEngine(tmp_path / "t", 4, be, pool, reserved_bytes=0, min_free=free + (1 << 40))
        await eng.open()
        try:
            assert eng.state() == TargetState.READ_ONLY
            data = b"still fits" * 100
            await eng.write(FragmentKey(1, 0, 0, 1), memoryview(data), crc32c(data))
            assert await _read(eng, FragmentKey(1, 0, 0, 1)) == data
            eng.min_free = 0
            assert eng.state() == TargetState.ONLINE
            eng.min_free_fraction = 0.9999  # all but 0.01% of the file system must be free
            assert eng.state() == TargetState.READ_ONLY
            eng.min_free_fraction = 0.0
            assert eng.state() == TargetState.ONLINE
        finally:
            await eng.close()
            await be.aclose()

    asyncio.run(main())
