"""Answers checked, and (shm) copied, off the event loop (tierfs.net.framing,
"Off the loop"): the work really runs on the worker threads; many large
answers in flight at once through a ring far smaller than they are arrive
whole; an answer damaged on the wire, or by a bad copy out of the ring, is
never returned, with the check off the loop exactly as on it; and the
switch itself is validated. (Every other data-plane test runs both ways:
dataplane_helpers.OFFLOAD.)"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from dataplane_helpers import arun

from tierfs.errors import ConfigError, UnavailableError
from tierfs.net import DataClient, Limits, MemoryFragmentStore, framing, shm
from tierfs.net.protocol import (
    F_RESPONSE,
    HEADER_SIZE,
    crc32c,
    decode_header,
    default_offload_min,
    encode_header,
)
from tierfs.storage.api import FragmentKey
from tierfs.storage.dataplane import DataPlaneServer, start_dataplane

pytestmark = pytest.mark.timeout(90)

ON = Limits(offload_min_bytes=64 << 10, shm_ring_bytes=1 << 20)  # a ring smaller than most answers


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(251)) * (n // 251) + bytes(n % 251)


@asynccontextmanager
async def served(transport: str, store: MemoryFragmentStore,
                 limits: Limits = ON) -> AsyncIterator[tuple[DataPlaneServer, DataClient]]:
    server = await start_dataplane({1: store}, "127.0.0.1", 0, limits=limits, transports=("tcp", transport))
    client = DataClient(transport=transport, routes={1: server.address}, limits=limits, request_timeout=20)
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()


def threads_of(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[str]:
    """Record the thread each call of ``module.name`` runs on."""
    seen: list[str] = []
    real: Callable[..., Any] = getattr(module, name)

    def spy(*a: Any) -> Any:
        seen.append(threading.current_thread().name)
        return real(*a)

    monkeypatch.setattr(module, name, spy)
    return seen


SIZES = [(64 << 10) - 1, 64 << 10, (64 << 10) + 1, (1 << 20) + 3, (5 << 20) + 11]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_many_large_answers_in_flight_arrive_whole_checked_off_the_loop(
        transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = threads_of(monkeypatch, framing, "crc32c")
    copies = threads_of(monkeypatch, shm, "memmove")

    async def body() -> None:
        store = MemoryFragmentStore(1, verify=False)
        async with served(transport, store) as (_, c):
            keys = [FragmentKey(3, i, 0, 1) for i in range(len(SIZES))]
            for i, (k, n) in enumerate(zip(keys, SIZES, strict=True)):
                await c.write(1, k, pattern(n, i))
            checks.clear()
            for _ in range(3):
                dests = [bytearray(n) for n in SIZES * 4]
                got = await asyncio.gather(*(c.read_into(1, keys[i % len(SIZES)], d) for i, d in enumerate(dests)))
                assert got == SIZES * 4
                for i, d in enumerate(dests):
                    assert d == pattern(SIZES[i % len(SIZES)], i % len(SIZES)), f"answer {i} differs"

    arun(body())
    # every answer of 64 KiB or more was checked on a worker; the one below, on the loop
    workers = [t for t in checks if t.startswith("tierfs-rx")]
    assert len(workers) == 3 * 4 * (len(SIZES) - 1)
    assert len(checks) > len(workers)  # the loop checked the smaller one (in pieces) and the headers' payloads
    if transport == "shm":
        assert copies and all(t.startswith("tierfs-rx") for t in copies)
    else:
        assert not copies


def test_offload_off_keeps_everything_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = threads_of(monkeypatch, framing, "crc32c")
    copies = threads_of(monkeypatch, shm, "memmove")

    async def body() -> None:
        store = MemoryFragmentStore(1, verify=False)
        async with served("shm", store, Limits(offload_min_bytes=0, shm_ring_bytes=1 << 20)) as (_, c):
            k = FragmentKey(3, 0, 0, 1)
            await c.write(1, k, pattern(3 << 20, 1))
            assert await c.read(1, k) == pattern(3 << 20, 1)

    arun(body())
    assert checks and not copies
    assert not [t for t in checks if t.startswith("tierfs-rx")]


def test_a_bad_copy_out_of_the_ring_is_caught_and_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that damages one byte (what a bug in the ring bookkeeping would
    do): the check, which runs over the destination after the copy, fails,
    the read fails, and no wrong answer is returned. With the copy sound
    again, a new connection reads the right bytes."""
    real = shm.memmove
    broken = {"on": True}

    def bad_memmove(dest: memoryview, src: memoryview) -> None:
        real(dest, src)
        if broken["on"]:
            dest[len(dest) // 2] ^= 0x40

    monkeypatch.setattr(shm, "memmove", bad_memmove)

    async def body() -> None:
        store = MemoryFragmentStore(1, verify=False)
        async with served("shm", store) as (_, c):
            k = FragmentKey(4, 0, 0, 1)
            data = pattern(2 << 20, 4)
            await c.write(1, k, data)
            dest = bytearray(len(data))
            with pytest.raises(UnavailableError, match="CRC mismatch"):
                await c.read_into(1, k, dest)
            broken["on"] = False
            assert await c.read(1, k) == data

    arun(body())


@pytest.mark.parametrize("offload", [0, 64 << 10], ids=["on-the-loop", "off-the-loop"])
def test_an_answer_damaged_on_the_wire_is_never_returned(offload: int) -> None:
    """A server whose answers carry a payload that does not match their CRC
    (one bit flipped on the way): the read fails and the connection is
    dropped, whether the check runs on the loop or off it."""

    async def body() -> None:
        data = pattern(1 << 20, 9)

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    hdr = decode_header(await reader.readexactly(HEADER_SIZE), 1 << 30)
                    if hdr.payload_len:
                        await reader.readexactly(hdr.payload_len)
                    out = bytearray(HEADER_SIZE)
                    encode_header(out, hdr.op, hdr.request_id, flags=F_RESPONSE, payload_len=len(data),
                                  payload_crc=crc32c(data))
                    damaged = bytearray(data)
                    damaged[12345] ^= 0x01
                    writer.write(bytes(out) + bytes(damaged))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        srv = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        limits = Limits(offload_min_bytes=offload)
        c = DataClient(transport="tcp", routes={1: ("127.0.0.1", port)}, limits=limits, request_timeout=10)
        try:
            dest = bytearray(len(data))
            with pytest.raises(UnavailableError, match="CRC mismatch"):
                await c.read_into(1, FragmentKey(5, 0, 0, 1), dest)
        finally:
            await c.close()
            srv.close()
            await srv.wait_closed()

    arun(body())


def test_the_switch_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="offload_min_bytes"):
        Limits(offload_min_bytes=-1)
    monkeypatch.setenv("TIERFS_OFFLOAD_MIN_BYTES", "lots")
    with pytest.raises(ConfigError, match="TIERFS_OFFLOAD_MIN_BYTES"):
        Limits()
    monkeypatch.setenv("TIERFS_OFFLOAD_MIN_BYTES", "131072")
    assert Limits().offload_min_bytes == 131072
    monkeypatch.delenv("TIERFS_OFFLOAD_MIN_BYTES")
    assert Limits().offload_min_bytes == default_offload_min() == (512 << 10 if len(os.sched_getaffinity(0)) >= 8
                                                                   else 0)
