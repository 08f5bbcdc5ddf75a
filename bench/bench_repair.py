"""Repair throughput on a real local cluster (1 meta replica, 8 storage
daemons, ec:4+2, 4 MiB chunks; data on the local disk: after one target is
removed and one node drained, 6 nodes remain for the 6-wide groups).

Cases (values are bytes of rebuilt fragments written per second, cluster
wide; the rebuild rate limit is off):

* ``rebuild (decode)``: ``tierfs target rm`` of one target; its
  replacements fetch 4 surviving fragments per lost one over the data plane
  and reconstruct it in place with ISA-L (the library behind pyeclib), then write it durably;
* ``drain (copy)``: ``tierfs node drain`` of another node; its replacements
  copy each fragment from the (still healthy) draining node;
* ``scrub``: one on-demand ``tierfs scrub`` pass over every fragment
  (verify CRC32C), payload bytes verified per second, cluster wide.

Baselines measured in the same run, on the same machine and disk:

* raw disk write: new 1 MiB files written durably the way the chunk engine
  writes a fragment (O_DIRECT create in a temp directory, fdatasync,
  rename, directory fsync shared by the writers waiting for one, as the
  engine's), 16 at once from 16 threads, in the directory the cluster's
  targets live in;
* raw loopback network: one uvloop TCP stream of 1 MiB writes over
  127.0.0.1 (``bench.bench_dataplane``'s raw baseline, its server in its
  own process);
* raw in-process decode (one 1 MiB fragment from four, in place with ISA-L,
  as the rebuild worker decodes), the third bound;
* raw disk, a decode rebuild's I/O: the raw disk write above with four
  O_DIRECT 1 MiB reads (of files written beforehand) before each write. On
  this machine every target shares one disk, so a decode rebuild reads four
  bytes from it for each byte it writes; this is that pattern's ceiling,
  with nothing fetched, decoded or served in between.

Rebuild and drain are reported as ratios of min(raw disk write, raw
network): the issue's target is >= 0.5 for the rebuild. The rebuild is also
reported against its own I/O pattern on the raw disk (how close to this
machine's hardware it gets).

The file is 4 GiB in a full run (768 MiB rebuilt, a few seconds), 256 MiB
with ``--quick``: at 1 GiB (the size until 2026-12-04) the rebuild took
about a second on a fast disk, and the map change and the workers' first
poll were a large share of it (0.43 of the I/O ceiling against 0.90-1.05
at 4 GiB; docs/repair.md, Round 5).

    python -m bench.bench_repair [--quick] [--mib N]
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tierfs.client import AsyncClient
from tierfs.client.codec import Codec
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient

MiB = 1 << 20


def _raw_decode(seconds: float) -> float:
    """Rebuilt bytes/s of the worker's decode, in-process: one 1 MiB fragment
    from four, in place with ISA-L (``tierfs.isal.rebuild_into``; checked
    against the codec's encode)."""
    from tierfs import isal

    codec = Codec("ec", 4, 2)
    chunk = np.random.default_rng(1).integers(0, 256, 4 * MiB, dtype=np.uint8).tobytes()
    frags = codec.encode(memoryview(chunk), len(chunk), 4 * MiB)
    have = {j: memoryview(bytearray(frags[j])) for j in (0, 2, 3, 4)}  # fragment 1 lost
    out = {1: memoryview(bytearray(MiB))}
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        isal.rebuild_into(4, 2, have, out)
        n += 1
    dt = time.perf_counter() - t0
    assert bytes(out[1]) == bytes(frags[1])
    return n * MiB / dt


def _raw_disk_write(dirpath: Path, total: int, size: int = MiB, depth: int = 16, reads: int = 0) -> float:
    """Bytes/s of new ``size``-byte files written durably (O_DIRECT, fdatasync,
    rename, directory fsync), ``depth`` at once: what the engine does per
    fragment, without the engine. Like the engine, a file is covered by the
    first directory fsync that starts after its rename, and the writers
    waiting at that moment share it (the engine's ``_DirSyncer``): the
    hardware's ceiling for the engine's pattern (per-file directory fsyncs
    measured 5-10% slower, a weaker bound).

    With ``reads`` > 0, each file written is preceded by ``reads`` O_DIRECT
    reads of ``size`` bytes from files written (untimed) beforehand: the I/O
    of a decode rebuild (K fragments read per fragment written) on the same
    disk, without fetching, decoding or any Python server in between."""
    from bench.bench_disk import _aligned, _run_threads

    bufs = [_aligned(size) for _ in range(depth)]
    rbufs = [[_aligned(size) for _ in range(reads)] for _ in range(depth)]
    spare = list(rbufs)  # each worker thread takes one set of read buffers
    tls = threading.local()
    tmp_dir, dst, src = dirpath / "raw-tmp", dirpath / "raw-dst", dirpath / "raw-src"
    tmp_dir.mkdir()
    dst.mkdir()
    count = max(depth * 2, total // size)
    n_src = min(count * reads, 4 * depth * reads)
    if reads:
        src.mkdir()
        for i in range(n_src):
            f = os.open(src / str(i), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
            try:
                os.pwrite(f, bufs[i % depth], 0)
                os.fdatasync(f)
            finally:
                os.close(f)
        # The sources were just written: O_DIRECT reads bypass the page
        # cache, so they come from the disk like a fragment a peer serves.
    cond = threading.Condition()
    sync = {"started": 0, "done": 0, "running": 0}

    def fsync_dir() -> None:
        d = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(d)
        finally:
            os.close(d)

    def durable(i: int) -> None:
        if reads and not hasattr(tls, "bufs"):
            with cond:
                tls.bufs = spare.pop()
        for r in range(reads):
            f = os.open(src / str((i * reads + r) % n_src), os.O_RDONLY | os.O_DIRECT)
            try:
                got = os.preadv(f, [tls.bufs[r]], 0)
            finally:
                os.close(f)
            if got != size:
                raise OSError(f"short read of a source file: {got} of {size} bytes")
        tmp = tmp_dir / f"{i}.tmp"
        f = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            os.pwrite(f, bufs[i % depth], 0)
            os.fdatasync(f)
        finally:
            os.close(f)
        os.rename(tmp, dst / str(i))
        with cond:
            mine = sync["started"] + 1  # the first fsync that starts from now on
            while sync["done"] < mine:
                if sync["running"]:
                    cond.wait()
                    continue
                sync["running"] = 1
                sync["started"] += 1
                n = sync["started"]
                cond.release()
                try:
                    fsync_dir()
                finally:
                    cond.acquire()
                    sync["done"], sync["running"] = n, 0
                    cond.notify_all()

    try:
        dt = _run_threads(depth, count, durable)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
        for b in [*bufs, *(b for rb in rbufs for b in rb)]:
            b.close()
    return count * size / dt


def _raw_network(total: int) -> float:
    """Bytes/s of one raw uvloop TCP stream over loopback (best of two)."""
    import uvloop

    from bench.bench_dataplane import _raw_tcp, _spawn, _stop

    proc, port = _spawn([sys.executable, "-m", "bench.bench_dataplane", "raw-tcp-server"])
    try:
        return max(uvloop.run(_raw_tcp(port, 0, total, MiB)) for _ in range(2)) * 1e9
    finally:
        _stop(proc)


async def _counters(mc: MetaClient) -> tuple[int, int]:
    from tierfs.cli.repair import _control
    from tierfs.proto.v1 import storage_control_pb2 as spb

    total = copied = 0
    for n in (await mc.get_cluster_map()).nodes:
        if n.state != 1 or not n.control_addr:
            continue
        r = await _control(n.control_addr, "RepairStatus", spb.RepairStatusRequest(), 10.0)
        total += r.bytes_rebuilt
        copied += r.fragments_copied
    return total, copied


async def _phases(mc: MetaClient) -> dict[str, float]:
    """Seconds the decode rebuilds spent fetching, decoding and writing
    (summed over fragments and nodes; they overlap in time)."""
    import urllib.request

    out = {"fetch_us": 0.0, "decode_us": 0.0, "write_us": 0.0}
    del mc
    for addr in _METRICS:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            for ln in r.read().decode().splitlines():
                for k in out:
                    if ln.startswith(f'tierfs_repair_total{{event="{k}"}}'):
                        out[k] += float(ln.rsplit(" ", 1)[1])
    return {k.removesuffix("_us"): v / 1e6 for k, v in out.items()}


_METRICS: list[str] = []


def _cpu_seconds(cl: LocalCluster) -> float:
    """CPU seconds (user + system) used so far by the cluster's daemons."""
    total = 0.0
    for p in cl.procs:
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _machine_busy() -> tuple[float, float]:
    """(busy, all) CPU time of the whole machine, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return float(sum(v) - v[3] - v[4]), float(sum(v))


async def _wait_rebuilt(mc: MetaClient, gone: set[int], timeout: float) -> None:
    end = time.monotonic() + timeout
    cmap = await mc.get_cluster_map()
    while True:
        if all(not gone.intersection(g.target_ids) and not g.rebuilding for g in cmap.groups):
            return
        if time.monotonic() > end:
            raise TimeoutError("rebuild did not finish")
        await asyncio.sleep(0.05)
        # "unchanged" (a few bytes) while the map is the one we have: the
        # poll should not load meta, which the rebuild needs.
        newer = await mc.get_cluster_map(known_version=int(cmap.version))
        cmap = cmap if newer.unchanged else newer


async def _scenario(cl: LocalCluster, size: int) -> dict[str, Any]:
    from tierfs.cli.repair import scrub_cluster

    block = np.random.default_rng(0).integers(0, 256, 16 * MiB, dtype=np.uint8).tobytes()
    async with AsyncClient(cl.meta_addrs) as c:
        await c.set_layout("/", chunk_size=4 * MiB, redundancy="ec:4+2")
        async with await c.open("/big", "wb") as f:
            for _ in range(size // len(block)):
                await f.write(block)
    out: dict[str, Any] = {}
    async with MetaClient(cl.meta_addrs, deadline=30) as mc:
        cmap = await mc.get_cluster_map()
        by_addr = {n.data_addr: n for n in cmap.nodes}
        victim = by_addr[cl.proc("storage-0").addr]
        drained = by_addr[cl.proc("storage-1").addr]

        b0, _ = await _counters(mc)
        c0, m0 = _cpu_seconds(cl), _machine_busy()
        t0 = time.perf_counter()
        stuck = (await mc.remove_target(victim.target_ids[0])).groups_stuck
        if stuck:
            raise RuntimeError(f"no replacement for groups {list(stuck)}")
        await _wait_rebuilt(mc, set(victim.target_ids), 600)
        dt = time.perf_counter() - t0
        c1, m1 = _cpu_seconds(cl), _machine_busy()
        b1, _ = await _counters(mc)
        out["decode"] = ((b1 - b0) / dt, b1 - b0, dt)
        # Where the time went: the cluster's own CPU, against the machine's.
        out["cpu"] = (c1 - c0, (m1[0] - m0[0]) / max(1.0, m1[1] - m0[1]))

        t0 = time.perf_counter()
        stuck = (await mc.drain_node(drained.node_id)).groups_stuck
        if stuck:
            raise RuntimeError(f"no replacement for groups {list(stuck)}")
        await _wait_rebuilt(mc, set(drained.target_ids), 600)
        dt = time.perf_counter() - t0
        b2, copied = await _counters(mc)
        out["copy"] = ((b2 - b1) / dt, b2 - b1, dt, copied)

        out["phases"] = await _phases(mc)
    rep = await scrub_cluster(cl.meta_addrs, delete_orphans=False)
    out["scrub"] = (rep["total"]["bytes"] / rep["seconds"], rep["total"]["bytes"], rep["seconds"])
    return out


def run(quick: bool, mib: int = 0) -> dict[str, Any]:
    size = (mib or (256 if quick else 4096)) * MiB
    load0 = os.getloadavg()[0]
    raw = _raw_decode(1.0 if quick else 3.0)
    net = _raw_network((256 if quick else 1024) * MiB)
    with tempfile.TemporaryDirectory(prefix="bench-repair-", dir=os.environ.get("TIERFS_BENCH_DIR")) as tmp:
        disk = _raw_disk_write(Path(tmp), (128 if quick else 512) * MiB)
        # The decode rebuild's own I/O on this one disk: 4 reads per write.
        disk_rebuild = _raw_disk_write(Path(tmp), (64 if quick else 256) * MiB, reads=4)
        cl = LocalCluster(Path(tmp) / "c", n_meta=1, n_storage=8,
                          extra_meta_args=["--tick-interval=0.1"],
                          extra_storage_args=["--rebuild-rate=0", "--rebuild-interval=0.1", "--scrub-rate=0",
                                              "--heartbeat-interval=0.5",
                                              "--metrics-addr=127.0.0.1:0"])
        cl.export_token()  # security on: this cluster's admin token
        try:
            cl.start(timeout=120)
            asyncio.run(cl.wait_healthy(120))
            import json

            _METRICS[:] = [json.loads((cl.dir / "logs" / f"{p.name}.out").read_text().splitlines()[-1])["metrics"]
                           for p in cl.procs if p.kind == "storage"]
            r = asyncio.run(_scenario(cl, size))
        finally:
            cl.stop()
    dec, cp, sc, ph = r["decode"], r["copy"], r["scrub"], r["phases"]
    load = f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    cpu_s, busy = r["cpu"]
    bound = min(disk, net)
    bound_name = f"min(raw disk write {disk / MiB:,.0f}, raw loopback tcp {net / MiB:,.0f}) MiB/s"
    rows = [
        {"case": "rebuild by decode (target rm)", "value": dec[0] / MiB, "unit": "MiB/s",
         "baseline": bound / MiB, "baseline_name": bound_name, "ratio": dec[0] / bound},
        {"case": "drain by copy (node drain)", "value": cp[0] / MiB, "unit": "MiB/s",
         "baseline": bound / MiB, "baseline_name": bound_name, "ratio": cp[0] / bound},
        {"case": "rebuild by decode vs its I/O on the raw disk", "value": dec[0] / MiB, "unit": "MiB/s",
         "baseline": disk_rebuild / MiB,
         "baseline_name": "raw disk: 4 O_DIRECT 1 MiB reads + 1 durable 1 MiB write per rebuilt MiB, x16",
         "ratio": dec[0] / disk_rebuild},
        {"case": "rebuild by decode vs in-process decode", "value": dec[0] / MiB, "unit": "MiB/s",
         "baseline": raw / MiB, "baseline_name": "ISA-L rebuild in place, in-process", "ratio": dec[0] / raw},
        {"case": "scrub verify (all nodes)", "value": sc[0] / MiB, "unit": "MiB/s",
         "baseline": None, "baseline_name": "", "ratio": None},
    ]
    notes = (f"file {size // MiB} MiB ec:4+2 on 8 nodes; target rm rebuilt {dec[1] / MiB:.1f} MiB in "
             f"{dec[2]:.2f} s; drain copied {cp[1] / MiB:.1f} MiB ({cp[3]} fragments) in {cp[2]:.2f} s; scrub "
             f"verified {sc[1] / MiB:.1f} MiB in {sc[2]:.2f} s. Baselines in the same run: raw durable 1 MiB "
             f"file writes x16 {disk / MiB:,.0f} MiB/s, the same with 4 O_DIRECT 1 MiB reads before each write (a decode "
             f"rebuild's disk I/O: every target shares this one disk) {disk_rebuild / MiB:,.0f} rebuilt MiB/s, raw loopback tcp stream {net / MiB:,.0f} MiB/s, "
             f"in-process ISA-L decode {raw / MiB:,.0f} MiB/s. A decode rebuild moves 4 fragments over the network per "
             f"fragment written. Times include meta's map change and the workers' poll (0.1 s). 2-core machine "
             f"shared by 9 daemons. Decode rebuild time per phase, summed over fragments (overlapping): fetch "
             f"{ph['fetch']:.2f} s, decode {ph['decode']:.2f} s, write {ph['write']:.2f} s. During the decode "
             f"rebuild the cluster's processes used {cpu_s:.2f} CPU s ({cpu_s / dec[2]:.2f} cores on average, "
             f"{cpu_s * 1e3 / max(dec[1] / MiB, 1):.1f} ms per rebuilt MiB) while the machine's CPUs were "
             f"{busy * 100:.0f}% busy. Machine: {load}.")
    return {"name": "repair", "rows": rows, "notes": notes}


if __name__ == "__main__":
    argv = sys.argv[1:]
    mib = int(argv[argv.index("--mib") + 1]) if "--mib" in argv else 0
    res = run("--quick" in argv, mib)
    for row in res["rows"]:
        ratio = f"  ({row['ratio']:.2f}x {row['baseline_name']})" if row["ratio"] is not None else ""
        print(f"{row['case']:44s} {row['value']:10.1f} {row['unit']}{ratio}")
    print(res["notes"])
