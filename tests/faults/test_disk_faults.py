"""Disk faults under a running cluster: bit flips in stored fragments,
fragments truncated or deleted behind the daemon's back, and a target on
a small, really full file system (tmpfs).

What they prove: the CRC32C on every fragment turns damage into an error
the client decodes around, so reads return exact bytes while at most M
fragments of a chunk are bad; a scrub (tierfs scrub) then finds and rebuilds
every damaged fragment, so the cluster is back to full redundancy; a full
target turns READ_ONLY: writes go on degraded around it, it keeps serving
reads, and takes writes again once space is freed.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import FaultCluster, Ledger, MiB, fragment_files, random_bytes
from tierfs.cli.main import run
from tierfs.client import Client
from tierfs.errors import TierFSError
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient


@pytest.fixture(scope="module")
def fc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    c = FaultCluster(tmp_path_factory.mktemp("disk"))
    yield c
    c.close()


def _frags_of(cl: LocalCluster, client: Client, path: str) -> dict[tuple[int, int], list[Path]]:
    """(chunk, fragment index) -> fragment files of ``path``, all nodes."""
    ino = client.stat(path).inode
    out: dict[tuple[int, int], list[Path]] = {}
    for f in fragment_files(cl):
        if f.parent.name == f"{ino:016x}":
            chunk, frag, _ver = (int(x, 16) for x in f.name.split("."))
            out.setdefault((chunk, frag), []).append(f)
    return out


def _scrub(fc: FaultCluster) -> dict[str, Any]:
    out = io.StringIO()
    code = run(["scrub", "--json", "--meta", ",".join(fc.meta_addrs)], stdout=out, stderr=io.StringIO())
    doc: dict[str, Any] = json.loads(out.getvalue())
    assert code == 0, doc
    return doc


def _flip(path: Path, rng: random.Random) -> bool:
    """Flip one bit in the first 64 payload bytes (past the 4 KiB header):
    the payload is zero padded to 4 KiB and a flip in the padding of a short
    fragment would not touch data at all. False if it has no payload."""
    if path.stat().st_size < 4096 + 4096:
        return False
    pos = 4096 + rng.randrange(64)
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["bitflip", "truncate", "delete", "bitflip_header"])
def test_damaged_fragments_are_read_around(fc: FaultCluster, damage: str) -> None:
    rng = random.Random(damage)
    ledger = Ledger()
    with fc.client(request_timeout=2.0) as client:
        d = f"/disk-{damage}"
        client.mkdir(d)
        client.set_layout(d, chunk_size=MiB)
        for i in range(3):
            assert ledger.write(client, f"{d}/f{i}", random_bytes(5 * MiB + 1000 * i, seed=i))
        damaged = 0
        originals: dict[Path, bytes] = {}
        for path in sorted(ledger.acked):
            frags = _frags_of(fc.cl, client, path)
            assert frags, path
            chunks = sorted({c for c, _ in frags})
            for c in chunks:
                # two of six fragments per chunk (M = 2): one data, one random other
                for j in (rng.randrange(4), rng.choice([4, 5])):
                    for f in frags.get((c, j), []):
                        originals[f] = f.read_bytes()
                        if damage == "bitflip":
                            if not _flip(f, rng):
                                del originals[f]
                                continue
                        elif damage == "bitflip_header":
                            with open(f, "r+b") as fh:
                                fh.seek(rng.randrange(8, 64))
                                fh.write(b"\xff")
                        elif damage == "truncate":
                            # into the header or the first payload bytes: a cut
                            # inside the zero padding would lose no data
                            os.truncate(f, rng.randrange(min(f.stat().st_size, 4096 + 64)))
                        else:
                            f.unlink()
                        damaged += 1
        assert damaged >= 2 * 5 * 3 - 3  # a short last chunk may leave a fragment empty
        for _ in range(2):  # second pass: the client may have marked targets failed
            ledger.verify(client)
            for path, data in ledger.acked.items():
                with client.open(path, "rb") as fh:
                    fh.seek(MiB + 77)
                    assert fh.read(2 * MiB) == data[MiB + 77: 3 * MiB + 77], path
        # The damage is on disk, not in the processes: every node stays up and online.
        h = asyncio.run(fc.cl.wait_healthy(30))
        assert all(s["state"] == "online" for s in h["storage"])
        # Back to fully healthy: the scrubber finds every damaged fragment and
        # rebuilds it (docs/repair.md) - those the reads above found within a
        # second in the background (the engine's suspects), the rest in this
        # pass; a second pass is clean; the bytes still read back.
        rep = _scrub(fc)
        t = rep["total"]
        assert t["errors"] == 0, t
        assert len(originals) == damaged
        for f, good in originals.items():
            assert f.exists() and f.read_bytes() == good, f"{f} not restored by the scrub ({t})"
        again = _scrub(fc)
        assert again["clean"], again["total"]
        ledger.verify(client)
        # And a third damaged fragment in a chunk is an error, never wrong bytes.
        path = f"{d}/f0"
        frags = _frags_of(fc.cl, client, path)
        for j in range(6):
            for f in frags.get((0, j), []):
                if f.exists():
                    f.unlink()
        with pytest.raises(TierFSError):
            client.read_bytes(path)
        ledger.acked.pop(path)
        ledger.verify(client)
        # A lost file is removed, and GC clears its fragments: the cluster is clean again.
        ino = client.stat(path).inode
        assert ledger.rm(client, path)
        deadline = time.monotonic() + 30
        while any(f.parent.name == f"{ino:016x}" for f in fragment_files(fc.cl)):
            assert time.monotonic() < deadline, "GC left fragments of a removed file"
            time.sleep(0.2)
        assert _scrub(fc)["clean"]


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.mark.timeout(150)
def test_full_disk_target(tmp_path: Path) -> None:
    """storage-5's only target is a 40 MiB tmpfs: once it is full, writes
    go on degraded around it (it reports READ_ONLY; docs/storage.md), reads
    keep working, and after deleting files (GC frees the fragments) it is
    ONLINE again and writes store every fragment again. (The remount case,
    with the repair of the skipped positions, is tests/faults/test_full_target.py.)"""
    if not _can_mount():
        pytest.skip("needs root and mount(8) to create a small tmpfs target")
    root = tmp_path / "cl"
    mnt = root / "storage-5" / "t0"
    mnt.mkdir(parents=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {res.stderr.strip()}")
    try:
        fc = FaultCluster(root, extra_storage_args=["--reserved-bytes=1MiB", "--min-free=2MiB", "--gc-interval=0.5",
                                                    "--heartbeat-interval=0.5"])
        try:
            _full_disk(fc)
        finally:
            fc.close()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


async def _target_state(meta: list[str], addr: str) -> int:
    async with MetaClient(meta, deadline=10.0) as mc:
        cmap = await mc.get_cluster_map()
    node = next(n for n in cmap.nodes if n.data_addr == addr)
    return next(t.state for t in cmap.targets if t.target_id == node.target_ids[0])


def _full_disk(fc: FaultCluster) -> None:
    from tierfs.proto.v1 import meta_pb2 as pb

    ledger = Ledger()
    addr = fc.cl.proc("storage-5").addr
    with fc.client(request_timeout=3.0, retries=2) as client:
        client.mkdir("/full")
        client.set_layout("/full", chunk_size=MiB)
        n = 0
        for i in range(60):  # 4 MiB files: 1 MiB per target each; the tmpfs holds < 40
            assert ledger.write(client, f"/full/f{i}", random_bytes(4 * MiB, seed=i)), ledger.errors
            n += 1
            if client.aclient.degraded_writes >= 8:
                break  # full for a while: the writes went on around it
        print(f"\nfull after {n} files: {client.aclient.degraded_writes} chunks written degraded")
        assert client.aclient.degraded_writes >= 8, "the 40 MiB target never filled up"
        # The daemon reports it at once (a heartbeat out of turn), but meta
        # hears it asynchronously: seen ONLINE still once in a loaded
        # `make test` (stop 42), so wait for it.
        deadline = time.monotonic() + 15
        while (state := asyncio.run(_target_state(fc.meta_addrs, addr))) != pb.TARGET_STATE_READ_ONLY:
            assert time.monotonic() < deadline, f"meta shows the full target in state {state}, not READ_ONLY"
            time.sleep(0.2)
        ledger.verify(client)  # reads still served from the full target
        # Free space: delete most files, wait for GC, then the target is
        # writable again and a write stores all six fragments.
        for path in sorted(ledger.acked)[:-3]:
            assert ledger.rm(client, path)
        deadline = time.monotonic() + 60
        while asyncio.run(_target_state(fc.meta_addrs, addr)) != pb.TARGET_STATE_ONLINE:
            assert time.monotonic() < deadline, "the target did not come back ONLINE after the deletes"
            time.sleep(0.3)
        before = client.aclient.degraded_writes
        # The client's map refreshes within its max_age: until then it may still skip the target.
        deadline = time.monotonic() + 30
        while True:
            assert ledger.write(client, "/full/after", random_bytes(4 * MiB, seed=1234)), ledger.errors
            if client.aclient.degraded_writes == before:
                break
            before = client.aclient.degraded_writes
            assert time.monotonic() < deadline, "writes still skip the target after it came back"
            time.sleep(0.5)
        ledger.verify(client)
    asyncio.run(fc.cl.wait_healthy(30))
