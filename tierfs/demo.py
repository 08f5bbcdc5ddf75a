"""``make run``: start a local cluster and show TierFS doing its job.

Starts (or reuses) a local cluster under ``--data`` (3 meta replicas, 6
storage daemons), then: writes a checkpoint-like file (ec:4+2, 4 MiB chunks
striped over every placement group) with a progress bar; reads it back and
verifies it; SIGKILLs a storage daemon and reads it again (a degraded read:
the missing fragments are decoded from parity); SIGKILLs the meta leader and
measures the fail-over; restarts what it killed, prints the throughput and
the cluster's status, and LEAVES THE CLUSTER RUNNING for you to use
(``tierfs down --data DIR`` stops it; ``--stop`` stops it at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import xxhash

from tierfs.cli.util import human_size, parse_size_arg
from tierfs.errors import TierFSError
from tierfs.local import LocalCluster

BLOCK = 64 << 20  # per write()/read_into() call: 16 chunks in flight
CKPT = "/demo/checkpoint/rank-00.bin"


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e6


class _Bar:
    """A progress bar on a terminal; nothing otherwise (logs stay readable)."""

    def __init__(self, label: str, total: int) -> None:
        self._p: Any = None
        if sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TransferSpeedColumn,
            )

            self._p = Progress(TextColumn("    " + label), BarColumn(), DownloadColumn(binary_units=True),
                               TransferSpeedColumn(), transient=True)
            self._task = self._p.add_task(label, total=total)
            self._p.start()

    def update(self, done: int) -> None:
        if self._p is not None:
            self._p.update(self._task, completed=done)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


async def _write(client: Any, path: str, size: int, base: bytes) -> tuple[float, str]:
    """Write ``size`` bytes of checkpoint-like data; returns (seconds, xxh3 digest).
    Every 64 MiB block is ``base`` with its own header (block number), so
    no two chunks are alike and nothing is generated on the timed path."""
    h = xxhash.xxh3_128()
    block = bytearray(base)
    view = memoryview(block)
    bar = _Bar("writing", size)
    t0 = time.perf_counter()
    try:
        async with await client.open(path, "wb") as f:
            done = 0
            while done < size:
                n = min(BLOCK, size - done)
                block[:16] = f"tensor-{done // BLOCK:09d}".encode()
                h.update(view[:n])
                await f.write(view[:n])
                done += n
                bar.update(done)
    finally:
        bar.close()
        view.release()
    return time.perf_counter() - t0, h.hexdigest()


async def _read(client: Any, path: str, size: int, label: str) -> tuple[float, str]:
    """Read ``path`` back block by block into one reused buffer; hashing is
    not timed."""
    h = xxhash.xxh3_128()
    buf = bytearray(min(BLOCK, size))
    view = memoryview(buf)
    bar = _Bar(label, size)
    spent = 0.0
    try:
        done = 0
        while done < size:
            t0 = time.perf_counter()
            n = await client.read_into(path, view, done)
            spent += time.perf_counter() - t0
            if n <= 0:
                break
            h.update(view[:n])
            done += n
            bar.update(done)
    finally:
        bar.close()
        view.release()
    return spent, h.hexdigest()


async def _leader(cl: LocalCluster) -> str:
    h = await cl.health()
    for m in h["meta"]:
        if m["role"] == "leader":
            return str(m["name"])
    raise TierFSError("no meta leader")


async def _wait_usage_reported(mc: Any, timeout: float = 10.0) -> bool:
    """Until the meta leader has heard every online node's usage since it
    took over (a new leader's map marks the committed figures it has not
    been told, up to meta's usage_interval old)."""
    from tierfs.proto.v1 import meta_pb2 as pb

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(TierFSError):
            cmap = await mc.get_cluster_map()
            online = {n.node_id for n in cmap.nodes if n.state == pb.NODE_STATE_ONLINE}
            if not any(t.used_unreported for t in cmap.targets if t.node_id in online):
                return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)


async def _wait_digests_equal(cl: LocalCluster, mc: Any, timeout: float = 20.0) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout
    while True:
        digests = []
        for m in cl.meta_addrs:
            try:
                digests.append((await mc.digest(addr=m)).digest)
            except TierFSError:
                digests.append("?")
        if len(set(digests)) == 1 or time.monotonic() > deadline:
            return len(set(digests)) == 1, digests[0]
        await asyncio.sleep(0.1)


async def demo(cl: LocalCluster, size: int, step: Callable[[str], None]) -> dict[str, float]:
    from tierfs.cli.cluster import cluster_status
    from tierfs.cli.main import render_status
    from tierfs.client import AsyncClient

    figures: dict[str, float] = {}
    await cl.wait_healthy(60)
    async with AsyncClient(cl.meta_addrs) as client:
        await client.mkdir("/demo/checkpoint", parents=True, exist_ok=True)
        await client.set_layout("/demo", redundancy="ec:4+2", chunk_size=4 << 20)

        step(f"Write a {human_size(size)} checkpoint shard to {CKPT}")
        base = os.urandom(min(BLOCK, size))
        wdt, wsum = await _write(client, CKPT, size, base)
        figures["write MB/s"] = _mbps(size, wdt)
        st = await client.stat(CKPT)
        info = await client.meta.stat(CKPT)
        groups = len(info.layout.groups)
        _say(f"    {human_size(size)} in {wdt:.2f} s: {_mbps(size, wdt):,.0f} MB/s "
             f"(ec:4+2: each 4 MiB chunk -> 4 data + 2 parity fragments on 6 nodes, fsynced; "
             f"{size // st.chunk_size} chunks striped over {groups} placement groups)")

        step("Read it back and verify")
        rdt, rsum = await _read(client, CKPT, size, "reading")
        figures["read MB/s"] = _mbps(size, rdt)
        _say(f"    {human_size(size)} in {rdt:.2f} s: {_mbps(size, rdt):,.0f} MB/s; "
             f"checksum {'identical' if rsum == wsum else 'MISMATCH'} (xxh3-128 {rsum[:16]})")

        victim = "storage-2"
        step(f"SIGKILL {victim} and read again (degraded: lost fragments decoded from parity)")
        pid = cl.kill(victim)
        _say(f"    killed {victim} (pid {pid}); one fragment of every chunk in its groups is gone")
        ddt, dsum = await _read(client, CKPT, size, "degraded read")
        figures["degraded read MB/s"] = _mbps(size, ddt)
        _say(f"    {human_size(size)} in {ddt:.2f} s: {_mbps(size, ddt):,.0f} MB/s; "
             f"checksum {'identical' if dsum == wsum else 'MISMATCH'}")
        t0 = time.perf_counter()
        cl.start(names=[victim])
        await cl.wait_healthy(60)
        _say(f"    restarted {victim}; cluster healthy again after {time.perf_counter() - t0:.1f} s")

        step("SIGKILL the meta leader")
        meta = client.meta
        old = await _leader(cl)
        cl.kill(old)
        t0 = time.perf_counter()
        await client.mkdir(f"/demo/after-failover-{int(time.time() * 1000)}")
        failover = time.perf_counter() - t0
        figures["meta failover s"] = failover
        again = await client.stat(CKPT)
        _say(f"    killed {old}; the next metadata write succeeded after {failover:.2f} s "
             f"(new leader: {await _leader(cl)})")
        _say(f"    {CKPT} after fail-over: {again.size:,} bytes "
             f"({'as written' if again.size == size and again.inode == st.inode else 'CHANGED'})")
        cl.start(names=[old])
        same, digest = await _wait_digests_equal(cl, meta)
        _say(f"    restarted {old}; replica state digests {'identical' if same else 'DIFFER'}: {digest[:16]}")
        await cl.wait_healthy(60)
        await _wait_usage_reported(meta)  # else status shows the committed used figures, marked '*'

        step("Cluster status (`tierfs status`)")
        status = await cluster_status(cl.meta_addrs, data_dir=str(cl.dir))
        _say("\n".join(("    " + ln) if ln else "" for ln in render_status(status).splitlines()))
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tierfs.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="./.tierfs", help="cluster directory (default ./.tierfs)")
    ap.add_argument("--size", type=parse_size_arg, default=512 << 20,
                    help="checkpoint size (default 512MiB)")
    ap.add_argument("--stop", action="store_true", help="stop the cluster at the end")
    ns = ap.parse_args(argv)
    if ns.size < 1:
        ap.error("--size must be positive")
    cl = LocalCluster(ns.data)
    n = [0]
    total = 6

    def step(title: str) -> None:
        n[0] += 1
        _say(f"\n[{n[0]}/{total}] {title}")

    _say(f"[1/{total}] A local cluster in {cl.dir} (3 meta replicas, 6 storage daemons)")
    n[0] = 1
    t0 = time.perf_counter()
    rc = 0
    try:
        started = cl.start()
        _say(f"    {'started ' + str(len(started)) + ' daemons' if started else 'reusing the running cluster'} "
             f"in {time.perf_counter() - t0:.1f} s")
        import uvloop

        from tierfs.meta.auth import default_token

        with default_token(cl.admin_token()):  # the cluster's own credential, whatever --data is
            figures = uvloop.run(demo(cl, ns.size, step))
        _say("\nThroughput on this machine (client and all 9 daemons share its CPUs):")
        for k, v in figures.items():
            _say(f"    {k:<20} {v:>8,.2f}" if k.endswith(" s") else f"    {k:<20} {v:>8,.0f}")
    except TierFSError as exc:
        _say(f"\ndemo failed: {type(exc).__name__}: {exc}")
        rc = 1
    data = ns.data
    from tierfs.cli.cluster import exports

    exported = exports(cl).replace("\n", "\n    ")
    hint = ("\n(From this directory the CLI also finds ./.tierfs/cluster.toml without the export.)"
            if os.path.abspath(ns.data) == os.path.abspath("./.tierfs") else "")
    if ns.stop:
        cl.stop()
        _say(f"\nStopped the cluster; its data stays in {cl.dir} (the next run reuses it).")
    else:
        _say(f"""
The cluster keeps running. Use it:
    {exported}
    .venv/bin/tierfs ls -l /demo/checkpoint
    .venv/bin/tierfs put ./some-file /demo/      # and get, cat, stat, mkdir, rm, mv
    .venv/bin/tierfs status{hint}
Stop it (data is kept; `make run` or `tierfs up --data {data}` starts it again):
    .venv/bin/tierfs down --data {data}""")
    return rc


if __name__ == "__main__":
    sys.exit(main())
