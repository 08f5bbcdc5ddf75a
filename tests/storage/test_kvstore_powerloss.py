"""A power cut under the per-target KV store (LazyFS drops every unsynced
change): an acknowledged overwrite or delete is never undone by the files
the cut leaves behind. docs/storage_kv.md, "After a power cut"."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.faults import LazyFS
from tests.storage.test_kvstore import disk_pool, get, pattern, put
from tierfs.buffers import BufferPool
from tierfs.fsutil import boot_id
from tierfs.storage.kvstore import KVStore

KiB = 1 << 10

pytestmark = pytest.mark.skipif(not LazyFS.available(), reason="needs /dev/fuse and fusermount3")


async def _open(root: Path, fsync: bool) -> tuple[KVStore, BufferPool]:
    pool = BufferPool(16 << 20)
    store = KVStore(root, target_id=1, pool=pool, sweep_interval=0)
    await store.open()
    store.configure([disk_pool(2, memory=0, disk=4 << 20, fsync=fsync)])
    return store, pool


async def _close(store: KVStore, pool: BufferPool) -> None:
    await store.close()
    pool.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fsync", [False, True], ids=["no-fsync", "fsync"])
def test_a_power_cut_does_not_undo_an_acknowledged_overwrite_or_delete(
        lazy: LazyFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool) -> None:
    root = tmp_path / "mnt" / "target"
    keys = [b"blk-%d" % i for i in range(12)]

    async def first_run() -> None:
        store, pool = await _open(root, fsync)
        for k in keys:
            assert await put(store, 2, k, pattern(k, 20 * KiB, 1))
        await _close(store, pool)
    asyncio.run(first_run())

    # Everything so far reaches the disk (as write-back would after a while).
    lazy.unmount()
    lazy.mount()

    async def second_run() -> None:
        store, pool = await _open(root, fsync)
        for k in keys[:6]:  # acknowledged overwrites
            assert await put(store, 2, k, pattern(k, 20 * KiB, 2), overwrite=True)
        for k in keys[6:]:  # acknowledged deletes
            assert await store.delete(2, k)
        for k in keys[:6]:
            assert await get(store, 2, k) == pattern(k, 20 * KiB, 2)
        lazy.power_loss()  # the daemon dies with its disk
        await _close(store, pool)  # (writes nothing now: the disk is gone)
    asyncio.run(second_run())

    lazy.mount()
    # The machine rebooted: a new boot id.
    monkeypatch.setenv("TIERFS_BOOT_ID", boot_id() + "-after-the-cut")

    async def restart_before_the_map() -> None:
        # A daemon that stops again before it learns its pools does not
        # forget that they may hold undone changes.
        pool = BufferPool(16 << 20)
        store = KVStore(root, target_id=1, pool=pool, sweep_interval=0)
        await store.open()
        assert store.after_power_cut
        await _close(store, pool)
    asyncio.run(restart_before_the_map())

    async def after() -> tuple[list[bytes | None], bool]:
        store, pool = await _open(root, fsync)
        try:
            return [await get(store, 2, k) for k in keys], store.after_power_cut
        finally:
            await _close(store, pool)
    got, noticed = asyncio.run(after())
    assert noticed
    for k, g in zip(keys[:6], got[:6], strict=True):
        # the new value, or a miss (a cache may lose it): never the one it replaced
        assert g is None or g == pattern(k, 20 * KiB, 2), f"{k!r}: the overwritten value came back"
    for k, g in zip(keys[6:], got[6:], strict=True):
        assert g is None, f"{k!r}: deleted, but served again after the power cut"
    if fsync:
        # an fsynced pool keeps what it acknowledged
        assert got[:6] == [pattern(k, 20 * KiB, 2) for k in keys[:6]]
    else:
        # one that does not cannot tell a current file from an undone one
        assert got == [None] * len(keys)


@pytest.mark.timeout(60)
def test_a_store_that_died_without_a_reboot_keeps_its_objects(lazy: LazyFS, tmp_path: Path) -> None:
    """A daemon killed (same boot: the page cache kept every change) finds
    its objects at restart; only a reboot after an unclean end drops them."""
    root = tmp_path / "mnt" / "target"
    keys = [b"blk-%d" % i for i in range(6)]

    async def run() -> None:
        store, pool = await _open(root, False)
        for k in keys:
            assert await put(store, 2, k, pattern(k, 20 * KiB, 1))
        assert await store.delete(2, keys[0])
        # no close: the process dies here
        again, pool2 = await _open(root, False)
        assert not again.after_power_cut
        assert [await get(again, 2, k) for k in keys] == [None] + [pattern(k, 20 * KiB, 1) for k in keys[1:]]
        await _close(again, pool2)
        await _close(store, pool)
        # closed cleanly: the mark of an open store is gone
        assert not (root / "kv" / ".running").exists()
    asyncio.run(run())
