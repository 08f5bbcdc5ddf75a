"""The GPU path, measured on a machine with a CUDA device (scripts/gpu_check.sh
runs it there; here, with no GPU, it refuses at once).

All in one run, median of ``--reps`` after one untimed run, every run's
bytes checked:

* **Baselines (torch alone):** a pinned host -> device copy, device -> pinned
  host, and device -> device, of the whole payload at once.
* **GpuTier** (the HBM tier): ``batch`` objects of ``chunk`` bytes put from
  CUDA tensors (device -> device into the arena) and read back into CUDA
  tensors, against the device -> device copy.
* **client.kv with CUDA tensors** against a ``tierfs.local.LocalCluster``
  (1 meta, ``--storage`` daemons, a ``replica:1`` in-memory pool), per
  transport: ``batch_put`` from CUDA tensors and ``batch_get_into`` CUDA
  tensors (each goes through pinned staging), and the same calls with host
  buffers, so the staging's share shows.
* **Prefill, recomputed:** the KV payload is that of ``--tokens`` tokens of
  an 8B-class model (32 layers x 8 KV heads x 128 dims, bf16: 128 KiB a
  token). The same number of tokens is prefilled through a Llama-3-8B-shaped
  ``transformers`` LlamaModel with random bf16 weights (SDPA attention,
  batch 1, logits for the last token only): the time a cache miss costs,
  measured on this GPU, against the time to fetch the KV from TierFS into
  HBM. transformers' prefill is slower than vLLM's fused kernels, so the
  recompute time is an upper bound; the FLOP rate is reported to judge it.

Writes ``bench/results/gpu_kv.{json,md}`` (``--out`` elsewhere).

    python -m bench.gpu_kv [--tokens 4096] [--reps 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import create_kv_pool, proc_cpu_s

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16 = 128 KiB
BLOCK_TOKENS = 16  # 2 MiB objects: the KV of 16 tokens


def _torch() -> Any:
    import torch

    return torch


DEVICE = "cuda"  # --device cpu: a dry run of the code paths on a machine without a GPU


def sync() -> None:
    if DEVICE == "cuda":
        _torch().cuda.synchronize()


def timed(fn: Callable[[], Any], reps: int, check: Callable[[], None] | None = None) -> list[float]:
    """One untimed run, then ``reps`` timed ones (seconds), each checked."""
    fn()
    sync()
    if check:
        check()
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
        if check:
            check()
    return out


def cpu_share(fn: Callable[[], Any], daemons: list[int]) -> dict[str, float]:
    """One run of ``fn``: its wall time, this process's CPU time (all its
    threads) and the storage daemons' CPU time over it."""
    sync()
    c0, d0, t0 = time.process_time(), proc_cpu_s(daemons), time.perf_counter()
    fn()
    sync()
    t1, c1, d1 = time.perf_counter(), time.process_time(), proc_cpu_s(daemons)
    return {"wall_s": t1 - t0, "client_cpu_s": c1 - c0, "daemons_cpu_s": d1 - d0}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def baselines(nbytes: int, reps: int) -> dict[str, Any]:
    torch = _torch()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dev2 = torch.empty_like(dev)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), reps)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), reps)
    d2d = timed(lambda: dev2.copy_(dev), reps)
    return {"h2d_s": h2d, "d2h_s": d2h, "d2d_s": d2d}


def gpu_tier(n: int, chunk: int, reps: int) -> dict[str, Any]:
    torch = _torch()
    from tierfs.kv.gpu import GpuTier

    tier = GpuTier(n * chunk + 64 * MiB)
    src = torch.randint(0, 255, (n, chunk), dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros_like(src)
    keys = [f"g{i}".encode() for i in range(n)]
    loop = asyncio.new_event_loop()

    def put() -> None:
        async def go() -> None:
            for i, k in enumerate(keys):
                await tier.delete(k)
                assert await tier.put(k, src[i])
        loop.run_until_complete(go())

    def get() -> None:
        async def go() -> None:
            for i, k in enumerate(keys):
                assert await tier.get_into(k, dst[i]) == chunk
        loop.run_until_complete(go())

    def check() -> None:
        assert torch.equal(dst, src)
        dst.zero_()

    def copies(each_sync: bool) -> Callable[[], None]:
        def go() -> None:
            for i in range(n):
                dst[i].copy_(src[i])
                if each_sync:
                    sync()
        return go

    try:
        p = timed(put, reps)
        g = timed(get, reps, check)
        # the floor for one call per object: torch copies alone, with a sync each (as the tier does) or one
        one_sync = timed(copies(False), reps, check)
        each_sync = timed(copies(True), reps, check)
    finally:
        loop.run_until_complete(tier.close())
        loop.close()
    return {"put_s": p, "get_s": g, "copies_one_sync_s": one_sync, "copies_each_sync_s": each_sync}


def _calls(kv: Any, prefix: str, src: Any, dst: Any, chunk: int) -> tuple[Callable[[], None], ...]:
    """A batch put of ``src``'s rows, a batch get into ``dst``'s, and a check
    that they are equal (which zeroes ``dst`` for the next get)."""
    torch = _torch()
    n = len(src)
    keys = [f"{prefix}{i}" for i in range(n)]

    def put() -> None:
        assert kv.batch_put(keys, [src[i] for i in range(n)], overwrite=True) == [True] * n

    def get() -> None:
        assert kv.batch_get_into(keys, [dst[i] for i in range(n)]) == [chunk] * n

    def check() -> None:
        assert torch.equal(dst, src)
        dst.zero_()

    return put, get, check


def cluster_kv(meta: list[str], pool: str, transport: str, n: int, chunk: int, reps: int,
               daemons: list[int]) -> dict[str, Any]:
    torch = _torch()
    from tierfs.client import Client

    src = torch.randint(0, 255, (n, chunk), dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros_like(src)
    hsrc = src.cpu()
    hdst = torch.zeros_like(hsrc)
    out: dict[str, Any] = {}
    transport, _, conns = transport.partition(":")
    with Client(meta, kv_pool=pool, transport=transport, connections_per_peer=int(conns or 2), kv_timeout=30.0,
                request_timeout=30.0) as c:
        put_dev, get_dev, check_dev = _calls(c.kv, f"{transport}-", src, dst, chunk)
        put_host, get_host, check_host = _calls(c.kv, f"{transport}-h", hsrc, hdst, chunk)
        out["put_cuda_s"] = timed(put_dev, reps)
        out["get_cuda_s"] = timed(get_dev, reps, check_dev)
        out["put_host_s"] = timed(put_host, reps)
        out["get_host_s"] = timed(get_host, reps, check_host)
        out["cpu"] = {"put_cuda": cpu_share(put_dev, daemons), "get_cuda": cpu_share(get_dev, daemons),
                      "put_host": cpu_share(put_host, daemons), "get_host": cpu_share(get_host, daemons)}
    return out


#: Llama-3-8B's shape; the dry run (--device cpu) prefills a toy of the same kind
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256}
TOY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 1024}


def prefill(tokens: int, reps: int, shape: dict[str, int] = LLAMA_8B) -> dict[str, Any]:
    """A model of ``shape`` (Llama-3-8B's), random bf16 weights, prefill of ``tokens``."""
    torch = _torch()
    import transformers
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(**shape, max_position_embeddings=max(8192, tokens), rope_theta=500000.0,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = LlamaModel(cfg).eval()
            head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    finally:
        torch.set_default_dtype(old)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters()) + head.weight.numel()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=DEVICE)

    def fwd() -> None:
        with torch.inference_mode():
            h = model(input_ids=ids, use_cache=True).last_hidden_state
            head(h[:, -1])

    times = timed(fwd, reps)
    return {"tokens": tokens, "shape": "Llama-3-8B" if shape == LLAMA_8B else "toy", "params": params,
            "build_s": build_s, "prefill_s": times,
            "transformers": transformers.__version__}


def _gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


def markdown(r: dict[str, Any]) -> str:
    n = r["payload_bytes"]
    lines = [f"### gpu_kv ({r['when']})", "", r["setup"], "",
             "| case | time (ms) | GB/s | baseline | ratio |", "|---|---:|---:|---|---:|"]

    def row(case: str, s: float | None, base: str, base_s: float | None) -> None:
        if s is None:
            lines.append(f"| {case} | failed | | {base} | |")
            return
        ratio = f"{base_s / s:.0%}" if base_s else ""
        lines.append(f"| {case} | {s * 1e3:,.1f} | {_gbps(n, s):.2f} | {base} | {ratio} |")

    b = r.get("baselines") or {}
    h2d, d2h, d2d = (med(b[k]) if k in b else None for k in ("h2d_s", "d2h_s", "d2d_s"))
    row("torch: pinned host -> device, one copy", h2d, "", None)
    row("torch: device -> pinned host, one copy", d2h, "", None)
    row("torch: device -> device, one copy", d2d, "", None)
    g = r.get("gpu_tier") or {}
    row(f"GpuTier put, {r['objects']} CUDA tensors", med(g["put_s"]) if "put_s" in g else None, "device -> device",
        d2d)
    row(f"GpuTier get_into, {r['objects']} CUDA tensors", med(g["get_s"]) if "get_s" in g else None,
        "device -> device", d2d)
    if "copies_each_sync_s" in g:
        one, each = med(g["copies_one_sync_s"]), med(g["copies_each_sync_s"])
        row(f"torch: {r['objects']} device -> device copies, one sync after all", one, "", None)
        row(f"torch: {r['objects']} device -> device copies, a sync after each", each, "", None)
        row(f"GpuTier get_into, {r['objects']} CUDA tensors", med(g["get_s"]), "copies, a sync after each", each)
    for t, c in (r.get("cluster") or {}).items():
        if "error" in c:
            lines.append(f"| TierFS ({t}) | failed: {c['error'].splitlines()[-1][:120]} | | | |")
            continue
        row(f"TierFS ({t}) batch_put from CUDA tensors", med(c["put_cuda_s"]), "device -> pinned host", d2h)
        row(f"TierFS ({t}) batch_get_into CUDA tensors", med(c["get_cuda_s"]), "pinned host -> device", h2d)
        row(f"TierFS ({t}) batch_put from host tensors", med(c["put_host_s"]), "", None)
        row(f"TierFS ({t}) batch_get_into host tensors", med(c["get_host_s"]), "", None)
    fetch = {t: _gbps(n, med(c["get_cuda_s"])) for t, c in (r.get("cluster") or {}).items() if "get_cuda_s" in c}
    for name in sorted((k for k in r if k.startswith("prefill")), key=lambda k: int(k.split("_")[1])):
        p = r[name]
        if "prefill_s" not in p:
            lines.append(f"| {name} | failed: {p.get('error', '').splitlines()[-1][:120]} | | | |")
            continue
        s = med(p["prefill_s"])
        flops = 2 * p["params"] * p["tokens"]
        kv_bytes = p["tokens"] * BYTES_PER_TOKEN
        lines.append(f"| prefill (recompute) of {p['tokens']:,} tokens, {p.get('shape', 'Llama-3-8B')} shape | "
                     f"{s * 1e3:,.1f} | | "
                     f"{flops / s / 1e12:,.0f} TFLOP/s counting 2N per token | |")
        for t, gbps in fetch.items():
            f_s = kv_bytes / gbps / 1e9
            how = "measured" if p["tokens"] == r["tokens"] else f"at the {gbps:.2f} GB/s measured above"
            lines.append(f"| fetch of its KV ({kv_bytes / 1e9:.2f} GB) from TierFS ({t}) into HBM, {how} | "
                         f"{f_s * 1e3:,.1f} | {gbps:.2f} | recompute | {s / f_s:.0%} |")
    cpu = [(t, c["cpu"]) for t, c in (r.get("cluster") or {}).items() if "cpu" in c]
    if cpu:
        lines += ["", "Where the time goes (one run each): wall time, the client's CPU time (all its threads), "
                  "the storage daemons' CPU time (all of them).", "",
                  "| transport | call | wall (ms) | client CPU (ms) | daemons' CPU (ms) |", "|---|---|---:|---:|---:|"]
        for t, c in cpu:
            for call, v in c.items():
                lines.append(f"| {t} | {call} | {v['wall_s'] * 1e3:,.1f} | {v['client_cpu_s'] * 1e3:,.1f} | "
                             f"{v['daemons_cpu_s'] * 1e3:,.1f} |")
    lines += ["", r["notes"], ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--storage", type=int, default=4)
    ap.add_argument("--transports", type=lambda v: v.split(","), default=["tcp", "shm", "tcp:8"],
                    help="comma-separated; tcp:8 = tcp with 8 connections per storage daemon (default 2)")
    ap.add_argument("--prefill-tokens", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help="prompt lengths to prefill (default: --tokens alone)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a dry run of the code (no GpuTier, no pinned memory, a toy model)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch = _torch()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.gpu_kv needs torch with a visible CUDA device; none here")
    from tierfs.local import LocalCluster

    n = args.tokens // BLOCK_TOKENS
    chunk = BLOCK_TOKENS * BYTES_PER_TOKEN
    nbytes = n * chunk
    r: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "payload_bytes": nbytes,
                         "objects": n, "object_bytes": chunk, "tokens": args.tokens, "reps": args.reps}

    def section(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            r[name] = fn()
        except Exception:
            r[name] = {"error": traceback.format_exc()}
            print(r[name]["error"], file=sys.stderr)
        print(f"[gpu_kv] {name}: {time.perf_counter() - t0:.1f} s", flush=True)

    section("baselines", lambda: baselines(nbytes, args.reps))
    if DEVICE == "cuda":
        section("gpu_tier", lambda: gpu_tier(n, chunk, args.reps))
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    cluster = LocalCluster(tmp / "cluster", n_storage=args.storage)
    cluster.export_token()  # security on: this cluster's admin token
    t_up = time.perf_counter()
    cluster.up(timeout=120)
    t_up = time.perf_counter() - t_up
    r["cluster"] = {}
    try:
        pool = "bench-gpu"
        daemons = [p.pid for p in cluster.procs if p.kind == "storage"]
        create_kv_pool(cluster.meta_addrs, pool, 4 * nbytes // args.storage + 256 * MiB)
        for t in args.transports:
            t0 = time.perf_counter()
            try:
                r["cluster"][t] = cluster_kv(cluster.meta_addrs, pool, t, n, chunk, args.reps, daemons)
            except Exception:
                r["cluster"][t] = {"error": traceback.format_exc()}
                print(r["cluster"][t]["error"], file=sys.stderr)
            print(f"[gpu_kv] cluster {t}: {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        cluster.stop()
    if not args.skip_prefill:
        for tokens in args.prefill_tokens or [args.tokens]:
            section(f"prefill_{tokens}", lambda t=tokens: prefill(t, args.reps, LLAMA_8B if DEVICE == "cuda" else TOY))
    if DEVICE == "cuda":
        gpu = torch.cuda.get_device_name()
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    else:
        gpu, smi = "none (--device cpu dry run)", ""
    r["setup"] = (f"KV of a {args.tokens:,}-token prefix, 8B-class layout (32 layers x 8 KV heads x 128 dims, "
                  f"bf16: 128 KiB/token): {n} objects of {chunk // MiB} MiB, {nbytes / 1e9:.2f} GB. "
                  f"GPU: {gpu} ({smi}); torch {torch.__version__}; {os.cpu_count()} CPUs, {platform.machine()}. "
                  f"TierFS: 1 meta + {args.storage} storage daemons on this host (started in {t_up:.1f} s), "
                  f"a replica:1 in-memory pool. Median of {args.reps} runs after one untimed run, every run's "
                  f"bytes checked.")
    r["notes"] = ("CUDA tensors go through pinned staging buffers (tierfs.kv.gpu): a put copies device -> "
                  "pinned host, then the host path; a get lands in pinned host memory, then host -> device. "
                  "The prefill is transformers' LlamaModel (SDPA attention), slower than vLLM's fused "
                  "kernels, so the recompute time is an upper bound. Every run's times are in the JSON.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_kv.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
    md = markdown(r)
    (args.out / "gpu_kv.md").write_text(f"# The GPU path (bench/gpu_kv.py)\n\n`python -m bench.gpu_kv`\n\n{md}")
    print(md)


if __name__ == "__main__":
    main()
