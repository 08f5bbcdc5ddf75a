"""One client process of the KV benchmark (``bench.bench_kv``).

Standalone on purpose: the TierFS client runs it with TierFS' venv, the Redis
and Mooncake Store clients with the benchmark's own (``.venv-bench``, which
has no TierFS), so nothing here imports a system's module before its mode
asks for it.

    python bench/kv_worker.py '<json spec>'

Protocol on stdin/stdout, one JSON object a line: the worker sets up
(connects, registers buffers), prints ``{"ready": true}``, then for each
line ``{"phase": NAME, ...}`` it reads, runs that phase and prints
``{"t0": s, "t1": s, "lat": [s, ...], "bytes": n, "errors": n, ...}``
(``time.monotonic()``: the same clock in every process, so the parent can
take the span of all clients together). EOF: clean up and exit.

Every value carries its key's index in its first 8 bytes and every get checks
it, so a mixed-up or stale object counts as an error, not as speed.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

_U64 = struct.Struct("<Q")


def _arena(n: int) -> mmap.mmap:
    """Pre-faulted anonymous memory (first touch of fresh memory is slow here)."""
    m = mmap.mmap(-1, max(n, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    pat = os.urandom(1 << 16)
    for off in range(0, len(m), len(pat)):
        k = min(len(pat), len(m) - off)
        m[off:off + k] = pat[:k]
    return m


def _addr(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


class Worker:
    """What every mode shares: the spec, a source buffer, dest buffers, timing."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.size: int = spec["size"]
        self.proc: int = spec["proc"]
        self.tag: str = spec["tag"]
        self.batch: int = spec.get("batch", 1)
        self.src = _arena(self.size)
        self.dst = [_arena(self.size) for _ in range(self.batch)]
        self.srcv = memoryview(self.src)
        self.dstv = [memoryview(d) for d in self.dst]

    def key(self, i: int) -> str:
        return f"{self.tag}-{self.proc}-{i}"

    def stamp(self, i: int) -> None:
        _U64.pack_into(self.src, 0, i)

    def check(self, i: int, buf: Any, n: int | None) -> bool:
        return n == self.size and _U64.unpack_from(buf, 0)[0] == i

    def timed(self, count: int, fn: Callable[[int], int]) -> dict[str, Any]:
        """Run fn(i) for i < count; fn returns the number of errors of that op."""
        lat: list[float] = []
        errors = 0
        t0 = time.monotonic()
        for i in range(count):
            a = time.monotonic()
            errors += fn(i)
            lat.append(time.monotonic() - a)
        t1 = time.monotonic()
        return {"t0": t0, "t1": t1, "lat": lat, "errors": errors}


# --- TierFS ---------------------------------------------------------------------------


def run_tierfs(spec: dict[str, Any]) -> None:
    import asyncio

    import uvloop

    from tierfs.client import AsyncClient

    w = Worker(spec)
    opts: dict[str, Any] = {"transport": spec.get("transport", "tcp"), "kv_timeout": 10.0,
                            "request_timeout": 10.0}
    opts.update(spec.get("client", {}))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with AsyncClient(spec["meta"], **opts) as c:
            kv = c.kv_pool(spec["pool"])
            # Connections (and shm rings) up before the clock starts.
            await kv.put(f"{w.tag}-warm-{w.proc}", w.srcv[:4096])
            await kv.get_into(f"{w.tag}-warm-{w.proc}", w.dstv[0])
            emit({"ready": True})
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line:
                    return
                cmd = json.loads(line)
                if spec.get("profile") and cmd["phase"] in ("put", "get", "batch_get", "exists"):
                    # Where a client's time goes (bench_kv --profile DIR).
                    import cProfile

                    prof = cProfile.Profile()
                    prof.enable()
                    res = await phase(kv, cmd)
                    prof.disable()
                    prof.dump_stats(os.path.join(spec["profile"], f"{w.tag}-{w.proc}-{cmd['phase']}.prof"))
                    emit(res)
                else:
                    emit(await phase(kv, cmd))

    async def timed(count: int, fn: Callable[[int], Any]) -> dict[str, Any]:
        lat: list[float] = []
        errors = 0
        t0 = time.monotonic()
        for i in range(count):
            a = time.monotonic()
            errors += await fn(i)
            lat.append(time.monotonic() - a)
        return {"t0": t0, "t1": time.monotonic(), "lat": lat, "errors": errors}

    async def phase(kv: Any, cmd: dict[str, Any]) -> dict[str, Any]:
        name, n, ws = cmd["phase"], cmd["n"], cmd.get("ws", 0)
        if name == "put":
            async def put(i: int) -> int:
                w.stamp(i)
                return 0 if await kv.put(w.key(i), w.srcv) else 1
            r = await timed(n, put)
            r["bytes"] = n * w.size
        elif name == "get":
            async def get(i: int) -> int:
                j = i % ws
                got = await kv.get_into(w.key(j), w.dstv[0])
                return 0 if w.check(j, w.dst[0], got) else 1
            r = await timed(n, get)
            r["bytes"] = n * w.size
        elif name == "batch_get":
            b = w.batch

            async def bget(i: int) -> int:
                js = [(i * b + k) % ws for k in range(b)]
                got = await kv.batch_get_into([w.key(j) for j in js], w.dstv)
                return sum(0 if w.check(j, w.dst[k], got[k]) else 1 for k, j in enumerate(js))
            r = await timed(n, bget)
            r["bytes"] = n * b * w.size
        elif name == "exists_setup":
            keys = [f"{w.tag}-e-{w.proc}-{i}" for i in range(cmd["keys"])]
            for s in range(0, len(keys), 100):
                await kv.batch_put(keys[s:s + 100], [w.srcv[:1024]] * len(keys[s:s + 100]))
            r = {"t0": 0, "t1": 0, "lat": [], "errors": 0, "bytes": 0}
        elif name == "exists":
            keys = [f"{w.tag}-e-{w.proc}-{i}" for i in range(cmd["keys"])]

            async def ex(i: int) -> int:
                return 0 if await kv.batch_exists(keys) == len(keys) else 1
            r = await timed(n, ex)
            r["bytes"] = 0
        elif name == "stats":
            r = {"stats": kv.stats()}
        elif name == "clean":
            for i in range(cmd["n"]):
                await kv.delete(w.key(i))
            r = {}
        else:
            raise ValueError(f"unknown phase {name!r}")
        return r

    uvloop.run(main())


# --- Redis ----------------------------------------------------------------------------


def run_redis(spec: dict[str, Any]) -> None:
    import redis
    from redis.connection import Encoder, PythonRespSerializer

    w = Worker(spec)
    # hiredis parses replies (redis-py picks it up by itself), but its command
    # packer copies every value into one buffer: redis-py's own packer sends a
    # large value as it is, which is faster for SET of >= 64 KiB.
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    r = redis.Redis(connection_pool=redis.ConnectionPool(host="127.0.0.1", port=spec["port"], socket_timeout=60,
                                                         command_packer=packer))
    r.ping()
    emit({"ready": True})
    def do(cmd: dict[str, Any]) -> dict[str, Any]:
        name, n, ws = cmd["phase"], cmd["n"], cmd.get("ws", 0)
        if name == "put":
            def put(i: int) -> int:
                w.stamp(i)
                return 0 if r.set(w.key(i), w.srcv) else 1
            res = w.timed(n, put)
            res["bytes"] = n * w.size
        elif name == "get":
            # GET returns a fresh bytes object; copying it into the caller's
            # buffer (what get_into does) is not counted against Redis.
            def get(i: int) -> int:
                j = i % ws
                v = r.get(w.key(j))
                return 0 if v is not None and w.check(j, v, len(v)) else 1
            res = w.timed(n, get)
            res["bytes"] = n * w.size
        elif name == "batch_get":
            b = w.batch

            def mget(i: int) -> int:
                js = [(i * b + k) % ws for k in range(b)]
                vs = r.mget([w.key(j) for j in js])
                return sum(0 if v is not None and w.check(j, v, len(v)) else 1 for j, v in zip(js, vs, strict=True))
            res = w.timed(n, mget)
            res["bytes"] = n * b * w.size
        elif name == "exists_setup":
            p = r.pipeline(transaction=False)
            for i in range(cmd["keys"]):
                p.set(f"{w.tag}-e-{w.proc}-{i}", w.srcv[:1024])
            p.execute()
            res = {"t0": 0, "t1": 0, "lat": [], "errors": 0, "bytes": 0}
        elif name == "exists":
            keys = [f"{w.tag}-e-{w.proc}-{i}" for i in range(cmd["keys"])]

            def ex(i: int) -> int:
                # One round trip for the 1,000 answers, as batch_exists.
                p = r.pipeline(transaction=False)
                for k in keys:
                    p.exists(k)
                return 0 if sum(p.execute()) == len(keys) else 1
            res = w.timed(n, ex)
            res["bytes"] = 0
        elif name == "clean":
            r.flushall()
            res = {}
        else:
            raise ValueError(f"unknown phase {name!r}")
        return res

    for line in sys.stdin:
        emit(do(json.loads(line)))


# --- Mooncake Store ---------------------------------------------------------------------


def _mooncake_setup(spec: dict[str, Any], segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup({
        "local_hostname": "127.0.0.1",
        "metadata_server": f"http://127.0.0.1:{spec['http_port']}/metadata",
        "global_segment_size": segment,
        "local_buffer_size": spec.get("local_buffer", 64 << 20),
        "protocol": "tcp",
        "rdma_devices": "",
        "master_server_addr": f"127.0.0.1:{spec['rpc_port']}",
    })
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup failed: {rc}")
    return store


def run_mooncake_server(spec: dict[str, Any]) -> None:
    """A store process that only contributes its memory segment (the
    counterpart of a storage daemon); the benchmark clients mount none."""
    store = _mooncake_setup(spec, spec["segment"])
    emit({"ready": True})
    sys.stdin.read()
    store.close()


def run_mooncake(spec: dict[str, Any]) -> None:
    w = Worker(spec)
    store = _mooncake_setup(spec, 0)
    sp = _addr(w.src)
    dps = [_addr(d) for d in w.dst]
    for a in [sp, *dps]:
        if store.register_buffer(a, w.size) != 0:
            raise RuntimeError("register_buffer failed")
    emit({"ready": True})
    def do(cmd: dict[str, Any]) -> dict[str, Any]:
        name, n, ws = cmd["phase"], cmd["n"], cmd.get("ws", 0)
        if name == "put":
            def put(i: int) -> int:
                w.stamp(i)
                return 0 if store.put_from(w.key(i), sp, w.size) == 0 else 1
            res = w.timed(n, put)
            res["bytes"] = n * w.size
        elif name == "get":
            def get(i: int) -> int:
                j = i % ws
                got = store.get_into(w.key(j), dps[0], w.size)
                return 0 if w.check(j, w.dst[0], got) else 1
            res = w.timed(n, get)
            res["bytes"] = n * w.size
        elif name == "batch_get":
            b = w.batch
            sizes = [w.size] * b

            def bget(i: int) -> int:
                js = [(i * b + k) % ws for k in range(b)]
                got = store.batch_get_into([w.key(j) for j in js], dps, sizes)
                return sum(0 if w.check(j, w.dst[k], got[k]) else 1 for k, j in enumerate(js))
            res = w.timed(n, bget)
            res["bytes"] = n * b * w.size
        elif name == "exists_setup":
            errs = 0
            for i in range(cmd["keys"]):
                errs += store.put_from(f"{w.tag}-e-{w.proc}-{i}", sp, 1024) != 0
            res = {"t0": 0, "t1": 0, "lat": [], "errors": errs, "bytes": 0}
        elif name == "exists":
            keys = [f"{w.tag}-e-{w.proc}-{i}" for i in range(cmd["keys"])]

            def ex(i: int) -> int:
                return 0 if sum(1 for x in store.batch_is_exist(keys) if x == 1) == len(keys) else 1
            res = w.timed(n, ex)
            res["bytes"] = 0
        elif name == "clean":
            store.remove_all(True)
            res = {}
        else:
            raise ValueError(f"unknown phase {name!r}")
        return res

    for line in sys.stdin:
        emit(do(json.loads(line)))
    store.close()


# --- the limits ------------------------------------------------------------------------------


def run_memcpy(spec: dict[str, Any]) -> None:
    """Copies out of a working set (as a DRAM tier's arena) into one reused buffer."""
    w = Worker(spec)
    ws_n = spec["ws"]
    arena = _arena(ws_n * w.size)
    av = memoryview(arena)
    dv = w.dstv[0]
    size = w.size
    emit({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        n = cmd["n"]

        def cp(i: int) -> int:
            off = (i % ws_n) * size
            dv[:] = av[off:off + size]
            return 0
        res = w.timed(n, cp)
        res["bytes"] = n * size
        emit(res)


def run_odirect(spec: dict[str, Any]) -> None:
    """O_DIRECT preads of a file of the working set's size, into one reused
    aligned buffer (what an SSD tier hit must do at least)."""
    w = Worker(spec)
    # As large as the working set the SSD tier reads (a smaller file could
    # sit in the virtual disk's host-side cache and flatter the limit).
    ws_n = spec["ws"]
    path = f"{spec['path']}-{w.proc}"  # a file per process, as each SSD tier has its own
    size = w.size
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        block = _arena(4 << 20)  # written in large requests: setup, not measured
        bv = memoryview(block)  # slices of a view stay page aligned (an mmap slice is a copy)
        for off in range(0, ws_n * size, len(block)):
            os.pwrite(fd, bv[:min(len(block), ws_n * size - off)], off)
        bv.release()
        block.close()
        os.fsync(fd)
        emit({"ready": True})
        for line in sys.stdin:
            cmd = json.loads(line)
            n = cmd["n"]

            def rd(i: int) -> int:
                return 0 if os.preadv(fd, [w.dst[0]], (i % ws_n) * size) == size else 1
            res = w.timed(n, rd)
            res["bytes"] = n * size
            emit(res)
    finally:
        os.close(fd)
        os.unlink(path)


def run_loopback(spec: dict[str, Any]) -> None:
    """The raw loopback stream: ``bench.bench_dataplane``'s uvloop stream
    from its raw server, ``size``-byte chunks into one reused buffer."""
    import uvloop

    from bench.bench_dataplane import _raw_tcp

    emit({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        total = cmd["n"] * spec["size"]
        t0 = time.monotonic()
        uvloop.run(_raw_tcp(spec["port"], 0, total, min(spec["size"], 4 << 20)))
        emit({"t0": t0, "t1": time.monotonic(), "lat": [], "errors": 0, "bytes": total})


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


MODES: dict[str, Callable[[dict[str, Any]], None]] = {
    "tierfs": run_tierfs, "redis": run_redis, "mooncake": run_mooncake,
    "mooncake-server": run_mooncake_server, "memcpy": run_memcpy, "odirect": run_odirect,
    "loopback": run_loopback,
}

if __name__ == "__main__":
    spec_ = json.loads(sys.argv[1])
    # Mooncake's C++ logs go to stderr; the protocol is stdout only.
    MODES[spec_["mode"]](spec_)
