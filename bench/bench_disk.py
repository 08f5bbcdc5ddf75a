"""Disk path benchmark: chunk-engine fragment writes and reads per I/O backend,
next to raw O_DIRECT I/O of the same sizes and depth measured in the same run.

Cases: fragment size 1 MiB and 4 MiB, 1 and 16 operations in flight.

* engine write: ``ChunkEngine.write`` of a pooled buffer (CRC32C of the
  payload, temp file, O_DIRECT write, fdatasync, rename, directory fsync);
* engine read: ``ChunkEngine.read`` of the whole fragment (O_DIRECT read,
  header and CRC32C checks);
* baseline: plain ``os.pwrite``/``os.pread`` on one O_DIRECT file from an
  aligned mmap buffer, with as many threads as operations in flight, no
  fsync (the disk's raw sequential speed);
* a second write row compares with a raw "durable new file" loop (create,
  O_DIRECT pwrite, fdatasync, rename, fsync dir) to show what the engine's
  own overhead is, separate from the cost of durability itself.

The data directory is a temporary directory under ``TIERFS_BENCH_DIR``
(default: the system temp dir, i.e. the root disk here).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SIZES = [1 << 20, 4 << 20]
DEPTHS = [1, 16]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _aligned(n: int) -> mmap.mmap:
    m = mmap.mmap(-1, n)
    m.write(os.urandom(min(n, 1 << 16)) * (n // min(n, 1 << 16)))
    return m


def _run_threads(depth: int, count: int, fn: Any) -> float:
    """Run fn(i) for i in range(count) over ``depth`` threads; seconds taken."""
    nxt = iter(range(count))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            fn(i)

    threads = [threading.Thread(target=worker) for _ in range(depth)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _raw(dirpath: Path, size: int, depth: int, count: int) -> tuple[float, float, float]:
    """(write GB/s, read GB/s, durable-new-file write GB/s) with plain syscalls."""
    bufs = [_aligned(size) for _ in range(depth)]
    local = threading.local()
    ids = iter(range(1 << 30))
    ids_lock = threading.Lock()

    def buf() -> mmap.mmap:
        b = getattr(local, "b", None)
        if b is None:
            with ids_lock:
                b = local.b = bufs[next(ids) % depth]
        return b

    path = dirpath / f"raw-{size}-{depth}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        w = _run_threads(depth, count, lambda i: os.pwrite(fd, buf(), i * size))
        r = _run_threads(depth, count, lambda i: os.preadv(fd, [buf()], i * size))
    finally:
        os.close(fd)
        path.unlink()
    durable_dir = dirpath / f"raw-durable-{size}-{depth}"
    durable_dir.mkdir()
    tmp_dir = dirpath / f"raw-tmp-{size}-{depth}"
    tmp_dir.mkdir()

    def durable(i: int) -> None:
        tmp = tmp_dir / f"{i}.tmp"
        f = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            os.pwrite(f, buf(), 0)
            os.fdatasync(f)
        finally:
            os.close(f)
        os.rename(tmp, durable_dir / str(i))
        d = os.open(durable_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(d)
        finally:
            os.close(d)

    dw = _run_threads(depth, count, durable)
    shutil.rmtree(durable_dir)
    shutil.rmtree(tmp_dir)
    for b in bufs:
        b.close()
    total = size * count
    return _gbps(total, w), _gbps(total, r), _gbps(total, dw)


async def _engine(dirpath: Path, kind: str, size: int, depth: int, count: int) -> tuple[float, float]:
    from tierfs.buffers import BufferPool
    from tierfs.storage.api import FragmentKey
    from tierfs.storage.engine import ChunkEngine, crc32c
    from tierfs.storage.io import open_backend

    pool = BufferPool(2 << 30)
    be = open_backend(kind, pool, queue_depth=max(32, 2 * depth), threads=max(4, depth))
    root = dirpath / f"engine-{kind}-{size}-{depth}"
    eng = ChunkEngine(root, 1, be, pool, reserved_bytes=0)
    await eng.open()
    try:
        srcs = []
        for _ in range(depth):
            b = pool.get(size)
            b[:] = os.urandom(size)
            srcs.append((b, crc32c(b)))
        keys = [FragmentKey(i // 64, i % 64, 0, 1) for i in range(count)]
        nxt = iter(range(count))

        async def writer(j: int) -> None:
            buf, crc = srcs[j]
            for i in nxt:
                await eng.write(keys[i], buf, crc)

        t0 = time.perf_counter()
        await asyncio.gather(*(writer(j) for j in range(depth)))
        tw = time.perf_counter() - t0
        rd = iter(range(count))

        async def reader() -> None:
            for i in rd:
                v = await eng.read(keys[i])
                eng.release(v)

        t0 = time.perf_counter()
        await asyncio.gather(*(reader() for _ in range(depth)))
        tr = time.perf_counter() - t0
        for b, _ in srcs:
            pool.put(b)
    finally:
        await eng.close()
        await be.aclose()
        pool.close()
        shutil.rmtree(root, ignore_errors=True)
    total = size * count
    return _gbps(total, tw), _gbps(total, tr)


def run(quick: bool) -> dict[str, Any]:
    import uvloop

    from tierfs.storage.io import probe_uring

    kinds = ["posix"] + (["uring"] if probe_uring() is None else [])
    per_case = (128 << 20) if quick else (512 << 20)
    repeats = 1 if quick else 3
    rows: list[dict[str, Any]] = []
    base = Path(tempfile.mkdtemp(prefix="tierfs-bench-disk-", dir=os.environ.get("TIERFS_BENCH_DIR")))
    try:
        # warm-up: the first fsyncs and allocations of a run are much slower
        _raw(base, 1 << 20, 4, 64)
        for kind in kinds:
            uvloop.run(_engine(base, kind, 1 << 20, 4, 64))
        for size in SIZES:
            for depth in DEPTHS:
                count = max(depth * 2, per_case // size)
                label = f"{size >> 20}MiB x{depth}"
                # best of `repeats`, raw and engine runs interleaved, so that
                # a noisy neighbour hurts both sides alike
                raw_runs: list[tuple[float, float, float]] = []
                eng_runs: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
                for _ in range(repeats):
                    raw_runs.append(_raw(base, size, depth, count))
                    for kind in kinds:
                        eng_runs[kind].append(uvloop.run(_engine(base, kind, size, depth, count)))
                rw, rr, rdw = (max(r[i] for r in raw_runs) for i in range(3))
                for kind in kinds:
                    ew = max(r[0] for r in eng_runs[kind])
                    er = max(r[1] for r in eng_runs[kind])
                    rows.append({"case": f"{kind} write {label}", "value": ew, "unit": "GB/s", "baseline": rw,
                                 "baseline_name": "raw O_DIRECT pwrite", "ratio": ew / rw if rw else None})
                    rows.append({"case": f"{kind} write {label} vs durable raw", "value": ew, "unit": "GB/s",
                                 "baseline": rdw, "baseline_name": "raw new file+fdatasync+rename+dir fsync",
                                 "ratio": ew / rdw if rdw else None})
                    rows.append({"case": f"{kind} read {label}", "value": er, "unit": "GB/s", "baseline": rr,
                                 "baseline_name": "raw O_DIRECT pread", "ratio": er / rr if rr else None})
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "name": "disk",
        "rows": rows,
        "notes": (
            f"{per_case >> 20} MiB per case, best of {repeats}, on {base.parent}; backends: {', '.join(kinds)}. Engine writes are "
            "durable (fdatasync + rename + dir fsync per fragment) and CRC32C-checked; raw pwrite is not durable."
        ),
    }


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run("--quick" in sys.argv), indent=2))
