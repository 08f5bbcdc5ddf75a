"""Network partitions of one storage node, for real: the node runs in its own
Linux network namespace, joined to the test's namespace by a veth pair with
private addresses (10.200.<n>.1 on our side, 10.200.<n>.2 inside). Cutting
the veth link partitions it; bringing it up heals it.

Everything here is created by the test and only carries traffic between
namespaces on this machine: the rest of the cluster (meta, the other storage
daemons, the client) binds 10.200.<n>.1, the host end of the veth, so the
partitioned node can reach it only through the link we cut.

::

    with NetnsNode.create(subnet=7) as nn:          # skips if netns is not allowed
        cl = LocalCluster(dir, host=nn.host_ip, ...) # cluster on our side of the veth
        nn.start_storage(dir / "storage-x", cl.meta_addrs)
        nn.partition(); ...; nn.heal()

A LocalCluster daemon is moved into the namespace with
:meth:`NetnsNode.python_wrapper` (used to partition a meta replica).

``partition()`` sets the namespace's end of the veth down: our end loses
carrier, packets to the node are dropped (connections time out, nothing
answers); the node's heartbeats to meta cannot leave. :meth:`close` kills
the daemon and deletes the namespace and the veth (also after a failure).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

__all__ = ["NetnsNode", "netns_unavailable"]


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip()}")
    return res


def netns_unavailable() -> str:
    """Why network namespaces cannot be used here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"tfsprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        return f"ip netns add is not permitted: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return ""


class NetnsNode:
    """One network namespace with a veth to ours, and the daemon inside it."""

    def __init__(self, subnet: int) -> None:
        if not 0 < subnet < 255:
            raise ValueError("subnet must be in 1..254")
        tag = f"{os.getpid() % 100000}x{subnet}"
        self.ns = f"tfs{tag}"
        self.host_if = f"tfh{tag}"[:15]
        self.ns_if = f"tfn{tag}"[:15]
        self.host_ip = f"10.200.{subnet}.1"
        self.ns_ip = f"10.200.{subnet}.2"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self._out: Path | None = None
        self._created = False

    @classmethod
    def create(cls, subnet: int) -> NetnsNode:
        """Build the namespace and veth; ``pytest.skip`` if not permitted.
        ``subnet`` is a preference: the first 10.200.<n>.0/24 from it that
        no interface here uses is taken (parallel test runs do not clash)."""
        why = netns_unavailable()
        if why:
            pytest.skip(why)
        used = _ip("-4", "-o", "addr", "show").stdout
        free = [n for n in [*range(subnet, 255), *range(1, subnet)] if f" 10.200.{n}." not in used]
        if not free:
            pytest.skip("no free 10.200.<n>.0/24 subnet")
        nn = cls(free[0])
        try:
            nn._setup()
        except BaseException:
            nn.close()
            raise
        return nn

    def _setup(self) -> None:
        _ip("netns", "add", self.ns)
        self._created = True
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _ip("link", "set", self.ns_if, "netns", self.ns)
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        _ip("addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if, ns=self.ns)
        _ip("link", "set", self.ns_if, "up", ns=self.ns)
        _ip("link", "set", "lo", "up", ns=self.ns)

    # --- the daemon -------------------------------------------------------------

    def start_storage(self, data_dir: Path, meta_addrs: Sequence[str], extra: Sequence[str] = (),
                      timeout: float = 60.0) -> dict[str, Any]:
        """Run ``tierfs-storage`` inside the namespace; returns its ready line."""
        data_dir.mkdir(parents=True, exist_ok=True)
        self._out = data_dir / "netns-storage.out"
        port = self.ready.get("port", 0)  # a restart keeps the address meta knows
        argv = [
            "ip", "netns", "exec", self.ns, sys.executable, "-m", "tierfs.storage.daemon",
            f"--data-dir={data_dir}", f"--target={data_dir / 't0'}", f"--host={self.ns_ip}", f"--port={port}",
            *[f"--meta={a}" for a in meta_addrs], *extra,
        ]
        offset = self._out.stat().st_size if self._out.exists() else 0
        with open(self._out, "ab") as out, open(data_dir / "netns-storage.log", "ab") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self._out, "rb") as f:
                f.seek(offset)
                for line in f:
                    with contextlib.suppress(ValueError):
                        doc = json.loads(line)
                        if isinstance(doc, dict) and doc.get("event") == "ready":
                            self.ready = doc
                            return doc
            if self.proc.poll() is not None:
                raise RuntimeError(f"storage daemon in {self.ns} exited: rc {self.proc.returncode}; "
                                   f"see {data_dir / 'netns-storage.log'}")
            time.sleep(0.05)
        raise TimeoutError(f"storage daemon in {self.ns} not ready after {timeout:.0f}s")

    def python_wrapper(self, path: Path, match: str) -> Path:
        """An executable to pass as ``LocalCluster(python=...)``: it runs the
        daemon whose arguments contain ``match`` (e.g. ``--node-id=meta-0``)
        inside this namespace, every other one as usual. The pid stays the
        daemon's (``exec`` all the way), so LocalCluster can signal it."""
        path.write_text(
            "#!/bin/sh\n"
            f'case " $* " in\n  *" {match} "*) exec ip netns exec {self.ns} {sys.executable} "$@" ;;\n'
            f'  *) exec {sys.executable} "$@" ;;\nesac\n'
        )
        path.chmod(0o755)
        return path

    @property
    def data_addr(self) -> str:
        return str(self.ready["data_addr"])

    def stop_storage(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    # --- the network --------------------------------------------------------------

    def partition(self) -> None:
        """Cut the node off: its end of the veth goes down (ours loses carrier)."""
        _ip("link", "set", self.ns_if, "down", ns=self.ns)

    def heal(self) -> None:
        _ip("link", "set", self.ns_if, "up", ns=self.ns)

    def reachable(self, port: int, timeout: float = 1.0) -> bool:
        import socket

        try:
            with socket.create_connection((self.ns_ip, port), timeout=timeout):
                return True
        except OSError:
            return False

    def close(self) -> None:
        try:
            self.stop_storage()
        finally:
            if self._created:
                # Deleting the namespace destroys its veth end, and with it ours.
                _ip("netns", "del", self.ns, check=False)
                self._created = False
            if _ip("link", "show", self.host_if, check=False).returncode == 0:
                _ip("link", "del", self.host_if, check=False)

    def __enter__(self) -> NetnsNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
