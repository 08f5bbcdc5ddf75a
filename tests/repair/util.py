"""Helpers for the failure-handling tests: a real local cluster (one meta
replica, N storage daemons; processes on loopback) tuned so that failure
detection and replacement take seconds, plus waits on the cluster map and
access to fragment files on disk."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tierfs.client import AsyncClient
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

if TYPE_CHECKING:
    from tierfs.net import DataClient

__all__ = [
    "META_FAST",
    "STORAGE_FAST",
    "HeldReaders",
    "digest",
    "fragments",
    "generations",
    "grant_all",
    "held_readers",
    "map_now",
    "random_bytes",
    "start",
    "wait_map",
    "write_files",
]

#: Heartbeats missed for 1.5 s: offline; down for 2 s: replaced. No
#: rebalancing: these tests count the fragments repair alone moves (the
#: rebalancer's tests turn it on: tests/scale/).
META_FAST = ("--heartbeat-timeout=1.5", "--replace-after=2", "--tick-interval=0.2", "--rebalance=false")
#: Fast heartbeats, GC, rebuild and repair-queue polls; no background scrub
#: (tests scrub on demand); orphans deletable at once.
STORAGE_FAST = ("--heartbeat-interval=0.2", "--gc-interval=0.3", "--rebuild-interval=0.3", "--repair-interval=0.3",
                "--scrub-rate=0", "--orphan-grace=0")
KiB = 1024
#: Replaced fragments are listed for deletion after this long (tierfs-meta
#: --gc-grace; its default is 300 s).
GC_GRACE = 0.5


def start(path: Path, n_storage: int = 7, meta_args: tuple[str, ...] = META_FAST,
          storage_args: tuple[str, ...] = (), gc_grace: float = GC_GRACE) -> LocalCluster:
    cl = LocalCluster(path, n_meta=1, n_storage=n_storage, extra_meta_args=list(meta_args), gc_grace=gc_grace,
                      extra_storage_args=[*STORAGE_FAST, *storage_args])
    cl.up(timeout=90)
    return cl


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def digest(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


async def write_files(client: AsyncClient, n: int = 4, size: int = 700 * KiB) -> dict[str, bytes]:
    """``n`` files of ``size`` bytes in 128 KiB chunks under /d (several chunks
    per file, so every file touches several groups)."""
    await client.mkdir("/d", exist_ok=True)
    await client.set_layout("/d", chunk_size=128 * KiB, redundancy="ec:4+2")
    files = {f"/d/f{i}": random_bytes(size + i * 1000, i) for i in range(n)}
    for path, data in files.items():
        await client.write_bytes(path, data)
    return files


def fragments(cl: LocalCluster, node: str | None = None) -> list[Path]:
    """Fragment files on disk (of one storage daemon, or all)."""
    pattern = f"{node or 'storage-*'}/t*/frags/*/*/*"
    return sorted(p for p in cl.dir.glob(pattern) if p.is_file())


async def generations(cl: LocalCluster, path: str) -> dict[int, int]:
    """The committed generation of each chunk of ``path`` (chunk -> generation)."""
    async with MetaClient(cl.meta_addrs, deadline=10) as mc:
        return {r.index: r.generation for r in (await mc.stat(path)).chunks}


async def map_now(cl: LocalCluster) -> pb.ClusterMap:
    async with MetaClient(cl.meta_addrs, deadline=10) as mc:
        return await mc.get_cluster_map()


async def wait_map(cl: LocalCluster, cond: Callable[[pb.ClusterMap], bool], timeout: float, what: str,
                   each: Callable[[pb.ClusterMap], None] | None = None) -> pb.ClusterMap:
    """Poll the cluster map until ``cond`` holds (``each`` sees every map)."""
    end = time.monotonic() + timeout
    async with MetaClient(cl.meta_addrs, deadline=10) as mc:
        while True:
            cmap = await mc.get_cluster_map()
            if each is not None:
                each(cmap)
            if cond(cmap):
                return cmap
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; map: {cmap}")
            await asyncio.sleep(0.2)


def grant_all(dc: DataClient, cl: LocalCluster, rotation: float = 3600.0) -> DataClient:
    """Give a test's raw data client a node capability (read + write, every
    inode) minted from the cluster secret, as a storage daemon mints its own
    (``rotation``: meta's ``cap_key_rotation``). Tests use it to plant or
    inspect fragments behind the EC client's back."""
    from tierfs import capability as capmod
    from tierfs.meta.secret import load_secret

    now = int(time.time() * 1000)
    epoch = capmod.epoch_at(now, rotation)
    cap = capmod.mint(capmod.epoch_key(load_secret(cl.secret_file), epoch), kind=capmod.KIND_NODE,
                      ops=capmod.OP_READ | capmod.OP_WRITE, epoch=epoch, scope=0, principal=0,
                      expiry_ms=now + 600_000)
    dc.caps.add(capmod.encode(cap))
    return dc


class HeldReaders:
    """Two files, each with a handle open that has read a byte: then the
    first is overwritten and the second removed (:meth:`replace`), so their
    generations wait for GC while the handles still read them."""

    def __init__(self, c: AsyncClient, old: dict[str, bytes], new: bytes, handles: list[Any]) -> None:
        self.c, self.old, self.new, self.handles = c, old, new, handles
        (self.overwritten, self.removed) = old

    async def replace(self) -> None:
        await self.c.write_bytes(self.overwritten, self.new)
        await self.c.rm(self.removed)

    async def check(self) -> None:
        """Each handle reads whole the bytes it opened; a fresh read of the
        overwritten file, the new ones."""
        ha, hb = self.handles
        # Removed: its generations are the only bytes there are.
        assert digest(await hb.read()) == digest(self.old[self.removed])
        # Overwritten: without its old generation the handle would read the
        # new one (a re-read after GenerationGoneError), as if the overwrite
        # had been seen; its view is still there.
        assert digest(await ha.read()) == digest(self.old[self.overwritten])
        assert digest(await self.c.read_bytes(self.overwritten)) == digest(self.new)


@contextlib.asynccontextmanager
async def held_readers(c: AsyncClient, old: dict[str, bytes], new: bytes) -> AsyncIterator[HeldReaders]:
    """Write the two files of ``old`` and open a handle on each
    (:class:`HeldReaders`); the handles are closed on exit."""
    for path, data in old.items():
        await c.write_bytes(path, data)
    handles = [await c.open(path, "rb") for path in old]
    try:
        for h, data in zip(handles, old.values(), strict=True):
            assert await h.read(1) == data[:1]
            h.seek(0)
        yield HeldReaders(c, old, new, handles)
    finally:
        for h in handles:
            await h.close()
