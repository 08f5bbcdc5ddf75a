"""Shared pieces of the fault-injection scenarios: a real local cluster
whose chosen storage daemons are reached only through a :class:`FaultProxy`,
a ledger of acknowledged files checked byte for byte, fragment files on
disk to damage, and waits on cluster health.

Routing through the proxy uses the storage daemon's ``--advertise-host``:
the daemon listens on ``127.0.0.1:P`` but tells meta (and so every client)
that it lives at ``127.0.0.2:P``, where the proxy listens and forwards to
``127.0.0.1:P``. Loopback answers on all of 127.0.0.0/8, so no interface
is created and nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.faults.proxy import FaultProxy
from tierfs.client import Client
from tierfs.errors import NotFoundError, TierFSError
from tierfs.local import LocalCluster, free_ports

__all__ = [
    "PROXY_HOST",
    "FaultCluster",
    "Ledger",
    "digest",
    "fragment_files",
    "node_states",
    "random_bytes",
    "wait_addr_state",
    "wait_node_state",
]

PROXY_HOST = "127.0.0.2"
MiB = 1 << 20

#: Meta flags that make fault scenarios quick: a node missing heartbeats for
#: 3 s (not 10) goes offline.
FAST_META = ("--heartbeat-timeout=3",)
#: GC grace of fault scenarios: long enough that a reader racing an
#: overwrite keeps its generation, short enough that "GC cleaned up" is quick.
FAST_GC_GRACE = 1.0


def _plan_ports(cl: LocalCluster) -> set[int]:
    """Every port the cluster's plan names (addresses and ``host:port`` or
    ``--*port=N`` arguments): free now, but promised to a daemon that has
    not bound it yet."""
    out: set[int] = set()
    for p in cl.procs:
        for word in (p.addr, *p.argv, *p.extra.values()):
            tail = str(word).rpartition("=")[2].rpartition(":")[2]
            if tail.isdigit():
                out.add(int(tail))
    return out


def _free_port(host: str, taken: set[int] | None = None) -> int:
    if host in ("127.0.0.1", "localhost"):
        # Below the ephemeral range (see free_ports), and none the plan
        # promised to another daemon (a storage daemon's metrics port was
        # drawn again here once: EADDRINUSE at the start of the second).
        for _ in range(100):
            port = free_ports(1)[0]
            if port not in (taken or set()):
                return port
        raise RuntimeError("no free loopback port outside the cluster's plan")
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def digest(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def read_latencies(client: Client, ledger: Ledger, paths: list[str]) -> list[float]:
    """Read each of ``paths`` whole, byte-exact against the ledger; the
    latencies in seconds, sorted."""
    out = []
    for p in paths:
        t0 = time.monotonic()
        got = client.read_bytes(p)
        out.append(time.monotonic() - t0)
        assert digest(got) == digest(ledger.acked[p]), p
    return sorted(out)


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class FaultCluster:
    """A :class:`LocalCluster` with ``proxied`` storage daemons behind proxies."""

    def __init__(self, path: Path, *, n_storage: int = 6, proxied: Sequence[str] = (),
                 extra_meta_args: Sequence[str] = FAST_META, extra_storage_args: Sequence[str] = (),
                 host: str = "127.0.0.1", python: str = sys.executable,
                 plan_hook: Callable[[LocalCluster], None] | None = None, gc_grace: float = FAST_GC_GRACE) -> None:
        self.cl = LocalCluster(path, n_storage=n_storage, extra_meta_args=list(extra_meta_args),
                               extra_storage_args=list(extra_storage_args), host=host, python=python,
                               gc_grace=gc_grace)
        self.proxies: dict[str, FaultProxy] = {}
        self.control_proxies: dict[str, FaultProxy] = {}
        try:
            if plan_hook is not None:
                plan_hook(self.cl)  # edit the plan (addresses, argv) before anything starts
            for name in proxied:
                p = self.cl.proc(name)
                host, _, port = p.addr.rpartition(":")
                p.argv.append(f"--advertise-host={PROXY_HOST}")
                p.addr = f"{PROXY_HOST}:{port}"  # what meta's map will say: health() matches on it
                self.proxies[name] = FaultProxy((PROXY_HOST, int(port)), (host, int(port)))
                # The control service (scrub, repair status) is advertised on the
                # same host: a fixed port with a plain pass-through proxy.
                cport = _free_port(host, _plan_ports(self.cl))
                p.argv.append(f"--control-port={cport}")
                self.control_proxies[name] = FaultProxy((PROXY_HOST, cport), (host, cport))
            self.cl.start(timeout=120)
            asyncio.run(self.cl.wait_healthy(120))
        except BaseException:
            self.close()
            raise

    @property
    def meta_addrs(self) -> list[str]:
        return self.cl.meta_addrs

    def client(self, **kw: Any) -> Client:
        kw.setdefault("request_timeout", 2.0)
        kw.setdefault("connect_timeout", 1.0)
        return Client(self.cl.meta_addrs, **kw)

    def storage_names(self) -> list[str]:
        return [p.name for p in self.cl.procs if p.kind == "storage"]

    def restart_all(self, timeout: float = 90.0) -> None:
        """Start whatever is down and wait until every node is online."""
        self.cl.start(timeout=timeout)
        asyncio.run(self.cl.wait_healthy(timeout))

    def close(self) -> None:
        try:
            # SIGCONT first: a stopped daemon ignores SIGTERM until continued.
            for p in self.cl.procs:
                if p.pid:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(p.pid, signal.SIGCONT)
            self.cl.stop()
        finally:
            for px in [*self.proxies.values(), *self.control_proxies.values()]:
                px.close()


async def node_states(meta_addrs: Sequence[str]) -> dict[str, str]:
    """data address -> "online" | "offline", from meta's cluster map."""
    from tierfs.meta import MetaClient
    from tierfs.proto.v1 import meta_pb2 as pb

    async with MetaClient(list(meta_addrs), deadline=5.0) as mc:
        cmap = await mc.get_cluster_map()
    return {n.data_addr: pb.NodeState.Name(n.state).removeprefix("NODE_STATE_").lower() for n in cmap.nodes}


def wait_addr_state(meta_addrs: Sequence[str], addr: str, state: str, timeout: float = 30.0) -> float:
    """Wait until meta shows the node at ``addr`` in ``state``; returns seconds waited."""
    t0 = time.monotonic()
    last = "?"
    while time.monotonic() - t0 < timeout:
        try:
            last = asyncio.run(node_states(meta_addrs)).get(addr, "unregistered")
            if last == state:
                return time.monotonic() - t0
        except TierFSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise AssertionError(f"node {addr} not {state} after {timeout:.0f}s (last: {last})")


def wait_node_state(cl: LocalCluster, name: str, state: str, timeout: float = 30.0) -> None:
    """Wait until meta's map shows storage daemon ``name`` in ``state``."""
    deadline = time.monotonic() + timeout
    last = "?"
    while time.monotonic() < deadline:
        try:
            h = asyncio.run(cl.health(deadline=3.0))
            last = next(s["state"] for s in h["storage"] if s["name"] == name)
            if last == state:
                return
        except TierFSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise AssertionError(f"{name} not {state} after {timeout:.0f}s (last: {last})")


def fragment_files(cl: LocalCluster, name: str | None = None) -> list[Path]:
    """Fragment files on disk (of storage daemon ``name``, or of all)."""
    roots = [cl.dir / name] if name else sorted(cl.dir.glob("storage-*"))
    out: list[Path] = []
    for r in roots:
        out += sorted(p for p in r.glob("t*/frags/*/*/*") if p.is_file())
    return out


@dataclass
class Ledger:
    """What the cluster has acknowledged (path -> contents), the paths whose
    write failed (they must not show a partial file) and deleted paths.
    A path whose rewrite failed leaves ``acked``: its old contents may be
    gone (``wb`` truncates), which ``verify`` checks as old-or-empty."""

    acked: dict[str, bytes] = field(default_factory=dict)
    failed: dict[str, bytes | None] = field(default_factory=dict)  # path -> content before the failed write
    deleted: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)  # of failed writes, in order

    def write(self, client: Client, path: str, data: bytes) -> bool:
        # After an earlier failed rewrite the file may still hold what it held before that.
        before = self.acked.get(path, self.failed.get(path))
        try:
            client.write_bytes(path, data)
        except TierFSError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            self.failed[path] = before
            self.acked.pop(path, None)
            self.deleted.discard(path)  # the create may have committed: an empty file
            return False
        self.acked[path] = data
        self.failed.pop(path, None)
        self.deleted.discard(path)
        return True

    def rm(self, client: Client, path: str) -> bool:
        try:
            client.rm(path)
        except TierFSError:
            return False
        self.acked.pop(path, None)
        self.failed.pop(path, None)
        self.deleted.add(path)
        return True

    def verify(self, client: Client) -> int:
        """Every acked file reads back exactly; every failed write left either
        the previous contents or (for a new file) no file or an empty one that
        was never committed; every deleted file is gone. Returns bytes checked."""
        n = 0
        for path, data in sorted(self.acked.items()):
            got = client.read_bytes(path)
            assert len(got) == len(data), f"{path}: {len(got)} bytes, acknowledged {len(data)}"
            assert digest(got) == digest(data), f"{path}: contents differ from the acknowledged write"
            n += len(data)
        for path, before in sorted(self.failed.items()):
            if before is None:
                try:
                    st = client.stat(path)
                except NotFoundError:
                    continue
                # The create committed but no bytes did: an empty file, never a partial one.
                assert st.size == 0, f"{path}: failed write left {st.size} visible bytes"
            else:
                # write_bytes opens with "wb", which truncates at open (POSIX):
                # a failed rewrite leaves the old contents or an empty file,
                # never a mix or a prefix of the new bytes.
                got = client.read_bytes(path)
                assert not got or digest(got) == digest(before), f"{path}: failed write left {len(got)} bytes"
        for path in sorted(self.deleted):
            assert not client.exists(path), f"{path}: deleted but still there"
        return n
