"""LMCache 0.5.6 loading a long prefix's KV: TierFS (our plugin) against
LMCache's Redis remote backend, in the same run.

Layout: an 8B-class model (Llama-3.1-8B: 32 layers x 8 KV heads x 128
dims, bf16, 128 KiB a token), LMCache's default 256-token chunks (32 MiB
each); a 4,096-token prefix is 512 MiB (``--tokens`` scales it).

For each remote backend:

1. engine W (a real ``LMCacheEngine`` from ``LMCacheEngineBuilder``) stores
   the prefix from a CPU KV tensor;
2. engine R (a fresh instance, ``local_cpu: False``, so every chunk comes
   from the remote backend) loads it ``--reps`` times: ``lookup`` then
   ``retrieve`` into a zeroed KV tensor, checked bit-exact on the first
   round; the time is lookup + retrieve, and the copy from LMCache's chunks
   into the KV tensor (the "GPU connector" step, a CPU memcpy here, an H2D
   copy on a GPU) is timed on its own too.

Backends (each started by this script, on loopback):

* ``tierfs-tcp`` / ``tierfs-shm``: ``tierfs.local.LocalCluster`` (1 meta,
  3 storage daemons), a replica:1 KV pool whose memory budget holds the
  prefix, our plugin over tcp and over shm;
* ``redis``: Debian's ``redis-server`` (persistence off), LMCache's
  ``remote_url: redis://...`` (its RedisConnector, redis-py);
* ``resp``: the same redis-server through LMCache's native RESP client
  (``remote_url: resp://...``), LMCache's fastest Redis path.

Each backend runs in a process of its own (``--child``): LMCache keeps
engines, connectors and their threads per process, and a backend that
stalls (its connectors cannot be closed: see ``destroy``) must not stall or
slow the next one. Before, a RESP run after the Redis one hung in
``retrieve`` (2026-12-04) while it ran alone in 0.56 s.

TTFT saved = the prefill it replaces (tokens / a stated prefill rate) minus
the load time. Writes ``bench/results/engines_lmcache.{json,md}``.

    python -m bench.engines_lmcache [--tokens 4096] [--reps 3] [--only tierfs-tcp,redis]
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore", DeprecationWarning)
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from bench.common import MEASURED_PREFILL_SOURCE, MEASURED_PREFILL_TOK_S, create_kv_pool  # noqa: E402
from tierfs.local import LocalCluster, free_ports  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1 << 20
LAYERS, KV_HEADS, HEAD_DIM, CHUNK = 32, 8, 128, 256
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
#: Prefill rates of an 8B model on one H100 (tokens/s) for the TTFT saved,
#: the middle one the stated headline, and the rate measured on an H200
#: (bench.common.MEASURED_PREFILL_TOK_S). See PREFILL_SOURCE.
PREFILL_RATES = (10_000, 15_000, 20_000, MEASURED_PREFILL_TOK_S)
PREFILL_SOURCE = (
    "compute-bound prefill of an 8B dense model is about 2 x 8.0e9 = 16 GFLOP a token (plus attention, "
    "~10% more at 4k context); one H100 SXM peaks at 989 TFLOPS dense BF16 (NVIDIA H100 Tensor Core GPU "
    "datasheet), so 10-20k tokens/s is 16-32% of peak, the range serving engines (vLLM, SGLang) reach in "
    "prefill of long prompts; 15k tokens/s is the headline rate here")
BACKENDS = ("tierfs-tcp", "tierfs-shm", "redis", "resp")


def _k(rate: int) -> str:
    """10_000 -> '10k', 33_850 -> '33.85k'."""
    return f"{rate / 1000:g}k"
#: Seconds one backend may take (store, wait, loads) before it is reported hung.
BACKEND_BUDGET_S = 90


class CPUKVConnector(GPUConnectorInterface):  # type: ignore[misc]
    """The serving engine's KV cache as one CPU tensor ``[2, layers, tokens,
    heads*dim]`` (LMCache's KV_2LTD layout); times the copy into it."""

    def __init__(self) -> None:
        self.to_engine_s = 0.0

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        kw["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e, **kw)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kw: Any) -> None:
        t0 = time.perf_counter()
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(m, s, e, **kw)
        self.to_engine_s += time.perf_counter() - t0

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, KV_HEADS * HEAD_DIM])


def metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name="bench-llama-3.1-8b", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM), chunk_size=CHUNK)


def engine(iid: str, cpu_gb: float, **cfg: Any) -> tuple[Any, CPUKVConnector]:
    conf = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=cpu_gb,
                                             lmcache_instance_id=iid, **cfg)
    gpu = CPUKVConnector()
    e = LMCacheEngineBuilder.get_or_create(iid, conf, metadata(), gpu, lambda t, r: None, lambda o, r: o)
    e.post_init()
    return e, gpu


def destroy(iid: str) -> None:
    e = LMCacheEngineBuilder.get(iid)
    dropped = False
    for name, b in e.storage_manager.storage_backends.items():
        conn = getattr(b, "connection", None)
        if name.startswith("RemoteBackend") and any(c in repr(conn) for c in ("RedisConnector", "RESPConnector")):
            # LMCache 0.5.6's Redis and RESP connectors deadlock in close():
            # an ``async close`` calls the blocking ``AsyncPQExecutor.shutdown``,
            # which waits for a coroutine on the very loop it blocks. Dropping
            # the connection makes RemoteBackend.close skip it (the sockets
            # close with the process).
            b.connection = None
            dropped = True
    LMCacheEngineBuilder.destroy(iid)
    sm = getattr(e, "storage_manager", None)
    # The dropped connector's queue tasks stay pending on its loop; closing
    # that loop would only turn them into "Task was destroyed" noise.
    if sm is not None and not sm.thread.is_alive() and not dropped:
        sm.loop.close()


def backend_config(name: str, meta: str, pool: str, redis_port: int) -> dict[str, Any]:
    if name.startswith("tierfs-"):
        return {"remote_storage_plugins": ["tierfs"], "extra_config": {
            "remote_storage_plugin.tierfs.module_path": "tierfs.integrations.lmcache",
            "remote_storage_plugin.tierfs.class_name": "TierFSConnector",
            "remote_storage_plugin.tierfs.meta": meta, "remote_storage_plugin.tierfs.pool": pool,
            "remote_storage_plugin.tierfs.transport": name.split("-", 1)[1]}}
    if name == "redis":
        # redis-py 6 and later time a socket write out after 5 s by default
        # (before: never). LMCache's RedisConnector sends a whole prefix's
        # chunks at once (16 x 32 MiB here), which a loaded 2-core host does
        # not drain in 5 s: the put failed ("Timeout writing to socket"), and
        # LMCache's retrieve then waited on it for ever. The URL's own
        # socket_timeout (redis-py parses it) gives it the time it needs.
        return {"remote_url": f"redis://127.0.0.1:{redis_port}?socket_timeout={REDIS_SOCKET_TIMEOUT_S}",
                "remote_serde": "naive"}
    # LMCache's RESP client stores raw chunks without metadata, so it refuses save_chunk_meta.
    return {"remote_url": f"resp://127.0.0.1:{redis_port}", "remote_serde": "naive",
            "extra_config": {"save_chunk_meta": False}}


#: Socket timeout for LMCache's redis-py connections (see backend_config).
REDIS_SOCKET_TIMEOUT_S = 60


class Hung(Exception):
    """A backend's call did not return within its budget."""


def _on_alarm(signum: int, frame: Any) -> None:
    faulthandler.dump_traceback(all_threads=True)
    raise Hung(f"no answer within {BACKEND_BUDGET_S} s (thread stacks on stderr)")


def run_backend(name: str, cfg: dict[str, Any], tokens: torch.Tensor, kv: torch.Tensor, reps: int,
                cpu_gb: float) -> dict[str, Any]:
    n = len(tokens)
    stamp = time.monotonic_ns()
    w_id, r_id = f"bench-w-{name}-{stamp}", f"bench-r-{name}-{stamp}"
    row: dict[str, Any] = {"backend": name, "tokens": n, "bytes": n * TOKEN_BYTES}
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(BACKEND_BUDGET_S)
    try:
        w, _ = engine(w_id, cpu_gb, **cfg)
        remote = [b for k, b in w.storage_manager.storage_backends.items() if k.startswith("RemoteBackend")]
        if not remote or remote[0].connection is None:
            raise RuntimeError("LMCache has no connected remote backend (see its log)")
        t0 = time.perf_counter()
        w.store(tokens, kvcaches=kv)
        store_call_s = time.perf_counter() - t0
        r, gpu = engine(r_id, cpu_gb, **cfg)
        deadline = time.monotonic() + 120
        while r.lookup(tokens) != n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: the stored prefix never became visible")
            time.sleep(0.05)
        row["store_visible_s"] = round(time.perf_counter() - t0, 3)
        row["store_call_s"] = round(store_call_s, 3)
        destroy(w_id)
        totals, lookups, copies = [], [], []
        out = torch.zeros_like(kv)
        for i in range(reps):
            out.zero_()
            gpu.to_engine_s = 0.0
            t0 = time.perf_counter()
            hit = r.lookup(tokens)
            t1 = time.perf_counter()
            mask = r.retrieve(tokens, kvcaches=out)
            t2 = time.perf_counter()
            if hit != n or int(mask.sum()) != n:
                raise RuntimeError(f"{name}: round {i} hit {hit} and loaded {int(mask.sum())} of {n} tokens")
            if i == 0 and not torch.equal(out.view(torch.int16), kv.view(torch.int16)):
                raise RuntimeError(f"{name}: the loaded KV differs from the stored KV")
            totals.append(t2 - t0)
            lookups.append(t1 - t0)
            copies.append(gpu.to_engine_s)
        load = statistics.median(totals)
        row.update({
            "load_s_median": round(load, 4), "load_s_min": round(min(totals), 4),
            "load_s_all": [round(x, 4) for x in totals],
            "lookup_s_median": round(statistics.median(lookups), 4),
            "copy_to_engine_s_median": round(statistics.median(copies), 4),
            "gb_s": round(n * TOKEN_BYTES / load / 1e9, 3),
            "gb_s_best": round(n * TOKEN_BYTES / min(totals) / 1e9, 3),
            "verified": "bit-exact",
        })
        for rate in PREFILL_RATES:
            row[f"ttft_saved_s_at_{_k(rate)}"] = round(n / rate - load, 4)
    except Exception as e:  # a backend that fails is reported, not hidden
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
    if isinstance(row.get("error"), str) and row["error"].startswith("Hung"):
        return row  # its threads are stuck: leave its engines (the process exits hard)
    for iid in (w_id, r_id):
        if LMCacheEngineBuilder.get(iid) is not None:
            destroy(iid)
    return row


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"redis-server did not listen on {port} within {timeout:.0f} s")


def start_redis(tmp: Path, nbytes: int) -> tuple[subprocess.Popen[bytes] | None, int, str]:
    server = shutil.which("redis-server")
    if server is None:
        return None, 0, "redis-server is not installed (apt-get install -y redis-server)"
    (port,) = free_ports(1)
    log = open(tmp / "redis-server.log", "wb")  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", str(3 * nbytes + 256 * MiB), "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp),
         "--proto-max-bulk-len", str(512 * MiB), "--client-output-buffer-limit", "normal 0 0 0"],
        stdout=log, stderr=subprocess.STDOUT)
    wait_port(port, proc)
    version = subprocess.run([server, "--version"], capture_output=True, text=True).stdout.split()[2]
    return proc, port, version


def stop_redis(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def markdown(res: dict[str, Any]) -> str:
    n = res["tokens"]
    lines = [
        "# LMCache + TierFS: loading a prefix's KV (bench/engines_lmcache.py)",
        "",
        f"{n:,} tokens of an 8B-class layout ({LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} dims, bf16, "
        f"{TOKEN_BYTES // 1024} KiB/token): {n * TOKEN_BYTES / MiB:,.0f} MiB in {n // CHUNK} LMCache chunks of "
        f"{CHUNK} tokens. A fresh LMCacheEngine (hot CPU cache off) does lookup + retrieve into a CPU KV "
        f"tensor; median of {res['reps']} rounds, first round checked bit-exact.",
        f"Machine: {res['machine']}; LMCache {res['lmcache']}, torch {res['torch']}, redis-server "
        f"{res['redis_version']}. Loaded 2-core host shared with other jobs: figures are noisy.",
        "",
        "| backend | load (s) | GB/s | best GB/s | lookup (s) | copy into KV tensor (s) | TTFT saved at "
        + " / ".join(_k(rate) for rate in PREFILL_RATES) + " tok/s, the last measured on an H200 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['backend']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['backend']} | {r['load_s_median']:.3f} | {r['gb_s']:.2f} | {r['gb_s_best']:.2f} | "
            f"{r['lookup_s_median']:.3f} | {r['copy_to_engine_s_median']:.3f} | "
            + " / ".join(f"{r[f'ttft_saved_s_at_{_k(rate)}']:.3f}" for rate in PREFILL_RATES
                         if f"ttft_saved_s_at_{_k(rate)}" in r) + " |")
    lines += [
        "",
        f"Recompute of {n:,} tokens: " + ", ".join(f"{n / rate:.3f} s at {_k(rate)} tok/s"
                                                  for rate in PREFILL_RATES) + ".",
        f"Prefill rate: {PREFILL_SOURCE}. {MEASURED_PREFILL_SOURCE}.",
        "Loading beats recompute when GB/s exceeds the prefill rate x 128 KiB: " + ", ".join(
            f"{rate * TOKEN_BYTES / 1e9:.2f} GB/s at {_k(rate)} tok/s" for rate in PREFILL_RATES) + ".",
        "",
        "GB/s = prefix bytes / (lookup + retrieve). The copy column is LMCache's own step from its chunk "
        "buffers into the engine's KV tensor (a CPU memcpy here, an H2D copy on a GPU), inside the load time.",
        "",
        f"Command: `{res['command']}`",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="prefix length (a multiple of 256)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default=",".join(BACKENDS))
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the .json and .md go (default: bench/results)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # one backend, in this process
    ap.add_argument("--meta", default="", help=argparse.SUPPRESS)
    ap.add_argument("--pool", default="", help=argparse.SUPPRESS)
    ap.add_argument("--redis-port", type=int, default=0, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.tokens % CHUNK:
        ap.error(f"--tokens must be a multiple of {CHUNK}")
    only = [b for b in ns.only.split(",") if b]
    for b in only:
        if b not in BACKENDS:
            ap.error(f"unknown backend {b!r} ({', '.join(BACKENDS)})")
    nbytes = ns.tokens * TOKEN_BYTES
    if ns.child:
        child(ns, nbytes)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lmcache-"))
    # `timeout` and Ctrl-C stop the daemons and redis-server too (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res: dict[str, Any] = {
        "tokens": ns.tokens, "reps": ns.reps, "bytes": nbytes, "layout": {
            "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16", "chunk": CHUNK},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "lmcache": "0.5.6", "torch": torch.__version__,
        "prefill_rates": list(PREFILL_RATES), "prefill_source": PREFILL_SOURCE,
        "command": "python -m bench.engines_lmcache " + " ".join(sys.argv[1:]), "rows": []}
    cluster = None
    redis_proc = None
    try:
        meta, port = "", 0
        if any(b.startswith("tierfs-") for b in only):
            cluster = LocalCluster(tmp / "cluster", n_meta=1, n_storage=3)
            cluster.export_token()  # security on: this cluster's admin token
            cluster.up(timeout=120)
            meta = ",".join(cluster.meta_addrs)
        res["redis_version"] = "not run"
        for b in only:
            if b in ("redis", "resp"):
                # A redis-server of its own for each: nothing of the previous run in it.
                stop_redis(redis_proc)
                redis_proc, port, res["redis_version"] = start_redis(tmp, nbytes)
                if redis_proc is None:
                    res["rows"].append({"backend": b, "error": res["redis_version"]})
                    continue
            pool_b = f"lmcache-bench-{b}"
            if b.startswith("tierfs-"):
                assert cluster is not None
                # replica:1 over 3 targets; each target's memory budget holds the
                # whole prefix, so placement skew never pushes a chunk to disk.
                create_kv_pool(cluster.meta_addrs, pool_b, memory=nbytes + 64 * MiB)
            print(f"[{b}] ...", flush=True)
            row = run_child(b, meta, pool_b, port, ns)
            print(f"[{b}] {json.dumps(row)}", flush=True)
            res["rows"].append(row)
    finally:
        stop_redis(redis_proc)
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "engines_lmcache.json").write_text(json.dumps(res, indent=1) + "\n")
    (ns.out / "engines_lmcache.md").write_text(markdown(res))
    print(markdown(res))


def child(ns: argparse.Namespace, nbytes: int) -> None:
    """``--child B``: run backend B alone, print its row, and exit hard
    (LMCache's threads of a dropped connector never finish)."""
    cpu_gb = (nbytes + 128 * MiB) / 1024**3
    tokens = torch.arange(10_000, 10_000 + ns.tokens)
    kv = torch.randint(-(1 << 15), 1 << 15, (2, LAYERS, ns.tokens, KV_HEADS * HEAD_DIM),
                       dtype=torch.int16).view(torch.bfloat16)
    row = run_backend(ns.child, backend_config(ns.child, ns.meta, ns.pool, ns.redis_port), tokens, kv, ns.reps,
                      cpu_gb)
    print(_ROW + json.dumps(row), flush=True)
    sys.stderr.flush()
    os._exit(0)


_ROW = "ROW "


def run_child(name: str, meta: str, pool: str, redis_port: int, ns: argparse.Namespace) -> dict[str, Any]:
    """Backend ``name`` in a process of its own (see the module's docstring):
    its row, or one that says how the process failed."""
    cmd = [sys.executable, "-m", "bench.engines_lmcache", "--child", name, "--meta", meta, "--pool", pool,
           "--redis-port", str(redis_port), "--tokens", str(ns.tokens), "--reps", str(ns.reps)]
    limit = BACKEND_BUDGET_S + 60  # the child's own alarm fires first
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=limit,
                              cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return {"backend": name, "error": f"Hung: its process did not finish within {limit} s"}
    rows = [ln[len(_ROW):] for ln in proc.stdout.splitlines() if ln.startswith(_ROW)]
    if not rows:
        return {"backend": name, "error": f"its process exited with {proc.returncode} and no result (stderr above)"}
    row: dict[str, Any] = json.loads(rows[-1])
    return row


if __name__ == "__main__":
    main()
