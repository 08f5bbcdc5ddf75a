"""A disk that starts failing for real: ext4 on a loop device whose backing
file lives on a LazyFS mount; killing the LazyFS server makes every block
I/O of that "disk" fail with EIO. The target must turn FAILED, answer
UnavailableError, and never return bytes."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults import LazyFS
from tierfs.buffers import BufferPool
from tierfs.errors import UnavailableError
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine, TargetState, crc32c
from tierfs.storage.io import IOBackend


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    not LazyFS.available() or os.geteuid() != 0 or shutil.which("mkfs.ext4") is None,
    reason="needs root, /dev/fuse, fusermount3 and mkfs.ext4",
)
def test_eio_from_the_disk_fails_the_target(
    tmp_path: Path, make_backend: Callable[..., IOBackend], pool: BufferPool
) -> None:
    fs = LazyFS(tmp_path / "backing", tmp_path / "fuse")
    fs.mount()
    ext4 = tmp_path / "ext4"
    ext4.mkdir()
    mounted = False
    try:
        img = tmp_path / "fuse" / "disk.img"
        with open(img, "wb") as f:
            f.truncate(32 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True, capture_output=True)
        res = subprocess.run(["mount", "-o", "loop", str(img), str(ext4)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot loop-mount: {res.stderr.strip()}")
        mounted = True

        async def main() -> None:
            be = make_backend()
            eng = ChunkEngine(ext4 / "t", 9, be, pool, reserved_bytes=0)
            await eng.open()
            try:
                data = os.urandom(300_000)
                key = FragmentKey(1, 0, 0, 1)
                await eng.write(key, memoryview(data), crc32c(data))
                v = await eng.read(key)
                assert bytes(v) == data
                eng.release(v)

                fs.power_loss()  # the "disk" under ext4 is gone: EIO from now on

                # the loop device may still serve reads from cached pages of
                # its backing file; the first write that must reach the disk fails
                with pytest.raises(UnavailableError):
                    await eng.write(FragmentKey(1, 1, 0, 1), memoryview(data), crc32c(data))
                assert eng.state() == TargetState.FAILED
                assert eng.stats().state == TargetState.FAILED and eng.counters["io_errors"] >= 1
                assert FragmentKey(1, 1, 0, 1) not in eng
                # a failed target refuses everything rather than risk bad bytes
                with pytest.raises(UnavailableError):
                    await eng.read(key)
                with pytest.raises(UnavailableError):
                    await eng.stat(key)
                with pytest.raises(UnavailableError):
                    await eng.delete(key)
            finally:
                await eng.close()
                await be.aclose()

        asyncio.run(main())
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ext4)], capture_output=True)
        if fs.mounted:
            fs.unmount()
