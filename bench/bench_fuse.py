"""The FUSE mount (``tierfs mount``) against the SDK, in the same run, on a
real local cluster (3 meta replicas, 6 storage daemons; ``ec:4+2``, 4 MiB
chunks).

Cases: sequential write of a 1 GiB file (quick: 64 MiB) in 1 MiB
``write(2)`` calls through the mount, ``dd``-style, including the
``close`` that commits it; and the sequential read of it in 1 MiB
``readinto`` calls through a fresh open (the mount opens files with
``keep_cache`` off, so the kernel's page cache is dropped at open and every
byte comes from the cluster). Baselines: the same write and read with the
same 1 MiB calls through the blocking SDK (``tierfs.client.Client``
``open``/``write``/``readinto``) in the benchmark process. Reads are best
of two (the machine is shared and noisy); the bytes read are checked
(outside the timing).

    python -m bench.bench_fuse [--quick]
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from tierfs.client import Client
from tierfs.fuse.mount import MountConfig
from tierfs.local import LocalCluster

MiB = 1 << 20
BLOCK = MiB
REPO = Path(__file__).resolve().parent.parent


def _mount_defaults() -> str:
    """The mount options this benchmark leaves at their defaults (MountConfig
    is a slotted dataclass: its class attributes are slot descriptors, not
    the defaults)."""
    d = MountConfig("", [])
    return f"attr timeout {d.attr_timeout:g} s, read-ahead {d.read_ahead_kib} KiB"


def _row(case: str, value: float, baseline: float, name: str) -> dict[str, Any]:
    return {"case": case, "value": round(value, 3), "unit": "GB/s", "baseline": round(baseline, 3),
            "baseline_name": name, "ratio": round(value / baseline, 3) if baseline else None}


def _tierfs(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "tierfs.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)


def _mount_write(path: Path, src: memoryview, size: int) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, size, BLOCK):
            os.write(fd, src[off % len(src): off % len(src) + BLOCK])
    finally:
        os.close(fd)  # the commit
    return size / (time.perf_counter() - t0) / 1e9


def _mount_read(path: Path, dest: memoryview, size: int) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < size:
            n = f.readinto(dest[got: got + BLOCK])
            if not n:
                break
            got += n
    dt = time.perf_counter() - t0
    assert got == size, (got, size)
    return size / dt / 1e9


def _sdk_write(c: Client, path: str, src: memoryview, size: int) -> float:
    t0 = time.perf_counter()
    with c.open(path, "wb") as f:
        for off in range(0, size, BLOCK):
            f.write(src[off % len(src): off % len(src) + BLOCK])
    return size / (time.perf_counter() - t0) / 1e9


def _sdk_read(c: Client, path: str, dest: memoryview, size: int) -> float:
    t0 = time.perf_counter()
    with c.open(path, "rb") as f:
        got = 0
        while got < size:
            n = f.readinto(dest[got: got + BLOCK])
            if not n:
                break
            got += n
    dt = time.perf_counter() - t0
    assert got == size, (got, size)
    return size / dt / 1e9


def _digest(src: memoryview, size: int) -> str:
    h = hashlib.sha256()
    for off in range(0, size, len(src)):
        h.update(src[: min(len(src), size - off)])
    return h.hexdigest()


def run(quick: bool) -> dict[str, Any]:
    size = (64 if quick else 1024) * MiB
    base = os.environ.get("TIERFS_BENCH_DIR")
    notes: list[str] = []
    block = np.random.default_rng(0).integers(0, 256, min(size, 64 * MiB), dtype=np.uint8)
    src = memoryview(block.data).cast("B")
    dest_arr = np.zeros(size, dtype=np.uint8)  # faulted in below, outside the timing
    dest = memoryview(dest_arr.data).cast("B")
    want = _digest(src, size)
    res: dict[str, list[float]] = {k: [] for k in ("mw", "mr", "sw", "sr")}
    with tempfile.TemporaryDirectory(prefix="bench-fuse-", dir=base) as tmp:
        cl = LocalCluster(Path(tmp) / "cluster", n_storage=6)
        cl.export_token()  # security on: this cluster's admin token
        mnt = Path(tmp) / "mnt"
        mnt.mkdir()
        mounted = False
        try:
            t0 = time.perf_counter()
            cl.start(timeout=120)
            uvloop.run(cl.wait_healthy(120))
            notes.append(f"cluster start {time.perf_counter() - t0:.1f} s")
            r = _tierfs("mount", str(mnt), "--meta", ",".join(cl.meta_addrs), "--log", str(Path(tmp) / "mount.log"))
            if r.returncode != 0:
                raise RuntimeError(f"tierfs mount failed: {r.stderr.strip()}")
            mounted = True
            with Client(cl.meta_addrs) as c:
                c.mkdir("/b", exist_ok=True)
                c.set_layout("/b", redundancy="ec:4+2", chunk_size=4 * MiB)
                for i in range(2):
                    res["sw"].append(_sdk_write(c, f"/b/sdk{i}", src, size))
                    res["mw"].append(_mount_write(mnt / "b" / f"fuse{i}", src, size))
                for i in range(2):
                    res["sr"].append(_sdk_read(c, "/b/sdk0", dest, size))
                    if i == 0:
                        assert hashlib.sha256(dest).hexdigest() == want, "SDK read back wrong bytes"
                    dest_arr[:] = 0
                    res["mr"].append(_mount_read(mnt / "b" / "fuse0", dest, size))
                    if i == 0:
                        assert hashlib.sha256(dest).hexdigest() == want, "mount read back wrong bytes"
                assert c.stat("/b/fuse1").size == size
        finally:
            if mounted:
                u = _tierfs("umount", str(mnt))
                if u.returncode != 0:
                    subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, timeout=60)
                    notes.append(f"umount failed: {u.stderr.strip()}")
            cl.stop()
    mw, sw, mr, sr = max(res["mw"]), max(res["sw"]), max(res["mr"]), max(res["sr"])
    rows = [
        _row("sequential write via the mount, 1 MiB write(2) + close", mw, sw, "SDK File.write, 1 MiB calls"),
        _row("sequential read via the mount, 1 MiB readinto, fresh open", mr, sr, "SDK File.readinto, 1 MiB calls"),
    ]
    notes.append(f"file {size // MiB} MiB in /b (ec:4+2, 4 MiB chunks), best of 2 each; 6 storage daemons, "
                 f"3 meta replicas, the mount daemon and this process on {os.cpu_count()} CPUs; "
                 f"mount defaults ({_mount_defaults()}); "
                 "writes include the commit at close")
    return {"name": "fuse", "rows": rows, "notes": "; ".join(notes)}


if __name__ == "__main__":
    import json

    print(json.dumps(run("--quick" in sys.argv), indent=2))
