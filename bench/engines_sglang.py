"""SGLang HiCache: time to load a prefix's KV from the L3 tier into SGLang's
host pool, TierFS (``TierFSHiCacheStorage``) against SGLang's own ``mooncake``
backend (Mooncake Store over TCP), in the same run.

The KV is an 8B-class layout: 32 layers x 8 KV heads x 128 dims in bf16,
128 KiB per token, a 4,096-token prefix (512 MiB) in pages of 64 tokens. Not
scaled down. The load is what SGLang's prefetch I/O thread does for a hit:
``batch_get_v1(page hashes, host slots)`` of the whole prefix (64 pages, one
``STORAGE_BATCH_SIZE`` batch) into SGLang's ``MHATokenToKVPoolHost``, every
byte checked afterwards; the hit query before it (``batch_exists``) is timed
too.

- TierFS: ``tierfs.local.LocalCluster`` (1 meta, 2 storage daemons on
  loopback), a ``replica:1`` pool held in the daemons' memory; the backend
  over tcp and over shm; host layouts page_first (2 objects of 4 MiB per
  page) and layer_first (64 objects of 128 KiB per page).
- Mooncake: ``mooncake_master`` with its HTTP metadata server, two store
  processes that only contribute memory segments (the counterpart of the two
  storage daemons), SGLang's ``MooncakeStore`` created by SGLang's factory
  with no segment of its own, protocol tcp, page_first (SGLang's Mooncake
  backend refuses layer_first for MHA).

Time to first token saved = recompute time at a stated prefill rate minus the
load time. The rate is an assumption, not measured here (no GPU): an 8B model
on one H100 prefills roughly 10,000-20,000 tokens/s (the range of published
vLLM / SGLang prefill throughput figures for Llama-3-8B on H100); the
middle, 15,000 tokens/s, is the headline.

    .venv-engines/bin/python -m bench.engines_sglang [--tokens 4096] [--reps 3]

Writes bench/results/engines_sglang.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import MEASURED_PREFILL_SOURCE, MEASURED_PREFILL_TOK_S

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
SHIMS = ROOT / "tests" / "engines" / "_shims"
LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 64
PREFILL_TOK_S = (10_000, 15_000, 20_000, MEASURED_PREFILL_TOK_S)  # the last measured on an H200 (bench.common)
MiB = 1 << 20


def _wait_port(port: int, timeout: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on {port} within {timeout:.0f} s")


def _segment_server(rpc: int, http: int, segment: int) -> None:
    """A Mooncake store process that only lends its memory (``--segment``)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", segment, 16 * MiB, "tcp", "",
                     f"127.0.0.1:{rpc}")
    if rc != 0:
        raise SystemExit(f"mooncake segment setup failed: {rc}")
    print("ready", flush=True)
    sys.stdin.read()


class Host:
    """SGLang's host KV pool of the 8B layout, with the prefix written in."""

    def __init__(self, layout: str, tokens: int) -> None:
        import torch
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        dev = MHATokenToKVPool(size=PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
                               layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        info = dev.get_device_pool_infos()[0].buffer_info
        self.pool = MHATokenToKVPoolHost(info, 1.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                         device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS,
                                         host_token_capacity=tokens)
        self.tokens = tokens
        self.indices = self.pool.alloc(tokens)
        self.pool.kv_buffer.view(torch.int16).random_(generator=torch.Generator().manual_seed(7))
        self.digest = self.checksum()
        self.keys = [hashlib.sha256(f"{uuid.uuid4()}-{i}".encode()).hexdigest() for i in range(tokens // PAGE)]

    def checksum(self) -> str:
        return hashlib.sha256(self.pool.kv_buffer.view(-1).view(__import__("torch").uint8).numpy()).hexdigest()

    @property
    def nbytes(self) -> int:
        return self.tokens * self.pool.get_size_per_token()


def _config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="meta-llama/Llama-3.1-8B", extra_config=extra)


def measure(name: str, backend_name: str, extra: dict[str, Any], host: Host, reps: int) -> dict[str, Any]:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    be = StorageBackendFactory.create_backend(backend_name, _config(extra), host.pool)
    be.register_mem_pool_host(host.pool)
    t0 = time.perf_counter()
    stored = be.batch_set_v1(host.keys, host.indices)
    t_store = time.perf_counter() - t0
    if not all(stored):
        raise RuntimeError(f"{name}: {stored.count(False)} pages not stored")
    exists, loads = [], []
    for _ in range(reps):
        host.pool.kv_buffer.zero_()
        t0 = time.perf_counter()
        hit = be.batch_exists(host.keys)
        t1 = time.perf_counter()
        ok = be.batch_get_v1(host.keys, host.indices)
        t2 = time.perf_counter()
        if hit != len(host.keys) or not all(ok):
            raise RuntimeError(f"{name}: hit {hit} of {len(host.keys)} pages, loaded {sum(ok)}")
        exists.append(t1 - t0)
        loads.append(t2 - t1)
    if host.checksum() != host.digest:
        raise RuntimeError(f"{name}: loaded bytes differ from the stored ones")
    with contextlib.suppress(Exception):
        be.close()
    del be
    load = statistics.median(loads)
    n = host.nbytes
    out = {"backend": name, "layout": host.pool.layout, "tokens": host.tokens, "bytes": n,
           "store_s": round(t_store, 4), "exists_ms": round(statistics.median(exists) * 1e3, 2),
           "load_s": round(load, 4), "load_s_all": [round(x, 4) for x in loads],
           "load_gbps": round(n / load / 1e9, 3), "store_gbps": round(n / t_store / 1e9, 3),
           "ttft_saved_s": {str(r): round(host.tokens / r - load, 4) for r in PREFILL_TOK_S},
           "verified": True}
    print(json.dumps(out), flush=True)
    return out


def run_tierfs(tmp: Path, tokens: int, reps: int) -> list[dict[str, Any]]:
    from tierfs.local import LocalCluster
    from tierfs.meta import MetaClient

    cl = LocalCluster(tmp / "tierfs", n_meta=1, n_storage=2)
    cl.export_token()  # security on: this cluster's admin token
    rows: list[dict[str, Any]] = []
    try:
        cl.up(timeout=120)
        per_target = 3 * tokens * LAYERS * HEADS * HEAD_DIM * 2 * 2  # 1.5x the prefix (x2 layouts) per target

        async def mk() -> None:
            async with MetaClient(cl.meta_addrs) as mc:
                await mc.create_kv_pool("sglang-bench", target_memory=per_target, target_disk=0)
        import asyncio

        asyncio.run(mk())
        _pool_served(cl.meta_addrs, "sglang-bench")
        for layout in ("page_first", "layer_first"):
            host = Host(layout, tokens)
            for transport in ("tcp", "shm"):
                extra = {"backend_name": "tierfs", "module_path": "tierfs.integrations.sglang",
                         "class_name": "TierFSHiCacheStorage", "meta": ",".join(cl.meta_addrs),
                         "pool": "sglang-bench", "transport": transport, "namespace": f"{layout}-{transport}",
                         "timeout": 30}
                rows.append(measure(f"tierfs ({transport})", "dynamic", extra, host, reps))
            del host
    finally:
        cl.stop()
    return rows


def _pool_served(meta: list[str], name: str, timeout: float = 60) -> None:
    from tierfs.client import Client

    deadline = time.monotonic() + timeout
    while True:
        try:
            with Client(meta, kv_pool=name) as c:
                c.kv.batch_put([f"probe-{time.monotonic_ns()}-{i}" for i in range(64)], [b"x"] * 64)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run_mooncake(tmp: Path, tokens: int, reps: int) -> list[dict[str, Any]]:
    from tierfs.local import free_ports

    master_bin = Path(sys.executable).parent / "mooncake_master"
    if not master_bin.exists():
        raise RuntimeError(f"{master_bin} missing: pip install mooncake-transfer-engine-non-cuda==0.3.13.post1")
    rpc, http, metrics = free_ports(3)
    log = (tmp / "mooncake-master.log").open("wb")
    master = subprocess.Popen([str(master_bin), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                               f"--http_metadata_server_port={http}", f"--metrics_port={metrics}"],
                              stdout=log, stderr=subprocess.STDOUT)
    segs: list[subprocess.Popen[str]] = []
    try:
        _wait_port(rpc, 30, "mooncake_master", master)  # type: ignore[arg-type]
        _wait_port(http, 30, "mooncake http metadata server", master)  # type: ignore[arg-type]
        segment = tokens * LAYERS * HEADS * HEAD_DIM * 2 * 2  # the whole prefix per segment process
        for i in range(2):
            p = subprocess.Popen([sys.executable, "-m", "bench.engines_sglang", "--segment", str(rpc), str(http),
                                  str(segment)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=(tmp / f"mooncake-seg{i}.log").open("wb"), text=True)
            segs.append(p)
        for p in segs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("mooncake segment server did not start")
        host = Host("page_first", tokens)
        extra = {"master_server_address": f"127.0.0.1:{rpc}", "metadata_server": f"http://127.0.0.1:{http}/metadata",
                 "protocol": "tcp", "device_name": "", "global_segment_size": 0, "local_hostname": "127.0.0.1",
                 "check_server": False}
        return [measure("mooncake (tcp)", "mooncake", extra, host, reps)]
    finally:
        for p in segs:
            with contextlib.suppress(Exception):
                assert p.stdin is not None
                p.stdin.close()
                p.wait(10)
            if p.poll() is None:
                p.kill()
        master.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            master.wait(10)
        if master.poll() is None:
            master.kill()
        log.close()


def write_md(res: dict[str, Any]) -> str:
    r = res["rows"]
    lines = [
        "# SGLang HiCache: loading a 4,096-token prefix from L3 into the host pool",
        "",
        f"Run {res['when']} on {res['machine']}; `{res['command']}`.",
        "",
        f"Layout: {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM} dims, bf16 (128 KiB/token), "
        f"{res['tokens']} tokens = {res['tokens'] * 128 // 1024} MiB, pages of {PAGE} tokens; "
        f"median of {res['reps']} loads (`batch_get_v1` of the whole prefix into SGLang's "
        "`MHATokenToKVPoolHost`, every byte verified); `batch_exists` is the hit query before it.",
        "",
        "| backend | host layout | load (s) | GB/s | batch_exists (ms) | store (s) | TTFT saved @10k / 15k / 20k / "
        "33.85k tok/s, the last measured on an H200 (s) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for x in r:
        t = x["ttft_saved_s"]
        lines.append(f"| {x['backend']} | {x['layout']} | {x['load_s']:.3f} | {x['load_gbps']:.2f} | "
                     f"{x['exists_ms']:.1f} | {x['store_s']:.2f} | "
                     + " / ".join(f"{t[str(rate)]:.3f}" for rate in PREFILL_TOK_S if str(rate) in t) + " |")
    lines += ["", *[f"- {n}" for n in res["notes"]], ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="tierfs,mooncake")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the .json and .md go (default: bench/results)")
    ap.add_argument("--segment", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.segment:
        _segment_server(*args.segment)
        return
    if args.tokens % PAGE:
        raise SystemExit(f"--tokens must be a multiple of {PAGE}")
    sys.path.insert(0, str(SHIMS))
    import sglang_cpu

    sglang_cpu.install()
    import sglang.srt.mem_cache.storage  # noqa: F401

    tmp = Path(tempfile.mkdtemp(prefix="engines-sglang-"))
    rows: list[dict[str, Any]] = []
    notes = [
        "TTFT saved = tokens / prefill rate - load time. The first three prefill rates are assumed, not measured "
        "(no GPU here): an 8B model on one H100 prefills roughly 10,000-20,000 tokens/s (published vLLM / SGLang prefill "
        "throughput for Llama-3-8B on H100); 15,000 tok/s is the middle. " + MEASURED_PREFILL_SOURCE + ".",
        "The load ends in SGLang's host pool (L2); the host-to-GPU copy after it (PCIe/NVLink, CUDA kernels) is not "
        "run here and not included.",
        f"Break-even: at {LAYERS * HEADS * HEAD_DIM * 2 * 2 // 1024} KiB/token, a load beats recomputing at "
        f"15,000 tok/s only above {LAYERS * HEADS * HEAD_DIM * 4 * 15_000 / 1e9:.2f} GB/s (10,000: "
        f"{LAYERS * HEADS * HEAD_DIM * 4 * 10_000 / 1e9:.2f} GB/s; the measured {MEASURED_PREFILL_TOK_S:,}: "
        f"{LAYERS * HEADS * HEAD_DIM * 4 * MEASURED_PREFILL_TOK_S / 1e9:.2f} GB/s); a negative 'saved' means "
        "recompute was faster.",
        "page_first stores 2 objects of 4 MiB per page (K, V); layer_first 64 objects of 128 KiB (a page is "
        "contiguous only within a layer there), hence its lower rate. SGLang's mooncake backend refuses "
        "layer_first for MHA, so it has the page_first row only.",
        "Mooncake: SGLang's own `mooncake` backend (MooncakeStore from SGLang's factory, "
        "mooncake-transfer-engine-non-cuda 0.3.13.post1, protocol tcp) ran on this CPU.",
        "Everything runs on one 2-core machine shared with other jobs: servers, client and copies compete for the "
        "same cores, so these are lower bounds for both systems.",
    ]
    try:
        if "tierfs" in args.only:
            rows += run_tierfs(tmp, args.tokens, args.reps)
        if "mooncake" in args.only:
            try:
                rows += run_mooncake(tmp, args.tokens, args.reps)
            except Exception as e:
                notes.append(f"SGLang's mooncake backend did not run: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "command": " ".join(
               ["python -m bench.engines_sglang", *sys.argv[1:]]), "tokens": args.tokens, "reps": args.reps,
           "layout": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16", "page": PAGE},
           "prefill_tok_s_assumed": list(PREFILL_TOK_S), "rows": rows, "notes": notes}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engines_sglang.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / "engines_sglang.md").write_text(write_md(res))
    print(write_md(res))


if __name__ == "__main__":
    main()
