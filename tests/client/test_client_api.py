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


def test_a_session_over_the_commit_cap_fails_early_and_commits_nothing(cluster: LocalCluster,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Meta commits at most MAX_CHUNKS_PER_REQUEST chunks per session (4 here
    instead of 32768): the write that would start one more fails at once, and
    the file keeps what it had."""
    import tierfs.client.file as file_mod
    from tierfs.errors import InvalidArgumentError

    monkeypatch.setattr(file_mod, "MAX_CHUNKS_PER_REQUEST", 4)
    cs = 64 * 1024

    async def main() -> None:
        async with AsyncClient(cluster.meta_addrs) as c:
            await c.mkdir("/capped")
            await c.set_layout("/capped", chunk_size=cs)
            await c.write_bytes("/capped/ok", b"k" * (4 * cs))  # at the cap: fine
            assert (await c.stat("/capped/ok")).size == 4 * cs
            f = await c.open("/capped/ok", "ab")
            with pytest.raises(InvalidArgumentError, match="at most 4 chunks"):
                await f.write(b"x" * (5 * cs))
            with pytest.raises(InvalidArgumentError):
                await f.close()  # the session aborts: nothing of it is visible
            assert await c.read_bytes("/capped/ok") == b"k" * (4 * cs)

    asyncio.run(main())
