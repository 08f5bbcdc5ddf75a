"""One conformance suite for every disk I/O backend that works on this machine.

Each test runs for every (backend, direct) pair: io_uring and posix threads,
with O_DIRECT and buffered fds, over real files under tmp_path. Expected
results come from plain buffered ``os.pread``/``os.pwrite`` semantics.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import sys
from pathlib import Path

import pytest

from tierfs.buffers import BufferPool
from tierfs.storage.io import IOBackend, PosixBackend, open_backend

SIZES = [0, 1, 4095, 4096, 4097, 1 << 20, 64 << 20]
OFFSETS = [0, 1, 4096, 5000]


def _pattern(n: int, seed: int) -> bytes:
    block = bytes((i * 131 + seed) & 0xFF for i in range(4096 + 251))
    reps = n // len(block) + 1
    return (block * reps)[:n]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
class TestIOBackend:
    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("size", SIZES)
    def test_round_trip_sizes_and_offsets(
        self, make_backend: object, pool: BufferPool, tmp_path: Path, direct: bool, size: int
    ) -> None:
        offsets = [0, 4096] if size >= 1 << 26 else OFFSETS

        async def main() -> None:
            be: IOBackend = make_backend()  # type: ignore[operator]
            try:
                for off in offsets:
                    data = _pattern(size, off)
                    path = tmp_path / f"f{size}_{off}"
                    fd = await be.open(path, os.O_RDWR | os.O_CREAT, direct=direct)
                    try:
                        # aligned pool buffer as the source
                        src = pool.get(size)
                        src[:] = data
                        await be.write_at(fd, src, off)
                        pool.put(src)
                        await be.fsync(fd)
                        assert os.stat(path).st_size == (off + size if size else 0)
                        # read into a pool buffer and into an unaligned bytearray
                        dst = pool.get(size)
                        assert await be.read_at(fd, dst, off) == size
                        assert bytes(dst) == data
                        pool.put(dst)
                        ba = bytearray(size + 1)
                        got = await be.read_at(fd, memoryview(ba)[1:], off)
                        assert got == size and bytes(ba[1:]) == data
                    finally:
                        await be.close(fd)
                    with open(path, "rb") as f:
                        raw = f.read()
                    assert raw == (bytes(off) + data if size else b"")
            finally:
                await be.aclose()

        asyncio.run(main())

    @pytest.mark.timeout(30)
    def test_readonly_source_and_partial_overwrite(
        self, make_backend: object, pool: BufferPool, tmp_path: Path, direct: bool
    ) -> None:
        async def main() -> None:
            be: IOBackend = make_backend()  # type: ignore[operator]
            path = tmp_path / "f"
            fd = await be.open(path, os.O_RDWR | os.O_CREAT, direct=direct)
            try:
                base = _pattern(3 * 4096 + 100, 7)
                await be.write_at(fd, memoryview(base), 0)  # bytes: read-only source
                patch = b"X" * 5000
                await be.write_at(fd, memoryview(patch), 3000)  # straddles blocks
                expect = bytearray(base)
                expect[3000:8000] = patch
                assert os.stat(path).st_size == len(base)
                buf = bytearray(len(base) + 500)
                n = await be.read_at(fd, memoryview(buf), 0)
                assert n == len(base) and bytes(buf[:n]) == bytes(expect)
                # a write past EOF leaves a zero-filled hole, like pwrite
                await be.write_at(fd, memoryview(b"tail"), len(base) + 10_000)
                with open(path, "rb") as f:
                    raw = f.read()
                assert raw == bytes(expect) + bytes(10_000) + b"tail"
            finally:
                await be.close(fd)
                await be.aclose()

        asyncio.run(main())

    @pytest.mark.timeout(30)
    def test_reads_at_and_past_eof(self, make_backend: object, pool: BufferPool, tmp_path: Path, direct: bool) -> None:
        async def main() -> None:
            be: IOBackend = make_backend()  # type: ignore[operator]
            path = tmp_path / "f"
            path.write_bytes(_pattern(10_000, 3))
            fd = await be.open(path, os.O_RDONLY, direct=direct)
            try:
                buf = pool.get(16384)
                assert await be.read_at(fd, buf, 0) == 10_000
                assert bytes(buf[:10_000]) == _pattern(10_000, 3)
                assert await be.read_at(fd, buf, 8192) == 10_000 - 8192
                assert await be.read_at(fd, buf, 10_000) == 0
                assert await be.read_at(fd, buf, 1 << 30) == 0
                assert await be.read_at(fd, buf[:0], 0) == 0
                pool.put(buf)
            finally:
                await be.close(fd)
                await be.aclose()

        asyncio.run(main())

    @pytest.mark.timeout(60)
    def test_concurrency_beyond_queue_depth(
        self, make_backend: object, pool: BufferPool, tmp_path: Path, direct: bool
    ) -> None:
        n, blk = 96, 64 << 10

        async def main() -> None:
            be: IOBackend = make_backend(queue_depth=8)  # type: ignore[operator]
            path = tmp_path / "f"
            fd = await be.open(path, os.O_RDWR | os.O_CREAT, direct=direct)
            try:

                async def put(i: int) -> None:
                    b = pool.get(blk)
                    b[:] = _pattern(blk, i)
                    await be.write_at(fd, b, i * blk)
                    pool.put(b)

                await asyncio.gather(*(put(i) for i in range(n)))
                await be.fsync(fd, datasync=True)

                async def get(i: int) -> bool:
                    b = pool.get(blk)
                    try:
                        return await be.read_at(fd, b, i * blk) == blk and bytes(b) == _pattern(blk, i)
                    finally:
                        pool.put(b)

                assert all(await asyncio.gather(*(get(i) for i in reversed(range(n)))))
            finally:
                await be.close(fd)
                await be.aclose()

        asyncio.run(main())

    @pytest.mark.timeout(30)
    def test_errors_carry_errno(self, make_backend: object, pool: BufferPool, tmp_path: Path, direct: bool) -> None:
        async def main() -> None:
            be: IOBackend = make_backend()  # type: ignore[operator]
            path = tmp_path / "f"
            path.write_bytes(b"x" * 8192)
            ro = await be.open(path, os.O_RDONLY, direct=direct)
            wo = await be.open(path, os.O_WRONLY, direct=direct)
            buf = pool.get(4096)
            try:
                with pytest.raises(OSError) as ei:
                    await be.write_at(ro, buf, 0)
                assert ei.value.errno == errno.EBADF
                with pytest.raises(OSError) as ei:
                    await be.read_at(wo, buf, 0)
                assert ei.value.errno == errno.EBADF
                with pytest.raises(OSError) as ei:
                    await be.read_at(ro, buf, -4096)
                assert ei.value.errno == errno.EINVAL
                with pytest.raises(FileNotFoundError):
                    await be.open(tmp_path / "missing", os.O_RDONLY, direct=direct)
                # the backend still works after errors
                assert await be.read_at(ro, buf, 0) == 4096 and bytes(buf) == b"x" * 4096
            finally:
                pool.put(buf)
                await be.close(ro)
                await be.close(wo)
            bad = os.open(path, os.O_RDONLY)
            os.close(bad)  # a closed fd number
            with pytest.raises(OSError) as ei:
                await be.fsync(bad)
            assert ei.value.errno == errno.EBADF
            await be.aclose()

        asyncio.run(main())

    @pytest.mark.timeout(30)
    def test_cancelled_read_leaves_backend_usable(
        self, make_backend: object, pool: BufferPool, tmp_path: Path, direct: bool
    ) -> None:
        async def main() -> None:
            be: IOBackend = make_backend()  # type: ignore[operator]
            path = tmp_path / "f"
            path.write_bytes(_pattern(8 << 20, 1))
            fd = await be.open(path, os.O_RDONLY, direct=direct)
            try:
                buf = pool.get(8 << 20)
                buf[:] = bytes(8 << 20)
                task = asyncio.ensure_future(be.read_at(fd, buf, 0))
                await asyncio.sleep(0)  # the read is submitted
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # the read was allowed to finish before the cancellation
                # surfaced: the buffer holds the file, and may go back to the pool
                assert bytes(buf) == _pattern(8 << 20, 1)
                pool.put(buf)
                small = pool.get(4096)
                assert await be.read_at(fd, small, 4096) == 4096
                assert bytes(small) == _pattern(8 << 20, 1)[4096:8192]
                pool.put(small)
            finally:
                await be.close(fd)
                await be.aclose()

        asyncio.run(main())

    @pytest.mark.timeout(30)
    def test_cancelled_twice_and_queued_reads(
        self, make_backend: object, pool: BufferPool, tmp_path: Path, direct: bool
    ) -> None:
        """A read cancelled twice still surfaces only once its buffer is
        filled; with a queue depth of 1, a read waiting behind it that is
        cancelled leaves the ones after it to complete."""
        async def main() -> None:
            be: IOBackend = make_backend(queue_depth=1)  # type: ignore[operator]
            path = tmp_path / "f"
            want = _pattern(8 << 20, 3)
            path.write_bytes(want)
            fd = await be.open(path, os.O_RDONLY, direct=direct)
            bufs = [pool.get(8 << 20) for _ in range(3)]
            try:
                for b in bufs:
                    b[:] = bytes(8 << 20)
                first, queued, last = (asyncio.ensure_future(be.read_at(fd, b, 0)) for b in bufs)
                await asyncio.sleep(0)
                first.cancel()
                queued.cancel()
                await asyncio.sleep(0)
                first.cancel()
                for t in (first, queued):
                    with pytest.raises(asyncio.CancelledError):
                        await t
                assert bytes(bufs[0]) == want
                assert await last == 8 << 20 and bytes(bufs[2]) == want
                assert await be.read_at(fd, bufs[1], 0) == 8 << 20 and bytes(bufs[1]) == want
            finally:
                for b in bufs:
                    pool.put(b)
                await be.close(fd)
                await be.aclose()

        asyncio.run(main())

    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("seed", [1, 2, 3])
    def test_random_ops_match_a_model(
        self, make_backend: object, pool: BufferPool, tmp_path: Path, direct: bool, seed: int
    ) -> None:
        """Random writes and reads (sizes and offsets around block edges, pool
        and plain buffers, some concurrent) agree with a bytearray model."""
        rng = random.Random(seed)

        def pick() -> int:
            return rng.choice([0, 1, 511, 4095, 4096, 4097, 8192, 12_000, 65_536, 70_001])

        async def main() -> None:
            be: IOBackend = make_backend(queue_depth=4)  # type: ignore[operator]
            path = tmp_path / "f"
            fd = await be.open(path, os.O_RDWR | os.O_CREAT, direct=direct)
            model = bytearray()
            try:
                for _ in range(40):
                    if rng.random() < 0.5:
                        # a batch of non-overlapping concurrent writes
                        base = rng.choice([0, 4096, len(model), max(0, len(model) - 100)])
                        jobs = []
                        for _k in range(rng.randint(1, 3)):
                            n = pick() or 1
                            data = rng.randbytes(n)
                            if rng.random() < 0.5:
                                src = pool.get(n)
                                src[:] = data
                            else:
                                src = memoryview(bytearray(data))
                            jobs.append((base, data, src))
                            base += n + rng.choice([0, 0, 3, 4096])
                        await asyncio.gather(*(be.write_at(fd, src, off) for off, _, src in jobs))
                        for off, data, src in jobs:
                            if len(model) < off:
                                model.extend(bytes(off - len(model)))
                            model[off : off + len(data)] = data
                            if pool.owns(src):
                                pool.put(src)
                    else:
                        off = rng.choice([0, 1, 4096, rng.randint(0, len(model) + 10)])
                        n = pick()
                        dst = pool.get(n) if rng.random() < 0.5 else memoryview(bytearray(n))
                        got = await be.read_at(fd, dst, off)
                        want = bytes(model[off : off + n])
                        assert got == len(want) and bytes(dst[:got]) == want
                        if pool.owns(dst):
                            pool.put(dst)
                assert os.fstat(fd).st_size == len(model)
                with open(path, "rb") as f:
                    assert f.read() == bytes(model)
            finally:
                await be.close(fd)
                await be.aclose()

        asyncio.run(main())

    @pytest.mark.timeout(30)
    def test_buffers_are_not_pinned(self, make_backend: object, tmp_path: Path, direct: bool) -> None:
        """Every buffer passed to the backend is free again afterwards (the
        io_uring binding leaks exports unless compensated)."""

        async def main() -> None:
            own = BufferPool(1 << 20)
            be: IOBackend = make_backend()  # type: ignore[operator]
            path = tmp_path / "f"
            fd = await be.open(path, os.O_RDWR | os.O_CREAT, direct=direct)
            try:
                buf = own.get(4096)
                buf[:] = b"z" * 4096
                refs = sys.getrefcount(buf)
                for _ in range(50):
                    await be.write_at(fd, buf, 0)
                    assert await be.read_at(fd, buf, 0) == 4096
                assert sys.getrefcount(buf) == refs
                buf.release()  # raises BufferError if an export leaked
            finally:
                await be.close(fd)
                await be.aclose()
                own.close()

        asyncio.run(main())


def test_open_backend_selection() -> None:
    pool = BufferPool(1 << 20)

    async def main() -> None:
        be = open_backend("posix", pool)
        assert isinstance(be, PosixBackend)
        await be.aclose()
        auto = open_backend("auto", pool)
        assert auto.name in ("uring", "posix")
        await auto.aclose()

    try:
        asyncio.run(main())
        from tierfs.errors import ConfigError

        with pytest.raises(ConfigError):
            open_backend("spdk", pool)
    finally:
        pool.close()


def test_auto_falls_back_to_posix_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the kernel refuses io_uring (old kernel, seccomp, sysctl), "auto"
    serves with posix and says why; "uring" refuses to start."""
    import tierfs.storage.io as io_mod
    from tierfs.errors import ConfigError

    monkeypatch.setattr(io_mod, "_uring_unavailable", lambda: "io_uring setup failed: [Errno 1] EPERM")
    pool = BufferPool(1 << 20)

    async def main() -> None:
        be = open_backend("auto", pool)
        assert isinstance(be, PosixBackend)
        await be.aclose()

    try:
        with caplog.at_level("WARNING", logger="tierfs.storage.io"):
            asyncio.run(main())
        assert "io_uring unavailable (io_uring setup failed" in caplog.text
        with pytest.raises(ConfigError, match="EPERM"):
            open_backend("uring", pool)
    finally:
        pool.close()
