"""A power cut under a whole local cluster: every daemon (3 meta, 6 storage)
keeps its data under one LazyFS mount, which drops every change that was not
fsynced at one instant, while four writers create, overwrite, rename and
delete files (``ec:4+2`` and ``replica:3``) and put, overwrite and delete KV
objects. The daemons go on for a second on the dead disk, then are killed;
the mount comes back (the reboot) and the same cluster is started again.

What it proves, against the operations acknowledged before the daemons were
killed: every acknowledged file reads back as its last acknowledged
contents, an acknowledged delete or rename stays done, a file whose write
was in flight is absent, empty or one of the versions written (never other
bytes), and a KV get after the reboot is a miss or the last value put, never
a deleted or overwritten one. Before stop 42 the cluster's own directory was
created without an fsync of its parent, so the cut took the whole cluster,
acknowledged files and all (``tierfs up``'s plan too).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.faults import LazyFS
from tierfs.client import AsyncClient
from tierfs.errors import NotFoundError, TierFSError
from tierfs.fsutil import BOOT_ID_ENV, boot_id
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient

pytestmark = pytest.mark.skipif(not LazyFS.available(), reason="needs /dev/fuse and fusermount3")

SIZES = (0, 1, 4096, 100_000, 1 << 20, 3 << 20, (9 << 20) + 17)
GONE = "gone"


def _content(tag: str, size: int) -> bytes:
    return random.Random(tag).randbytes(size)


class _Model:
    """What was acknowledged, and what may have happened (calls in flight)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, int]] = {}  # path -> (tag, size) acknowledged
        self.maybe: dict[str, list[Any]] = {}  # path -> versions (or GONE) of calls not acknowledged
        self.kv: dict[str, str | None] = {}  # key -> tag acknowledged (None: deleted)
        self.kv_maybe: dict[str, list[str | None]] = {}
        self.ops = 0  # file operations acknowledged (the cut waits for some)
        self.moves = ""  # the rebalancer's progress just before the cut

    def snapshot(self) -> _Model:
        m = _Model()
        m.files, m.kv = dict(self.files), dict(self.kv)
        m.maybe = {k: list(v) for k, v in self.maybe.items()}
        m.kv_maybe = {k: list(v) for k, v in self.kv_maybe.items()}
        m.ops, m.moves = self.ops, self.moves
        return m


async def _file_worker(c: AsyncClient, w: int, m: _Model, rng: random.Random) -> None:
    i = 0
    while True:
        i += 1
        mine = [p for p in m.files if p.rsplit("/", 1)[1].startswith(f"w{w}-")]
        r = rng.random()
        try:
            if r < 0.75 or not mine:  # a new file, or an overwrite of one of ours
                new = r < 0.55 or not mine
                path = f"{rng.choice(['/pl', '/pl/r3'])}/w{w}-{i}" if new else rng.choice(mine)
                v = (f"{path}#{i}", rng.choice(SIZES))
                m.maybe.setdefault(path, []).append(v)
                await c.write_bytes(path, _content(*v))
                m.files[path] = v
                m.maybe.pop(path)
            elif r < 0.88:
                path = rng.choice(mine)
                m.maybe.setdefault(path, []).append(GONE)
                await c.rm(path)
                del m.files[path]
                m.maybe.pop(path)
            else:
                src = rng.choice(mine)
                dst = f"/pl/w{w}-{i}-mv"
                v = m.files[src]
                m.maybe.setdefault(src, []).append(GONE)
                m.maybe.setdefault(dst, []).append(v)
                await c.rename(src, dst)
                del m.files[src]
                m.files[dst] = v
                m.maybe.pop(src)
                m.maybe.pop(dst)
            m.ops += 1
        except TierFSError:
            return


async def _kv_worker(c: AsyncClient, m: _Model, rng: random.Random) -> None:
    kv = c.kv_pool("plkv")
    i = 0
    while True:
        i += 1
        key = f"kv-{rng.randrange(24)}"
        try:
            if rng.random() < 0.8:
                tag = f"{key}#{i}"
                m.kv_maybe.setdefault(key, []).append(tag)
                if not await kv.put(key, _content(tag, 50_000), overwrite=True):
                    raise AssertionError(f"put of {key} with overwrite=True not stored")
                m.kv[key] = tag
            else:
                m.kv_maybe.setdefault(key, []).append(None)
                await kv.delete(key)
                m.kv[key] = None
            m.kv_maybe.pop(key, None)
        except TierFSError:
            return


async def _check(meta: list[str], m: _Model) -> list[str]:
    bad: list[str] = []
    async with AsyncClient(meta, request_timeout=10.0, kv_timeout=10.0) as c:
        listed = {f"/pl/{n}" for n in await c.ls("/pl")} | {f"/pl/r3/{n}" for n in await c.ls("/pl/r3")}
        listed.discard("/pl/r3")
        for path in sorted(set(m.files) | set(m.maybe) | listed):
            allowed: list[Any] = [m.files[path]] if path in m.files else ([] if path in m.maybe else [GONE])
            allowed += m.maybe.get(path, [])
            try:
                await c.stat(path)  # absent from the namespace, or there
            except NotFoundError:
                got: bytes | None = None
            else:
                try:
                    got = await c.read_bytes(path)
                except TierFSError as exc:
                    bad.append(f"{path}: read failed: {exc!r} (allowed {allowed})")
                    continue
            versions = [v for v in allowed if v != GONE]
            if got is None:
                if path in m.files and GONE not in allowed:  # (an unlink or rename in flight may have)
                    bad.append(f"{path}: acknowledged {m.files[path]}, gone after the cut")
                continue
            if any(got == _content(*v) for v in versions):
                continue
            if path not in m.maybe and path in m.files:
                bad.append(f"{path}: {len(got)} bytes, not the acknowledged {m.files[path]}")
            elif not any(len(got) <= v[1] and got == _content(*v)[:len(got)] for v in versions):
                # a write in flight leaves the file empty or a prefix of what it wrote, never other bytes
                bad.append(f"{path}: {len(got)} bytes that no write made (allowed {allowed})")
        kv = c.kv_pool("plkv")
        for key in sorted(set(m.kv) | set(m.kv_maybe)):
            got = await kv.get(key)
            if got is None:
                continue  # a cache may lose objects
            tags = ([m.kv[key]] if key in m.kv else []) + m.kv_maybe.get(key, [])
            if not any(t is not None and got == _content(t, 50_000) for t in tags):
                bad.append(f"KV {key}: served a value it no longer had (allowed {tags})")
    return bad


def _up_quietly(cl: LocalCluster) -> None:
    """``up`` that the power may cut short (the daemons then die of the
    dead mount, and so may ``up``)."""
    with contextlib.suppress(Exception):
        cl.up(timeout=30)


async def _progress(meta: list[str], case: str) -> str:
    """The rebalancer's or the rebuild's progress just before the cut."""
    async with MetaClient(meta, deadline=3.0) as mc:
        if case == "while-rebalancing":
            st = await mc.rebalance_status()
            return f"moves done {st.moves_done}, in flight {st.moves_in_flight}, planned {st.moves_planned}"
        if case == "while-rebuilding":
            cmap = await mc.get_cluster_map()
            rebuilding = sum(1 for g in cmap.groups if len(g.rebuilding))
            return f"map version {cmap.version}, {rebuilding} of {len(cmap.groups)} groups rebuilding"
    return ""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["steady", "while-rebalancing", "while-rebuilding", "again-while-restarting"])
def test_a_power_cut_of_the_whole_cluster_keeps_every_acknowledged_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """``while-rebalancing``: two storage daemons join after 15 file
    operations, so groups move (fragments copied to the new members, the
    moves committed, the old copies dropped) while the writers go on and
    when the power goes. ``while-rebuilding``: one of seven storage daemons
    is SIGKILLed after 15 file operations; meta calls it offline after 1.5 s
    and replaces its targets 2 s later, and the survivors rebuild its
    fragments onto the replacements while the writers go on (degraded until
    then) and when the power goes. It comes back with the others after the
    reboot, its copies now orphans. ``again-while-restarting``: as
    ``steady``, then the power goes a second time while the cluster starts
    again after the first cut (meta replaying and truncating its journals,
    the KV stores finding the boot changed and dropping their pools without
    fsync, the storage daemons registering and scrubbing), at a moment drawn
    from the seed; after the second reboot every write acknowledged before
    the first cut must still be there."""
    seed = int(os.environ.get("TIERFS_POWERCUT_SEED", "4242"))
    rng = random.Random(seed)
    fs = LazyFS(tmp_path / "disk", tmp_path / "mnt")
    fs.mount()
    root = tmp_path / "mnt" / "cluster"
    cl: LocalCluster | None = None
    try:
        if case == "while-rebuilding":
            cl = LocalCluster(root, n_meta=3, n_storage=7,
                              extra_meta_args=["--heartbeat-timeout=1.5", "--replace-after=2", "--tick-interval=0.2"],
                              extra_storage_args=["--heartbeat-interval=0.2", "--rebuild-interval=0.3"])
        else:
            cl = LocalCluster(root, n_meta=3, n_storage=6)
        monkeypatch.setenv("TIERFS_TOKEN", cl.export_token())
        cl.up(timeout=120)
        meta = cl.meta_addrs

        async def before() -> _Model:
            m = _Model()
            async with MetaClient(meta) as mc:
                await mc.create_kv_pool("plkv", redundancy="replica:2", target_memory=0, target_disk=64 << 20)
            # Short timeouts: calls in flight at the cut then fail soon.
            async with AsyncClient(meta, request_timeout=2.0, kv_timeout=2.0, meta_deadline=3.0) as c:
                await c.mkdir("/pl")
                await c.mkdir("/pl/r3")
                await c.set_layout("/pl/r3", redundancy="replica:3")
                kv = c.kv_pool("plkv")
                for _ in range(100):  # the pool is served once every daemon has it in its map
                    with contextlib.suppress(TierFSError):
                        await kv.put("probe", b"x")
                        break
                    await asyncio.sleep(0.1)
                tasks = [asyncio.create_task(_file_worker(c, w, m, rng)) for w in range(4)]
                tasks.append(asyncio.create_task(_kv_worker(c, m, rng)))
                cut_at = 40 + rng.randrange(20)
                if case != "steady":
                    while m.ops < 15:
                        await asyncio.sleep(0.01)
                if case == "while-rebalancing":
                    await asyncio.to_thread(cl.grow, 8)
                    await asyncio.to_thread(cl.start)
                elif case == "while-rebuilding":
                    cl.kill("storage-0")
                    # the cut comes once its targets are replaced and rebuilding
                    for _ in range(300):
                        if " 0 of " not in await _progress(meta, case):
                            break
                        await asyncio.sleep(0.1)
                    await asyncio.sleep(rng.random())
                while m.ops < cut_at:
                    await asyncio.sleep(0.01)
                m.moves = await _progress(meta, case)
                fs.power_loss()  # the cut: nothing from here on persists
                # The daemons go on for a moment on the dead disk: whatever
                # they acknowledge now must be durable too (or refused).
                await asyncio.sleep(1.0)
                snap = m.snapshot()
                for p in cl.procs:
                    if p.alive():
                        os.kill(p.pid, signal.SIGKILL)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return snap

        m = asyncio.run(before())
        print(f"seed {seed}: {m.ops} file operations, {len(m.files)} files acknowledged at the cut, "
              f"calls in flight: {m.maybe}; {m.moves}")
        assert len(m.files) >= 5, f"{len(m.files)} acknowledged files at the cut: too few to prove anything"
        cl.stop(timeout=5)
        fs.mount()  # the reboot: only what was fsynced is there
        monkeypatch.setenv(BOOT_ID_ENV, boot_id() + "-after-the-cut")
        if case == "again-while-restarting":
            cl = LocalCluster.open(root)
            delay = rng.uniform(0.0, 3.0)
            starting = threading.Thread(target=_up_quietly, args=(cl,), daemon=True)
            starting.start()
            starting.join(delay)
            alive = sum(p.alive() for p in cl.procs)
            fs.power_loss()  # the second cut, while the cluster starts again
            print(f"second cut {delay:.2f} s into the restart, {alive} daemons running")
            starting.join(60)
            assert not starting.is_alive(), "tierfs up hung after the second cut"
            for p in cl.procs:
                if p.alive():
                    os.kill(p.pid, signal.SIGKILL)
            cl.stop(timeout=5)
            fs.mount()
            monkeypatch.setenv(BOOT_ID_ENV, boot_id() + "-after-the-second-cut")
        cl = LocalCluster.open(root)
        cl.up(timeout=120)
        bad = asyncio.run(_check(cl.meta_addrs, m))
        assert not bad, "\n".join(bad)
    finally:
        if cl is not None:
            cl.stop(timeout=10)
        if fs.mounted:
            fs.unmount()
