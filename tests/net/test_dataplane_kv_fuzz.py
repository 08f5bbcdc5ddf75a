"""Fuzz a real data-plane server's KV ops (a real KVStore on disk, in its own
process) with random, mutated and resealed-nonsense KV frames: it must stay
up, change no stored object, and serve valid KV requests afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from pathlib import Path

import pytest
from dataplane_helpers import arun, server_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierfs.errors import InvalidArgumentError
from tierfs.net import DataClient
from tierfs.net.protocol import (
    HEADER_SIZE,
    KV_OVERWRITE,
    Op,
    crc32c,
    encode_header,
    pack_keys,
)

TARGET, POOL = 1, 1
SEEDED = {f"seed-{i}".encode(): os.urandom(500 * (i + 1)) for i in range(8)}
KEYS = sorted(SEEDED)


def kv_put_frame(key: bytes, value: bytes, flags: int = KV_OVERWRITE) -> bytes:
    buf = bytearray(HEADER_SIZE)
    vcrc = crc32c(value)
    encode_header(buf, Op.KV_PUT, 1, target=TARGET, key=(POOL, 0, flags, vcrc), offset=len(key),
                  payload_len=len(value) + len(key), payload_crc=crc32c(key, vcrc))
    return bytes(buf) + value + key


def kv_key_frame(op: int, key: bytes, **kw: int) -> bytes:
    buf = bytearray(HEADER_SIZE)
    encode_header(buf, op, 1, target=TARGET, key=(POOL, 0, kw.pop("fragment", 0), 0), payload_len=len(key),
                  payload_crc=crc32c(key), **kw)
    return bytes(buf) + key


def kv_exists_frame(keys: list[bytes]) -> bytes:
    body = bytes(pack_keys(keys))
    buf = bytearray(HEADER_SIZE)
    encode_header(buf, Op.KV_EXISTS, 1, target=TARGET, key=(POOL, 0, 0, 0), offset=len(keys),
                  payload_len=len(body), payload_crc=crc32c(body))
    return bytes(buf) + body


def reseal(buf: bytearray) -> bytes:
    struct.pack_into("<I", buf, 84, crc32c(bytes(buf[:84])))
    return bytes(buf)


keys = st.sampled_from(KEYS)
puts = st.builds(lambda k, v: kv_put_frame(k, v), keys, st.binary(min_size=0, max_size=1500))
# Frames that would change stored objects if they arrived intact.
mutating = st.one_of(
    st.builds(lambda k, v: kv_put_frame(k, v), keys, st.binary(min_size=0, max_size=1500)),
    st.builds(lambda k: kv_key_frame(Op.KV_DELETE, k), keys),
)
harmless = st.one_of(
    st.builds(lambda k, n: kv_key_frame(Op.KV_GET, k, length=n), keys, st.integers(0, 5000)),
    st.builds(lambda ks: kv_exists_frame(ks), st.lists(keys, min_size=1, max_size=6)),
    st.builds(lambda k: kv_key_frame(Op.KV_PIN, k, fragment=1, length=1000), keys),
)


@st.composite
def header_flips(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(mutating))
    for pos in draw(st.lists(st.integers(0, HEADER_SIZE - 1), min_size=1, max_size=3, unique=True)):
        data[pos] = (data[pos] + draw(st.integers(1, 255))) % 256
    return bytes(data)


@st.composite
def payload_flips(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(mutating))
    if len(data) == HEADER_SIZE:
        return bytes(data[:-1])
    pos = draw(st.integers(HEADER_SIZE, len(data) - 1))
    data[pos] ^= draw(st.integers(1, 255))
    return bytes(data)


@st.composite
def resealed_kv_nonsense(draw: st.DrawFn) -> bytes:
    """Valid header CRC, nonsense in a KV field a frame uses: a put's key
    length or value CRC, an exists count, a payload length, the pool."""
    which = draw(st.sampled_from(["keylen", "valuecrc", "exists_count", "payload_len", "pool"]))
    frame = bytearray(draw(puts if which in ("keylen", "valuecrc") else mutating))
    if which == "keylen":
        struct.pack_into("<Q", frame, 56, draw(st.sampled_from([0, 513, 1 << 40, (1 << 64) - 1])))
    elif which == "valuecrc":
        struct.pack_into("<Q", frame, 48, draw(st.integers(0, (1 << 64) - 1)))
    elif which == "exists_count":
        frame = bytearray(kv_exists_frame(KEYS[:3]))
        struct.pack_into("<Q", frame, 56, draw(st.sampled_from([0, 2, 4, 5000, (1 << 64) - 1])))
    elif which == "payload_len":
        struct.pack_into("<Q", frame, 72, draw(st.integers(0, 1 << 20)))
    else:
        struct.pack_into("<Q", frame, 24, draw(st.sampled_from([0, 2, (1 << 64) - 1])))
    return reseal(frame[:HEADER_SIZE]) + bytes(frame[HEADER_SIZE:])


garbage = st.builds(lambda op, tail: bytes(b"TFDP\x01" + bytes([op])) + tail,
                    st.sampled_from([int(o) for o in (Op.KV_PUT, Op.KV_GET, Op.KV_EXISTS, Op.KV_DELETE, Op.KV_PIN)]),
                    st.binary(max_size=200))
attacks = st.one_of(header_flips(), payload_flips(), resealed_kv_nonsense(), garbage)
sessions = st.tuples(st.lists(harmless, max_size=3), attacks)


def throw(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while s.recv(1 << 16):
                pass


@pytest.mark.timeout(180)
def test_fuzzed_kv_frames_change_nothing(tmp_path: Path) -> None:
    with server_process("--kv-target", f"{TARGET}:{tmp_path / 't'}", "--kv-pool", f"{POOL}:8388608:16777216",
                        "--max-frame-bytes", str(1 << 20), log=tmp_path / "server.log") as srv:
        async def seed() -> None:
            async with DataClient(routes={TARGET: srv.address}) as c:
                for k, v in SEEDED.items():
                    assert await c.kv_put(TARGET, POOL, k, memoryview(v))

        arun(seed())

        @settings(max_examples=500, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(sessions)
        def fuzz(session: tuple[list[bytes], bytes]) -> None:
            prefix, attack = session
            throw(srv.port, b"".join(prefix) + attack)
            assert srv.proc.poll() is None, "data-plane server died"

        fuzz()

        async def check() -> None:
            async with DataClient(routes={TARGET: srv.address}) as c:
                for k, v in SEEDED.items():
                    assert await c.kv_get(TARGET, POOL, k) == v, f"{k!r} changed"
                assert await c.kv_exists(TARGET, POOL, KEYS) == [True] * len(KEYS)
                assert await c.kv_put(TARGET, POOL, b"after", memoryview(b"the storm"))
                assert await c.kv_get(TARGET, POOL, b"after") == b"the storm"
                with pytest.raises(InvalidArgumentError):
                    await c.kv_get_into(TARGET, POOL, KEYS[-1], memoryview(bytearray(3)))

        arun(check())
        assert srv.proc.poll() is None
    log = (tmp_path / "server.log").read_text()
    assert "dataplane connection closed" in log
    assert "Traceback" not in log
