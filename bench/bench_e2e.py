"""End-to-end client throughput: one large file written and read sequentially
through ``tierfs.client.AsyncClient`` on a real local cluster (3 meta
replicas, 6 storage daemons, each its own process, data on the local disk).

Cases, for ``ec:4+2`` and ``replica:3`` (4 MiB chunks): sequential write of a
2 GiB file (quick: 256 MiB) in 64 MiB ``write`` calls, including the commit;
sequential ``read_into`` of the whole file into one pre-faulted buffer (best
of two: the machine is shared and noisy); and,
for ``ec:4+2``, the same read right after one storage daemon is SIGKILLed
(degraded: the chunks whose data fragments lived there are decoded from
parity). Values are *file* bytes per second: an ``ec:4+2`` write moves 1.5x
that over the network and onto disks, a ``replica:3`` write 3x.

Limits measured in the same run, as ratios:

* raw uvloop TCP stream of the same total between two processes (the helper
  of ``bench.bench_dataplane``): send for writes, receive for reads;
* raw O_DIRECT sequential read of a file of the same size on the same disk
  (``bench.bench_disk``), 4 MiB requests, 16 in flight;
* for writes, also raw *durable* 1 MiB file writes on the same disk (new
  file, O_DIRECT write, fdatasync, rename, directory fsync; 32 in flight):
  what every storage target does per fragment, compared with the bytes the
  cluster stores (1.5x or 3x the file).

    python -m bench.bench_e2e [--quick] [--profile read|write|degraded] [--security on|off|both]

``--security`` (default both): the cases run on a cluster with security on
(token auth on meta, capabilities checked by the storage daemons) and on one
with it off, in the same run; rows of the latter end in "[security off]",
and "security on vs off" rows give the ratios.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from bench.bench_dataplane import _raw_tcp, _spawn, _stop
from bench.bench_disk import _raw
from tierfs.buffers import BufferPool
from tierfs.client import AsyncClient
from tierfs.local import LocalCluster

MiB = 1 << 20
PIECE = 64 * MiB


def _source(size: int) -> tuple[np.ndarray[Any, Any], int]:
    """One random 64 MiB block (the file repeats it) and the file size."""
    block = np.random.default_rng(0).integers(0, 256, min(size, PIECE), dtype=np.uint8)
    return block, size


async def _write(c: AsyncClient, path: str, block: np.ndarray[Any, Any], size: int) -> float:
    view = block.data
    t0 = time.perf_counter()
    f = await c.open(path, "wb")
    async with f:
        done = 0
        while done < size:
            n = min(len(view), size - done)
            done += await f.write(view[:n])
    return size / (time.perf_counter() - t0) / 1e9


async def _read(c: AsyncClient, path: str, dest: memoryview, block: np.ndarray[Any, Any]) -> float:
    t0 = time.perf_counter()
    n = await c.read_into(path, dest)
    dt = time.perf_counter() - t0
    b = block.data
    for off in range(0, n, len(b)):  # every byte checked, outside the timing
        k = min(len(b), n - off)
        if dest[off: off + k] != b[:k]:
            raise AssertionError(f"{path}: wrong bytes in [{off}, {off + k})")
    return n / dt / 1e9


def _row(case: str, value: float, baseline: float | None, name: str) -> dict[str, Any]:
    return {"case": case, "value": round(value, 3), "unit": "GB/s",
            "baseline": None if baseline is None else round(baseline, 3), "baseline_name": name,
            "ratio": round(value / baseline, 3) if baseline else None}


async def _cases(cl: LocalCluster, size: int, profile: str | None) -> dict[str, float]:
    block, size = _source(size)
    out: dict[str, float] = {}
    pool = BufferPool(0, max_pooled_size=0)
    dest = pool.get(size)  # pre-faulted (MAP_POPULATE): first touch is not what we measure
    prof = cProfile.Profile()
    try:
        async with AsyncClient(cl.meta_addrs) as c:
            for red in ("ec:4+2", "replica:3"):
                d = "/bench-" + red.replace(":", "-").replace("+", "_")
                await c.mkdir(d, exist_ok=True)
                await c.set_layout(d, chunk_size=4 * MiB, redundancy=red)
                await _write(c, f"{d}/warm", block, min(size, 64 * MiB))  # connections, pools
                await _read(c, f"{d}/warm", dest[: min(size, 64 * MiB)], block)
                await c.rm(f"{d}/warm")
                if profile == "write" and red == "ec:4+2":
                    prof.enable()
                out[f"write {red}"] = await _write(c, f"{d}/big", block, size)
                prof.disable()
                if profile == "read" and red == "ec:4+2":
                    prof.enable()
                out[f"read {red}"] = max([await _read(c, f"{d}/big", dest, block) for _ in range(2)])
                prof.disable()
            # Degraded: a storage daemon dies just before the read; the client
            # learns it from refused connections (meta notices later).
            cl.kill("storage-0")
            if profile == "degraded":
                prof.enable()
            out["read ec:4+2 degraded"] = max([await _read(c, "/bench-ec-4_2/big", dest, block) for _ in range(2)])
            prof.disable()
    finally:
        pool.put(dest)
        pool.close()
    if profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return out


def run(quick: bool, profile: str | None = None, security: str = "both") -> dict[str, Any]:
    size = (256 if quick else 2048) * MiB
    modes = {"on": [True], "off": [False], "both": [True, False]}[security]
    base = os.environ.get("TIERFS_BENCH_DIR")
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-e2e-", dir=base) as tmp:
        raw_srv, raw_port = _spawn([sys.executable, str(Path(__file__).with_name("bench_dataplane.py")),
                                    "raw-tcp-server"])
        try:
            async def tcp() -> tuple[float, float]:
                send = await _raw_tcp(raw_port, 1, size, MiB)
                recv = await _raw_tcp(raw_port, 0, size, MiB)
                return send, recv

            tcp_send, tcp_recv = uvloop.run(tcp())
        finally:
            _stop(raw_srv)
        disk_dir = Path(tmp) / "raw-disk"
        disk_dir.mkdir()
        _, disk_read, _ = _raw(disk_dir, 4 * MiB, 16, size // (4 * MiB))
        # What a storage target must do per fragment: new file, O_DIRECT write, fdatasync, rename, dir fsync.
        _, _, disk_durable = _raw(disk_dir, MiB, 32, min(size, 512 * MiB) // MiB)
        results: dict[bool, dict[str, float]] = {}
        for on in modes:
            # Off: meta without authentication and storage daemons that
            # check no capability (the client still sends the ones meta mints).
            cl = LocalCluster(Path(tmp) / f"cluster-{'on' if on else 'off'}", n_storage=6,
                              extra_meta_args=[] if on else ["--insecure-no-auth"],
                              extra_storage_args=[] if on else ["--require-capabilities=false"])
            cl.export_token()  # this cluster's admin token
            try:
                t0 = time.perf_counter()
                cl.start(timeout=120)
                uvloop.run(cl.wait_healthy(120))
                notes.append(f"cluster (security {'on' if on else 'off'}) start {time.perf_counter() - t0:.1f} s")
                results[on] = uvloop.run(_cases(cl, size, profile))
            finally:
                cl.stop()
    rows: list[dict[str, Any]] = []
    for on, res in results.items():
        tag = "" if on else " [security off]"
        rows += [dict(r, case=r["case"] + tag) for r in _rows(res, tcp_send, tcp_recv, disk_read, disk_durable)]
    if len(results) == 2:
        for case in ("write ec:4+2", "read ec:4+2", "write replica:3", "read replica:3"):
            rows.append(_row(f"{case}: security on vs off", results[True][case], results[False][case],
                             "the same case with security off"))
    notes.append(f"file {size // MiB} MiB, 4 MiB chunks, 6 storage daemons + 3 meta replicas and the "
                 f"client on {os.cpu_count()} CPUs; writes include the commit; every byte read is checked "
                 f"(outside the timing); security on = token auth on meta and capabilities checked by every "
                 f"storage daemon (plaintext, no TLS)")
    return {"name": "e2e", "rows": rows, "notes": "; ".join(notes)}


def _rows(res: dict[str, float], tcp_send: float, tcp_recv: float, disk_read: float,
          disk_durable: float) -> list[dict[str, Any]]:
    tcp_r, tcp_w = "raw uvloop TCP receive", "raw uvloop TCP send"
    return [
        _row("write ec:4+2 (file bytes)", res["write ec:4+2"], tcp_send, tcp_w),
        _row("read ec:4+2", res["read ec:4+2"], tcp_recv, tcp_r),
        _row("read ec:4+2 vs disk", res["read ec:4+2"], disk_read, "raw O_DIRECT read"),
        _row("read ec:4+2, 1 of 6 daemons SIGKILLed", res["read ec:4+2 degraded"], tcp_recv, tcp_r),
        _row("write ec:4+2, stored bytes (1.5x file) vs durable disk writes", 1.5 * res["write ec:4+2"],
             disk_durable, "raw durable 1 MiB file writes, 32 in flight"),
        _row("write replica:3 (file bytes)", res["write replica:3"], tcp_send, tcp_w),
        _row("write replica:3, stored bytes (3x file) vs durable disk writes", 3 * res["write replica:3"],
             disk_durable, "raw durable 1 MiB file writes, 32 in flight"),
        _row("read replica:3", res["read replica:3"], tcp_recv, tcp_r),
        _row("read replica:3 vs disk", res["read replica:3"], disk_read, "raw O_DIRECT read"),
    ]


if __name__ == "__main__":
    import json

    prof = sys.argv[sys.argv.index("--profile") + 1] if "--profile" in sys.argv else None
    sec = sys.argv[sys.argv.index("--security") + 1] if "--security" in sys.argv else "both"
    if sec not in ("on", "off", "both"):
        sys.exit("--security takes on, off or both")
    print(json.dumps(run("--quick" in sys.argv, prof, sec), indent=2))
