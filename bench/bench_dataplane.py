"""Data-plane throughput: fragment reads and writes against one server in a
separate process, next to the raw limit measured in the same run.

Cases: {tcp, shm} x {read, write} x {1 MiB, 4 MiB fragments} x {1, 16 in
flight}, and 4 KiB reads (KV-cache sized) x {1, 32 in flight}, server serving an in-memory store without CRC re-checks (the
network-path number); plus a disk case through the chunk engine when
``tierfs.storage.engine`` exists. Baselines, each between two processes:

* tcp: a plain uvloop socket stream of the same bytes (BufferedProtocol
  receiving into one reused buffer, sender writing one reused buffer);
  for the 4 KiB reads, a bare uvloop request/answer loop;
* shm: a raw shared-memory copy loop (copy into a memfd ring, copy out,
  credits over a pipe) with the same ring size as the shm transport.

    python -m bench.bench_dataplane [--quick] [--security on|off|both] [--tls | --tls-only] [--mib N]

``--security`` (default both): each data-plane case against a server that
requires capabilities (the client sends a file capability, verified once per
connection, checked per request) and/or one that requires none; rows of the
"on" runs end in "[caps]". The baselines are the same for both.

With ``--tls`` the tcp cases also run against a second server that serves
TLS (a throwaway CA and certificates, mutual TLS as ``tierfs up --tls``
runs it), in the same run, as "tcp+tls" rows next to the plaintext ones
(both without capabilities); ``--tls-only`` runs just those; ``--mib N``
sets the bytes per case.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import select
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import uvloop

from tierfs import capability as capmod
from tierfs.meta.secret import ensure_secret_file, load_secret
from tierfs.net import DataClient, Limits
from tierfs.storage.api import FragmentKey

MiB = 1 << 20
RING = Limits().shm_ring_bytes
_U64 = struct.Struct("<Q")


# --- raw tcp baseline ------------------------------------------------------------


class _Sink(asyncio.BufferedProtocol):
    """Receives into one reused buffer; counts bytes; resolves at ``want``."""

    def __init__(self, chunk: int) -> None:
        self.buf = memoryview(bytearray(chunk))
        self.got = 0
        self.want = -1
        self.done: asyncio.Future[None] | None = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.done = asyncio.get_running_loop().create_future()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf

    def buffer_updated(self, n: int) -> None:
        self.got += n
        if self.want >= 0 and self.got >= self.want and self.done and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done and not self.done.done():
            self.done.set_result(None)


class _Source(asyncio.Protocol):
    def __init__(self) -> None:
        self.can_write = asyncio.Event()
        self.can_write.set()

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()


async def _stream(transport: Any, proto: _Source, total: int, chunk: int) -> None:
    data = memoryview(bytearray(os.urandom(64)) * (chunk // 64))
    # Keep a few chunks queued so the socket never runs dry between wakeups.
    transport.set_write_buffer_limits(high=4 * chunk, low=2 * chunk)
    sent = 0
    while sent < total:
        await proto.can_write.wait()
        transport.write(data)
        sent += chunk


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    n = Limits().socket_buffer_bytes
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, n)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, n)


async def _raw_tcp_server(tls: ssl.SSLContext | None = None) -> None:
    """Child: on each connection, read ``mode, total, chunk``; mode 0: stream
    ``total`` bytes out; mode 1: sink ``total`` bytes then send one byte.
    ``tls``: the same over TLS (the raw baseline of the tcp+tls rows)."""
    loop = asyncio.get_running_loop()

    class Conn(asyncio.Protocol):
        def __init__(self) -> None:
            self.buf = bytearray()
            self.sink: _Sink | None = None

        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            _tune(transport.get_extra_info("socket"))
            self.src = _Source()

        def pause_writing(self) -> None:
            self.src.pause_writing()

        def resume_writing(self) -> None:
            self.src.resume_writing()

        def data_received(self, data: bytes) -> None:
            self.buf += data
            if len(self.buf) >= 24:
                mode, total, chunk = struct.unpack("<QQQ", self.buf[:24])
                if mode == 0:
                    self.task = loop.create_task(_stream(self.transport, self.src, total, chunk))
                elif mode == 2:
                    responder = _Responder(self.transport, chunk)
                    self.transport.set_protocol(responder)
                    rest = memoryview(bytes(self.buf[24:]))
                    while len(rest):  # requests that came with the mode header
                        dst = responder.get_buffer(-1)
                        k = min(len(dst), len(rest))
                        dst[:k] = rest[:k]
                        responder.buffer_updated(k)
                        rest = rest[k:]
                else:
                    sink = _Sink(chunk)
                    sink.want = total - (len(self.buf) - 24)
                    sink.connection_made(self.transport)
                    self.transport.set_protocol(sink)
                    assert sink.done is not None
                    sink.done.add_done_callback(lambda _: self.transport.write(b"!"))
                self.buf = bytearray()

    server = await loop.create_server(Conn, "127.0.0.1", 0, ssl=tls)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()


async def _raw_tcp(port: int, mode: int, total: int, chunk: int, tls: ssl.SSLContext | None = None) -> float:
    loop = asyncio.get_running_loop()
    sink = _Sink(chunk)
    transport, _ = await loop.create_connection(lambda: sink, "127.0.0.1", port, ssl=tls,
                                                server_hostname="127.0.0.1" if tls is not None else None)
    _tune(transport.get_extra_info("socket"))
    t0 = time.perf_counter()
    transport.write(struct.pack("<QQQ", mode, total, chunk))
    if mode == 0:
        sink.want = total
    else:
        src = _Source()
        transport.set_protocol(src)  # for flow control while we send
        await _stream(transport, src, total, chunk)
        transport.set_protocol(sink)
        sink.want = 1
    assert sink.done is not None
    await sink.done
    dt = time.perf_counter() - t0
    transport.close()
    return total / dt / 1e9


# --- raw request/response baseline (small reads) ---------------------------------


class _Responder(asyncio.BufferedProtocol):
    """Child side: answers every 88-byte request with ``size`` bytes."""

    def __init__(self, transport: Any, size: int) -> None:
        self.transport = transport
        self.buf = memoryview(bytearray(88))
        self.fill = 0
        self.reply = bytes(size)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf[self.fill:]

    def buffer_updated(self, n: int) -> None:
        self.fill += n
        if self.fill == 88:
            self.fill = 0
            self.transport.write(self.reply)


class _Asker(asyncio.BufferedProtocol):
    def __init__(self, size: int) -> None:
        self.buf = memoryview(bytearray(size))
        self.fill = 0
        self.waiter: asyncio.Future[None] | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf[self.fill:]

    def buffer_updated(self, n: int) -> None:
        self.fill += n
        if self.fill == len(self.buf):
            self.fill = 0
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)


async def _raw_pingpong(port: int, count: int, size: int) -> float:
    """Requests per second of a bare uvloop request (88 B) / answer (size B) loop."""
    loop = asyncio.get_running_loop()
    asker = _Asker(size)
    transport, _ = await loop.create_connection(lambda: asker, "127.0.0.1", port)
    _tune(transport.get_extra_info("socket"))
    transport.write(struct.pack("<QQQ", 2, count, size))
    req = bytes(88)
    t0 = 0.0
    for i in range(count + 100):  # the first 100 warm up
        if i == 100:
            t0 = time.perf_counter()
        asker.waiter = loop.create_future()
        transport.write(req)
        await asker.waiter
    dt = time.perf_counter() - t0
    transport.close()
    return count / dt


# --- raw shm baseline --------------------------------------------------------------


def _shm_consumer(ring_fd: int, bell_r: int, credit_w: int, chunk: int) -> None:
    """Child: copy every chunk out of the ring into one buffer, give credit."""
    ring = mmap.mmap(ring_fd, RING)
    rv = memoryview(ring)
    dest = memoryview(bytearray(chunk))
    pos = 0
    while True:
        b = os.read(bell_r, 8)
        if len(b) < 8:
            break
        (n,) = _U64.unpack(b)
        left = n
        while left:
            p = pos % RING
            k = min(left, RING - p, chunk)
            dest[:k] = rv[p:p + k]
            pos += k
            left -= k
        os.write(credit_w, _U64.pack(n))
    rv.release()
    ring.close()


def _raw_shm(total: int, chunk: int) -> float:
    fd = os.memfd_create("bench-ring")
    os.ftruncate(fd, RING)
    bell_r, bell_w = os.pipe()
    credit_r, credit_w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, __file__, "raw-shm-consumer", str(fd), str(bell_r), str(credit_w), str(chunk)],
        pass_fds=(fd, bell_r, credit_w))
    os.close(bell_r)
    os.close(credit_w)
    ring = mmap.mmap(fd, RING)
    rv = memoryview(ring)
    src = memoryview(bytearray(os.urandom(64)) * (chunk // 64))
    free, pos, sent = RING, 0, 0
    warm = 4 * RING  # touch the ring and the consumer's buffer before timing
    total += warm
    t0 = time.perf_counter()
    outstanding = 0
    while sent < total or outstanding:
        if sent == warm:
            t0 = time.perf_counter()
        if sent < total and free >= chunk:
            left = chunk
            while left:
                p = pos % RING
                k = min(left, RING - p)
                rv[p:p + k] = src[chunk - left:chunk - left + k]
                pos += k
                left -= k
            free -= chunk
            sent += chunk
            outstanding += chunk
            os.write(bell_w, _U64.pack(chunk))
            continue
        select.select([credit_r], [], [])
        (n,) = _U64.unpack(os.read(credit_r, 8))
        free += n
        outstanding -= n
    dt = time.perf_counter() - t0
    os.close(bell_w)
    child.wait(timeout=30)
    os.close(credit_r)
    rv.release()
    ring.close()
    os.close(fd)
    return (total - warm) / dt / 1e9


# --- data plane ----------------------------------------------------------------------


def _caps(secret_file: str) -> list[bytes]:
    """File capabilities (read + write) for the inodes the cases use, as meta mints them."""
    secret = load_secret(secret_file)
    now = int(time.time() * 1000)
    epoch = capmod.epoch_at(now, 3600.0)
    key = capmod.epoch_key(secret, epoch)
    return [capmod.encode(capmod.mint(key, kind=capmod.KIND_FILE, ops=capmod.OP_READ | capmod.OP_WRITE,
                                      epoch=epoch, scope=inode, principal=1000, expiry_ms=now + 3_600_000))
            for inode in (1, 2)]


def _client(transport: str, port: int, conns: int, caps: list[bytes], tls: ssl.SSLContext | None = None) -> DataClient:
    c = DataClient(transport=transport, routes={1: f"127.0.0.1:{port}"}, connections_per_peer=conns, tls=tls)
    for cap in caps:
        c.caps.add(cap)
    return c


async def _dataplane(port: int, transport: str, op: str, size: int, depth: int, total: int,
                     caps: list[bytes] | None = None, tls: ssl.SSLContext | None = None) -> float:
    async with _client(transport, port, 1 if depth == 1 else 4, caps or [], tls) as c:
        data = memoryview(bytearray(os.urandom(64)) * (size // 64))
        keys = [FragmentKey(1, i, 0, 1) for i in range(depth)]
        for k in keys:
            await c.write(1, k, data)
        bufs = [memoryview(bytearray(size)) for _ in range(depth)]
        count = max(depth, total // size)

        async def worker(i: int, rounds: int) -> None:
            for _ in range(rounds):
                if op == "read":
                    await c.read_into(1, keys[i], bufs[i])
                else:
                    await c.write(1, keys[i], data)

        # Warm up: connections, shm rings, the server's buffer pool and our
        # buffers are all touched once before the clock starts (first touch
        # of fresh memory runs at ~0.7 GiB/s here and would dominate).
        warm = 1 + (4 * RING) // (size * depth)
        await asyncio.gather(*(worker(i, warm) for i in range(depth)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, count // depth) for i in range(depth)))
        dt = time.perf_counter() - t0
        return (count // depth) * depth * size / dt / 1e9


async def _dataplane_ops(port: int, transport: str, size: int, depth: int, count: int,
                         caps: list[bytes] | None = None, tls: ssl.SSLContext | None = None) -> float:
    """Small reads per second (KV-cache sized blobs)."""
    async with _client(transport, port, 1, caps or [], tls) as c:
        keys = [FragmentKey(2, i, 0, 1) for i in range(depth)]
        for k in keys:
            await c.write(1, k, os.urandom(size))
        bufs = [memoryview(bytearray(size)) for _ in range(depth)]

        async def worker(i: int, rounds: int) -> None:
            for _ in range(rounds):
                await c.read_into(1, keys[i], bufs[i])

        await asyncio.gather(*(worker(i, 100) for i in range(depth)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, count // depth) for i in range(depth)))
        return (count // depth) * depth / (time.perf_counter() - t0)


async def _latency(port: int, transport: str, count: int, caps: list[bytes] | None = None) -> tuple[float, float]:
    """p50 and p99 (microseconds) of 4 KiB reads, one in flight."""
    async with _client(transport, port, 1, caps or []) as c:
        key = FragmentKey(2, 1000, 0, 1)  # inode 2: the capabilities of _caps cover inodes 1 and 2
        await c.write(1, key, os.urandom(4096))
        buf = memoryview(bytearray(4096))
        for _ in range(200):
            await c.read_into(1, key, buf)
        lat = []
        for _ in range(count):
            t0 = time.perf_counter()
            await c.read_into(1, key, buf)
            lat.append(time.perf_counter() - t0)
        lat.sort()
        return lat[len(lat) // 2] * 1e6, lat[int(0.99 * (len(lat) - 1))] * 1e6


def _spawn(args: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"{args} did not start")
    return proc, int(json.loads(line)["port"])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def _tls_files(d: str) -> tuple[list[str], ssl.SSLContext]:
    """Server flags and a client context of a throwaway local CA in ``d``."""
    from tierfs.tls import TlsFiles, issue, make_local_ca

    ca = str(make_local_ca(d))
    cert, key = issue(d, "server", ["127.0.0.1"])
    ccert, ckey = issue(d, "client")
    flags = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", ca, "--tls-require-client-cert"]
    return flags, TlsFiles(ca=ca, cert=str(ccert), key=str(ckey)).client_ssl_context()


def run(quick: bool, security: str = "both", tls: bool = False, mib: int = 0,
        tls_only: bool = False) -> dict[str, Any]:
    total = (mib or (256 if quick else 1024)) * MiB
    reps = 1 if quick else 3  # best of: the machine is shared and noisy
    rows: list[dict[str, Any]] = []
    modes = {"on": [True], "off": [False], "both": [False, True]}[security]
    raw_srv, raw_port = _spawn([sys.executable, __file__, "raw-tcp-server"])
    secret_dir = tempfile.TemporaryDirectory(prefix="bench-dp-secret-")
    secret_file = str(ensure_secret_file(os.path.join(secret_dir.name, "cluster.secret")))
    caps = _caps(secret_file)
    dp_args = ["--memory-target", "1", "--no-verify"]
    # one server per security mode: (port, the capabilities the client sends)
    servers: dict[bool, tuple[subprocess.Popen[bytes], int]] = {}
    for on in sorted(set(modes) | ({False} if tls else set())):  # TLS rows compare with plaintext, no caps
        servers[on] = _spawn([sys.executable, "-m", "tierfs.storage.dataplane", *dp_args,
                              *(["--cap-secret-file", secret_file] if on else [])])
    disk_dir = None
    disk_srvs: dict[bool, tuple[subprocess.Popen[bytes], int]] = {}
    notes = []
    tls_srv = raw_tls_srv = None
    tls_port = raw_tls_port = 0
    tls_ctx: ssl.SSLContext | None = None
    tls_dir = tempfile.TemporaryDirectory(prefix="bench-dp-tls-") if tls else None
    if tls_dir is not None:
        flags, tls_ctx = _tls_files(tls_dir.name)
        tls_srv, tls_port = _spawn([sys.executable, "-m", "tierfs.storage.dataplane", *dp_args,
                                    "--transports", "tcp", *flags])
        raw_tls_srv, raw_tls_port = _spawn([sys.executable, __file__, "raw-tcp-server", *flags[:4]])
    try:
        import tierfs.storage.engine  # noqa: F401

        disk_dir = tempfile.TemporaryDirectory(prefix="bench-dp-", dir=os.environ.get("TIERFS_BENCH_DIR"))
        for on in modes:
            disk_srvs[on] = _spawn([sys.executable, "-m", "tierfs.storage.dataplane",
                                    "--disk-target", f"1:{os.path.join(disk_dir.name, 'on' if on else 'off')}",
                                    *(["--cap-secret-file", secret_file] if on else [])])
    except Exception as exc:  # the chunk engine is optional here
        notes.append(f"disk case skipped: {type(exc).__name__}: {exc}")
    try:
        def raw_shm(total: int, size: int) -> Any:
            return asyncio.get_running_loop().run_in_executor(None, _raw_shm, total, size)

        async def baseline(transport: str, op: str, size: int) -> float:
            if transport == "shm":
                return float(await raw_shm(total, size))
            return await _raw_tcp(raw_port, 0 if op == "read" else 1, total, size)

        async def pair(transport: str, op: str, size: int, depth: int, port: int, n: int,
                       cc: list[bytes]) -> tuple[float, float]:
            # Baseline and case alternate, so both see the same machine load.
            base = v = 0.0
            for _ in range(reps):
                base = max(base, await baseline(transport, op, size))
                v = max(v, await _dataplane(port, transport, op, size, depth, n, cc))
            return v, base

        async def measure() -> None:
            if tls_ctx is not None:
                await measure_tls(servers[False][1])
                if tls_only:
                    return
            for on in modes:
                await measure_mode(servers[on][1], disk_srvs[on][1] if on in disk_srvs else None,
                                   caps if on else [], " [caps]" if on else "")
            if len(modes) == 2:
                # What the per-request check adds to latency: on and off alternate.
                n = 2000 if quick else 10000
                for transport in ("tcp", "shm"):
                    best: dict[bool, tuple[float, float]] = {}
                    for _ in range(reps):
                        for on in modes:
                            p50, p99 = await _latency(servers[on][1], transport, n, caps if on else [])
                            old = best.get(on)
                            best[on] = (p50, p99) if old is None else (min(old[0], p50), min(old[1], p99))
                    for i, q in ((0, "p50"), (1, "p99")):
                        rows.append({
                            "case": f"{transport} read 4 KiB latency {q}, 1 in flight [caps]",
                            "value": round(best[True][i], 1), "unit": "us", "baseline": round(best[False][i], 1),
                            "baseline_name": "the same reads from a server checking no capability",
                            "ratio": round(best[True][i] / best[False][i], 3)})

        async def measure_tls(plain_port: int) -> None:
            if tls_ctx is not None:
                for op in ("read", "write"):
                    for size in (1 * MiB, 4 * MiB):
                        for depth in (1, 16):
                            # Plaintext and TLS alternate too: the cost of TLS is their ratio.
                            plain = sealed = base = 0.0
                            for _ in range(reps):
                                base = max(base, await _raw_tcp(raw_tls_port, 0 if op == "read" else 1, total,
                                                                size, tls_ctx))
                                plain = max(plain, await _dataplane(plain_port, "tcp", op, size, depth, total))
                                sealed = max(sealed, await _dataplane(tls_port, "tcp", op, size, depth, total,
                                                                      None, tls_ctx))
                            rows.append({
                                "case": f"tcp+tls {op} {size // MiB} MiB x{depth} in flight (memory store)",
                                "value": round(sealed, 3), "unit": "GB/s", "baseline": round(plain, 3),
                                "baseline_name": "the same case over plaintext tcp",
                                "ratio": round(sealed / plain, 3), "raw_tls_stream": round(base, 3)})
                for depth in (1, 32):
                    plain = sealed = 0.0
                    for _ in range(reps):
                        plain = max(plain, await _dataplane_ops(plain_port, "tcp", 4096, depth, 5000))
                        sealed = max(sealed, await _dataplane_ops(tls_port, "tcp", 4096, depth, 5000, None, tls_ctx))
                    rows.append({
                        "case": f"tcp+tls read 4 KiB x{depth} in flight (memory store)",
                        "value": round(sealed), "unit": "ops/s", "baseline": round(plain),
                        "baseline_name": "the same case over plaintext tcp", "ratio": round(sealed / plain, 3)})

        async def measure_mode(dp_port: int, disk_port: int | None, cc: list[bytes], tag: str) -> None:
            for transport in ("tcp", "shm"):
                for op in ("read", "write"):
                    for size in (1 * MiB, 4 * MiB):
                        for depth in (1, 16):
                            v, base = await pair(transport, op, size, depth, dp_port, total, cc)
                            rows.append({
                                "case": f"{transport} {op} {size // MiB} MiB x{depth} in flight (memory store){tag}",
                                "value": round(v, 3), "unit": "GB/s", "baseline": round(base, 3),
                                "baseline_name": "raw uvloop tcp stream" if transport == "tcp"
                                else "raw shm ring copy loop",
                                "ratio": round(v / base, 3)})
            ops = 5000 if quick else 20000
            for transport in ("tcp", "shm"):
                for depth in (1, 32):
                    base = v = 0.0
                    for _ in range(reps):
                        base = max(base, await _raw_pingpong(raw_port, ops // 4, 4096))
                        v = max(v, await _dataplane_ops(dp_port, transport, 4096, depth, ops, cc))
                    rows.append({
                        "case": f"{transport} read 4 KiB x{depth} in flight (memory store){tag}",
                        "value": round(v), "unit": "ops/s", "baseline": round(base),
                        "baseline_name": "raw uvloop tcp request/response, 1 in flight",
                        "ratio": round(v / base, 3)})
            if disk_port is not None:
                for op in ("write", "read"):
                    v, base = await pair("tcp", op, 4 * MiB, 16, disk_port, min(total, 512 * MiB), cc)
                    rows.append({"case": f"tcp {op} 4 MiB x16 in flight (chunk engine on disk){tag}",
                                 "value": round(v, 3), "unit": "GB/s", "baseline": round(base, 3),
                                 "baseline_name": "raw uvloop tcp stream", "ratio": round(v / base, 3)})

        uvloop.run(measure())
    finally:
        _stop(raw_srv)
        for proc, _port in [*servers.values(), *disk_srvs.values()]:
            _stop(proc)
        if disk_dir is not None:
            disk_dir.cleanup()
        secret_dir.cleanup()
        for srv in (tls_srv, raw_tls_srv):
            if srv is not None:
                _stop(srv)
        if tls_dir is not None:
            tls_dir.cleanup()
    notes.insert(0, f"{total // MiB} MiB per case, best of {reps}, each case alternating with its "
                    f"baseline; client and server are separate processes on "
                    f"{os.cpu_count()} CPUs; payload CRC32C computed and checked on both ends of "
                    "the data plane, not by the baselines.")
    return {"name": "dataplane", "rows": rows, "notes": " ".join(notes)}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "raw-tcp-server":
        ctx = None
        if "--tls-cert" in sys.argv:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(sys.argv[sys.argv.index("--tls-cert") + 1], sys.argv[sys.argv.index("--tls-key") + 1])
        uvloop.run(_raw_tcp_server(ctx))
    elif len(sys.argv) > 1 and sys.argv[1] == "raw-shm-consumer":
        _shm_consumer(*(int(a) for a in sys.argv[2:6]))
    else:
        sec = sys.argv[sys.argv.index("--security") + 1] if "--security" in sys.argv else "both"
        if sec not in ("on", "off", "both"):
            sys.exit("--security takes on, off or both")
        mib = int(sys.argv[sys.argv.index("--mib") + 1]) if "--mib" in sys.argv else 0
        res = run("--quick" in sys.argv, sec, tls="--tls" in sys.argv or "--tls-only" in sys.argv, mib=mib,
                  tls_only="--tls-only" in sys.argv)
        for r in res["rows"]:
            raw = f"  raw tls stream {r['raw_tls_stream']:.3f}" if "raw_tls_stream" in r else ""
            print(f"{r['case']:<60} {r['value']:10.3f} {r['unit']:<6} base {r['baseline']:10.3f}  {r['ratio']:.0%}"
                  + raw)
        print(res["notes"])
