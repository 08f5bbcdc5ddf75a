"""client.kv with real torch CPU tensors (the engines' buffers): every dtype
the engines use round-trips bit-exact, straight into the destination tensor,
and tensors that have no plain byte view are refused, changing nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tierfs.client import Client
from tierfs.errors import InvalidArgumentError

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def kv(tierfs_meta: str) -> Iterator[object]:
    with Client(tierfs_meta, kv_timeout=2.0) as c:
        yield c.kv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool,
                                   torch.float8_e4m3fn, torch.uint8])
def test_tensor_round_trip_bit_exact(kv, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(7)
    src = (torch.randn(2, 8, 4, 16, generator=g) * 3).to(dtype)
    key = f"torch-rt-{dtype}"
    kv.delete(key)
    assert kv.put(key, src) is True
    dst = torch.zeros_like(src)
    assert kv.get_into(key, dst) == src.numel() * src.element_size()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    # A batch lands each value in its own slice of one big tensor (page views).
    pages = torch.zeros(3, *src.shape, dtype=dtype)
    assert kv.batch_get_into([key, "torch-rt-absent", key], [pages[0], pages[1], pages[2]]) == [
        src.numel() * src.element_size(), None, src.numel() * src.element_size()]
    assert torch.equal(pages[0].view(torch.uint8), src.view(torch.uint8))
    assert not pages[1].view(torch.uint8).any()


def test_unusable_tensors_are_refused_and_change_nothing(kv) -> None:  # type: ignore[no-untyped-def]
    src = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    kv.delete("torch-bad")
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        kv.put("torch-bad", src.t())
    assert not kv.exists("torch-bad")
    kv.put("torch-bad", src)
    dst = torch.full((8, 8), -1.0)
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        kv.get_into("torch-bad", dst.t())
    small = torch.full((4, 8), -1.0)
    with pytest.raises(InvalidArgumentError):
        kv.get_into("torch-bad", small)
    assert torch.equal(small, torch.full((4, 8), -1.0)), "a refused get wrote into the buffer"
    # A tensor that requires grad is read through its detached alias.
    w = torch.ones(8, 8, requires_grad=True)
    assert kv.get_into("torch-bad", w) == 256
    assert torch.equal(w.detach(), src)
