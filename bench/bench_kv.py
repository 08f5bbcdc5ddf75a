"""KV-cache store benchmark: TierFS ``client.kv`` against Redis and Mooncake
Store, and against the limits of this machine, all measured in the same run.

Every system is started by the benchmark and stopped afterwards (also on
failure); each runs alone, so no system's memory or CPU load is another's:

* Redis: Debian's ``redis-server`` (persistence off, ``maxmemory`` sized to
  the cells), redis-py clients: SET, GET, MGET, a pipeline of EXISTS.
* Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``, in
  ``.venv-bench``): ``mooncake_master`` with its HTTP metadata server, two
  store processes that only contribute memory segments (the counterpart of
  two storage daemons), clients with no segment of their own over the TCP
  protocol: zero-copy ``put_from`` / ``get_into`` / ``batch_get_into`` on
  registered buffers, ``batch_is_exist``.
* TierFS: ``LocalCluster`` with 3 meta replicas and 2 storage daemons on
  loopback, a ``replica:1`` KV pool sized for the cells, clients over tcp
  and over shm.

Cells: 64 KiB, 1 MiB, 4 MiB, 32 MiB values x 1 and 4 client processes (one
request in flight per process); put, get, batched get (16 keys a call,
4 at 32 MiB) and, at 64 KiB, ``batch_exists`` of 1,000 keys. For TierFS:
get from the cluster tier (a client with no local tiers), get on a DRAM-tier
hit (``kv_dram_bytes``), get on an SSD-tier hit (``kv_ssd_path`` on the local
disk, no DRAM tier). Figures: throughput of all clients together (bytes over
the span from the first start to the last end) and p50 / p99 per call.

Limits (same cells, same process counts): memcpy out of a working set into
one reused buffer (DRAM tier), O_DIRECT preads of a file on the same disk
(SSD tier), the raw uvloop loopback stream of ``bench.bench_dataplane``
(cluster tier). Then two behaviour rows: puts at 3x a small pool's capacity
(failures must be 0) and a KV pool's objects after the meta leader is
SIGKILLed (lost must be 0). The targets of issue 9 are judged at the end.

    python -m bench.bench_kv [--quick] [--only redis,mooncake,tierfs,limits]

Needs ``make bench`` (redis-server, .venv-bench); a missing peer is reported
as such, not skipped silently. Writes ``bench/results/kv.md`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from bench.common import results_dir

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "kv_worker.py"
BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"
MOONCAKE_MASTER = "mooncake_master"
KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 1 * MiB, 4 * MiB, 32 * MiB]
PROCS = [1, 4]
EXISTS_KEYS = 1000
T = TypeVar("T")


def _label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


# --- plan ------------------------------------------------------------------------------


class Plan:
    """How many operations each cell runs (quick: about a quarter)."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.put_bytes = (32 if quick else 128) * MiB  # per process
        self.get_bytes = (64 if quick else 256) * MiB
        self.min_put = 4 if quick else 8
        self.min_get = 16 if quick else 32
        self.exists_calls = 20 if quick else 60

    def n_put(self, size: int) -> int:
        return max(self.min_put, self.put_bytes // size)

    def n_get(self, size: int) -> int:
        return max(self.min_get, self.get_bytes // size)

    def batch(self, size: int) -> int:
        # Never more keys a call than the working set has: a batch naming a
        # key twice is not what an engine sends (and Mooncake fails it).
        return min(4 if size >= 32 * MiB else 16, self.n_put(size))

    def n_batch(self, size: int) -> int:
        return max(4, self.n_get(size) // self.batch(size))


# --- worker processes ------------------------------------------------------------------


class Group:
    """``n`` worker processes of one mode, driven phase by phase in lockstep."""

    def __init__(self, python: str, spec: dict[str, Any], n: int, logdir: Path, timeout: float = 120) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.bufs: list[bytes] = []
        self.logs: list[Path] = []
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        try:
            for i in range(n):
                log = logdir / f"{spec['mode']}-{spec.get('tag', 'x')}-{i}.log"
                self.logs.append(log)
                with open(log, "wb") as err:
                    self.procs.append(subprocess.Popen(
                        [python, str(WORKER), json.dumps({**spec, "proc": spec.get("proc_base", 0) + i})], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=err, env=env, cwd=ROOT, bufsize=0))
                self.bufs.append(b"")
            for i in range(n):
                self._read(i, timeout)
        except BaseException:
            self.close()
            raise

    def _read(self, i: int, timeout: float) -> dict[str, Any]:
        p = self.procs[i]
        assert p.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.bufs[i]:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([p.stdout], [], [], left)[0]:
                raise TimeoutError(f"worker {i} silent for {timeout:.0f} s; log {self.logs[i]}:\n{self._tail(i)}")
            chunk = os.read(p.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"worker {i} exited ({p.wait()}); log {self.logs[i]}:\n{self._tail(i)}")
            self.bufs[i] += chunk
        line, _, self.bufs[i] = self.bufs[i].partition(b"\n")
        out: dict[str, Any] = json.loads(line)
        return out

    def _tail(self, i: int) -> str:
        try:
            return "\n".join(self.logs[i].read_text(errors="replace").splitlines()[-12:])
        except OSError:
            return "(no log)"

    def phase(self, timeout: float = 300, **cmd: Any) -> list[dict[str, Any]]:
        line = (json.dumps(cmd) + "\n").encode()
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line)
        return [self._read(i, timeout) for i in range(len(self.procs))]

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                assert p.stdin is not None
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.procs = []


@contextlib.contextmanager
def group(python: str, spec: dict[str, Any], n: int, logdir: Path) -> Iterator[Group]:
    g = Group(python, spec, n, logdir)
    try:
        yield g
    finally:
        g.close()


def summarize(results: list[dict[str, Any]], unit_bytes: bool = True) -> dict[str, Any]:
    """All clients of one phase together: throughput over the common span,
    p50/p99 over every call of every client."""
    lat = sorted(x for r in results for x in r["lat"])
    span = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    calls = sum(len(r["lat"]) for r in results)
    out: dict[str, Any] = {
        "mib_s": round(nbytes / span / MiB, 1) if span > 0 and unit_bytes else None,
        "calls_s": round(calls / span, 1) if span > 0 else None,
        "p50_ms": round(1000 * statistics.median(lat), 3) if lat else None,
        "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        "calls": calls,
        "errors": sum(r["errors"] for r in results),
    }
    return out


# --- the limits ------------------------------------------------------------------------


def measure_limits(plan: Plan, tmp: Path, logdir: Path) -> dict[str, dict[str, Any]]:
    """``limits[f"{kind} {size} x{procs}"]`` for kind memcpy, odirect, loopback."""
    from bench.bench_dataplane import _spawn, _stop

    out: dict[str, dict[str, Any]] = {}
    raw_srv, raw_port = _spawn([sys.executable, str(HERE / "bench_dataplane.py"), "raw-tcp-server"])
    try:
        for size in SIZES:
            for n in PROCS:
                ws = plan.n_put(size)
                base = {"size": size, "tag": "lim", "ws": ws}
                with group(sys.executable, {**base, "mode": "memcpy"}, n, logdir) as g:
                    g.phase(n=ws)  # warm: every page of the working set touched
                    out[f"memcpy {size} x{n}"] = summarize(g.phase(n=plan.n_get(size)))
                with group(sys.executable, {**base, "mode": "odirect", "path": str(tmp / f"odirect-{size}")},
                           n, logdir) as g:
                    out[f"odirect {size} x{n}"] = summarize(g.phase(n=plan.n_get(size)))
                with group(sys.executable, {**base, "mode": "loopback", "port": raw_port}, n, logdir) as g:
                    g.phase(n=max(4, (16 * MiB) // size))
                    out[f"loopback {size} x{n}"] = summarize(g.phase(n=plan.n_get(size)))
    finally:
        _stop(raw_srv)
    return out


# --- one system's cells ------------------------------------------------------------------


def _retry(fn: Callable[[], T], recover: Callable[[], bool] | None) -> T:
    """fn(), and once more if it failed and ``recover()`` says it mended the cause."""
    try:
        return fn()
    except Exception:
        if recover is None or not recover():
            raise
        return fn()


def run_cells(plan: Plan, python: str, base: dict[str, Any], logdir: Path, system: str,
              ops: tuple[str, ...] = ("put", "get", "batch_get", "exists"),
              recover: Callable[[], bool] | None = None) -> dict[str, dict[str, Any]]:
    """``cells[f"{system} {op} {size} x{procs}"]``; the get phases read back the put phase's keys."""
    out: dict[str, dict[str, Any]] = {}

    def cell(size: int, n: int) -> dict[str, dict[str, Any]]:
        got: dict[str, dict[str, Any]] = {}
        tag = f"{system.replace(' ', '_')}-{size}-{n}-{time.monotonic_ns() % 10**9}"
        spec = {**base, "size": size, "tag": tag, "batch": plan.batch(size)}
        with group(python, spec, n, logdir) as g:
            ws = plan.n_put(size)
            res = g.phase(phase="put", n=ws)
            if "put" in ops:
                got[f"{system} put {size} x{n}"] = summarize(res)
            if "get" in ops:
                got[f"{system} get {size} x{n}"] = summarize(g.phase(phase="get", n=plan.n_get(size), ws=ws))
            if "batch_get" in ops:
                got[f"{system} batch_get {size} x{n}"] = summarize(
                    g.phase(phase="batch_get", n=plan.n_batch(size), ws=ws))
            if "exists" in ops and size == SIZES[0]:
                g.phase(phase="exists_setup", n=0, keys=EXISTS_KEYS)
                got[f"{system} exists {EXISTS_KEYS} x{n}"] = summarize(
                    g.phase(phase="exists", n=plan.exists_calls, keys=EXISTS_KEYS), unit_bytes=False)
            g.phase(phase="clean", n=ws)
        return got

    for size in SIZES:
        for n in PROCS:
            got = _retry(lambda: cell(size, n), recover)  # noqa: B023 - called at once
            out.update(got)
            print(f"  {system} {_label(size)} x{n}: " + ", ".join(
                f"{k.split()[-3]} {v.get('mib_s') or v.get('calls_s')}" for k, v in got.items()
                if "mib_s" in v), flush=True)
    return out


def run_redis(plan: Plan, tmp: Path, logdir: Path) -> dict[str, dict[str, Any]]:
    from tierfs.local import free_ports

    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("redis-server is not installed (make bench installs it)")
    (port,) = free_ports(1)
    # Room for the largest cell (4 clients' put working sets) with margin.
    maxmem = 4 * plan.n_put(SIZES[-1]) * SIZES[-1] * 2 + 256 * MiB
    with open(logdir / "redis-server.log", "wb") as log:
        proc = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", str(maxmem), "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp),
             "--proto-max-bulk-len", str(512 * MiB), "--client-output-buffer-limit", "normal 0 0 0"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_port(port, 20, "redis-server", proc)
        return run_cells(plan, str(BENCH_PY), {"mode": "redis", "port": port}, logdir, "redis")
    finally:
        _terminate(proc)


def _mooncake_master() -> str:
    path = BENCH_PY.parent / MOONCAKE_MASTER
    if not path.exists():
        raise RuntimeError(f"{path} missing: make bench installs mooncake-transfer-engine-non-cuda into .venv-bench")
    return str(path)


def run_mooncake(plan: Plan, tmp: Path, logdir: Path) -> dict[str, dict[str, Any]]:
    from tierfs.local import free_ports

    rpc, http = free_ports(2)
    with open(logdir / "mooncake-master.log", "wb") as log:
        master = subprocess.Popen(
            [_mooncake_master(), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={http}"], stdout=log, stderr=subprocess.STDOUT)
    servers: Group | None = None
    try:
        _wait_port(rpc, 30, "mooncake_master", master)
        _wait_port(http, 30, "mooncake http metadata server", master)
        segment = 4 * plan.n_put(SIZES[-1]) * SIZES[-1] + 512 * MiB  # per store process; 2 of them
        base = {"rpc_port": rpc, "http_port": http}
        servers = Group(str(BENCH_PY), {**base, "mode": "mooncake-server", "segment": segment, "size": 4096,
                                        "tag": "srv"}, 2, logdir)
        return run_cells(plan, str(BENCH_PY), {**base, "mode": "mooncake"}, logdir, "mooncake")
    finally:
        if servers is not None:
            servers.close()
        _terminate(master)


def _pool_ready(meta: list[str], pool: str, timeout: float = 60) -> None:
    from tierfs.client import AsyncClient

    async def go() -> None:
        deadline = time.monotonic() + timeout
        async with AsyncClient(meta, kv_timeout=2.0) as c:
            last: Exception | None = None
            while time.monotonic() < deadline:
                try:
                    # Many keys, so every target is asked: a daemon that has not
                    # seen the new pool in its map yet fails its puts with
                    # NotFoundError (seen for seconds after a cluster restart).
                    stamp = time.monotonic_ns()
                    await c.kv_pool(pool).batch_put([f"probe-{stamp}-{i}" for i in range(64)], [b"x"] * 64)
                    return
                except Exception as exc:  # not served yet: retry until the deadline
                    last = exc
                    await asyncio.sleep(0.3)
            raise TimeoutError(f"KV pool {pool!r} not served after {timeout:.0f} s: {last}")

    asyncio.run(go())


def _create_pool(meta: list[str], name: str, **kw: Any) -> None:
    from tierfs.errors import AlreadyExistsError
    from tierfs.meta import MetaClient

    async def go() -> None:
        async with MetaClient(meta) as mc:
            with contextlib.suppress(AlreadyExistsError):  # a retried cell made it already
                await mc.create_kv_pool(name, **kw)

    asyncio.run(go())


def run_tierfs(plan: Plan, tmp: Path, logdir: Path, transports: tuple[str, ...],
               profile: str = "") -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], str]:
    from tierfs.local import LocalCluster

    cl = LocalCluster(tmp / "cluster", n_meta=3, n_storage=2, extra_meta_args=["--heartbeat-timeout=3"])
    cl.export_token()  # security on: this cluster's admin token
    out: dict[str, dict[str, Any]] = {}
    behaviour: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        cl.up(timeout=120)
        note = f"cluster up in {time.perf_counter() - t0:.1f} s"
        biggest = 4 * plan.n_put(SIZES[-1]) * SIZES[-1]
        # Memory only, as Redis and Mooncake Store keep their objects: a pool
        # with a disk budget writes a file per put (docs/kv_bench.md). Each
        # target's memory holds the largest cell, so every get is a hit.
        _create_pool(cl.meta_addrs, "bench", redundancy="replica:1", target_memory=biggest + 512 * MiB,
                     target_disk=0)
        _pool_ready(cl.meta_addrs, "bench")
        base = {"mode": "tierfs", "meta": cl.meta_addrs, "pool": "bench", "profile": profile}
        restarts: list[str] = []

        def recover() -> bool:
            """Other work on this machine has stopped our daemons (SIGTERM to
            all of them at once, seen three times): start them again."""
            down = [name for name, alive in cl.running().items() if not alive]
            if not down:
                return False
            restarts.append(f"{', '.join(down)} at {time.strftime('%H:%M:%S', time.gmtime())}")
            print(f"  cluster daemons stopped from outside ({', '.join(down)}): restarting, cell retried", flush=True)
            cl.up(timeout=120)
            _pool_ready(cl.meta_addrs, "bench")
            return True

        for tr in transports:
            out.update(run_cells(plan, sys.executable, {**base, "transport": tr}, logdir, f"tierfs-{tr} cluster",
                                 recover=recover))

        def local(kind: str, size: int) -> dict[str, Any]:
            cap = int(1.5 * plan.n_put(size) * size) + 16 * MiB
            if kind == "dram":
                return {"kv_dram_bytes": cap}
            return {"kv_ssd_bytes": cap, "kv_ssd_path": str(tmp / f"ssd-tier-{size}-{time.monotonic_ns()}")}

        def local_cell(kind: str, size: int, n: int) -> dict[str, dict[str, Any]]:
            got: dict[str, dict[str, Any]] = {}
            tag = f"tierfs-{kind}-{size}-{n}-{time.monotonic_ns() % 10**9}"
            spec = {**base, "transport": "auto", "size": size, "tag": tag, "batch": plan.batch(size)}
            procs: list[Group] = []
            try:
                # One group per process: each has its own tier (its own SSD file).
                for i in range(n):
                    procs.append(Group(sys.executable, {**spec, "client": local(kind, size), "proc_base": i}, 1,
                                       logdir))
                ws = plan.n_put(size)
                # Puts fill the local tier (write-through: and the cluster).
                got[f"tierfs-{kind} put {size} x{n}"] = summarize(_fan(procs, phase="put", n=ws))
                cell = got[f"tierfs-{kind} get {size} x{n}"] = summarize(
                    _fan(procs, phase="get", n=plan.n_get(size), ws=ws))
                stats = _fan(procs, phase="stats", n=0)
                # Proof that the gets were served by the tier under test.
                cell["tier_hits"] = sum(t["hits"] for s in stats for t in s["stats"]["tiers"] if t["name"] == kind)
                cell["cluster_hits"] = sum(s["stats"]["cluster"]["hits"] for s in stats)
                _fan(procs, phase="clean", n=ws)
            finally:
                for p in procs:
                    p.close()
            return got

        for kind in ("dram", "ssd"):
            for size in SIZES:
                for n in PROCS:
                    got = _retry(lambda: local_cell(kind, size, n), recover)  # noqa: B023 - called at once
                    out.update(got)
                    print(f"  tierfs-{kind} {_label(size)} x{n}: get "
                          f"{got[f'tierfs-{kind} get {size} x{n}']['mib_s']} MiB/s", flush=True)
        behaviour += _retry(lambda: _overfill(cl), recover)
        behaviour += _retry(lambda: _leader_kill(cl), recover)
        if restarts:
            note += ("; the cluster's daemons were SIGTERMed from outside the benchmark (other work on the "
                     f"machine) at {'; '.join(restarts)}: restarted, the cell retried")
        return out, behaviour, note
    finally:
        cl.stop()


def _fan(groups: list[Group], **cmd: Any) -> list[dict[str, Any]]:
    """One phase on several single-process groups at once (sent to all, then read)."""
    line = (json.dumps(cmd) + "\n").encode()
    for g in groups:
        for p in g.procs:
            assert p.stdin is not None
            p.stdin.write(line)
    return [g._read(0, 300) for g in groups]


def _overfill(cl: Any) -> list[dict[str, Any]]:
    """Puts of 3x a small pool's capacity: every one must succeed."""
    from tierfs.client import AsyncClient

    size = 64 * KiB
    disk = 4 * MiB
    _create_pool(cl.meta_addrs, "small", redundancy="replica:1", target_memory=2 * MiB, target_disk=disk)
    _pool_ready(cl.meta_addrs, "small")
    capacity = 2 * disk  # 2 targets
    n = 3 * capacity // size

    errors: dict[str, int] = {}

    async def go() -> tuple[int, int, int]:
        failures = 0
        buf = bytearray(os.urandom(size))
        async with AsyncClient(cl.meta_addrs, kv_timeout=10.0) as c:
            kv = c.kv_pool("small")
            for i in range(n):
                buf[:8] = i.to_bytes(8, "little")
                try:
                    await kv.put(f"fill-{i}", buf)
                except Exception as exc:  # a failed put is what this row counts
                    failures += 1
                    msg = f"{type(exc).__name__}: {str(exc)[:160]}"
                    errors[msg] = errors.get(msg, 0) + 1
            recent = [f"fill-{i}" for i in range(n - (capacity // size) // 5, n)]
            dest = [bytearray(size) for _ in recent]
            got = await kv.batch_get_into(recent, dest)
            present = sum(1 for g in got if g == size)
            return failures, present, len(recent)

    failures, present, want = asyncio.run(go())
    return [
        {"case": f"puts at 3x a pool's capacity ({n} x 64 KiB into 2 x {disk // MiB} MiB): failures", "value": failures,
         "unit": "puts", "baseline": 0, "baseline_name": "target: 0", "ratio": None, "met": failures == 0,
         "failures": errors},
        {"case": "  ... newest 20 % of the capacity present afterwards", "value": present, "unit": "objects",
         "baseline": want, "baseline_name": "objects put last", "ratio": round(present / want, 3)},
    ]


def _leader_kill(cl: Any) -> list[dict[str, Any]]:
    """Put N objects, SIGKILL the meta leader, get them all (and keep putting)."""
    from tierfs.client import AsyncClient

    size, n = 64 * KiB, 500

    def leader() -> str:
        h = asyncio.run(cl.health())
        return next(m["name"] for m in h["meta"] if m["role"] == "leader")

    async def go() -> tuple[int, int, float, float]:
        buf = bytearray(os.urandom(size))
        async with AsyncClient(cl.meta_addrs, kv_timeout=10.0) as c:
            kv = c.kv_pool("bench")
            for i in range(n):
                buf[:8] = i.to_bytes(8, "little")
                await kv.put(f"lk-{i}", buf)
            name = await asyncio.get_running_loop().run_in_executor(None, leader)
            cl.kill(name)
            t0 = time.perf_counter()
            dest = bytearray(size)
            lost = 0
            worst = 0.0
            for i in range(n):
                a = time.perf_counter()
                got = await kv.get_into(f"lk-{i}", dest)
                worst = max(worst, time.perf_counter() - a)
                if got != size or int.from_bytes(dest[:8], "little") != i:
                    lost += 1
            put_fail = 0
            put_worst = 0.0
            for i in range(100):
                a = time.perf_counter()
                try:
                    await kv.put(f"lk-after-{i}", buf)
                except Exception:  # counted
                    put_fail += 1
                put_worst = max(put_worst, time.perf_counter() - a)
            del t0
            return lost, put_fail, worst, put_worst

    lost, put_fail, worst, put_worst = asyncio.run(go())
    return [
        {"case": f"meta leader SIGKILLed: objects lost of {n} x 64 KiB", "value": lost, "unit": "objects",
         "baseline": 0, "baseline_name": "target: 0", "ratio": None, "met": lost == 0},
        {"case": "  ... slowest get after the kill", "value": round(worst * 1000, 1), "unit": "ms",
         "baseline": None, "baseline_name": "", "ratio": None},
        {"case": "  ... puts failed / slowest put after the kill (100 puts)", "value": put_fail, "unit": "puts",
         "baseline": round(put_worst * 1000, 1), "baseline_name": "slowest put, ms", "ratio": None,
         "met": put_fail == 0},
    ]


# --- processes ------------------------------------------------------------------------


def _wait_port(port: int, timeout: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on {port} within {timeout:.0f} s")


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- judging ----------------------------------------------------------------------------


def _best(cells: dict[str, dict[str, Any]], system: str, size: int, n: int,
          ops: tuple[str, ...] = ("get", "batch_get")) -> tuple[float | None, str]:
    best, which = None, ""
    for op in ops:
        c = cells.get(f"{system} {op} {size} x{n}")
        if c and c.get("mib_s") and not c.get("errors") and (best is None or c["mib_s"] > best):
            best, which = c["mib_s"], op
    return best, which


def judge(cells: dict[str, dict[str, Any]], limits: dict[str, dict[str, Any]],
          transports: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows for bench.run's table, target verdicts)."""
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []

    def row(case: str, cell: dict[str, Any] | None, base: float | None, base_name: str, **extra: Any) -> None:
        if not cell:
            return
        v = cell.get("mib_s")
        rows.append({"case": case, "value": v, "unit": "MiB/s", "baseline": base, "baseline_name": base_name,
                     "ratio": round(v / base, 3) if v and base else None, "p50_ms": cell.get("p50_ms"),
                     "p99_ms": cell.get("p99_ms"), "errors": cell.get("errors"), **extra})

    def target(name: str, value: float | None, want: float, detail: str, higher: bool = True) -> None:
        if value is None:
            targets.append({"target": name, "value": None, "want": want, "met": None, "detail": detail + " (no figure)"})
            return
        met = value >= want if higher else value <= want
        # by: the margin, positive when met (how far above a floor, how far
        # below a ceiling), negative when missed.
        by = (value / want - 1 if higher else want / value - 1) if want and value else None
        targets.append({"target": name, "value": round(value, 3), "want": want, "met": met,
                        "by": None if by is None else round(by, 3), "detail": detail})

    for n in PROCS:
        for size in SIZES:
            lab = f"{_label(size)} x{n}"
            loop = limits.get(f"loopback {size} x{n}", {}).get("mib_s")
            mc_best, mc_op = _best(cells, "mooncake", size, n)
            redis_get = cells.get(f"redis get {size} x{n}", {}).get("mib_s")
            for peer in ("redis", "mooncake"):
                for op in ("put", "get", "batch_get"):
                    row(f"{peer} {op} {lab}", cells.get(f"{peer} {op} {size} x{n}"), None, "")
            for tr in transports:
                sysname = f"tierfs-{tr} cluster"
                for op in ("put", "get", "batch_get"):
                    c = cells.get(f"{sysname} {op} {size} x{n}")
                    peer = cells.get(f"redis {op} {size} x{n}", {}).get("mib_s")
                    mc = cells.get(f"mooncake {op} {size} x{n}", {}).get("mib_s")
                    row(f"tierfs {tr} {op} {lab}", c, loop if op != "put" else None,
                        "raw loopback stream" if op != "put" else "",
                        vs_redis=round(c["mib_s"] / peer, 3) if c and peer and c.get("mib_s") else None,
                        vs_mooncake=round(c["mib_s"] / mc, 3) if c and mc and c.get("mib_s") else None)
            tf_best, tf_op, tf_tr = None, "", ""
            for tr in transports:
                b, op = _best(cells, f"tierfs-{tr} cluster", size, n)
                if b is not None and (tf_best is None or b > tf_best):
                    tf_best, tf_op, tf_tr = b, op, tr
            tf_get_best = max((cells.get(f"tierfs-{tr} cluster get {size} x{n}", {}).get("mib_s") or 0
                               for tr in transports), default=0) or None
            if mc_best is not None:
                target(f"cluster get >= 1.5x Mooncake best, {lab}", tf_best / mc_best if tf_best else None, 1.5,
                       f"TierFS {tf_tr} {tf_op} {tf_best} vs Mooncake {mc_op} {mc_best} MiB/s")
            if redis_get is not None:
                target(f"cluster get >= 1.25x Redis GET, {lab}", tf_get_best / redis_get if tf_get_best else None,
                       1.25, f"TierFS get_into {tf_get_best} vs Redis GET {redis_get} MiB/s")
            if size >= MiB and loop:
                target(f"cluster get >= 0.8x raw loopback, {lab}", tf_best / loop if tf_best else None, 0.8,
                       f"TierFS {tf_tr} {tf_op} {tf_best} vs raw stream {loop} MiB/s")
            # p99 of the single get against each peer's single get.
            tf_p99 = min((cells.get(f"tierfs-{tr} cluster get {size} x{n}", {}).get("p99_ms") or 1e9
                          for tr in transports), default=1e9)
            for peer in ("redis", "mooncake"):
                pp = cells.get(f"{peer} get {size} x{n}", {}).get("p99_ms")
                if pp and tf_p99 < 1e9:
                    target(f"cluster get p99 <= {peer}'s, {lab}", tf_p99, pp,
                           f"TierFS p99 {tf_p99} ms vs {peer} {pp} ms", higher=False)
            dram = cells.get(f"tierfs-dram get {size} x{n}")
            memcpy = limits.get(f"memcpy {size} x{n}", {}).get("mib_s")
            row(f"tierfs DRAM-tier hit {lab}", dram, memcpy, "memcpy into a reused buffer",
                tier_hits=(dram or {}).get("tier_hits"))
            if dram and memcpy:
                target(f"DRAM hit >= 0.8x memcpy, {lab}", dram["mib_s"] / memcpy, 0.8,
                       f"{dram['mib_s']} vs memcpy {memcpy} MiB/s")
            ssd = cells.get(f"tierfs-ssd get {size} x{n}")
            od = limits.get(f"odirect {size} x{n}", {}).get("mib_s")
            row(f"tierfs SSD-tier hit {lab}", ssd, od, "raw O_DIRECT read", tier_hits=(ssd or {}).get("tier_hits"))
            if ssd and od:
                target(f"SSD hit >= 0.85x O_DIRECT, {lab}", ssd["mib_s"] / od, 0.85,
                       f"{ssd['mib_s']} vs O_DIRECT {od} MiB/s")
        # batch_exists of 1,000 keys, calls per second
        ex = {s: cells.get(f"{s} exists {EXISTS_KEYS} x{n}") for s in
              ["redis", "mooncake", *(f"tierfs-{tr} cluster" for tr in transports)]}
        for s, c in ex.items():
            if c:
                rows.append({"case": f"{s.replace('-', ' ').replace(' cluster', '')} batch_exists {EXISTS_KEYS} keys "
                                     f"x{n}", "value": c["calls_s"], "unit": "calls/s", "baseline": None,
                             "baseline_name": "", "ratio": None, "p50_ms": c["p50_ms"], "p99_ms": c["p99_ms"],
                             "errors": c["errors"]})
    return rows, targets


# --- report -----------------------------------------------------------------------------


def _f(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 10 else f"{v:,.0f}"
    return str(v)


def to_markdown(result: dict[str, Any]) -> str:
    cells, limits = result["cells"], result["limits"]
    trs = result["transports"]
    out = [f"### kv ({'quick' if result['quick'] else 'full'} run, {result['when']})", "",
           result["notes"], "",
           "Throughput in MiB/s of all clients together; p50 / p99 per call in ms. "
           "`batch` = batch_get_into / MGET of 16 keys a call (4 at 32 MiB).", ""]
    cols = ["limit: loopback", "limit: memcpy", "limit: O_DIRECT", "redis put", "redis GET", "redis MGET",
            "mooncake put_from", "mooncake get_into", "mooncake batch"]
    for tr in trs:
        cols += [f"tierfs {tr} put", f"tierfs {tr} get", f"tierfs {tr} batch"]
    cols += ["tierfs DRAM hit", "tierfs SSD hit"]
    out.append("| cell | " + " | ".join(cols) + " |")
    out.append("|---|" + "---:|" * len(cols))
    for n in PROCS:
        for size in SIZES:
            def c(key: str, src: dict[str, Any] = cells) -> str:
                x = src.get(key)
                if not x or x.get("mib_s") is None:
                    return "-"
                s = f"{_f(x['mib_s'])}"
                if x.get("p50_ms") is not None:
                    s += f" ({_f(x['p50_ms'])} / {_f(x['p99_ms'])})"
                if x.get("errors"):
                    s += f" **{x['errors']} err**"
                return s
            k = f"{size} x{n}"
            vals = [c(f"loopback {k}", limits), c(f"memcpy {k}", limits), c(f"odirect {k}", limits),
                    c(f"redis put {k}"), c(f"redis get {k}"), c(f"redis batch_get {k}"),
                    c(f"mooncake put {k}"), c(f"mooncake get {k}"), c(f"mooncake batch_get {k}")]
            for tr in trs:
                vals += [c(f"tierfs-{tr} cluster put {k}"), c(f"tierfs-{tr} cluster get {k}"),
                         c(f"tierfs-{tr} cluster batch_get {k}")]
            vals += [c(f"tierfs-dram get {k}"), c(f"tierfs-ssd get {k}")]
            out.append(f"| {_label(size)} x{n} | " + " | ".join(vals) + " |")
    out += ["", f"batch_exists of {EXISTS_KEYS} present keys, calls/s (p50 / p99 ms):", "",
            "| clients | " + " | ".join(["redis (pipelined EXISTS)", "mooncake batch_is_exist",
                                         *(f"tierfs {tr}" for tr in trs)]) + " |",
            "|---|" + "---:|" * (2 + len(trs))]
    for n in PROCS:
        vals = []
        for s in ["redis", "mooncake", *(f"tierfs-{tr} cluster" for tr in trs)]:
            x = cells.get(f"{s} exists {EXISTS_KEYS} x{n}")
            vals.append("-" if not x else f"{_f(x['calls_s'])} ({_f(x['p50_ms'])} / {_f(x['p99_ms'])})"
                        + (f" **{x['errors']} err**" if x["errors"] else ""))
        out.append(f"| x{n} | " + " | ".join(vals) + " |")
    out += ["", "Behaviour:", "", "| case | value | unit | note |", "|---|---:|---|---|"]
    for r in result.get("behaviour", []):
        note = r.get("baseline_name", "")
        if r.get("baseline") is not None:
            note = f"{note} {r['baseline']}".strip()
        out.append(f"| {r['case']} | {_f(r['value'])} | {r['unit']} | {note} |")
    t = result.get("targets", [])
    met = sum(1 for x in t if x["met"])
    out += ["", f"Targets of issue 9: {met} of {len(t)} met.", "",
            "| target | value | want | met | by | detail |", "|---|---:|---:|---|---:|---|"]
    for x in t:
        by = "-" if x.get("by") is None else f"{x['by']:+.0%}"
        out.append(f"| {x['target']} | {_f(x['value'])} | {_f(x['want'])} | "
                   f"{'yes' if x['met'] else ('no' if x['met'] is False else '?')} | {by} | {x['detail']} |")
    if result.get("errors_seen"):
        out += ["", "Failures during the run:", ""] + [f"- {e}" for e in result["errors_seen"]]
    return "\n".join(out) + "\n"


def run(quick: bool, only: tuple[str, ...] = ("limits", "redis", "mooncake", "tierfs"),
        transports: tuple[str, ...] = ("tcp", "shm"), profile: str = "") -> dict[str, Any]:
    """``profile``: a directory where each TierFS client writes a cProfile of
    each of its timed phases (``<tag>-<proc>-<phase>.prof``)."""
    plan = Plan(quick)
    t_start = time.monotonic()
    base = os.environ.get("TIERFS_BENCH_DIR")
    tmp = Path(tempfile.mkdtemp(prefix="bench-kv-", dir=base))
    logdir = tmp / "logs"
    logdir.mkdir()
    cells: dict[str, dict[str, Any]] = {}
    limits: dict[str, dict[str, Any]] = {}
    behaviour: list[dict[str, Any]] = []
    errors: list[str] = []
    notes: list[str] = []
    load = os.getloadavg()
    loads: list[str] = []  # 1-minute load average as each part starts: how busy the machine was
    try:
        for part in only:
            print(f"== kv: {part}", flush=True)
            t0 = time.monotonic()
            loads.append(f"{part} {os.getloadavg()[0]:.1f}")
            try:
                if part == "limits":
                    limits = measure_limits(plan, tmp, logdir)
                elif part == "redis":
                    cells.update(run_redis(plan, tmp, logdir))
                elif part == "mooncake":
                    cells.update(run_mooncake(plan, tmp, logdir))
                elif part == "tierfs":
                    c, behaviour, note = run_tierfs(plan, tmp, logdir, transports, profile)
                    cells.update(c)
                    notes.append(note)
            except Exception as exc:  # one system failing must not hide the others' figures
                import traceback

                traceback.print_exc()
                errors.append(f"{part}: {type(exc).__name__}: {str(exc)[:1500]}")
            print(f"   {part}: {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        if errors and os.environ.get("BENCH_KV_KEEP"):
            print(f"kept {tmp} (logs of the failed run)", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    rows, targets = judge(cells, limits, transports)
    rows += behaviour
    for b in behaviour:
        if "met" in b:
            targets.append({"target": b["case"], "value": b["value"], "want": 0, "met": b["met"], "by": None,
                            "detail": ""})
    notes.insert(0, (
        f"{'quick' if quick else 'full'} run in {time.monotonic() - t_start:.0f} s on {os.cpu_count()} CPUs shared "
        f"with other work (1-minute load average {load[0]:.1f} at the start; as each part started: "
        f"{', '.join(loads)}): figures are single runs, expect +-30 % on a quiet machine, more on a busy one. "
        f"Per client process: puts of {plan.put_bytes // MiB} MiB (at least {plan.min_put}), gets of "
        f"{plan.get_bytes // MiB} MiB (at least {plan.min_get}) over the put working set, one call in flight. "
        "TierFS: 3 meta + 2 storage daemons, a memory-only replica:1 pool; Mooncake: master + 2 "
        "segment processes, clients over TCP; Redis: one server. Every get checks its key's stamp."))
    result: dict[str, Any] = {
        "name": "kv", "rows": rows, "notes": " ".join(notes), "cells": cells, "limits": limits,
        "behaviour": behaviour, "targets": targets, "transports": list(transports), "quick": quick,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if errors:
        result["errors_seen"] = errors
        result["error"] = "; ".join(e[:300] for e in errors)
    (results_dir(quick) / "kv.md").write_text(to_markdown(result))
    return result


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="limits,redis,mooncake,tierfs")
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--profile", default="", metavar="DIR", help="cProfile of each TierFS client phase into DIR")
    ap.add_argument("--rejudge", metavar="JSON", help="judge the cells of an earlier kv.json again (no run)")
    ns = ap.parse_args()
    parts = ("limits", "redis", "mooncake", "tierfs")
    bad = sorted(set(ns.only.split(",")) - set(parts))
    if bad:
        ap.error(f"--only: no part named {', '.join(map(repr, bad))}; parts: {', '.join(parts)}")
    bad = sorted(set(ns.transports.split(",")) - {"tcp", "shm"})
    if bad:
        ap.error(f"--transports: no transport named {', '.join(map(repr, bad))}; transports: tcp, shm")
    if ns.rejudge:
        res = json.loads(Path(ns.rejudge).read_text())
        res["rows"], res["targets"] = judge(res["cells"], res["limits"], tuple(res["transports"]))
        res["rows"] += res["behaviour"]
        res["targets"] += [{"target": b["case"], "value": b["value"], "want": 0, "met": b["met"], "by": None,
                            "detail": ""} for b in res["behaviour"] if "met" in b]
        (HERE / "results" / "kv.json").write_text(json.dumps(res, indent=1) + "\n")
        (HERE / "results" / "kv.md").write_text(to_markdown(res))
        sys.exit(0)
    if ns.profile:
        os.makedirs(ns.profile, exist_ok=True)
    res = run(ns.quick, tuple(ns.only.split(",")), tuple(ns.transports.split(",")),
              os.path.abspath(ns.profile) if ns.profile else "")
    (results_dir(ns.quick) / "kv.json").write_text(json.dumps(res, indent=1) + "\n")
    print(to_markdown(res))
