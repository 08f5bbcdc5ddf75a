"""The data plane between separate processes: shm across a process boundary,
and a server SIGKILLed with requests in flight."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from dataplane_helpers import arun, server_process

from tierfs.errors import UnavailableError
from tierfs.net import DataClient
from tierfs.storage.api import FragmentKey


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("transport", "store"), [("tcp", "memory"), ("shm", "memory"), ("tcp", "disk")])
def test_roundtrip_across_processes(transport: str, store: str, tmp_path: Path) -> None:
    target = ["--memory-target", "3"] if store == "memory" else ["--disk-target", f"3:{tmp_path / 't'}"]
    with server_process(*target, log=tmp_path / "server.log") as srv:
        async def body() -> None:
            async with DataClient(transport=transport, routes={3: srv.address}) as c:
                blobs = {FragmentKey(9, i, 0, 1): os.urandom((i + 1) * 70_001) for i in range(20)}
                assert await c.write_batch([(3, k, v) for k, v in blobs.items()]) == [None] * 20
                dests = [bytearray(len(v)) for v in blobs.values()]
                res = await c.read_batch([(3, k, memoryview(d), 0) for k, d in zip(blobs, dests, strict=True)])
                assert res == [len(v) for v in blobs.values()]
                assert dests == list(blobs.values())

        arun(body())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_sigkill_mid_read_gives_unavailable(transport: str, tmp_path: Path) -> None:
    with server_process("--memory-target", "1", log=tmp_path / "server.log") as srv:
        async def body() -> None:
            async with DataClient(transport=transport, routes={1: srv.address},
                                  connections_per_peer=2) as c:
                key = FragmentKey(1, 1, 1, 1)
                await c.write(1, key, os.urandom(32 << 20))
                dests = [bytearray(32 << 20) for _ in range(8)]
                reads = [asyncio.ensure_future(c.read_into(1, key, d)) for d in dests]
                await asyncio.sleep(0)  # let them all send
                os.kill(srv.proc.pid, signal.SIGKILL)
                results = await asyncio.gather(*reads, return_exceptions=True)
                # Some may have finished before the kill; the rest fail cleanly.
                assert all(r == 32 << 20 or isinstance(r, UnavailableError) for r in results), results
                assert any(isinstance(r, UnavailableError) for r in results)
                with pytest.raises(UnavailableError):
                    await c.stat(1, key)

        arun(body())
        assert srv.proc.wait(timeout=15) == -signal.SIGKILL
