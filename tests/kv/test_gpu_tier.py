"""The GPU (HBM) path: GpuTier through the conformance suite, CUDA tensors in
and out of it, the pinned staging pool, and CUDA tensors through
``client.kv`` against a real cluster.

Every test here needs torch with a visible CUDA device and skips otherwise,
with a reason containing "needs CUDA" (tests/skip_policy.py, category
``cuda``, always allowed: no GPU is the normal case here). They ran, and
passed, on an H200 (scripts/gpu_check.sh; docs/kv_tiers.md, "GPU path").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.faults.harness import FAST_META
from tests.kv.conformance import DemotingTierConformance, MiB, TierFactory, pattern, run
from tierfs.errors import InvalidArgumentError
from tierfs.kv.gpu import cuda_available

pytestmark = [
    pytest.mark.skipif(not cuda_available(), reason="needs CUDA (torch with a visible GPU); none here"),
    pytest.mark.timeout(120),
]


def _torch() -> Any:
    import torch  # type: ignore[import-not-found,unused-ignore]

    return torch


class TestGpuTier(DemotingTierConformance):
    @pytest.fixture
    def make_tier(self) -> TierFactory:
        from tierfs.kv.gpu import GpuTier

        return lambda cap: GpuTier(cap)


def test_cuda_tensors_in_and_out_of_the_gpu_tier() -> None:
    from tierfs.kv.gpu import GpuTier

    torch = _torch()
    tier = GpuTier(8 * MiB)

    async def main() -> None:
        src = torch.arange(300_000, dtype=torch.float32, device="cuda")
        assert await tier.put(b"f32", src)
        assert await tier.size_of(b"f32") == src.numel() * 4
        out = torch.empty_like(src)
        assert await tier.get_into(b"f32", out) == src.numel() * 4
        assert torch.equal(out, src)
        # a bfloat16 tensor (no numpy dtype) stored from the device, read into host memory
        bf = torch.randn(1000, dtype=torch.bfloat16, device="cuda")
        assert await tier.put(b"bf16", bf)
        host = bytearray(2000)
        assert await tier.get_into(b"bf16", host) == 2000
        assert bytes(host) == bf.cpu().view(torch.uint8).numpy().tobytes()
        # a host value read into a CUDA tensor
        data = pattern(b"h", 70_001)
        assert await tier.put(b"h", memoryview(data))
        dev = torch.zeros(70_001, dtype=torch.uint8, device="cuda")
        assert await tier.get_into(b"h", dev) == 70_001
        assert bytes(dev.cpu().numpy()) == data
        # too small a CUDA destination: refused, untouched
        tiny = torch.full((10,), 7, dtype=torch.uint8, device="cuda")
        with pytest.raises(InvalidArgumentError, match="smaller"):
            await tier.get_into(b"h", tiny)
        assert bool((tiny == 7).all())
        with pytest.raises(InvalidArgumentError, match="contiguous"):
            await tier.put(b"nc", torch.zeros(64, 64, device="cuda")[:, ::2])
        await tier.close()

    run(main())


def test_staging_buffers_are_pinned_and_reused() -> None:
    from tierfs.kv.gpu import StagingPool

    pool = StagingPool()
    a = pool.acquire(100_000)
    assert a.tensor.is_pinned() and len(a.view) == 100_000
    pool.release(a)
    b = pool.acquire(120_000)  # the same size class: the same buffer
    assert b.tensor.data_ptr() == a.tensor.data_ptr() and pool.allocated == 1
    pool.release(b)


# ---- CUDA tensors through client.kv -------------------------------------------------


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tierfs.local import LocalCluster

    c = LocalCluster(tmp_path_factory.mktemp("gpu"), n_meta=1, n_storage=3, extra_meta_args=list(FAST_META))
    c.up(timeout=120)
    yield c
    c.stop()


@pytest.mark.parametrize("dram", [0, 16 * MiB], ids=["cluster-only", "with-dram-tier"])
def test_cuda_tensors_round_trip_through_client_kv(cl: Any, dram: int) -> None:
    from tests.kv.test_kv_cluster import pool_ready
    from tierfs.client import Client

    torch = _torch()
    with Client(cl.meta_addrs, kv_timeout=2.0, request_timeout=5.0, kv_dram_bytes=dram) as c:
        pool_ready(c, "default")
        kv = c.kv
        src = torch.randn(256, 1024, dtype=torch.float16, device="cuda")
        assert kv.put(f"t{dram}", src) is True
        out = torch.zeros_like(src)
        assert kv.get_into(f"t{dram}", out) == src.numel() * 2
        assert torch.equal(out, src)
        # batches mixing CUDA tensors and host buffers
        keys = [f"b{dram}-{i}" for i in range(4)]
        vals: list[Any] = [torch.full((1000,), i, dtype=torch.int32, device="cuda") for i in range(2)]
        vals += [pattern(b"x", 4000), bytearray(pattern(b"y", 4000))]
        assert kv.batch_put(keys, vals) == [True] * 4
        dests: list[Any] = [torch.zeros(1000, dtype=torch.int32, device="cuda") for _ in range(2)]
        dests += [bytearray(4000), torch.zeros(4000, dtype=torch.uint8, device="cuda")]
        assert kv.batch_get_into(keys, dests) == [4000] * 4
        assert torch.equal(dests[0], vals[0]) and torch.equal(dests[1], vals[1])
        assert bytes(dests[2]) == vals[2] and bytes(dests[3].cpu().numpy()) == bytes(vals[3])
        # a whole number of elements of the destination's dtype, or nothing written
        kv.put(f"six{dram}", b"123456")
        f32 = torch.full((4,), 9.0, device="cuda")
        with pytest.raises(InvalidArgumentError, match="whole number of 4-byte elements"):
            kv.get_into(f"six{dram}", f32)
        assert bool((f32 == 9.0).all())
        assert kv.get_into("never-put", torch.zeros(10, device="cuda")) is None

