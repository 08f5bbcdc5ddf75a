"""Client SDK pieces that need no cluster: the codec, the ordered fan-out,
the config, mode parsing and chunk-version lookup."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from dataclasses import replace

import pytest

from tierfs.chunk import (
    GEN_SHIFT,
    MAX_UPLOAD_SEQ,
    ChunkRecord,
    chunk_crc,
    chunk_records,
    crc32c,
    fragment_size,
    generation,
    parity_size,
    session_version,
    valid_bytes,
)
from tierfs.client import ClientConfig, Codec
from tierfs.client.fanout import ordered
from tierfs.client.file import _parse_mode
from tierfs.config import load
from tierfs.errors import ConfigError, InvalidArgumentError, NotFoundError
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(60)

CS = 1 << 16


def _chunk_bytes(codec: Codec, frags: dict[int, memoryview], p: int) -> bytes:
    """Reassemble the chunk from decoded segments (the positional format)."""
    f = codec.frag_size(CS)
    plain = codec.decode(frags, p)
    out = bytearray(codec.k * f)
    for j in range(codec.k):
        out[j * f: j * f + p] = plain[j * p: (j + 1) * p]
    return bytes(out[:CS])


@pytest.mark.parametrize(("k", "m"), [(4, 2), (8, 2), (3, 2)])
@pytest.mark.parametrize("length", [1, 100, CS // 4 - 1, CS // 4, CS // 4 + 1, CS - 1, CS])
def test_codec_decodes_from_any_k_fragments(k: int, m: int, length: int) -> None:
    codec = Codec("ec", k, m)
    data = os.urandom(length)
    buf = bytearray(codec.encode_size(CS))
    buf[:length] = data
    frags = codec.encode(memoryview(buf), length, CS)
    f = codec.frag_size(CS)
    p = min(f, length)
    assert len(frags) == k + m
    # Positional and trimmed: data fragment j holds chunk bytes [j*F, j*F+len).
    for j in range(k):
        assert bytes(frags[j]) == data[j * f: j * f + p][: max(0, min(p, length - j * f))]
    assert all(len(frags[j]) == p for j in range(k, k + m))
    expect = data + bytes(CS - length)
    combos = list(itertools.combinations(range(k + m), k))
    for keep in combos[:: max(1, len(combos) // 12)]:
        have = {j: frags[j] for j in keep}
        assert _chunk_bytes(codec, have, p) == expect
        lost = [j for j in range(k) if j not in keep]
        rebuilt = codec.reconstruct(have, p, lost)
        for j in lost:  # rebuilt payloads are the zero-extended data fragments
            assert bytes(rebuilt[j]) == bytes(frags[j]) + bytes(p - len(frags[j]))


def test_codec_replica_and_errors() -> None:
    rep = Codec("replica", 1, 2)
    assert rep.width == 3 and rep.replicated and repr(rep) == "replica:3"
    buf = memoryview(bytearray(b"hello" + bytes(CS - 5)))
    assert [bytes(f) for f in rep.encode(buf, 5, CS)] == [b"hello"] * 3
    ec = Codec("ec", 4, 2)
    with pytest.raises(InvalidArgumentError):
        ec.encode(memoryview(bytearray(CS)), 0, CS)
    with pytest.raises(InvalidArgumentError):
        ec.decode({0: memoryview(b"x")}, 1)
    with pytest.raises(InvalidArgumentError):
        Codec("raid", 4, 2)


def test_ordered_fanout_keeps_order_and_limit() -> None:
    running = 0
    peak = 0

    async def job(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001 * ((i * 7) % 5))
        running -= 1
        if i % 4 == 3:
            raise NotFoundError(f"slot {i}")
        return i

    async def main() -> list[int | Exception]:
        return list(await ordered([lambda i=i: job(i) for i in range(20)], 3))  # type: ignore[misc]

    res = asyncio.run(main())
    assert peak <= 3
    for i, r in enumerate(res):
        if i % 4 == 3:
            assert isinstance(r, NotFoundError) and str(r) == f"slot {i}"
        else:
            assert r == i


def test_ordered_fanout_propagates_bugs() -> None:
    async def bad() -> int:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        asyncio.run(ordered([bad, bad], 2))


def test_config_env_and_validation() -> None:
    cfg = load(ClientConfig, env={"TIERFS_META": "127.0.0.1:1, 127.0.0.1:2", "TIERFS_READ_CONCURRENCY": "4",
                                  "TIERFS_REQUEST_TIMEOUT": "250ms"})
    assert cfg.meta == ["127.0.0.1:1", "127.0.0.1:2"]
    assert cfg.read_concurrency == 4 and cfg.request_timeout == 0.25
    with pytest.raises(ConfigError) as ei:
        load(ClientConfig, env={"TIERFS_META": "nohost"})
    assert ei.value.field == "meta"
    for port in ("99999", "0"):  # 99999 was taken, and reported later as another port
        with pytest.raises(ConfigError, match="out of range"):
            load(ClientConfig, env={"TIERFS_META": f"127.0.0.1:{port}"})
    with pytest.raises(ConfigError, match="abort_deadline"):
        ClientConfig(abort_deadline=0)
    with pytest.raises(ConfigError):
        ClientConfig(read_concurrency=0)
    with pytest.raises(ConfigError):
        ClientConfig(transport="carrier-pigeon")
    # one string of addresses, as TIERFS_META and AsyncClient(meta=) take it
    # (until stop 49: "not a host:port address: '1'", one character at a time)
    assert ClientConfig(meta="127.0.0.1:1, 127.0.0.1:2").meta == ["127.0.0.1:1", "127.0.0.1:2"]  # type: ignore[arg-type]
    assert ClientConfig(meta=("127.0.0.1:1",)).meta == ["127.0.0.1:1"]  # type: ignore[arg-type]


def test_client_needs_meta_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierfs.client import AsyncClient

    monkeypatch.delenv("TIERFS_META", raising=False)
    with pytest.raises(ConfigError):
        AsyncClient()
    monkeypatch.setenv("TIERFS_META", "127.0.0.1:9")
    c = AsyncClient()
    assert c.config.meta == ["127.0.0.1:9"]
    asyncio.run(c.close())
    c2 = AsyncClient("127.0.0.1:7,127.0.0.1:8", read_concurrency=2)
    assert c2.config.meta == ["127.0.0.1:7", "127.0.0.1:8"] and c2.config.read_concurrency == 2
    asyncio.run(c2.close())


def test_mode_parsing() -> None:
    assert _parse_mode("rb") == ("r", False)
    assert _parse_mode("r+b") == ("r", True)
    assert _parse_mode("wb") == ("w", False)
    assert _parse_mode("ab+") == ("a", True)
    assert _parse_mode("x") == ("x", False)
    for bad in ("rt", "q", "rr", "rw", ""):
        with pytest.raises(InvalidArgumentError):
            _parse_mode(bad)


def test_chunk_records_lookup() -> None:
    info = pb.FileInfo(chunks=[pb.ChunkRecord(index=10, generation=3 << 20, length=5, valid=4, crc32c=7,
                                              missing=[2, 0]),
                               pb.ChunkRecord(index=0, generation=(1 << 20) | 1, length=9, valid=9)])
    recs = chunk_records(info)
    assert recs[10] == ChunkRecord(3 << 20, 5, 4, 7, (0, 2)) and recs[0].generation == (1 << 20) | 1
    assert recs.get(1) is None
    assert ChunkRecord.from_pb(recs[10].fill_pb(pb.ChunkRecord(), 10)) == recs[10]


def test_chunk_rules() -> None:
    """tierfs.chunk: generations, valid bytes, trimmed fragment sizes, and the
    chunk CRC from data fragments, against the codec that stores them."""
    assert generation(5, 0) == 5 << GEN_SHIFT and session_version(generation(5, 7)) == 5
    assert generation(5, 1) != generation(5, 0) != generation(6, 0)
    with pytest.raises(ValueError):
        generation(1, MAX_UPLOAD_SEQ + 1)
    rec = ChunkRecord(generation(1, 0), length=3000, valid=6, crc=0)
    cs = 64 << 10
    assert valid_bytes(rec, 0, cs, 3000) == 6  # truncated to 6, then grown back: zeros after 6
    assert valid_bytes(replace(rec, valid=3000), 0, cs, 100) == 100  # the file size cuts too
    assert valid_bytes(replace(rec, valid=3000), 1, cs, cs + 10) == 10
    rng = random.Random(3)
    for k, m in ((4, 2), (8, 2), (1, 2), (3, 1)):
        codec = Codec("ec", k, m)
        for length in sorted({min(cs, n) for n in (1, 7, cs // k - 1, cs // k, cs // k + 1, cs - 1, cs)}):
            data = bytearray(codec.encode_size(cs))
            data[:length] = rng.randbytes(length)
            frags = codec.encode(memoryview(data), length, cs)
            assert [len(fr) for fr in frags] == [fragment_size(j, k, cs, length) for j in range(k + m)]
            assert max(len(fr) for fr in frags) == parity_size(k, cs, length)
            assert chunk_crc(frags[:k]) == crc32c(bytes(data[:length]))
    assert fragment_size(2, 1, cs, 77, replicated=True) == 77


def test_router_skips_offline_and_recently_failed_targets() -> None:
    from tierfs.client.routing import Router
    from tierfs.meta.client import MetaClient
    from tierfs.net import DataClient

    async def main() -> None:
        meta, data = MetaClient(["127.0.0.1:9"]), DataClient()
        try:
            r = Router(meta, data, failed_ttl=60.0)
            r._apply(pb.ClusterMap(
                version=7,
                nodes=[pb.ClusterNode(node_id=1, data_addr="127.0.0.1:1001", state=pb.NODE_STATE_ONLINE),
                       pb.ClusterNode(node_id=2, data_addr="127.0.0.1:1002", state=pb.NODE_STATE_OFFLINE)],
                targets=[pb.ClusterTarget(target_id=10, node_id=1, state=pb.TARGET_STATE_ONLINE),
                         pb.ClusterTarget(target_id=11, node_id=1, state=pb.TARGET_STATE_FAILED),
                         pb.ClusterTarget(target_id=12, node_id=1, state=pb.TARGET_STATE_READ_ONLY),
                         pb.ClusterTarget(target_id=20, node_id=2, state=pb.TARGET_STATE_ONLINE)],
                groups=[pb.PlacementGroup(group_id=3, width=4, target_ids=[10, 11, 12, 20])]))
            assert await r.targets(3) == (10, 11, 12, 20)
            assert [r.usable(t) for t in (10, 11, 12, 20)] == [True, False, True, False]
            assert data.routes[20] == ("127.0.0.1", 1002)
            r.mark_failed(10)
            assert not r.usable(10) and r.failed_recently(10)
            r.mark_ok(10)
            assert r.usable(10)
            # Slow (hedged): read around, but not "failed" (writes still go there).
            r.mark_slow(10, 0.2)
            assert not r.usable(10) and not r.failed_recently(10)
            r.mark_ok(10)  # an answer does not clear it: it expires
            assert not r.usable(10)
            deadline = time.monotonic() + 5
            while not r.usable(10):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            # Down for writes: offline or failed in the map.
            assert [r.down(t) for t in (10, 11, 12, 20)] == [False, True, False, True]
            assert r.read_targets(3, (10, 11, 12, 20)) == ((10, 11, 12, 20), frozenset())
            # Members being rebuilt: read from the member they replaced when it
            # is still readable, else decode around them; writes use the group.
            r._apply(pb.ClusterMap(
                version=8,
                nodes=[pb.ClusterNode(node_id=1, data_addr="127.0.0.1:1001", state=pb.NODE_STATE_ONLINE)],
                targets=[pb.ClusterTarget(target_id=t, node_id=1, state=pb.TARGET_STATE_ONLINE)
                         for t in (10, 12, 13, 14, 15)],
                groups=[pb.PlacementGroup(group_id=3, width=4, target_ids=[10, 13, 12, 14],
                                          rebuilding=[13, 14], rebuild_sources=[15, 0])]))
            targets = await r.targets(3)
            assert targets == (10, 13, 12, 14)
            assert r.read_targets(3, targets) == ((10, 15, 12, 14), frozenset({3}))
        finally:
            await data.close()
            await meta.close()

    asyncio.run(main())


def test_min_write_fragments_and_hedge_config() -> None:
    from tierfs.client import AsyncClient
    from tierfs.client.client import _Latencies

    def mw(red: tuple[str, int, int], n: int = 0) -> int:
        return AsyncClient(["127.0.0.1:9"], min_write_fragments=n).min_write_fragments(Codec(*red))

    # Defaults: K+1 for ec (one more loss survivable before repair), 2 copies for replica:N >= 2.
    assert mw(("ec", 4, 2)) == 5 and mw(("ec", 8, 3)) == 9 and mw(("ec", 4, 0)) == 4
    assert mw(("replica", 1, 2)) == 2 and mw(("replica", 1, 1)) == 2 and mw(("replica", 1, 0)) == 1
    assert mw(("replica", 1, 2), 1) == 1  # configurable below the default
    # Explicit values are clamped to [K, K+M].
    assert mw(("ec", 4, 2), 2) == 4 and mw(("ec", 4, 2), 6) == 6 and mw(("ec", 4, 2), 99) == 6
    for bad in ({"min_write_fragments": -1}, {"hedge_min": -1.0}, {"slow_target_ttl": -1.0}):
        with pytest.raises(ConfigError) as ei:
            ClientConfig(**bad)  # type: ignore[arg-type]
        assert ei.value.field == next(iter(bad))
    assert load(ClientConfig, env={"TIERFS_HEDGED_READS": "false"}).hedged_reads is False
    # The adaptive hedge delay: twice the p95 of recent latencies, clamped.
    lat = _Latencies()
    assert lat.hedge_delay(0.02, 0.5) == 0.05  # before any sample
    for i in range(64):
        lat.add(0.001 if i % 20 else 0.1)  # 5 % slow outliers
    assert 0.02 <= lat.hedge_delay(0.02, 0.5) <= 0.2
    for _ in range(256):
        lat.add(0.4)
    assert lat.hedge_delay(0.02, 0.5) == 0.5
    for _ in range(256):
        lat.add(0.0001)
    assert lat.hedge_delay(0.02, 0.5) == 0.02


def test_a_config_made_in_code_takes_meta_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Client(config=ClientConfig(...))`` without meta uses TIERFS_META,
    as docs/client.md says; until stop 44 it raised "set TIERFS_META" with
    the variable set (a new user's find)."""
    from tierfs.client import AsyncClient

    async def go() -> None:
        monkeypatch.setenv("TIERFS_META", "127.0.0.1:7100, 127.0.0.1:7101")
        c = AsyncClient(config=ClientConfig(kv_dram_bytes=1 << 20))
        try:
            assert c.config.meta == ["127.0.0.1:7100", "127.0.0.1:7101"] and c.config.kv_dram_bytes == 1 << 20
        finally:
            await c.close()
        c = AsyncClient("127.0.0.1:9", config=ClientConfig())  # an explicit address wins
        try:
            assert c.config.meta == ["127.0.0.1:9"]
        finally:
            await c.close()
        monkeypatch.delenv("TIERFS_META")
        with pytest.raises(ConfigError, match=r"ClientConfig\(meta=\[\.\.\.\]\)\) or set TIERFS_META"):
            AsyncClient(config=ClientConfig())
    asyncio.run(go())
