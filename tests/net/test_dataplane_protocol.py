"""Unit tests of the frame header codec and the limits."""

from __future__ import annotations

import struct

import pytest

from tierfs.errors import ConfigError, ProtocolError
from tierfs.net.protocol import (
    ALL,
    HEADER_FORMAT,
    HEADER_SIZE,
    MAGIC,
    Flag,
    Limits,
    Op,
    crc32c,
    decode_header,
    encode_header,
)
from tierfs.storage.api import FragmentKey

MAX = 1 << 20


def frame(**kw: object) -> bytearray:
    buf = bytearray(HEADER_SIZE)
    args: dict[str, object] = {"op": Op.READ, "request_id": 7}
    args.update(kw)
    encode_header(buf, **args)  # type: ignore[arg-type]
    return buf


def test_layout_is_fixed() -> None:
    assert HEADER_SIZE == 88 == struct.calcsize(HEADER_FORMAT)
    buf = frame()
    assert buf[:4] == MAGIC
    assert struct.unpack_from("<I", buf, 84)[0] == crc32c(bytes(buf[:84]))


def test_roundtrip_every_field() -> None:
    key = FragmentKey((1 << 64) - 1, 2, 3, 4)
    buf = frame(op=Op.WRITE, request_id=(1 << 64) - 2, flags=Flag.RESPONSE | Flag.MORE,
                target=(1 << 32) - 1, status=5, key=key, offset=11, length=ALL,
                payload_len=MAX, payload_crc=0xDEADBEEF)
    h = decode_header(buf, MAX)
    assert (h.op, h.request_id, h.flags, h.target, h.status) == (
        Op.WRITE, (1 << 64) - 2, 3, (1 << 32) - 1, 5)
    assert h.key == key and h.is_response
    assert (h.offset, h.length, h.payload_len, h.payload_crc) == (11, ALL, MAX, 0xDEADBEEF)


@pytest.mark.parametrize("pos", range(HEADER_SIZE))
def test_any_flipped_bit_is_caught(pos: int) -> None:
    buf = frame(key=FragmentKey(1, 2, 3, 4), payload_len=10)
    buf[pos] ^= 0x10
    with pytest.raises(ProtocolError):
        decode_header(buf, MAX)


def reseal(buf: bytearray) -> bytearray:
    struct.pack_into("<I", buf, 84, crc32c(bytes(buf[:84])))
    return buf


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b.__setitem__(slice(0, 4), b"XXXX"), "bad magic"),
        (lambda b: b.__setitem__(4, 2), "version"),
        (lambda b: b.__setitem__(5, 99), "unknown op"),
        (lambda b: b.__setitem__(5, 0), "unknown op"),
        (lambda b: struct.pack_into("<H", b, 6, 0x80), "unknown flags"),
        (lambda b: struct.pack_into("<Q", b, 72, MAX + 1), "exceeds limit"),
    ],
)
def test_semantic_errors_with_valid_crc(mutate: object, reason: str) -> None:
    buf = frame()
    mutate(buf)  # type: ignore[operator]
    with pytest.raises(ProtocolError, match=reason):
        decode_header(reseal(buf), MAX)


def test_truncated_header() -> None:
    with pytest.raises(ProtocolError, match="truncated"):
        decode_header(frame()[:50], MAX)


def test_encode_rejects_out_of_range() -> None:
    with pytest.raises(ProtocolError):
        frame(target=1 << 32)
    with pytest.raises(ValueError):
        FragmentKey(-1, 0, 0, 0)


def test_limits_validated() -> None:
    with pytest.raises(ConfigError, match="max_inflight_bytes"):
        Limits(max_frame_bytes=10 << 20, max_inflight_bytes=1 << 20)
    with pytest.raises(ConfigError, match="max_inflight_requests"):
        Limits(max_inflight_requests=0)
    with pytest.raises(ConfigError, match="shm_ring_bytes"):
        Limits(shm_ring_bytes=10)
