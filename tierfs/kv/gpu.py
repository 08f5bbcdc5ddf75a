"""The GPU (HBM) path of the KV API: CUDA tensors in and out, and an HBM tier.

It runs where a GPU is: tests/kv/test_gpu_tier.py and tests/engines/test_cuda.py
passed on an H200 (scripts/gpu_check.sh); elsewhere they skip with "needs
CUDA". docs/kv_tiers.md, "GPU path", says what ran and what it measured.

* **Staging.** The data plane and the host tiers move host memory. A put
  or a ``get_into`` with a CUDA tensor goes through a pinned (page-locked)
  host buffer: device -> pinned with ``non_blocking=True``, one stream
  synchronisation for the whole batch, then the ordinary host path; a get
  lands in pinned buffers and is copied up the same way. The pinned
  buffers come from a :class:`StagingPool` (power-of-two size classes,
  reused: pinning fresh memory costs far more than the copy).
* **GPUDirect Storage.** :func:`gds_available` tells whether ``kvikio``
  imports. Nothing uses it yet: GDS moves data between a file and the GPU,
  and the KV data path is a socket (or shared memory); the place it would
  fit is an SSD tier reading straight into HBM. It is guarded, never a
  dependency.
* **GpuTier.** An HBM-resident cache tier: one CUDA ``uint8`` arena
  allocated up front, carved by the DRAM tier's extent allocator
  (``tierfs.kv.tiers``), with the same index, policy, eviction, demotion
  and slot reference counts. Values and destinations may be CUDA tensors
  (device-to-device copies) or host buffers (through the staging pool).

Copies run on the current CUDA stream and are synchronised before a call
returns, so a caller may reuse its tensor (or we our staging buffer) at
once; that costs a stream sync per call, a price paid for simplicity.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tierfs.buffers import ALIGN
from tierfs.errors import ConfigError, InvalidArgumentError
from tierfs.kv.keys import is_cuda_tensor
from tierfs.kv.policy import EvictionPolicy
from tierfs.kv.tiers import (
    MAX_KEY_BYTES,
    EvictCallback,
    _Entry,
    _ExtentTier,
    check_key,
    dest_view,
    source_view,
)

if TYPE_CHECKING:
    from tierfs.kv.client import AsyncKV

__all__ = [
    "GpuTier",
    "StagingBuffer",
    "StagingPool",
    "cuda_available",
    "cuda_bytes",
    "gds_available",
    "get_into_cuda",
    "put_cuda",
    "staging_pool",
]


def _torch() -> Any:
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return torch


@functools.cache
def cuda_available() -> bool:
    """torch imports and sees a CUDA device (asked once per process)."""
    torch = _torch()
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def gds_available() -> bool:
    """``kvikio`` (GPUDirect Storage) imports. Informational: no path uses it yet."""
    try:
        import kvikio  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except Exception:
        return False
    return True


def _need_cuda() -> Any:
    torch = _torch()
    if torch is None or not cuda_available():
        raise ConfigError("the GPU path needs CUDA (torch with a visible GPU)", field="device")
    return torch


def cuda_bytes(t: Any, what: str = "tensor") -> Any:
    """A flat ``uint8`` alias of a contiguous CUDA tensor (any dtype)."""
    torch = _need_cuda()
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"{what}: layout {t.layout} is not strided")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{what} of shape {tuple(t.shape)} is not contiguous (call .contiguous())")
    return t.detach().reshape(-1).view(torch.uint8)


def _sync(devices: set[Any]) -> None:
    torch = _torch()
    for d in devices:
        torch.cuda.current_stream(d).synchronize()


# -- pinned staging buffers -----------------------------------------------------------


class StagingBuffer:
    """One pinned host buffer of at least ``n`` bytes, lent by a StagingPool."""

    __slots__ = ("cls", "n", "tensor", "view")

    def __init__(self, tensor: Any, cls: int, n: int) -> None:
        self.tensor = tensor  # pinned uint8, ``cls`` bytes
        self.cls = cls
        self.n = n
        self.view = memoryview(tensor.numpy()).cast("B")[:n]


class StagingPool:
    """Pinned host buffers in power-of-two size classes, kept for reuse up to
    ``max_cached_bytes`` in all (a buffer past that is freed on release).
    Thread-safe: ``Client`` runs the async client on its own loop thread."""

    MIN = 64 << 10

    def __init__(self, max_cached_bytes: int = 256 << 20) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[Any]] = {}
        self._cached = 0
        self._lock = threading.Lock()
        self.allocated = 0  # pinned allocations made (a reused buffer is not one)

    def acquire(self, n: int) -> StagingBuffer:
        torch = _need_cuda()
        cls = max(self.MIN, 1 << max(0, n - 1).bit_length())
        with self._lock:
            free = self._free.get(cls)
            t = free.pop() if free else None
            if t is not None:
                self._cached -= cls
        if t is None:
            t = torch.empty(cls, dtype=torch.uint8, pin_memory=True)
            self.allocated += 1
        return StagingBuffer(t, cls, n)

    def release(self, buf: StagingBuffer) -> None:
        with contextlib.suppress(BufferError):
            buf.view.release()
        with self._lock:
            if self._cached + buf.cls <= self.max_cached_bytes:
                self._free.setdefault(buf.cls, []).append(buf.tensor)
                self._cached += buf.cls

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._cached = 0


_POOL: StagingPool | None = None
_POOL_LOCK = threading.Lock()


def staging_pool() -> StagingPool:
    """The process's staging pool (pinned memory is a process-wide resource)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = StagingPool()
        return _POOL


# -- client.kv with CUDA tensors ------------------------------------------------------


async def put_cuda(kv: AsyncKV, keys: Sequence[Any], bufs: Sequence[Any], **kw: Any) -> list[bool]:
    """``kv.batch_put`` where some buffers are CUDA tensors: each is copied
    into a pinned buffer (one stream sync for the batch) and put from there."""
    pool = staging_pool()
    staged: list[StagingBuffer] = []
    host: list[Any] = list(bufs)
    try:
        devices = set()
        for i, b in enumerate(bufs):
            if not is_cuda_tensor(b):
                continue
            flat = cuda_bytes(b, f"buffer {i}")
            n = flat.numel()
            s = pool.acquire(n)
            staged.append(s)
            if n:
                s.tensor[:n].copy_(flat, non_blocking=True)
            devices.add(flat.device)
            host[i] = s.view
        _sync(devices)
        return await kv.batch_put(keys, host, **kw)
    finally:
        for s in staged:
            pool.release(s)


async def get_into_cuda(kv: AsyncKV, keys: Sequence[Any], bufs: Sequence[Any], *,
                        misfit: str = "raise") -> list[int | None]:
    """``kv.batch_get_into`` where some destinations are CUDA tensors: the
    objects land in pinned buffers, then go up to the device. ``misfit``:
    as for ``batch_get_into``."""
    pool = staging_pool()
    staged: dict[int, tuple[StagingBuffer, Any]] = {}
    host: list[Any] = list(bufs)
    try:
        for i, b in enumerate(bufs):
            if is_cuda_tensor(b):
                flat = cuda_bytes(b, f"buffer {i}")
                s = pool.acquire(flat.numel())
                staged[i] = (s, flat)
                host[i] = s.view
        got = await kv.batch_get_into(keys, host, misfit=misfit)
        devices = set()
        for i, (s, flat) in staged.items():
            n = got[i]
            if n is None:
                continue
            size = bufs[i].element_size()
            if n % size:  # checked before anything is written to the tensor
                if misfit == "miss":
                    got[i] = None
                    continue
                raise InvalidArgumentError(
                    f"object {keys[i]!r} of {n} bytes is not a whole number of {size}-byte elements of its "
                    f"tensor's dtype")
            if n:
                flat[:n].copy_(s.tensor[:n], non_blocking=True)
                devices.add(flat.device)
        _sync(devices)
        return got
    finally:
        for s, _ in staged.values():
            pool.release(s)


# -- the HBM tier ---------------------------------------------------------------------


class GpuTier(_ExtentTier):
    """Objects in one pre-allocated CUDA ``uint8`` arena of ``capacity_bytes``
    (rounded down to the granule), on ``device`` (default: the current one).
    Values and destinations: CUDA tensors (copied device to device) or host
    buffers (through pinned staging). ``borrow`` lends nothing (no host view)."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        policy: str | EvictionPolicy = "lru",
        granule: int = ALIGN,
        device: Any = None,
        staging: StagingPool | None = None,
        name: str = "gpu",
    ) -> None:
        torch = _need_cuda()
        if granule < 1 or granule & (granule - 1):
            raise ConfigError(f"granule must be a power of two, got {granule}", field="granule")
        if capacity_bytes < granule:
            raise ConfigError(f"capacity {capacity_bytes} is below one granule ({granule})", field="capacity_bytes")
        capacity_bytes = capacity_bytes // granule * granule
        super().__init__(name, capacity_bytes, granule, policy)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self._arena: Any = torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device)
        self._staging = staging or staging_pool()

    # copies ------------------------------------------------------------------------

    def _from_host(self, e: _Entry, src: memoryview) -> None:
        s = self._staging.acquire(e.size)
        try:
            s.view[: e.size] = src
            self._arena[e.pos : e.end].copy_(s.tensor[: e.size], non_blocking=True)
            _sync({self.device})
        finally:
            self._staging.release(s)

    def _to_host(self, e: _Entry, dest: memoryview) -> None:
        s = self._staging.acquire(e.size)
        try:
            s.tensor[: e.size].copy_(self._arena[e.pos : e.end], non_blocking=True)
            _sync({self.device})
            dest[: e.size] = s.view[: e.size]
        finally:
            self._staging.release(s)

    async def _store(self, e: _Entry, src: Any) -> None:
        if not e.size:
            return
        if isinstance(src, memoryview):
            self._from_host(e, src)
        else:  # a flat uint8 CUDA tensor
            self._arena[e.pos : e.end].copy_(src)
            _sync({self.device, src.device})

    async def _demote(self, e: _Entry, cb: EvictCallback) -> None:
        s = self._staging.acquire(e.size)
        try:
            if e.size:
                s.tensor[: e.size].copy_(self._arena[e.pos : e.end], non_blocking=True)
                _sync({self.device})
            await cb(e.key, s.view[: e.size].toreadonly(), e.expires)
        finally:
            self._staging.release(s)

    # the interface -----------------------------------------------------------------

    async def put(self, key: bytes, buf: Any, *, parent: bytes | None = None, expires: float = 0.0) -> bool:
        self._check_open()
        if is_cuda_tensor(buf):
            src: Any = cuda_bytes(buf, "the value")
            size = int(src.numel())
        else:
            src = source_view(buf)
            size = src.nbytes
        key = check_key(key)
        # The same steps as _ExtentTier.put, for a source that may be a tensor.
        return await self._put_checked(key, src, size, expires, parent)

    async def get_into(self, key: bytes, dest: Any) -> int | None:
        cuda = is_cuda_tensor(dest)
        d: Any = cuda_bytes(dest, "the destination") if cuda else dest_view(dest)
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            key = check_key(key)
        key, e = self._lookup(key)
        if e is None:
            self.misses += 1
            self._policy.on_miss(key)
            return None
        n = e.size
        have = int(d.numel()) if cuda else d.nbytes
        if have < n:
            raise InvalidArgumentError(f"destination of {have} bytes is smaller than object {key!r} of {n} bytes")
        # No await from here on: nothing can evict and reuse the extent mid-copy.
        if n:
            if cuda:
                d[:n].copy_(self._arena[e.pos : e.end])
                _sync({self.device, d.device})
            else:
                self._to_host(e, d)
        self._policy.on_access(key)
        self.hits += 1
        self.bytes_out += n
        return n

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._index.clear()
        self._wake()
        self._arena = None
