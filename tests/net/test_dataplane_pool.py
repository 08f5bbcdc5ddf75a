"""The client's connection pool: its size per peer, and recovery when the
server drops connections."""

from __future__ import annotations

import asyncio
import os

import pytest
from dataplane_helpers import FaultyStore, arun, wait_for

from tierfs.errors import UnavailableError
from tierfs.net import DataClient, MemoryFragmentStore
from tierfs.storage.api import FragmentKey
from tierfs.storage.dataplane import start_dataplane


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 4])
def test_pool_grows_to_its_size_under_load(transport: str, size: int) -> None:
    async def body() -> None:
        store = FaultyStore(1)
        server = await start_dataplane({1: store}, transports=("tcp", transport))
        try:
            async with DataClient(transport=transport, routes={1: server.address},
                                  connections_per_peer=size) as c:
                await c.ping(1)
                assert server.counters["connections_total"] == 1  # lazily opened
                store.gate = asyncio.Event()
                writes = [asyncio.ensure_future(c.write(1, FragmentKey(1, i, 0, 1), os.urandom(1000)))
                          for i in range(64)]
                await wait_for(lambda: store.active > 0 and server.counters["connections_total"] == size)
                store.gate.set()
                await asyncio.gather(*writes)
                assert server.counters["connections_total"] == size
                assert len(store.data) == 64
        finally:
            await server.close()

    arun(body())


@pytest.mark.timeout(60)
def test_pool_replaces_dropped_connections(transport: str) -> None:
    async def body() -> None:
        store = MemoryFragmentStore(1)
        server = await start_dataplane({1: store}, transports=("tcp", transport))
        try:
            async with DataClient(transport=transport, routes={1: server.address},
                                  connections_per_peer=2) as c:
                await asyncio.gather(*(c.write(1, FragmentKey(2, i, 0, 1), b"x" * 100) for i in range(20)))
                for conn in list(server._conns):
                    conn.abort()
                pool = next(iter(c._pools.values()))
                await wait_for(lambda: all(x.closed for x in pool.conns), what="client sees the drop")
                assert await c.read(1, FragmentKey(2, 3, 0, 1)) == b"x" * 100
                assert server.counters["connections_active"] >= 1
        finally:
            await server.close()

    arun(body())


@pytest.mark.timeout(60)
def test_no_connection_outlives_close(transport: str) -> None:
    """Requests still running when the client closes, and connects that
    complete while it closes, leave no open connection behind (an unclosed
    socket is a ResourceWarning, an error in this suite)."""
    async def body() -> None:
        store = FaultyStore(1)
        server = await start_dataplane({1: store}, transports=("tcp", transport))
        try:
            c = DataClient(transport=transport, routes={1: server.address}, connections_per_peer=4)
            await c.ping(1)
            store.gate = asyncio.Event()
            # Enough writes in flight that the pool is still opening connections.
            writes = [asyncio.ensure_future(c.write(1, FragmentKey(3, i, 0, 1), b"y" * 100)) for i in range(32)]
            await wait_for(lambda: store.active > 0)
            pools = list(c._pools.values())
            await c.close()
            store.gate.set()
            res = await asyncio.gather(*writes, return_exceptions=True)
            # Each write either landed or failed (a pending one may be cancelled by the close).
            assert all(r is None or isinstance(r, (Exception, asyncio.CancelledError)) for r in res), res
            with pytest.raises(UnavailableError, match="closed"):
                await c.ping(1)
            assert not c._pools
            for p in pools:
                assert p.closed and not p.connecting
                assert all(x.closed for x in p.conns)
            await wait_for(lambda: server.counters["connections_active"] == 0, what="server sees every close")
        finally:
            await server.close()

    arun(body())
