"""vLLM benchmark: the time to load the KV of a 4,096-token prefix of an
8B-class layout through TierFSSecondaryTier, against vLLM's CPU offloading
tier alone (a warm local hit), in the same run.

Layout: 32 layers x 8 KV heads x 128 dims, bf16, K and V: 128 KiB per token,
so 4,096 tokens are 512 MiB. vLLM's offloading blocks are 16 tokens (2 MiB).

Everything is vLLM's own code except the transport: vLLM's offloading spec
factory builds ``TierFSCPUTieringSpec`` (``TieringOffloadingSpec`` with the
CPU worker half of tierfs.integrations.vllm_cpu) from an ``OffloadingConfig``
with that layout; its ``TieringOffloadingManager`` (the CPU primary tier plus
our tier, made by vLLM's tier factory) and the worker are driven as the
scheduler and the model runner drive them, in steps of ``--step-ms``:

* store: 256 blocks written into a host-resident "device" KV cache, copied to
  the primary tier by the worker (``submit_store``), ``complete_store``
  cascades them to TierFS; the figure ends when the cascade has finished;
* CPU tier alone (warm hit): lookups hit the primary tier, ``prepare_load``,
  the worker copies the rows into the device cache, ``complete_load``;
* TierFS: ``reset_cache`` empties the primary tier (vLLM keeps secondary
  tiers), then lookups (batched, answered between steps), promotion from
  TierFS into the primary rows, and the same worker copy. Reported with and
  without the final copy. Every run checks the loaded bytes.

TierFS runs as ``LocalCluster`` (3 meta, 3 storage daemons, tcp on loopback)
with a replica:1 pool that holds the prefix in memory.

The time to first token saved is recompute time minus load time, with the
recompute time from a stated prefill rate (``--prefill-tokens-per-s``, 15,000
by default; see PREFILL_SOURCE).

    python -m bench.engines_vllm [--tokens 4096] [--repeat 3]

Writes bench/results/engines_vllm.{json,md}. Needs .venv-engines.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import MEASURED_PREFILL_SOURCE, MEASURED_PREFILL_TOK_S, create_kv_pool

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
KiB, MiB = 1 << 10, 1 << 20

LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 32, 8, 128, 2
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES   # K and V: 128 KiB
BLOCK_TOKENS = 16

PREFILL_SOURCE = (
    "Stated, not measured here: 15,000 tokens/s of prefill for an 8B model on one H100 SXM "
    "(range 10,000-20,000 given too). Basis: a forward pass costs about 2N FLOPs per token "
    "(Kaplan et al. 2020, 'Scaling Laws for Neural Language Models', sec. 2.1), 16 GFLOP/token "
    "for N = 8e9; NVIDIA's H100 SXM datasheet gives 989 TFLOPS dense BF16, so 15,000 tokens/s "
    "is about 24% of peak, 10,000-20,000 is 16-32%, the usual range for vLLM prefill of a "
    "single long prompt."
)


def _offloading_config(tokens: int, meta: str, pool: str, transport: str) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    n_blocks = tokens // BLOCK_TOKENS
    block_bytes = BLOCK_TOKENS * BYTES_PER_TOKEN
    extra = {
        "spec_name": "TierFSCPUTieringSpec", "spec_module_path": "tierfs.integrations.vllm_cpu",
        # Room for the stored prefix and a promoted copy of it.
        "cpu_bytes_to_use": 2 * n_blocks * block_bytes + 16 * MiB,
        "secondary_tiers": [{"type": "TierFSSecondaryTier", "module_path": "tierfs.integrations.vllm",
                             "meta": meta, "pool": pool, "transport": transport,
                             "namespace": f"bench-8b-{uuid.uuid4().hex[:8]}"}],
    }
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, group_id=0,
                                      layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))),),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False, extra_config=extra,
        engine_id=f"bench-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="bench/llama-8b-layout", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


class Bench:
    def __init__(self, tokens: int, meta: str, pool: str, step_s: float, transport: str) -> None:
        import torch
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            make_offload_key,
        )
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        self.torch = torch
        self.step_s = step_s
        self.n = tokens // BLOCK_TOKENS
        self.block_bytes = BLOCK_TOKENS * BYTES_PER_TOKEN
        self.nbytes = self.n * self.block_bytes
        self.spec = OffloadingSpecFactory.create_spec(_offloading_config(tokens, meta, pool, transport))
        self.manager = self.spec.get_manager()
        (self.tier,) = self.manager.secondary_tiers
        # The host-resident "device" KV cache: blocks [0, n) hold the prefix as
        # prefill wrote it, blocks [n, 2n) receive each load.
        self.device = torch.empty((2 * self.n, self.block_bytes), dtype=torch.int8)
        g = torch.Generator().manual_seed(7)
        self.device[: self.n] = torch.randint(-128, 128, (self.n, self.block_bytes), dtype=torch.int8,
                                              generator=g)
        self.device[self.n:].zero_()   # faulted in now, not inside the first timed load
        kv = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(self.device, self.block_bytes)],
                               group_data_refs=[[CanonicalKVCacheRef(0, self.block_bytes)]])
        self.worker = self.spec.get_worker(kv)
        run = uuid.uuid4().hex
        self.keys = [make_offload_key(hashlib.sha256(f"{run}/{i}".encode()).digest(), 0) for i in range(self.n)]
        self._job = 1 << 40
        self._req = 0

    # ---- vLLM's scheduler/worker calls ------------------------------------------------------

    def _ctx(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self._req += 1
        ctx = ReqContext(req_id=f"bench-{self._req}")
        self.manager.on_new_request(ctx)
        return ctx

    def _step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(self.step_s)

    def _gpu_spec(self, first_block: int) -> Any:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        return GPULoadStoreSpec(list(range(first_block, first_block + self.n)), group_sizes=[self.n],
                                block_indices=[0])

    def _worker_job(self, store: bool, cpu_spec: Any, first_block: int) -> None:
        self._job += 1
        if store:
            assert self.worker.submit_store(self._job, self._gpu_spec(first_block), cpu_spec)
        else:
            assert self.worker.submit_load(self._job, cpu_spec, self._gpu_spec(first_block))
        done = self.worker.get_finished()
        assert [r.job_id for r in done] == [self._job] and done[0].success

    def store(self) -> float:
        ctx = self._ctx()
        t0 = time.perf_counter()
        out = self.manager.prepare_store(self.keys, ctx)
        assert out is not None and len(out.keys_to_store) == self.n
        self._worker_job(True, out.store_spec, 0)
        self.manager.complete_store(self.keys, ctx)
        while self.manager.has_pending_work():
            self._step()
        elapsed = time.perf_counter() - t0
        self.manager.on_request_finished(ctx)
        self._step()
        return elapsed

    def _load_from_primary(self, ctx: Any) -> None:
        cpu_spec = self.manager.prepare_load(self.keys, ctx)
        self._worker_job(False, cpu_spec, self.n)
        self.manager.complete_load(self.keys, ctx)

    def _check(self) -> None:
        assert self.torch.equal(self.device[self.n:], self.device[: self.n]), "loaded KV differs from stored"
        self.device[self.n:].zero_()

    def cpu_hit(self) -> float:
        from vllm.v1.kv_offload.base import LookupResult

        ctx = self._ctx()
        t0 = time.perf_counter()
        assert all(self.manager.lookup(k, ctx) is LookupResult.HIT for k in self.keys)
        self._load_from_primary(ctx)
        elapsed = time.perf_counter() - t0
        self.manager.on_request_finished(ctx)
        self._check()
        return elapsed

    def tierfs_hit(self) -> tuple[float, float]:
        """(to the primary tier, to the device cache) in seconds."""
        from vllm.v1.kv_offload.base import LookupResult

        self.manager.reset_cache()          # the CPU tier forgets; TierFS keeps
        ctx = self._ctx()
        t0 = time.perf_counter()
        deadline = time.monotonic() + 120
        while True:
            results = [self.manager.lookup(k, ctx) for k in self.keys]
            if all(r is LookupResult.HIT for r in results):
                break
            if any(r is LookupResult.MISS for r in results):
                raise RuntimeError(f"{sum(r is LookupResult.MISS for r in results)} chunks missed in TierFS")
            if time.monotonic() > deadline:
                raise TimeoutError("TierFS load did not finish in 120 s")
            self._step()
        t_primary = time.perf_counter() - t0
        self._load_from_primary(ctx)
        t_device = time.perf_counter() - t0
        self.manager.on_request_finished(ctx)
        self._step()
        self._check()
        return t_primary, t_device

    def direct_get(self) -> float:
        """The transport's share: ``batch_get_into`` of the same objects into
        the same (now free) primary rows, batched as the tier batches (its
        ``batch_bytes``, ``batches_in_flight`` at a time: the tier's own
        ``_load``), without vLLM's machinery."""
        self.manager.reset_cache()
        tier = self.tier
        bs = tier.block_size_bytes
        keys = [tier.key_of(k) for k in self.keys]
        views = [tier._flat[i * bs:(i + 1) * bs] for i in range(self.n)]
        try:
            t0 = time.perf_counter()
            got, error = asyncio.run_coroutine_threadsafe(tier._load(keys, views), tier._loop).result()
            elapsed = time.perf_counter() - t0
        finally:
            for v in views:
                v.release()
        assert got == [bs] * self.n, error
        self.manager.reset_cache()
        return elapsed

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from tierfs.local import LocalCluster

    tokens = args.tokens
    n_bytes = tokens * BYTES_PER_TOKEN
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    load1 = os.getloadavg()[0]
    cluster = LocalCluster(tmp / "cluster", n_storage=3)
    cluster.export_token()  # security on: this cluster's admin token
    t_up = time.perf_counter()
    cluster.up(timeout=120)
    t_up = time.perf_counter() - t_up
    runs: dict[str, dict[str, Any]] = {}
    block_bytes = BLOCK_TOKENS * BYTES_PER_TOKEN
    try:
        meta = ",".join(cluster.meta_addrs)
        pool = "bench-vllm"
        # replica:1 over 3 targets: each holds about a third; room for both runs.
        create_kv_pool(cluster.meta_addrs, pool, max(64 * MiB, n_bytes))
        for transport in args.transports:
            t_setup = time.perf_counter()
            bench = Bench(tokens, meta, pool, args.step_ms / 1e3, transport)
            t_setup = time.perf_counter() - t_setup
            try:
                store = bench.store()
                # One untimed run of each path first: first-use costs (lazy
                # imports, connections, the daemons' first sends) are not the
                # steady state a serving engine sees.
                bench.cpu_hit()
                bench.tierfs_hit()
                cpu = [bench.cpu_hit() for _ in range(args.repeat)]
                tfs = [bench.tierfs_hit() for _ in range(args.repeat)]
                direct = [bench.direct_get() for _ in range(args.repeat)]
            finally:
                bench.close()
            runs[transport] = {"setup_s": t_setup, "store_s": store, "cpu": cpu, "tierfs": tfs, "direct": direct}
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def gbps(s: float) -> float:
        return n_bytes / s / 1e9

    rates = {"low": 10_000.0, "stated": float(args.prefill_tokens_per_s), "high": 20_000.0,
             "measured_h200": float(MEASURED_PREFILL_TOK_S)}
    recompute = {k: tokens / r for k, r in rates.items()}
    cpu_all = [t for r in runs.values() for t in r["cpu"]]
    med_cpu = statistics.median(cpu_all)
    out_runs: dict[str, Any] = {}
    for transport, r in runs.items():
        med_primary = statistics.median(t for t, _ in r["tierfs"])
        med_device = statistics.median(t for _, t in r["tierfs"])
        out_runs[transport] = {
            "setup_s": r["setup_s"], "store_s": r["store_s"], "store_gbps": gbps(r["store_s"]),
            "tierfs_to_primary_s": [t for t, _ in r["tierfs"]], "tierfs_to_primary_gbps": gbps(med_primary),
            "tierfs_to_device_s": [t for _, t in r["tierfs"]], "tierfs_to_device_gbps": gbps(med_device),
            "ttft_saved_s": {k: rc - med_device for k, rc in recompute.items()},
            "batch_get_into_s": r["direct"], "batch_get_into_gbps": gbps(statistics.median(r["direct"])),
        }
    import torch
    import vllm

    return {
        "bench": "engines_vllm",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_start": load1},
        "layout": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                   "bytes_per_token": BYTES_PER_TOKEN, "block_tokens": BLOCK_TOKENS, "chunk_bytes": block_bytes},
        "tokens": tokens, "bytes": n_bytes, "repeat": args.repeat, "step_ms": args.step_ms,
        "cluster": {"meta": 3, "storage": 3, "pool": "replica:1, in memory", "up_s": t_up},
        "cpu_tier_hit_s": cpu_all, "cpu_tier_hit_gbps": gbps(med_cpu),
        "cpu_tier_ttft_saved_s": {k: rc - med_cpu for k, rc in recompute.items()},
        "tierfs": out_runs,
        "prefill_tokens_per_s": rates, "prefill_source": PREFILL_SOURCE + " " + MEASURED_PREFILL_SOURCE + ".",
        "recompute_s": recompute,
    }


def markdown(r: dict[str, Any]) -> str:
    mib = r["bytes"] / MiB
    rs = r["recompute_s"]

    def saved(d: dict[str, float]) -> str:
        out = f"{_fmt_ms(d['low'])} / {_fmt_ms(d['stated'])} / {_fmt_ms(d['high'])}"
        return out + (f" / {_fmt_ms(d['measured_h200'])}" if "measured_h200" in d else "")

    lines = [
        f"### engines_vllm ({r['when']})",
        "",
        f"KV of a {r['tokens']:,}-token prefix, 8B-class layout ({LAYERS} layers x {KV_HEADS} KV heads x "
        f"{HEAD_DIM} dims, bf16: {BYTES_PER_TOKEN // KiB} KiB/token, {mib:,.0f} MiB in "
        f"{r['tokens'] // BLOCK_TOKENS} chunks of {r['layout']['chunk_bytes'] // MiB} MiB), driven through vLLM "
        f"{r['versions']['vllm']}'s TieringOffloadingManager and offloading worker in {r['step_ms']:g} ms "
        f"scheduler steps. TierFS: 3 meta + 3 storage daemons on this host, a replica:1 in-memory pool. "
        f"{r['machine']['cpus']} CPUs shared with other work (1-minute load "
        f"{r['machine']['load_avg_1m_at_start']:.1f} at the start); median of {r['repeat']} runs after one "
        f"untimed run, every run's bytes checked.",
        "",
        "| path | time (ms) | effective GB/s | TTFT saved vs recompute at 10k / 15k / 20k / 33.85k tok/s "
        "(the last measured on an H200) (ms) |",
        "|---|---:|---:|---:|",
        f"| vLLM CPU offloading tier alone, warm hit (lookups + copy to the KV cache) | "
        f"{_fmt_ms(statistics.median(r['cpu_tier_hit_s']))} | {r['cpu_tier_hit_gbps']:.2f} | "
        f"{saved(r['cpu_tier_ttft_saved_s'])} |",
    ]
    for transport, t in r["tierfs"].items():
        lines += [
            f"| TierFS ({transport}) batch_get_into alone (the transport's share, no vLLM) | "
            f"{_fmt_ms(statistics.median(t['batch_get_into_s']))} | {t['batch_get_into_gbps']:.2f} | |",
            f"| TierFS ({transport}) -> vLLM's CPU tier (lookups + promotion) | "
            f"{_fmt_ms(statistics.median(t['tierfs_to_primary_s']))} | {t['tierfs_to_primary_gbps']:.2f} | |",
            f"| TierFS ({transport}) -> KV cache (the above + the same copy) | "
            f"{_fmt_ms(statistics.median(t['tierfs_to_device_s']))} | {t['tierfs_to_device_gbps']:.2f} | "
            f"{saved(t['ttft_saved_s'])} |",
        ]
    lines += [
        f"| recompute (prefill) at 10k / 15k / 20k / 33.85k tok/s | {saved(rs)} | | |",
        "",
        "Stores (device copy + cascade to TierFS, once per transport): "
        + ", ".join(f"{k} {_fmt_ms(t['store_s'])} ms ({t['store_gbps']:.2f} GB/s)" for k, t in r["tierfs"].items())
        + ".",
        "",
        f"Prefill rate: {r['prefill_source']}",
        "",
        "On this host the 'device' KV cache is host memory, so the last copy is a memcpy; on a GPU it is a "
        "host-to-device DMA over PCIe for both paths alike. Runs (ms): CPU tier "
        + ", ".join(_fmt_ms(d) for d in r["cpu_tier_hit_s"]) + "; "
        + "; ".join(f"TierFS {k} " + ", ".join(_fmt_ms(d) for d in t["tierfs_to_device_s"])
                    for k, t in r["tierfs"].items()) + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=1.0, help="sleep between scheduler steps")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=15_000.0)
    ap.add_argument("--transports", type=lambda v: v.split(","), default=["tcp", "shm"],
                    help="TierFS data-plane transports to run, comma-separated (tcp: as to remote daemons)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.tokens % BLOCK_TOKENS:
        ap.error(f"--tokens must be a multiple of {BLOCK_TOKENS}")
    r = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engines_vllm.json").write_text(json.dumps(r, indent=2) + "\n")
    md = markdown(r)
    (args.out / "engines_vllm.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
