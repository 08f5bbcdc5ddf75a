"""Training I/O patterns on a real local cluster (3 meta replicas, 6 storage
daemons, data on the local disk), each against the local disk in the same run.

* **Checkpoint burst:** 8 writer *processes* (quick: 8) each write one
  256 MiB file (quick: 16 MiB) at once into one directory laid out
  ``ec:4+2`` (4 MiB chunks), in 64 MiB ``write`` calls, then ``close``. A
  ``close`` returns only once every chunk has at least K+1 fragments durable
  on the targets (fdatasync + rename + directory fsync each; all K+M unless
  a target fails) and the commit is in meta's Raft journal on a majority
  (fdatasync'ed), so the time to the last close *is* the time until all
  files are durable; nothing is added after it. Aggregate GB/s = file bytes
  / (first writer's start after a common barrier -> last close returned).
  Baseline: the same bytes from 8 processes to new files on the same local
  disk, ``O_DIRECT`` ``pwrite`` of the same 64 MiB pieces, ``fdatasync``,
  ``close``, ``fsync`` of the directory (the new names durable too), timed
  the same way.
* **Weights fan-out:** one 1 GiB file (quick: 64 MiB) in TierFS
  (``ec:4+2``, 4 MiB chunks); 8 reader processes each read all of it at once,
  with ``read_into`` into one reused 256 MiB buffer (pre-faulted). Aggregate
  GB/s = 8 x file size / (first start -> last finish). Baseline: a local
  copy of the same bytes read by 8 processes with ``O_DIRECT`` ``preadv`` of
  8 MiB requests into an aligned (mmap) buffer of the same size, so the page
  cache does not serve it. The storage daemons read fragments with
  ``O_DIRECT`` too (``tierfs.storage.io``, docs/storage.md); after the runs
  the page-cache residency of the file's fragment files is measured
  (``fincore``) and reported in the notes, so a cache-served result would
  show.

Each case runs ``REPS`` times, TierFS and baseline interleaved; rows carry the
median and every run (``runs``). The workers are processes (spawned once,
reused across repetitions) so that no GIL serializes the clients; they start
each timed section together on a ``multiprocessing.Barrier``. Every byte
written is read back and checked in the first repetition, and every reader
of the first fan-out repetition checks the file's CRC32C; both outside the
timing. Writes ``bench/results/training.md`` as well. The full run keeps
every repetition's files until the end (no deletes, so no garbage collection
competes with a later run): about 12 GiB of disk under ``TIERFS_BENCH_DIR``
(default: the system temp dir).

    python -m bench.bench_training [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import results_dir

MiB = 1 << 20
WORKERS = 8
CHUNK = 4 * MiB
PIECE = 64 * MiB  # one write call; also the repeated random block of every file
READ_BUF = 256 * MiB  # each reader's reused destination buffer
LOCAL_REQ = 8 * MiB  # O_DIRECT request of the local read baseline
REPS = 3
#: Seconds one worker command may take before the run is declared hung.
COMMAND_TIMEOUT = 300.0
_MAP = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def _block(seed: int, size: int) -> mmap.mmap:
    """A page-aligned, pre-faulted buffer of random bytes (O_DIRECT needs the alignment)."""
    m = mmap.mmap(-1, size, flags=_MAP)
    m[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    return m


# ---- the worker process --------------------------------------------------------------


class _Worker:
    """State a worker keeps across commands: its event loop, its client, its buffers."""

    def __init__(self, meta: list[str]) -> None:
        import uvloop

        self.meta = meta
        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.client: Any = None
        self.blocks: dict[tuple[int, int], mmap.mmap] = {}
        self.buf: mmap.mmap | None = None

    def block(self, seed: int, size: int) -> mmap.mmap:
        key = (seed, size)
        if key not in self.blocks:
            self.blocks[key] = _block(seed, size)
        return self.blocks[key]

    def buffer(self, size: int) -> mmap.mmap:
        if self.buf is None or len(self.buf) != size:
            self.buf = mmap.mmap(-1, size, flags=_MAP)
        return self.buf

    async def connect(self) -> Any:
        if self.client is None:
            from tierfs.client import AsyncClient

            self.client = AsyncClient(self.meta)
            await self.client.stat("/")
        return self.client

    # Each command: prepare() untimed, then the barrier, then the timed part.

    def tierfs_write(self, barrier: Barrier, path: str, size: int, seed: int, verify: bool) -> dict[str, Any]:
        c = self.loop.run_until_complete(self.connect())
        block = memoryview(self.block(seed, min(size, PIECE)))

        async def write() -> None:
            f = await c.open(path, "wb")
            async with f:
                done = 0
                while done < size:
                    done += await f.write(block[: min(len(block), size - done)])

        barrier.wait(COMMAND_TIMEOUT)
        t0 = time.monotonic()
        self.loop.run_until_complete(write())
        t1 = time.monotonic()
        if verify:
            self.loop.run_until_complete(self._check(c, path, size, block))
        return {"start": t0, "end": t1, "bytes": size}

    async def _check(self, c: Any, path: str, size: int, block: memoryview) -> None:
        buf = memoryview(self.buffer(min(size, READ_BUF)))
        for off in range(0, size, len(buf)):
            n = await c.read_into(path, buf, off)
            want = min(len(buf), size - off)
            if n != want:
                raise AssertionError(f"{path}: read {n} bytes at {off}, expected {want}")
            for p in range(0, n, len(block)):
                k = min(len(block), n - p)
                if buf[p: p + k] != block[:k]:
                    raise AssertionError(f"{path}: wrong bytes in [{off + p}, {off + p + k})")

    def local_write(self, barrier: Barrier, path: str, size: int, seed: int) -> dict[str, Any]:
        block = memoryview(self.block(seed, min(size, PIECE)))
        barrier.wait(COMMAND_TIMEOUT)
        t0 = time.monotonic()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            done = 0
            while done < size:
                done += os.pwrite(fd, block[: min(len(block), size - done)], done)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        d = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(d)
        finally:
            os.close(d)
        return {"start": t0, "end": time.monotonic(), "bytes": size}

    def tierfs_read(self, barrier: Barrier, path: str, size: int, crc: int | None) -> dict[str, Any]:
        from tierfs.chunk import crc32c

        c = self.loop.run_until_complete(self.connect())
        buf = memoryview(self.buffer(min(size, READ_BUF)))

        async def read(check: bool) -> int:
            total, value = 0, 0
            for off in range(0, size, len(buf)):
                n = await c.read_into(path, buf, off)
                if check:
                    value = crc32c(buf[:n], value)
                total += n
            if check and value != crc:
                raise AssertionError(f"{path}: CRC32C {value:#010x}, expected {crc:#010x}")
            return total

        # Untimed: the connections to every daemon are made, and (first rep) the bytes checked.
        self.loop.run_until_complete(read(True) if crc is not None else c.read_into(path, buf[: 16 * CHUNK]))
        barrier.wait(COMMAND_TIMEOUT)
        t0 = time.monotonic()
        n = self.loop.run_until_complete(read(False))
        t1 = time.monotonic()
        if n != size:
            raise AssertionError(f"{path}: read {n} bytes, expected {size}")
        return {"start": t0, "end": t1, "bytes": n}

    def local_read(self, barrier: Barrier, path: str, size: int) -> dict[str, Any]:
        buf = memoryview(self.buffer(min(size, READ_BUF)))
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            barrier.wait(COMMAND_TIMEOUT)
            t0 = time.monotonic()
            total = 0
            while total < size:
                p = total % len(buf)  # the buffer is reused, as the TierFS readers reuse theirs
                n = os.preadv(fd, [buf[p: p + min(LOCAL_REQ, len(buf) - p, size - total)]], total)
                if n <= 0:
                    break
                total += n
            t1 = time.monotonic()
        finally:
            os.close(fd)
        if total != size:
            raise AssertionError(f"{path}: read {total} bytes, expected {size}")
        return {"start": t0, "end": t1, "bytes": total}

    def close(self) -> None:
        if self.client is not None:
            self.loop.run_until_complete(self.client.close())
        self.loop.close()


def _serve(meta: list[str], barrier: Barrier, conn: Connection) -> None:
    """A worker's main loop: one command at a time, a result (or error) back."""
    w = _Worker(meta)
    try:
        while True:
            cmd, kw = conn.recv()
            if cmd == "stop":
                return
            try:
                conn.send(getattr(w, cmd)(barrier, **kw))
            except Exception as e:
                barrier.abort()  # the others must not wait for this one forever
                conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        w.close()


class _Pool:
    """``n`` worker processes (spawned: no inherited event loop or threads)."""

    def __init__(self, n: int, meta: list[str]) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(n)
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(meta, self.barrier, theirs), daemon=True)
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)

    def run(self, cmd: str, kws: list[dict[str, Any]]) -> dict[str, float]:
        """Run ``cmd`` on every worker (``kws[i]`` for worker i) at once;
        aggregate GB/s, seconds from the first start to the last end, and
        the spread of the ends."""
        self.barrier.reset()
        for conn, kw in zip(self.conns, kws, strict=True):
            conn.send((cmd, kw))
        out = []
        for i, conn in enumerate(self.conns):
            if not conn.poll(COMMAND_TIMEOUT):
                raise TimeoutError(f"worker {i}: no answer to {cmd} within {COMMAND_TIMEOUT:.0f} s")
            out.append(conn.recv())
        errors = [f"worker {i}: {r['error']}" for i, r in enumerate(out) if "error" in r]
        if errors:
            # BrokenBarrierError is only the echo of another worker's failure.
            real = [e for e in errors if "BrokenBarrierError" not in e]
            raise RuntimeError(f"{cmd}: " + "; ".join(real or errors))
        t0 = min(r["start"] for r in out)
        t1 = max(r["end"] for r in out)
        total = sum(r["bytes"] for r in out)
        return {"gbps": total / (t1 - t0) / 1e9, "seconds": t1 - t0,
                "first_end": min(r["end"] for r in out) - t0}

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop", {}))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


# ---- the parent ----------------------------------------------------------------------


def _cached_bytes(paths: list[Path]) -> tuple[int, int] | None:
    """(bytes of ``paths`` in the page cache, their total size), by ``fincore``; None without it."""
    if shutil.which("fincore") is None or not paths:
        return None
    cached = 0
    for i in range(0, len(paths), 500):
        out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *map(str, paths[i: i + 500])],
                             capture_output=True, text=True, check=True).stdout
        cached += sum(int(x) for x in out.split())
    return cached, sum(p.stat().st_size for p in paths)


async def _put_weights(meta: list[str], path: str, local: Path, size: int) -> int:
    """The fan-out file, in TierFS and as a local copy (O_DIRECT, fdatasync); its CRC32C."""
    from tierfs.chunk import crc32c
    from tierfs.client import AsyncClient

    block = memoryview(_block(999, min(size, PIECE)))
    crc = 0
    fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        async with AsyncClient(meta) as c:
            f = await c.open(path, "wb")
            async with f:
                done = 0
                while done < size:
                    piece = block[: min(len(block), size - done)]
                    await f.write(piece)
                    os.pwrite(fd, piece, done)
                    crc = crc32c(piece, crc)
                    done += len(piece)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return crc


async def _setup(meta: list[str]) -> None:
    from tierfs.client import AsyncClient

    async with AsyncClient(meta) as c:
        for d in ("/ckpt", "/weights"):
            await c.mkdir(d, exist_ok=True)
            await c.set_layout(d, chunk_size=CHUNK, redundancy="ec:4+2")


async def _sizes(meta: list[str], paths: list[str]) -> list[int]:
    from tierfs.client import AsyncClient

    async with AsyncClient(meta) as c:
        return [(await c.stat(p)).size for p in paths]


def _row(case: str, value: float, unit: str, baseline: float | None, name: str,
         runs: list[float] | None = None, base_runs: list[float] | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {"case": case, "value": round(value, 3), "unit": unit,
                         "baseline": None if baseline is None else round(baseline, 3), "baseline_name": name,
                         "ratio": round(value / baseline, 3) if baseline else None}
    if runs is not None:
        r["runs"] = [round(x, 3) for x in runs]
    if base_runs is not None:
        r["baseline_runs"] = [round(x, 3) for x in base_runs]
    return r


def run(quick: bool) -> dict[str, Any]:
    import uvloop

    from bench.run import to_markdown
    from tierfs.local import LocalCluster

    per_writer = (16 if quick else 256) * MiB
    weights = (64 if quick else 1024) * MiB
    notes: list[str] = []
    burst: dict[str, list[dict[str, float]]] = {"tierfs": [], "local": []}
    fan: dict[str, list[dict[str, float]]] = {"tierfs": [], "local": []}
    cache_note = "page-cache residency not measured (no fincore)"
    with tempfile.TemporaryDirectory(prefix="bench-training-", dir=os.environ.get("TIERFS_BENCH_DIR")) as tmp:
        local = Path(tmp) / "local"
        local.mkdir()
        cl = LocalCluster(Path(tmp) / "cluster", n_meta=3, n_storage=6)
        cl.export_token()  # security on: this cluster's admin token
        pool: _Pool | None = None
        try:
            t0 = time.monotonic()
            cl.start(timeout=120)
            uvloop.run(cl.wait_healthy(120))
            notes.append(f"cluster start {time.monotonic() - t0:.1f} s")
            meta = cl.meta_addrs
            uvloop.run(_setup(meta))
            pool = _Pool(WORKERS, meta)
            crc = uvloop.run(_put_weights(meta, "/weights/model.bin", local / "model.bin", weights))
            for rep in range(REPS):
                # Alternate which side goes first, so a noisy neighbour or a
                # warming disk does not always favour the same one.
                sides = ("tierfs", "local") if rep % 2 == 0 else ("local", "tierfs")
                for side in sides:
                    if side == "tierfs":
                        uvloop.run(_mkdir(meta, f"/ckpt/rep{rep}"))
                        burst["tierfs"].append(pool.run("tierfs_write", [
                            {"path": f"/ckpt/rep{rep}/rank{i}", "size": per_writer, "seed": i, "verify": rep == 0}
                            for i in range(WORKERS)]))
                    else:
                        d = local / f"ckpt-rep{rep}"
                        d.mkdir()
                        burst["local"].append(pool.run("local_write", [
                            {"path": str(d / f"rank{i}"), "size": per_writer, "seed": i} for i in range(WORKERS)]))
                        shutil.rmtree(d)
                if rep == 0:
                    sizes = uvloop.run(_sizes(meta, [f"/ckpt/rep0/rank{i}" for i in range(WORKERS)]))
                    if sizes != [per_writer] * WORKERS:
                        raise AssertionError(f"checkpoint files have sizes {sizes}, expected {per_writer} each")
            for rep in range(REPS):
                sides = ("tierfs", "local") if rep % 2 == 0 else ("local", "tierfs")
                for side in sides:
                    if side == "tierfs":
                        fan["tierfs"].append(pool.run("tierfs_read", [
                            {"path": "/weights/model.bin", "size": weights, "crc": crc if rep == 0 else None}
                            for _ in range(WORKERS)]))
                    else:
                        fan["local"].append(pool.run("local_read", [
                            {"path": str(local / "model.bin"), "size": weights} for _ in range(WORKERS)]))
            inode = uvloop.run(_inode(meta, "/weights/model.bin"))
            frags = sorted(Path(cl.dir).glob(f"storage-*/t*/frags/{inode & 0xFF:02x}/{inode:016x}/*"))
            got = _cached_bytes(frags)
            local_got = _cached_bytes([local / "model.bin"])
            if got is not None and local_got is not None:
                cache_note = (f"after the fan-out runs, the page cache held {got[0] / MiB:,.1f} MiB of the weights "
                              f"file's {got[1] / MiB:,.1f} MiB of fragment files on the storage targets "
                              f"({len(frags)} files) and {local_got[0] / MiB:,.1f} MiB of the "
                              f"{local_got[1] / MiB:,.0f} MiB local copy (fincore)")
        finally:
            if pool is not None:
                pool.close()
            cl.stop()

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def all_(runs: list[dict[str, float]], key: str) -> list[float]:
        return [r[key] for r in runs]

    bw, bl = burst["tierfs"], burst["local"]
    fw, fl = fan["tierfs"], fan["local"]
    local_w = "local disk, 8 processes: O_DIRECT pwrite + fdatasync + dir fsync"
    local_r = "local copy, 8 processes: O_DIRECT preadv, 8 MiB requests"
    label = f"{WORKERS} x {per_writer // MiB} MiB"
    rows = [
        _row(f"checkpoint burst {label}, ec:4+2: aggregate (file bytes)", med(bw, "gbps"), "GB/s",
             med(bl, "gbps"), local_w, all_(bw, "gbps"), all_(bl, "gbps")),
        _row(f"checkpoint burst {label}: until all durable (last close; lower is better)", med(bw, "seconds"), "s",
             med(bl, "seconds"), local_w, all_(bw, "seconds"), all_(bl, "seconds")),
        _row(f"checkpoint burst {label}: first writer durable (lower is better)", med(bw, "first_end"), "s",
             med(bl, "first_end"), local_w, all_(bw, "first_end"), all_(bl, "first_end")),
        _row(f"checkpoint burst {label}: stored bytes (1.5x file) vs local", 1.5 * med(bw, "gbps"), "GB/s",
             med(bl, "gbps"), local_w),
        _row(f"weights fan-out {WORKERS} readers x {weights // MiB} MiB, ec:4+2: aggregate", med(fw, "gbps"), "GB/s",
             med(fl, "gbps"), local_r, all_(fw, "gbps"), all_(fl, "gbps")),
        _row(f"weights fan-out {WORKERS} readers x {weights // MiB} MiB: until the last reader is done "
             "(lower is better)", med(fw, "seconds"), "s", med(fl, "seconds"), local_r,
             all_(fw, "seconds"), all_(fl, "seconds")),
    ]
    notes += [
        f"median of {REPS} runs each (all runs in the JSON), TierFS and baseline interleaved; "
        f"{WORKERS} worker processes (spawned), 6 storage daemons + 3 meta replicas, all on {os.cpu_count()} CPUs "
        "and one disk; data plane over loopback TCP",
        "a TierFS close returns once every chunk has >= K+1 fragments durable (fdatasync + rename + dir fsync "
        "on the targets) and the commit is fdatasync'ed on a Raft majority: the last close is the moment all "
        "files are durable; the local baseline writes with O_DIRECT, then fdatasync and an fsync of the directory",
        "an ec:4+2 write stores 1.5x the file's bytes on the same disk the baseline writes to",
        f"fan-out: each reader reads the whole file with read_into into a reused {min(weights, READ_BUF) // MiB} "
        "MiB buffer; the storage daemons read fragments with O_DIRECT (no page cache), the baseline reads the "
        "local copy with O_DIRECT; " + cache_note,
        "every byte of the first burst is read back and checked, every reader of the first fan-out checks the "
        "file's CRC32C (both untimed)",
    ]
    result = {"name": "training", "rows": rows, "notes": "; ".join(notes)}
    (results_dir(quick) / "training.md").write_text(
        "# Checkpoint burst and weights fan-out (bench/bench_training.py)\n\n"
        f"`python -m bench.run --only training{' --quick' if quick else ''}`, "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n\n" + to_markdown(result))
    return result


async def _mkdir(meta: list[str], path: str) -> None:
    from tierfs.client import AsyncClient

    async with AsyncClient(meta) as c:
        await c.mkdir(path, exist_ok=True)


async def _inode(meta: list[str], path: str) -> int:
    from tierfs.client import AsyncClient

    async with AsyncClient(meta) as c:
        return (await c.stat(path)).inode


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run("--quick" in sys.argv), indent=2))
