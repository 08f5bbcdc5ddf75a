"""Fuzz a real data-plane server in a separate process with random and
mutated frames: it must stay up, change no stored fragment, and serve a
valid request afterwards."""

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

from tierfs.net import DataClient
from tierfs.net.protocol import HEADER_SIZE, Flag, Op, crc32c, encode_header
from tierfs.storage.api import FragmentKey

TARGET = 1
SEEDED = {FragmentKey(1, i, j, 1): os.urandom(1000 * (i + 1) + j) for i in range(4) for j in range(3)}
KEYS = sorted(SEEDED)


def frame(op: int, key: FragmentKey, payload: bytes = b"", **kw: int) -> bytes:
    buf = bytearray(HEADER_SIZE)
    encode_header(buf, op, kw.pop("rid", 1), target=TARGET, key=key, payload_len=len(payload),
                  payload_crc=crc32c(payload), **kw)
    return bytes(buf) + payload


def reseal(buf: bytearray) -> bytes:
    struct.pack_into("<I", buf, 84, crc32c(bytes(buf[:84])))
    return bytes(buf)


keys = st.sampled_from(KEYS)
# Frames that could change stored data if they arrived intact.
mutating = st.one_of(
    st.builds(lambda k, p: frame(Op.WRITE, k, p), keys, st.binary(min_size=1, max_size=2000)),
    st.builds(lambda k: frame(Op.WRITE, k), keys),
    st.builds(lambda k: frame(Op.DELETE, k), keys),
)
harmless = st.one_of(
    st.builds(lambda k, o, n: frame(Op.READ, k, offset=o, length=n), keys,
              st.integers(0, 5000), st.integers(0, 5000)),
    st.builds(lambda k: frame(Op.STAT, k), keys),
    st.builds(lambda: frame(Op.PING, FragmentKey(0, 0, 0, 0))),
)


@st.composite
def header_flips(draw: st.DrawFn) -> bytes:
    """Any byte of the header changed: the header CRC must catch it."""
    data = bytearray(draw(mutating))
    for pos in draw(st.lists(st.integers(0, HEADER_SIZE - 1), min_size=1, max_size=3, unique=True)):
        data[pos] = (data[pos] + draw(st.integers(1, 255))) % 256
    return bytes(data)


@st.composite
def payload_flips(draw: st.DrawFn) -> bytes:
    """A write whose payload got damaged in flight: the payload CRC must catch it."""
    data = bytearray(draw(st.builds(lambda k, p: frame(Op.WRITE, k, p), keys,
                                    st.binary(min_size=1, max_size=2000))))
    pos = draw(st.integers(HEADER_SIZE, len(data) - 1))
    data[pos] ^= draw(st.integers(1, 255))
    return bytes(data)


@st.composite
def resealed_nonsense(draw: st.DrawFn) -> bytes:
    """A header with a valid CRC but at least one invalid field."""
    buf = bytearray(draw(mutating)[:HEADER_SIZE])
    which = draw(st.sampled_from(["version", "op", "flags", "length", "response"]))
    if which == "version":
        buf[4] = draw(st.integers(0, 255).filter(lambda v: v != 1))
    elif which == "op":
        buf[5] = draw(st.integers(0, 255).filter(lambda v: v not in set(Op)))
    elif which == "flags":
        struct.pack_into("<H", buf, 6, draw(st.integers(4, 0xFFFF)) | 0x4)
    elif which == "length":
        struct.pack_into("<Q", buf, 72, draw(st.integers(1 << 30, (1 << 64) - 1)))
    else:
        struct.pack_into("<H", buf, 6, Flag.RESPONSE)
    return reseal(buf)


@st.composite
def truncated(draw: st.DrawFn) -> bytes:
    data = draw(st.one_of(mutating, harmless))
    cut = draw(st.integers(0, len(data) - 1))
    if data[5] in (Op.WRITE, Op.DELETE) and cut >= len(data):
        cut = len(data) - 1
    return data[:cut]


garbage = st.one_of(
    st.binary(min_size=1, max_size=400),
    st.builds(lambda tail: b"TFDP" + tail, st.binary(max_size=200)),
)
attacks = st.one_of(header_flips(), payload_flips(), resealed_nonsense(), truncated(), garbage)
# Harmless valid frames first (answered), then the attack (connection closed).
sessions = st.tuples(st.lists(harmless, max_size=3), attacks)


def throw(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        # The server may hang up mid-send (that is the point): EPIPE, ECONNRESET
        # or ENOTCONN are all fine here.
        with contextlib.suppress(OSError):
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while s.recv(1 << 16):
                pass


@pytest.mark.timeout(150)
@pytest.mark.parametrize("store", ["memory", "disk"])
def test_fuzzed_frames_change_nothing(store: str, tmp_path: Path) -> None:
    target = (["--memory-target", str(TARGET)] if store == "memory"
              else ["--disk-target", f"{TARGET}:{tmp_path / 'target'}"])
    with server_process(*target, "--max-frame-bytes", str(1 << 20),
                        log=tmp_path / "server.log") as srv:
        async def seed() -> None:
            async with DataClient(routes={TARGET: srv.address}) as c:
                for k, v in SEEDED.items():
                    await c.write(TARGET, k, v)

        arun(seed())

        @settings(max_examples=600, derandomize=True, deadline=None, database=None,
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
                    assert await c.read(TARGET, k) == v, f"{k} changed"
                fresh = FragmentKey(99, 0, 0, 1)
                await c.write(TARGET, fresh, b"after the storm")
                assert await c.read(TARGET, fresh) == b"after the storm"

        arun(check())
        assert srv.proc.poll() is None
    log = (tmp_path / "server.log").read_text()
    assert "dataplane connection closed" in log
    assert "Traceback" not in log
