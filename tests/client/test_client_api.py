"""The two faces of the client: ``AsyncClient`` used from asyncio, and the
blocking ``Client`` (its background loop, re-created in a forked child)."""

from __future__ import annotations

import asyncio
import os

import pytest
import uvloop

import tierfs
from tierfs.client import AsyncClient, Client
from tierfs.local import LocalCluster

pytestmark = pytest.mark.timeout(60)


def test_public_surface() -> None:
    assert tierfs.Client is Client and tierfs.AsyncClient is AsyncClient
    assert {"Client", "AsyncClient"} <= set(tierfs.__all__)


def test_async_client(cluster: LocalCluster) -> None:
    async def main() -> None:
        async with AsyncClient(cluster.meta_addrs) as c:
            await c.mkdir("/async")
            async with await c.open("/async/f", "wb") as f:
                await f.write(b"a" * 1000)
                await f.write(memoryview(b"b" * 10))
            assert (await c.stat("/async/f")).size == 1010
            async with await c.open("/async/f", "rb") as f:
                f.seek(995)
                assert await f.read(10) == b"aaaaabbbbb"
            buf = bytearray(20)
            assert await c.read_into("/async/f", buf, offset=1000) == 10
            assert bytes(buf[:10]) == b"b" * 10
            # Many concurrent readers and writers on one client.
            await asyncio.gather(*(c.write_bytes(f"/async/g{i}", bytes([i]) * (i * 1000 + 1)) for i in range(16)))
            got = await asyncio.gather(*(c.read_bytes(f"/async/g{i}") for i in range(16)))
            assert got == [bytes([i]) * (i * 1000 + 1) for i in range(16)]
            top = [p async for p in c.walk("/async")]
            assert top[0][2][:3] == ["f", "g0", "g1"]

    uvloop.run(main())


def test_sync_client_survives_fork(cluster: LocalCluster) -> None:
    with Client(cluster.meta_addrs) as c:
        c.write_bytes("/forked", b"from the parent")
        assert c.read_bytes("/forked") == b"from the parent"
        pid = os.fork()
        if pid == 0:  # child: the client must start its own loop thread
            code = 1
            try:
                if c.read_bytes("/forked") == b"from the parent":
                    c.write_bytes("/forked-child", b"from the child")
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert c.read_bytes("/forked-child") == b"from the child"


def test_a_session_of_more_chunks_than_one_request_takes(cluster: LocalCluster,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A write session stores any number of chunks: their records and uploads
    go to meta in requests of at most MAX_CHUNKS_PER_REQUEST (4 here instead
    of 2048, so that a small file needs several), staged by renewals and the
    close, and every one is published."""
    import tierfs.client.file as file_mod

    monkeypatch.setattr(file_mod, "MAX_CHUNKS_PER_REQUEST", 4)
    cs = 64 * 1024
    data = bytes(range(256)) * (19 * cs // 256)

    async def main() -> None:
        async with AsyncClient(cluster.meta_addrs, lease_ms=1000) as c:  # a renewal every 0.33 s
            await c.mkdir("/staged")
            await c.set_layout("/staged", chunk_size=cs)
            f = await c.open("/staged/f", "wb")
            for off in range(0, len(data), 3 * cs):
                await f.write(data[off: off + 3 * cs])
                await asyncio.sleep(0.1)
            await f.close()
            info = await c.meta.stat("/staged/f")
            assert info.attr.size == len(data) and [r.index for r in info.chunks] == list(range(19))
            assert await c.read_bytes("/staged/f") == data
            # an abort reports every upload in batches too: nothing of it shows
            f = await c.open("/staged/f", "ab")
            await f.write(b"x" * (9 * cs))
            await f.flush()
            await f.abort()
            assert await c.read_bytes("/staged/f") == data

    asyncio.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_close_cancelled_while_it_waits_leaves_no_connection_open(cluster: LocalCluster, loop: str) -> None:
    """A task cancelled during its cleanup (``async with`` exiting on a
    cancel that lands inside ``close``) must not leave data-plane sockets
    for the garbage collector: seen as ResourceWarnings failing unrelated
    tests (tests/repair/test_rebuild.py cancels a reader mid-close)."""

    async def go() -> None:
        ac = AsyncClient(cluster.meta_addrs)
        await ac.write_bytes("/cancelled-close", os.urandom(300_000))
        assert len(await ac.read_bytes("/cancelled-close")) == 300_000
        conns = [c for p in ac._parts()[1]._pools.values() for c in p.conns]
        assert conns
        closing = asyncio.ensure_future(ac.close())
        await asyncio.sleep(0)  # the close has begun and waits
        assert not closing.done()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert all(c.transport is not None and c.transport.is_closing() for c in conns)

    if loop == "uvloop":
        uvloop.run(go())
    else:
        asyncio.run(go())
