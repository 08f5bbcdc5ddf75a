"""tierfs.integrations.safetensors against the safetensors library itself:
files the library wrote, uploaded to a live cluster, load equal to the
library's load of the same bytes from local disk; the lazy handle and its
slices match the library's; save_file writes the library's exact bytes; and
corrupt or truncated files are refused with errors naming file and tensor."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch as st
import torch

from tierfs.client import AsyncClient, Client
from tierfs.errors import InvalidArgumentError
from tierfs.integrations import safetensors as tst

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = f"/safetensors-{os.getpid()}"


@pytest.fixture(scope="module")
def client(tierfs_meta: str) -> Iterator[Client]:
    with Client(tierfs_meta) as c:
        c.mkdir(ROOT, parents=True, exist_ok=True)
        # The session cluster has three storage nodes: ec:2+1 fits them.
        c.set_layout(ROOT, redundancy="ec:2+1")
        # Small chunks, so that tensors here span several of them.
        c.mkdir(f"{ROOT}/small", exist_ok=True)
        c.set_layout(f"{ROOT}/small", chunk_size=64 << 10, redundancy="ec:2+1")
        yield c


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "f32": torch.randn(37, 19, generator=g),
        "f16": torch.randn(8, 3, 5, generator=g).half(),
        "bf16": torch.randn(129, generator=g).bfloat16(),
        "f64": torch.randn(4, 4, generator=g).double(),
        "i64": torch.randint(-2**40, 2**40, (13, 2), generator=g),
        "i32": torch.randint(-2**20, 2**20, (7,), generator=g, dtype=torch.int32),
        "i16": torch.randint(-2**10, 2**10, (3, 3), generator=g, dtype=torch.int16),
        "i8": torch.randint(-100, 100, (17,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (2, 9), generator=g, dtype=torch.uint8),
        "bool": torch.rand(5, 6, generator=g) > 0.5,
        "f8_e4m3": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(16, generator=g).to(torch.float8_e5m2),
        "scalar": torch.tensor(3.25),
        "scalar_i64": torch.tensor(-7),
        "empty": torch.empty(0, dtype=torch.float32),
        "empty_2d": torch.empty(4, 0, 3, dtype=torch.bfloat16),
        "big": torch.randn(300, 257, generator=g),  # ~300 KiB: several 64 KiB chunks
    }


META = {"format": "pt", "note": "ünïcode ✓"}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype, k
        assert g.shape == w.shape, k
        # Bytes, so that NaNs and float8 compare exactly too.
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8)), k


def upload(client: Client, path: str, data: bytes) -> None:
    assert client.write_bytes(path, data) == len(data)


@pytest.mark.parametrize("where", ["", "small/"])
def test_load_file_equals_library(client: Client, tmp_path: Path, where: str) -> None:
    data = st.save(sample(), metadata=META)
    local = tmp_path / "m.safetensors"
    local.write_bytes(data)
    path = f"{ROOT}/{where}lib.safetensors"
    upload(client, path, data)
    got = tst.load_file(client, path)
    assert_same(got, st.load_file(str(local)))
    assert list(got) == list(st.load_file(str(local)))


def test_header_longer_than_first_window(client: Client, tmp_path: Path) -> None:
    # metadata past the 1 MiB first read: the header takes a second read.
    meta = {"blob": "x" * (tst.HEADER_WINDOW + 12345)}
    tensors = {"a": torch.arange(10, dtype=torch.int64), "b": torch.ones(3, 2, dtype=torch.float16)}
    data = st.save(tensors, metadata=meta)
    assert struct.unpack_from("<Q", data)[0] > tst.HEADER_WINDOW
    upload(client, f"{ROOT}/longhdr.safetensors", data)
    assert_same(tst.load_file(client, f"{ROOT}/longhdr.safetensors"), tensors)
    with tst.safe_open(client, f"{ROOT}/longhdr.safetensors") as f:
        assert f.metadata() == meta


def test_safe_open_and_slices_match_library(client: Client, tmp_path: Path) -> None:
    tensors = sample()
    data = st.save(tensors, metadata=META)
    local = tmp_path / "m.safetensors"
    local.write_bytes(data)
    path = f"{ROOT}/small/lazy.safetensors"
    upload(client, path, data)
    with tst.safe_open(client, path) as f, safetensors.safe_open(str(local), framework="pt") as ref:
        # the same order too: keys() sorted, offset_keys() in file order (keys()
        # was in header order until stop 45)
        assert f.keys() == ref.keys() and f.offset_keys() == ref.offset_keys()
        assert f.keys() != f.offset_keys()  # the sample's file order is not its name order
        assert f.metadata() == ref.metadata() == META
        for k in list(ref.keys()):
            assert_same({k: f.get_tensor(k)}, {k: ref.get_tensor(k)})
            s, rs = f.get_slice(k), ref.get_slice(k)
            assert s.get_shape() == rs.get_shape()
            assert s.get_dtype() == rs.get_dtype()
        with pytest.raises(KeyError, match="nope"):
            f.get_tensor("nope")
        for name, key in [("big", slice(5, 17)), ("big", slice(290, None)), ("big", 3), ("big", -1),
                          ("big", (slice(1, 9, 3), slice(2, 6))), ("big", slice(10, 10)),
                          ("f16", (slice(None), 1)), ("bool", slice(2, 4)), ("bf16", slice(100, 200)),
                          ("empty_2d", slice(1, 3)), ("i64", Ellipsis),
                          # numpy and torch integer scalars (refused until stop 47)
                          ("big", np.int64(3)), ("big", (torch.tensor(2), slice(1, 4)))]:
            got, want = f.get_slice(name)[key], ref.get_slice(name)[key]
            assert_same({name: got}, {name: want})
        assert f.get_slice("scalar")[()].item() == 3.25
        assert f.get_slice("scalar")[(Ellipsis,)].item() == ref.get_slice("scalar")[(Ellipsis,)].item() == 3.25


def test_get_slice_reads_only_its_rows(client: Client) -> None:
    # Rows 2..4 of a tensor whose other rows lie past the file's end would
    # fail if read: a slice reads only its own byte range.
    t = torch.arange(40, dtype=torch.int32).reshape(10, 4)
    data = st.save({"t": t})
    path = f"{ROOT}/rows.safetensors"
    upload(client, path, data)
    with tst.safe_open(client, path) as f:
        view, header = f._reader.view, f._reader.header
        assert view is not None and header is not None
        f._reader.view = dataclasses.replace(view, size=header.tensors["t"].begin + 5 * 16)
        assert torch.equal(f.get_slice("t")[2:5], t[2:5])
        with pytest.raises(InvalidArgumentError, match=r"read \d+ of \d+ bytes"):
            f.get_slice("t")[4:7]


def test_save_file_is_byte_identical_to_library(client: Client) -> None:
    tensors = sample()
    # Not contiguous: the library refuses it, save_file packs that one tensor.
    tensors["strided"] = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    packed = {**tensors, "strided": tensors["strided"].contiguous()}
    # The library writes __metadata__ in its hash map's order, which varies
    # from one process to the next: with one key (or none) the whole file is
    # byte-identical; with several, the header parses the same and every
    # byte from the header's length field's value on is too.
    for meta in ({"format": "pt"}, None, META):
        path = f"{ROOT}/small/saved.safetensors"
        tst.save_file(tensors, client, path, metadata=meta)
        got, want = client.read_bytes(path), st.save(packed, metadata=meta)
        if meta is None or len(meta) == 1:
            assert got == want
        else:
            (n,) = struct.unpack_from("<Q", got)
            assert len(got) == len(want) and got[:8] == want[:8] and got[8 + n:] == want[8 + n:]
            assert json.loads(got[8:8 + n]) == json.loads(want[8:8 + n])
        assert_same(st.load(got), packed)
        assert_same(tst.load_file(client, path), packed)
    tst.save_file({}, client, f"{ROOT}/empty.safetensors")
    assert client.read_bytes(f"{ROOT}/empty.safetensors") == st.save({})
    assert tst.load_file(client, f"{ROOT}/empty.safetensors") == {}


def test_save_file_refuses_bad_input(client: Client) -> None:
    with pytest.raises(InvalidArgumentError, match=r"not a torch\.Tensor"):
        tst.save_file({"a": [1, 2]}, client, f"{ROOT}/bad.safetensors")
    with pytest.raises(InvalidArgumentError, match="metadata"):
        tst.save_file({"a": torch.ones(1)}, client, f"{ROOT}/bad.safetensors", metadata={"k": 1})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError, match="complex128"):
        tst.save_file({"c": torch.ones(2, dtype=torch.complex128)}, client, f"{ROOT}/bad.safetensors")
    assert not client.exists(f"{ROOT}/bad.safetensors")


def test_async_api(tierfs_meta: str, client: Client) -> None:
    tensors = sample()

    async def go() -> None:
        async with AsyncClient(tierfs_meta) as ac:
            await tst.asave_file(tensors, ac, f"{ROOT}/async.safetensors", metadata={"format": "pt"})
            assert_same(await tst.aload_file(ac, f"{ROOT}/async.safetensors"), tensors)
            async with tst.asafe_open(ac, f"{ROOT}/async.safetensors") as f:
                assert f.metadata() == {"format": "pt"}
                assert_same({"i64": await f.get_tensor("i64")}, {"i64": tensors["i64"]})
                assert torch.equal(await f.get_slice("big").aget(slice(3, 8)), tensors["big"][3:8])
            with pytest.raises(InvalidArgumentError, match="aload_file"):
                tst.load_file(ac, f"{ROOT}/async.safetensors")  # type: ignore[arg-type]
    asyncio.run(go())
    assert client.read_bytes(f"{ROOT}/async.safetensors") == st.save(tensors, metadata={"format": "pt"})


def build(header: Any, data: bytes = b"", *, raw: bytes | None = None, length: int | None = None) -> bytes:
    h = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


_OK = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
       "b": {"dtype": "I16", "shape": [2, 2], "data_offsets": [8, 16]}}


def _with(**changes: Any) -> dict[str, Any]:
    h = json.loads(json.dumps(_OK))
    for k, v in changes.items():
        name, field = k.split("__")
        h[name][field] = v
    return h


CORRUPT: dict[str, tuple[bytes, str]] = {
    "shorter-than-length": (b"\x05\x00\x00", "shorter than the 8-byte header length"),
    "length-past-eof": (build(_OK, bytes(16), length=10_000), "runs past the end of the file"),
    "length-huge": (build(_OK, bytes(16), length=2**63), "exceeds"),
    "truncated-header": (build(_OK)[:40], "runs past the end of the file"),
    "not-json": (build(None, bytes(16), raw=b"{not json!!"), "not JSON"),
    "not-utf8": (build(None, bytes(16), raw=b'{"\xff": 1}'), "not JSON"),
    "json-list": (build([1, 2]), "not an object"),
    "entry-not-object": (build({"a": 3}), "tensor 'a'.*not an object"),
    "unknown-dtype": (build(_with(a__dtype="F128"), bytes(16)), "tensor 'a'.*unknown dtype 'F128'"),
    "no-dtype": (build(_with(b__dtype=None), bytes(16)), "tensor 'b'.*dtype"),
    "bad-shape": (build(_with(b__shape=[2, -2]), bytes(16)), "tensor 'b'.*shape"),
    "shape-not-list": (build(_with(b__shape="2x2"), bytes(16)), "tensor 'b'.*shape"),
    "size-mismatch": (build(_with(b__shape=[3, 2]), bytes(16)), "tensor 'b'.*needs 12"),
    "offsets-reversed": (build(_with(b__data_offsets=[16, 8]), bytes(16)), "tensor 'b'.*end before"),
    "offsets-not-pair": (build(_with(b__data_offsets=[8]), bytes(16)), "tensor 'b'.*data_offsets"),
    "overlap": (build(_with(b__data_offsets=[4, 12]), bytes(16)), "tensor 'b'.*overlaps"),
    "gap": (build(_with(b__data_offsets=[12, 20]), bytes(20)), "tensor 'b'.*gap"),
    "past-end": (build(_OK, bytes(12)), "tensor 'b'.*past its end"),
    "trailing-bytes": (build(_OK, bytes(20)), r"data ends at byte \d+ but the file has \d+ bytes"),
    "bad-metadata": (build({**_OK, "__metadata__": {"k": 1}}, bytes(16)), "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_files_refused(client: Client, case: str) -> None:
    data, match = CORRUPT[case]
    # The library refuses each of these too (what a valid file is, is its call).
    with pytest.raises(Exception):  # noqa: B017 - the library's errors have no common type
        st.load(data)
    path = f"{ROOT}/corrupt-{case}.safetensors"
    upload(client, path, data)
    with pytest.raises(InvalidArgumentError, match=match) as ei:
        tst.load_file(client, path)
    assert path in str(ei.value)
    with pytest.raises(InvalidArgumentError, match=match):
        tst.safe_open(client, path).__enter__()


def test_dtype_torch_lacks_is_clear(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    data = build(_OK, bytes(16))
    upload(client, f"{ROOT}/lacks.safetensors", data)
    monkeypatch.setitem(tst._DTYPES, "I16", ("int16_not_in_torch", 2))
    with pytest.raises(InvalidArgumentError, match=r"tensor 'b'.*'I16', which this torch lacks"):
        tst.load_file(client, f"{ROOT}/lacks.safetensors")


def test_wrong_client_type_is_clear(client: Client) -> None:
    with pytest.raises(InvalidArgumentError, match="needs a tierfs Client"):
        tst.load_file("localhost:1", f"{ROOT}/x")  # type: ignore[arg-type]
