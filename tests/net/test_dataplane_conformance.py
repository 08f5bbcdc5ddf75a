"""One conformance suite for every data-plane transport that runs here.

Each test starts a real server (tcp + shm listeners) on 127.0.0.1:0 and a
real client over the parametrized transport, in one uvloop loop. "tcp+tls"
is tcp with mutual TLS (certificates of a throwaway local CA)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import shutil
import ssl
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from dataplane_helpers import (
    TRANSPORTS,
    FaultyStore,
    arun,
    disk_store,
    transport_params,
    use_transport,
    wait_for,
)

from tierfs.chunk import crc32c
from tierfs.errors import (
    CorruptError,
    InternalError,
    InvalidArgumentError,
    NoSpaceError,
    NotFoundError,
    TimeoutError_,
    UnavailableError,
)
from tierfs.net import DataClient, Limits, MemoryFragmentStore
from tierfs.storage.api import FragmentKey, FragmentStore
from tierfs.storage.dataplane import DataPlaneServer, start_dataplane
from tierfs.tls import TlsFiles, issue, make_local_ca

SIZES = [0, 1, 4095, 4096, 4097, 1 << 20, 64 << 20]


@pytest.fixture(params=transport_params([*TRANSPORTS, "tcp+tls"]))
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    return use_transport(request, monkeypatch)


def _base(transport: str) -> str:
    return "tcp" if transport == "tcp+tls" else transport


@functools.cache
def _ca_dir() -> str:
    d = tempfile.mkdtemp(prefix="tierfs-conformance-tls-")
    atexit.register(shutil.rmtree, d, True)
    make_local_ca(d)
    issue(d, "server", ["127.0.0.1"])
    issue(d, "client")
    return d


def _tls(transport: str, side: str) -> ssl.SSLContext | None:
    if transport != "tcp+tls":
        return None
    d = _ca_dir()
    files = TlsFiles(ca=f"{d}/ca.pem", cert=f"{d}/{side}.pem", key=f"{d}/{side}.key", require_client_cert=True)
    return files.server_ssl_context() if side == "server" else files.client_side().client_ssl_context()


def pattern(n: int, seed: int) -> bytes:
    """Distinct-everywhere bytes (a swapped or shifted block is detected)."""
    words = (np.arange((n + 3) // 4, dtype=np.uint64) * 2654435761 + seed) % (1 << 32)
    return words.astype(np.uint32).tobytes()[:n]


@asynccontextmanager
async def served(transport: str, *stores: FragmentStore, limits: Limits | None = None,
                 **client_kw: object) -> AsyncIterator[tuple[DataPlaneServer, DataClient]]:
    server = await start_dataplane({s.target_id: s for s in stores}, "127.0.0.1", 0,
                                   limits=limits, transports=("tcp", _base(transport)), tls=_tls(transport, "server"))
    client = DataClient(transport=_base(transport), tls=_tls(transport, "client"), routes={s.target_id: server.address for s in stores},
                        limits=limits, **client_kw)  # type: ignore[arg-type]
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()


@pytest.mark.timeout(90)
class TestTransportConformance:
    def test_roundtrip_sizes(self, transport: str) -> None:
        async def body() -> None:
            store = MemoryFragmentStore(1)
            async with served(transport, store) as (_, c):
                for i, n in enumerate(SIZES):
                    key = FragmentKey(7, i, 2, 1)
                    data = pattern(n, i)
                    await c.write(1, key, data)
                    dest = bytearray(n + 10)  # room to spare: the answer says how much came
                    got = await c.read_into(1, key, memoryview(dest))
                    assert got == n
                    assert dest[:n] == data and dest[n:] == bytes(10)
                    info = await c.stat(1, key)
                    assert info.size == n
                    assert bytes(store.data[key][0]) == data
                assert await c.read(1, FragmentKey(7, 3, 2, 1)) == pattern(4096, 3)

        arun(body())

    def test_ranges(self, transport: str) -> None:
        async def body() -> None:
            store = MemoryFragmentStore(1)
            async with served(transport, store) as (_, c):
                key = FragmentKey(1, 0, 0, 1)
                data = pattern(100_000, 9)
                await c.write(1, key, data)
                for off, ln in [(0, 1), (1, 4095), (4096, 4097), (99_999, 1), (50_000, 50_000), (12345, 0)]:
                    assert await c.read(1, key, off, ln) == data[off:off + ln]
                    dest = bytearray(ln)
                    assert await c.read_into(1, key, dest, off) == ln
                    assert dest == data[off:off + ln]
                # Past the end: a short read, then nothing.
                dest = bytearray(1000)
                assert await c.read_into(1, key, dest, 99_500) == 500
                assert dest[:500] == data[99_500:]
                assert await c.read(1, key, 100_000) == b""
                assert await c.read(1, key, 30) == data[30:]
                with pytest.raises(InvalidArgumentError):
                    await c.read(1, key, 100_001)
                with pytest.raises(InvalidArgumentError):
                    await c.read_into(1, key, bytes(10))  # read-only destination

        arun(body())

    def test_batches(self, transport: str) -> None:
        async def body() -> None:
            stores = [MemoryFragmentStore(1), MemoryFragmentStore(2)]
            async with served(transport, *stores) as (_, c):
                items = [(1 + i % 2, FragmentKey(3, i, i % 6, 1), pattern(4096 * (i % 5) + i, i))
                         for i in range(40)]
                assert await c.write_batch(items) == [None] * 40
                dests = [bytearray(len(d)) for _, _, d in items]
                reads = [(t, k, memoryview(d), 0) for (t, k, _), d in zip(items, dests, strict=True)]
                reads.insert(5, (1, FragmentKey(99, 0, 0, 0), memoryview(bytearray(8)), 0))
                reads.insert(7, (77, FragmentKey(1, 0, 0, 0), memoryview(bytearray(8)), 0))  # no route
                reads.insert(9, (1, FragmentKey(1, 0, 0, 0), memoryview(b"ro"), 0))  # read-only
                crcs: list[int] = []
                res = await c.read_batch(reads, crcs=crcs)
                assert isinstance(res[5], NotFoundError)
                assert isinstance(res[7], UnavailableError)
                assert isinstance(res[9], InvalidArgumentError)
                assert crcs[5] == crcs[7] == crcs[9] == 0
                del res[9], res[7], res[5]
                del crcs[9], crcs[7], crcs[5]
                assert res == [len(d) for _, _, d in items]
                assert all(dest == d for dest, (_, _, d) in zip(dests, items, strict=True))
                # The CRC32C of each item's bytes, as checked on arrival (what a rebuild combines).
                assert crcs == [crc32c(d) for _, _, d in items]

        arun(body())

    def test_batch_timeout_fills_every_slot(self, transport: str) -> None:
        async def body() -> None:
            store = FaultyStore(1)
            async with served(transport, store, request_timeout=0.3) as (server, c):
                keys = [FragmentKey(4, i, 0, 1) for i in range(5)]
                assert await c.write_batch([(1, k, b"q" * 3000) for k in keys], timeout=20) == [None] * 5
                store.gate = asyncio.Event()
                dests = [bytearray(3000) for _ in keys]
                res = await c.read_batch([(1, k, memoryview(d), 0) for k, d in zip(keys, dests, strict=True)])
                assert all(isinstance(r, TimeoutError_) for r in res)
                store.gate.set()
                store.gate = None
                await wait_for(lambda: server.counters["reads"] == 5 and store.active == 0)
                assert dests == [bytearray(3000)] * 5  # late answers were dropped
                res = await c.read_batch([(1, k, memoryview(d), 0) for k, d in zip(keys, dests, strict=True)],
                                         timeout=20)
                assert res == [3000] * 5
                assert dests == [b"q" * 3000] * 5

        arun(body())

    def test_many_in_flight(self, transport: str) -> None:
        async def body() -> None:
            store = MemoryFragmentStore(1)
            async with served(transport, store, connections_per_peer=3) as (server, c):
                blobs = {FragmentKey(5, i, 0, 1): os.urandom(1 + (i * 7919) % 300_000) for i in range(300)}
                await asyncio.gather(*(c.write(1, k, v) for k, v in blobs.items()))
                dests = {k: bytearray(len(v)) for k, v in blobs.items()}
                got = await asyncio.gather(*(c.read_into(1, k, dests[k]) for k in blobs))
                assert got == [len(v) for v in blobs.values()]
                assert all(dests[k] == v for k, v in blobs.items())
                assert 1 <= server.counters["connections_total"] <= 3

        arun(body())

    def test_store_errors_come_back_typed(self, transport: str) -> None:
        async def body() -> None:
            store = FaultyStore(1, capacity=10_000)
            async with served(transport, store) as (server, c):
                missing = FragmentKey(1, 1, 1, 1)
                with pytest.raises(NotFoundError, match="not found"):
                    await c.read(1, missing)
                with pytest.raises(FileNotFoundError):
                    await c.stat(1, missing)
                assert await c.delete(1, missing) is False
                with pytest.raises(NoSpaceError):
                    await c.write(1, missing, bytes(20_000))
                key = FragmentKey(1, 2, 3, 4)
                await c.write(1, key, b"x" * 100)
                store.corrupt(key, 10)
                with pytest.raises(CorruptError):
                    await c.read(1, key)
                store.boom = RuntimeError("disk on fire")
                with pytest.raises(InternalError, match="disk on fire"):
                    await c.stat(1, key)
                store.boom = None
                with pytest.raises(UnavailableError, match="target 42"):
                    await c.ping(42)
                c.set_route(42, server.address)
                with pytest.raises(UnavailableError, match="not served"):
                    await c.write(42, key, b"abc")
                assert await c.delete(1, key) is True
                # The connection survived every error above.
                assert server.counters["connections_total"] == 1
                assert server.counters["protocol_violations"] == 0

        arun(body())

    def test_timeout_then_late_answer_is_dropped(self, transport: str) -> None:
        async def body() -> None:
            store = FaultyStore(1)
            async with served(transport, store, request_timeout=0.3) as (server, c):
                key = FragmentKey(2, 0, 0, 1)
                await c.write(1, key, b"a" * 5000, timeout=20)
                store.gate = asyncio.Event()
                dest = bytearray(5000)
                with pytest.raises(TimeoutError_):
                    await c.read_into(1, key, dest)
                store.gate.set()
                store.gate = None
                await wait_for(lambda: server.counters["reads"] == 1 and store.active == 0)
                # The late answer went nowhere near the abandoned buffer...
                assert await c.read(1, key, 0, 10, timeout=10) == b"a" * 10
                assert dest == bytes(5000)
                # ...and the connection is still the first one.
                assert server.counters["connections_total"] == 1

        arun(body())

    def test_connect_failure_is_unavailable(self, transport: str) -> None:
        async def body() -> None:
            server = await start_dataplane({}, "127.0.0.1", 0, transports=("tcp", _base(transport)), tls=_tls(transport, "server"))
            addr = server.address
            await server.close()
            async with DataClient(transport=_base(transport), tls=_tls(transport, "client"), routes={1: addr}, connect_timeout=5) as c:
                with pytest.raises(UnavailableError):
                    await c.ping(1)

        arun(body())

    def test_server_close_fails_inflight_with_unavailable(self, transport: str) -> None:
        async def body() -> None:
            store = FaultyStore(1)
            server = await start_dataplane({1: store}, "127.0.0.1", 0, transports=("tcp", _base(transport)), tls=_tls(transport, "server"))
            async with DataClient(transport=_base(transport), tls=_tls(transport, "client"), routes={1: server.address}) as c:
                await c.write(1, FragmentKey(1, 1, 1, 1), b"z")
                store.gate = asyncio.Event()
                pending = asyncio.ensure_future(c.stat(1, FragmentKey(1, 1, 1, 1)))
                await wait_for(lambda: store.active == 1)
                await server.close(grace=0.2)
                with pytest.raises(UnavailableError):
                    await pending

        arun(body())


@pytest.mark.timeout(90)
def test_timeouts_mid_payload_never_touch_the_buffer_afterwards(transport: str) -> None:
    """Timeouts that fire before, during or after a big answer arrives: the
    call fails cleanly, and its buffer is never written once it has failed."""

    async def body() -> None:
        store = MemoryFragmentStore(1, verify=False)
        async with served(transport, store) as (_, c):
            big, other = FragmentKey(1, 0, 0, 1), FragmentKey(1, 1, 0, 1)
            data = pattern(16 << 20, 5)
            await c.write(1, big, data)
            await c.write(1, other, b"o" * 1000)
            outcomes = set()
            for i in range(12):
                dest = bytearray(16 << 20)
                try:
                    n = await c.read_into(1, big, dest, timeout=0.0005 * (2 ** (i % 6)))
                    assert n == len(data) and dest == data
                    outcomes.add("ok")
                    continue
                except TimeoutError_:
                    outcomes.add("timeout")
                snapshot = bytes(dest)
                # Anything still in flight for the abandoned call is drained
                # or its connection is gone once a later request completes.
                assert await c.read(1, other, timeout=10) == b"o" * 1000
                assert bytes(dest) == snapshot
            assert "timeout" in outcomes
            assert await c.read(1, big, timeout=10) == data

    arun(body())


@pytest.mark.timeout(90)
def test_a_request_beside_one_abandoned_mid_transfer_succeeds(transport: str) -> None:
    """Calls in flight on the connection a timed-out call's abandonment drops
    (its answer was arriving into the caller's buffer) did nothing wrong:
    each goes again on a new connection. Until stop 47 they failed as
    "connection lost (a request was abandoned mid-transfer)", and a KV
    delete beside a timed-out get was reported not done on a healthy
    cluster."""

    async def body() -> None:
        store = MemoryFragmentStore(1, verify=False)
        async with served(transport, store) as (server, c):
            big, other = FragmentKey(1, 0, 0, 1), FragmentKey(1, 1, 0, 1)
            data = pattern(16 << 20, 6)
            await c.write(1, big, data)
            await c.write(1, other, b"o" * 1000)
            dropped = 0
            for i in range(16):
                before = server.counters["connections_total"]
                got = await asyncio.gather(c.read_into(1, big, bytearray(16 << 20), timeout=0.0005 * (2 ** (i % 6))),
                                           *(c.read(1, other, timeout=10) for _ in range(3)),
                                           return_exceptions=True)
                assert all(g == b"o" * 1000 for g in got[1:]), got[1:]
                dropped += server.counters["connections_total"] > before
            assert dropped, "no abandonment dropped a connection: the test saw nothing"

    arun(body())


@pytest.mark.timeout(90)
def test_chunk_engine_behind_the_data_plane(transport: str, tmp_path: Path) -> None:
    """The same round trips with the real on-disk engine as the store."""

    async def body() -> None:
        async with disk_store(tmp_path / "t1", 1) as engine, served(transport, engine) as (_, c):
            for i, n in enumerate(SIZES[:-1]):
                key = FragmentKey(8, i, 0, 1)
                data = pattern(n, i)
                await c.write(1, key, data)
                dest = bytearray(n)
                assert await c.read_into(1, key, dest) == n and dest == data
                assert (await c.stat(1, key)).size == n
            key = FragmentKey(8, 5, 0, 1)
            data = pattern(1 << 20, 5)
            for off, ln in [(0, 1), (4095, 4097), (65536 * 3 + 17, 70_000), ((1 << 20) - 1, 1)]:
                assert await c.read(1, key, off, ln) == data[off:off + ln]
            with pytest.raises(NotFoundError):
                await c.read(1, FragmentKey(8, 99, 0, 1))
            assert await c.delete(1, key) is True
            with pytest.raises(NotFoundError):
                await c.stat(1, key)

    arun(body())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_read_and_stat_answers_carry_the_fragment_serial(tmp_path: Path, kind: str) -> None:
    """Both stores behind the data plane give a fragment a serial (docs/
    dataplane.md, "Serials"): a READ answer and a STAT answer of the same
    fragment carry the same one, and a rewrite under the same key gives a
    new one. Until stop 39 the in-memory store answered 0 (not known), so a
    client verified every partial read against it again."""

    async def body() -> None:
        async with contextlib.AsyncExitStack() as stack:
            store: FragmentStore = MemoryFragmentStore(1) if kind == "memory" else \
                await stack.enter_async_context(disk_store(tmp_path / "t1", 1))
            _, c = await stack.enter_async_context(served("tcp", store))
            key = FragmentKey(9, 0, 0, 1)
            await c.write(1, key, pattern(10_000, 1))
            serials: list[int] = []
            dest = bytearray(100)
            assert await c.read_into(1, key, dest, 500, serials=serials) == 100
            s1 = serials[-1]
            assert s1 and (await c.stat(1, key)).serial == s1
            await c.write(1, key, pattern(10_000, 2))  # replaced under the same key
            assert await c.read_into(1, key, dest, 500, serials=serials) == 100
            assert serials[-1] not in (0, s1) and (await c.stat(1, key)).serial == serials[-1]

    arun(body())
