"""The torch integrations with CUDA tensors, against the engines' session
cluster: safetensors loaded straight to the GPU (``device="cuda"``) equal the
library's own load to the GPU; a Distributed Checkpoint of CUDA tensors saves
and loads back bit-exact, into CUDA and into CPU tensors; and ``client.kv``
moves CUDA tensors of every dtype the engines use bit-exact, also into page
views of one big device tensor.

Every test needs torch with a visible CUDA device and skips otherwise, with
a reason containing "needs CUDA" (tests/skip_policy.py, category ``cuda``):
in .venv-engines (CPU torch) they always skip; they run on a GPU machine
(scripts/gpu_check.sh, docs/kv_tiers.md "GPU path").
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp

from tierfs.client import Client
from tierfs.errors import InvalidArgumentError
from tierfs.integrations import safetensors as tst
from tierfs.integrations.torch_dcp import TierFSStorageReader, TierFSStorageWriter

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch with a visible GPU); none here"),
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

ROOT = f"/cuda-{os.getpid()}"


@pytest.fixture(scope="module")
def client(tierfs_meta: str) -> Iterator[Client]:
    with Client(tierfs_meta, kv_timeout=2.0) as c:
        c.mkdir(ROOT, parents=True, exist_ok=True)
        # three storage nodes in the session cluster; small chunks, so that
        # tensors span several of them
        c.set_layout(ROOT, chunk_size=64 << 10, redundancy="ec:2+1")
        yield c


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "embed": torch.randn(1000, 64, generator=g).bfloat16(),  # 125 KiB: two chunks
        "f32": torch.randn(37, 19, generator=g),
        "f16": torch.randn(8, 3, 5, generator=g).half(),
        "i64": torch.randint(-2**40, 2**40, (13, 2), generator=g),
        "bool": torch.rand(5, 6, generator=g) > 0.5,
        "f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, dtype=torch.float32),
    }


def test_safetensors_load_to_the_gpu_equals_the_library(client: Client, tmp_path: Path) -> None:
    data = st.save(tensors())
    local = tmp_path / "m.safetensors"
    local.write_bytes(data)
    path = f"{ROOT}/m.safetensors"
    assert client.write_bytes(path, data) == len(data)
    want = st.load_file(str(local), device="cuda")
    got = tst.load_file(client, path, device="cuda")
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k].is_cuda, k
        assert same_bits(got[k], w), k
    with tst.safe_open(client, path, device="cuda") as f:
        e = f.get_tensor("embed")
        assert e.is_cuda and same_bits(e, want["embed"])
        rows = f.get_slice("embed")[100:300]
        assert rows.is_cuda and same_bits(rows, want["embed"][100:300])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_of_cuda_tensors_saves_and_loads_bit_exact(client: Client) -> None:
    base = torch.arange(4096, dtype=torch.float32, device="cuda").reshape(64, 64)
    sd = {
        "w": torch.randn(256, 512, device="cuda").bfloat16(),
        "rows": base[:8],  # a view into a larger storage
        "cols": base[:, ::2],  # not contiguous
        "step": 7,
    }
    path = f"{ROOT}/dcp-{uuid.uuid4().hex[:8]}"
    w = TierFSStorageWriter(path, client=client)
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.copied_tensors == 3  # each CUDA tensor went through host memory once
    into_gpu = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(into_gpu, storage_reader=TierFSStorageReader(path, client=client), no_dist=True)
    into_cpu = {k: torch.zeros_like(v, device="cpu") if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(into_cpu, storage_reader=TierFSStorageReader(path, client=client), no_dist=True)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert into_gpu[k].is_cuda and same_bits(into_gpu[k], v), k
            assert not into_cpu[k].is_cuda and same_bits(into_cpu[k], v.cpu()), k
        else:
            assert into_gpu[k] == v and into_cpu[k] == v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool,
                                   torch.float8_e4m3fn, torch.uint8])
def test_cuda_tensors_round_trip_through_kv_bit_exact(client: Client, dtype: torch.dtype) -> None:
    kv = client.kv
    g = torch.Generator(device="cuda").manual_seed(7)
    src = (torch.randn(2, 8, 4, 16, generator=g, device="cuda") * 3).to(dtype)
    key = f"cuda-rt-{dtype}-{os.getpid()}"
    kv.delete(key)
    assert kv.put(key, src) is True
    dst = torch.zeros_like(src)
    n = src.numel() * src.element_size()
    assert kv.get_into(key, dst) == n
    assert same_bits(dst, src)
    # a batch lands each value in its own page of one big device tensor
    pages = torch.zeros(3, *src.shape, dtype=dtype, device="cuda")
    assert kv.batch_get_into([key, f"{key}-absent", key], [pages[0], pages[1], pages[2]]) == [n, None, n]
    assert same_bits(pages[0], src) and same_bits(pages[2], src)
    assert not pages[1].view(torch.uint8).any()
    # a CPU copy of the same bytes reads back equal (the store holds bytes, not devices)
    host = torch.zeros_like(src, device="cpu")
    assert kv.get_into(key, host) == n and same_bits(host, src.cpu())


def test_unusable_cuda_tensors_are_refused_and_change_nothing(client: Client) -> None:
    kv = client.kv
    key = f"cuda-bad-{os.getpid()}"
    src = torch.arange(64, dtype=torch.float32, device="cuda").reshape(8, 8)
    kv.delete(key)
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        kv.put(key, src.t())
    assert not kv.exists(key)
    assert kv.put(key, src) is True
    small = torch.full((4, 8), -1.0, device="cuda")
    with pytest.raises(InvalidArgumentError):
        kv.get_into(key, small)
    assert bool((small == -1.0).all()), "a refused get wrote into the tensor"
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        kv.get_into(key, torch.zeros(8, 8, device="cuda").t())
