"""Hard limits and malformed input: each bad frame closes only its own
connection with a logged reason, stored data is untouched, and the server
keeps serving; in-flight limits pause reading instead of failing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable

import pytest
from dataplane_helpers import FaultyStore, arun, wait_for

from tierfs.errors import InvalidArgumentError, TimeoutError_, UnavailableError
from tierfs.net import DataClient, Limits, MemoryFragmentStore
from tierfs.net.protocol import HEADER_SIZE, Flag, Op, crc32c, encode_header
from tierfs.storage.api import FragmentKey
from tierfs.storage.dataplane import start_dataplane

KEY = FragmentKey(1, 0, 0, 1)
ORIGINAL = b"precious" * 1000


def header(op: int = Op.WRITE, payload: bytes = b"", *, crc: int | None = None, flags: int = 0,
           key: FragmentKey = KEY, payload_len: int | None = None) -> bytes:
    buf = bytearray(HEADER_SIZE)
    encode_header(buf, op, 1, flags=flags, target=1, key=key,
                  payload_len=len(payload) if payload_len is None else payload_len,
                  payload_crc=crc32c(payload) if crc is None else crc)
    return bytes(buf)


def reseal(buf: bytearray) -> bytes:
    struct.pack_into("<I", buf, 84, crc32c(bytes(buf[:84])))
    return bytes(buf)


def _mut(b: bytes, at: int, value: int) -> bytearray:
    out = bytearray(b)
    out[at] = value
    return out


BAD_FRAMES: dict[str, tuple[Callable[[], bytes], str]] = {
    "bad magic": (lambda: b"XXXX" + header()[4:], "magic"),
    "bad version": (lambda: reseal(_mut(header(), 4, 9)), "version"),
    "unknown op": (lambda: reseal(_mut(header(), 5, 77)), "unknown op"),
    "header crc": (lambda: bytes(_mut(header(), 30, 1)), "header CRC"),
    "oversized": (lambda: header(payload_len=1 << 40), "exceeds limit"),
    "payload crc": (lambda: header(payload=b"evil" * 100, crc=12345) + b"evil" * 100, "payload CRC"),
    "response flag": (lambda: header(op=Op.STAT, flags=Flag.RESPONSE), "response frame"),
    "payload on read": (lambda: header(op=Op.READ, payload=b"x") + b"x", "carries no payload"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_frame_closes_connection_only(case: str, caplog: pytest.LogCaptureFixture) -> None:
    make, reason = BAD_FRAMES[case]

    async def body() -> None:
        store = MemoryFragmentStore(1)
        server = await start_dataplane({1: store}, transports=("tcp",))
        try:
            async with DataClient(routes={1: server.address}) as c:
                await c.write(1, KEY, ORIGINAL)
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(make())
                try:
                    async with asyncio.timeout(20):
                        rest = await reader.read()  # the server hangs up...
                except ConnectionResetError:
                    rest = b""  # ...or resets, when our bytes were still unread
                writer.close()
                with contextlib.suppress(ConnectionResetError):
                    await writer.wait_closed()
                assert rest == b""
                assert server.counters["protocol_violations"] == 1
                assert await c.read(1, KEY) == ORIGINAL
                await c.write(1, FragmentKey(2, 0, 0, 1), b"still serving")
                assert await c.read(1, FragmentKey(2, 0, 0, 1)) == b"still serving"
        finally:
            await server.close()

    with caplog.at_level(logging.WARNING, logger="tierfs.net"):
        arun(body())
    recs = [r for r in caplog.records if getattr(r, "event", "") == "dataplane.protocol_violation"]
    assert len(recs) == 1 and reason in recs[0].reason  # type: ignore[attr-defined]
    assert recs[0].role == "server"  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_truncated_frame_then_hangup() -> None:
    async def body() -> None:
        store = MemoryFragmentStore(1)
        server = await start_dataplane({1: store}, transports=("tcp",))
        try:
            for cut in (1, HEADER_SIZE - 1, HEADER_SIZE + 10):
                payload = b"p" * 100
                _, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write((header(payload=payload) + payload)[:cut])
                await writer.drain()
                writer.close()
                await writer.wait_closed()
            await wait_for(lambda: server.counters["connections_active"] == 0)
            assert store.data == {}
            assert store._loose == {}  # the cut-off payload buffer went back
            assert server.counters["requests_total"] == 0
        finally:
            await server.close()

    arun(body())


@pytest.mark.timeout(60)
def test_inflight_requests_limit_pauses_reading() -> None:
    async def body() -> None:
        store = FaultyStore(1)
        limits = Limits(max_inflight_requests=2)
        server = await start_dataplane({1: store}, limits=limits, transports=("tcp",))
        try:
            async with DataClient(routes={1: server.address}, connections_per_peer=1) as c:
                store.gate = asyncio.Event()
                writes = [asyncio.ensure_future(c.write(1, FragmentKey(1, i, 0, 1), b"w" * 10_000))
                          for i in range(10)]
                await wait_for(lambda: store.active == 2)
                # Reading is paused: even a ping on that connection waits.
                with pytest.raises(TimeoutError_):
                    await c.ping(1, timeout=0.5)
                assert store.active == 2
                store.gate.set()
                await asyncio.gather(*writes)
                assert store.max_active == 2 and len(store.data) == 10
                await c.ping(1)
        finally:
            await server.close()

    arun(body())


@pytest.mark.timeout(60)
def test_inflight_bytes_limit_pauses_reading() -> None:
    async def body() -> None:
        store = FaultyStore(1)
        limits = Limits(max_frame_bytes=64 << 10, max_inflight_bytes=128 << 10)
        server = await start_dataplane({1: store}, limits=limits, transports=("tcp",))
        try:
            async with DataClient(routes={1: server.address}, connections_per_peer=1, limits=limits) as c:
                store.gate = asyncio.Event()
                writes = [asyncio.ensure_future(c.write(1, FragmentKey(1, i, 0, 1), b"b" * (60 << 10)))
                          for i in range(12)]
                await wait_for(lambda: store.active >= 3)
                with pytest.raises(TimeoutError_):
                    await c.ping(1, timeout=0.5)
                store.gate.set()
                await asyncio.gather(*writes)
                assert store.max_active == 3  # 60K + 60K < 128K <= 60K * 3
                assert len(store.data) == 12
        finally:
            await server.close()

    arun(body())


@pytest.mark.timeout(60)
def test_client_side_limits() -> None:
    async def body() -> None:
        big = Limits(max_frame_bytes=8 << 20)
        store = MemoryFragmentStore(1)
        server = await start_dataplane({1: store}, limits=big, transports=("tcp",))
        small = Limits(max_frame_bytes=1 << 20)
        try:
            async with DataClient(routes={1: server.address}, limits=small) as c:
                with pytest.raises(InvalidArgumentError, match="frame limit"):
                    await c.write(1, KEY, bytes((1 << 20) + 1))
                with pytest.raises(InvalidArgumentError, match="frame limit"):
                    await c.read_into(1, KEY, bytearray((1 << 20) + 1))
                store.put(KEY, bytes(2 << 20))
                # The server answers with a frame over the client's limit: the
                # client drops that connection and says why.
                with pytest.raises(UnavailableError, match="exceeds limit"):
                    await c.read(1, KEY)
                await c.ping(1)  # a fresh connection
            async with DataClient(routes={1: server.address}, limits=big) as c:
                with pytest.raises(InvalidArgumentError, match="frame limit"):
                    await c.read(1, KEY, 0, 9 << 20)
        finally:
            await server.close()

    arun(body())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer", ["garbage", "wrong id", "silence", "hangup"])
def test_client_survives_a_bad_server(answer: str) -> None:
    """A peer that is not a good data-plane server: the client raises
    UnavailableError or TimeoutError_, never a raw socket error."""

    async def body() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readexactly(HEADER_SIZE)
            if answer == "garbage":
                writer.write(b"\x00" * 200)
            elif answer == "wrong id":
                buf = bytearray(HEADER_SIZE)
                encode_header(buf, head[5], 999, flags=Flag.RESPONSE)
                writer.write(bytes(buf))
            elif answer == "hangup":
                writer.close()
                return
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await reader.read()
            writer.close()

        fake = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = fake.sockets[0].getsockname()[1]
        try:
            # Only the silent server needs a short deadline; the others must
            # fail on their own, well before a generous one.
            deadline = 0.5 if answer == "silence" else 20.0
            async with DataClient(routes={1: f"127.0.0.1:{port}"}, request_timeout=deadline) as c:
                expected = TimeoutError_ if answer == "silence" else UnavailableError
                with pytest.raises(expected):
                    await c.stat(1, KEY)
        finally:
            fake.close()
            await fake.wait_closed()

    arun(body())


@pytest.mark.timeout(30)
def test_optional_transport_that_cannot_bind_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        first = await start_dataplane({1: MemoryFragmentStore(1)}, transports=("tcp", "shm"))
        try:
            # A second server cannot take the first one's shm name (the
            # port's): bind the same TCP port number on another loopback
            # address, whose own shm name is held here.
            import socket

            from tierfs.net.shm import socket_name
            squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            squat.bind(socket_name(first.port, "127.0.0.2"))
            try:
                second = await start_dataplane({1: MemoryFragmentStore(1)}, "127.0.0.2", first.port,
                                               transports=("tcp", "shm"))
            finally:
                squat.close()
            try:
                assert list(second.listeners) == ["tcp"]
                async with DataClient(routes={1: second.address}) as c:
                    await c.ping(1)
            finally:
                await second.close()
        finally:
            await first.close()

    with caplog.at_level(logging.WARNING, logger="tierfs.net"):
        arun(body())
    assert any(getattr(r, "event", "") == "dataplane.transport_failed" for r in caplog.records)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lie", ["bad hello", "ring overrun", "bad doorbell", "garbage frame"])
def test_shm_peer_that_lies_is_dropped(lie: str) -> None:
    """A local process that speaks the shm handshake wrongly, claims more
    bytes than the ring holds, or puts garbage in the ring: only its own
    connection goes."""
    import fcntl
    import os
    import socket

    from tierfs.net.shm import _BELL, _HELLO, REQUIRED_SEALS, socket_name

    async def body() -> None:
        store = MemoryFragmentStore(1)
        server = await start_dataplane({1: store}, transports=("tcp", "shm"))
        loop = asyncio.get_running_loop()
        size = 1 << 16
        fds = [os.memfd_create("lie", os.MFD_ALLOW_SEALING), os.memfd_create("lie", os.MFD_ALLOW_SEALING)]
        for fd in fds:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)  # past the handshake (test_shm_peers.py)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, socket_name(server.port))
            magic = b"XXXX" if lie == "bad hello" else b"TFSM"
            socket.send_fds(sock, [_HELLO.pack(magic, size)], fds)
            if lie == "ring overrun":
                await loop.sock_sendall(sock, _BELL.pack(b"W", size + 1))
            elif lie == "bad doorbell":
                await loop.sock_sendall(sock, _BELL.pack(b"Z", 1))
            elif lie == "garbage frame":
                with open(fds[0], "r+b", closefd=False) as f:
                    f.write(b"\xff" * HEADER_SIZE)
                await loop.sock_sendall(sock, _BELL.pack(b"W", HEADER_SIZE))
            async with asyncio.timeout(10):
                while await loop.sock_recv(sock, 4096):
                    pass  # credit may come back first; then the hangup
            async with DataClient(transport="shm", routes={1: server.address}) as c:
                await c.write(1, KEY, b"fine")
                assert await c.read(1, KEY) == b"fine"
        finally:
            sock.close()
            for fd in fds:
                os.close(fd)
            await server.close()

    arun(body())


class _TightStore(MemoryFragmentStore):
    """A store whose buffer pool refuses payloads over 64 KiB (as a
    ChunkEngine does past its pool's ``max_total_bytes``)."""

    def alloc(self, size: int) -> memoryview:
        if size > 64 << 10:
            raise UnavailableError(f"buffer pool exhausted: cannot hold {size} bytes")
        return super().alloc(size)


@pytest.mark.timeout(60)
def test_store_refusing_a_buffer_answers_that_request_only() -> None:
    async def body() -> None:
        server = await start_dataplane({1: _TightStore(1)}, transports=("tcp",))
        try:
            async with DataClient(routes={1: server.address}, connections_per_peer=1) as c:
                big = FragmentKey(3, 0, 0, 1)
                with pytest.raises(UnavailableError, match="buffer pool exhausted"):
                    await c.write(1, big, b"x" * (1 << 20))
                # The payload was drained: the same connection keeps serving.
                await c.write(1, KEY, ORIGINAL)
                assert await c.read(1, KEY) == ORIGINAL
                with pytest.raises(FileNotFoundError):
                    await c.read(1, big)
                assert server.counters["protocol_violations"] == 0
        finally:
            await server.close()

    arun(body())
