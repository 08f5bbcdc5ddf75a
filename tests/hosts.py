"""A cluster of N "hosts" on this machine: every daemon in its own Linux
network namespace, with its own address on one bridge, the shape of a real
deployment (deploy/docker-compose.yml, deploy/k8s/).

::

    10.201.<s>.1     the bridge, in the test's own namespace (the test process
                     reaches every host through it)
    10.201.<s>.10+i  meta-i       raft :7100, gRPC :7000
    10.201.<s>.100+i storage-i    data plane :7200, rack label --rack R
    10.201.<s>.200+i client-i     runs client programs (tests/hosts_worker.py)

Each host is a namespace joined to the bridge by a veth pair; its end is
``eth0``. Ports are the deployment's fixed ones (each namespace has its own
port space). The daemons are a :class:`LocalCluster` whose plan this module
writes (so credentials, the cluster secret, the node key, TLS, start, stop,
``health()`` are LocalCluster's, exactly as in every other test); a small
``sh`` wrapper given as LocalCluster's ``python`` execs each daemon with
``ip netns exec`` in its host's namespace (``exec`` all the way: the pid
LocalCluster records is the daemon's).

::

    with HostCluster(tmp_path / "hc", n_storage=6, racks=["r0", ..., "r5"]) as hc:
        hc.partition("storage-2"); ...; hc.heal("storage-2")
        hc.cut("meta-0", "meta-1"); ...; hc.mend("meta-0", "meta-1")
        hc.kill_host("meta-1"); hc.restart_host("meta-1")
        hc.kill_rack("r3")
        out = hc.run_client("client-0", "write", "--dir", "/c", "--files", "4")

``partition(h)`` sets the host's ``eth0`` down: its packets go nowhere and
nothing reaches it (connections time out, as with a pulled cable); ``heal``
sets it up again. ``cut(a, b)`` cuts only the link between two hosts (a
blackhole route on each side: ``tc`` actions and iptables are not there),
``mend`` restores it. Names (bridge, veths, namespaces) carry this process's pid
and a counter, and the subnet is the first free 10.201.<s>.0/24 (chosen under
a lock file), so parallel runs do not collide; 10.200.x is
tests/faults/netns.py's. :meth:`close` (also run at interpreter exit, and by
the constructor when start-up fails) stops the daemons and deletes every
namespace, veth and the bridge; a later run also deletes what a killed run
left behind (names with its dead pid, and the TierFS daemons in them).

Skips (``pytest.skip``) with a reason that says "netns" (category ``netns``
in tests/skip_policy.py) when namespaces or bridges are not permitted here.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import MetaCluster
from tests.faults.harness import FAST_GC_GRACE, FAST_META
from tierfs.client import Client
from tierfs.local import LocalCluster, ProcInfo, pid_alive

__all__ = ["DEPLOY_RACKS", "Host", "HostCluster", "HostMetaCluster", "HostNet", "hosts_unavailable", "wait_until"]

REPO = Path(__file__).resolve().parent.parent
#: The deployment's ports (deploy/docker-compose.yml, deploy/k8s/): each host has its own port space.
META_GRPC, META_RAFT, STORAGE_PORT = 7000, 7100, 7200
#: The racks of the deployed topology (compose: 6 storage nodes, one rack each;
#: tests/cli/test_deploy_topology.py keeps deploy/ in step with this).
DEPLOY_RACKS = tuple(f"rack-{i}" for i in range(6))
_LOCK = Path("/tmp/tierfs-hosts.lock")
_counter = itertools.count()
_live: weakref.WeakSet[HostNet] = weakref.WeakSet()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def hosts_unavailable() -> str:
    """Why the hosts fixture cannot run here ('' when it can); the reason
    says "netns" so that the skip policy files it under ``netns``."""
    from tests.faults.netns import netns_unavailable

    why = netns_unavailable()
    if why:
        return f"netns hosts: {why}"
    probe = f"tfbp{os.getpid() % 10**7}"
    res = subprocess.run(["ip", "link", "add", probe, "type", "bridge"], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        return f"netns hosts: cannot create a bridge: {res.stderr.strip()}"
    subprocess.run(["ip", "link", "del", probe], capture_output=True, timeout=20)
    return ""


def _sweep_stale() -> None:
    """Delete what a killed run left: its namespaces (named with its pid,
    which is dead now), the TierFS daemons still running in them (they
    outlive their parent, as LocalCluster's do) and its bridges. Nothing
    whose owner lives is touched, nor a process in those namespaces that is
    not a TierFS daemon (then the namespace stays too)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = re.fullmatch(r"tfhost-(\d+)x\d+-.+", ns)
        if not m or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not all(pid_alive(p) for p in pids):
            continue  # something else (or a zombie) in there: leave it alone
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        _ip("netns", "del", ns, check=False)
    for m in re.finditer(r"^\d+: (tfb(\d+)x\d+)[:@]", _ip("-o", "link", "show", check=False).stdout, flags=re.M):
        if not os.path.exists(f"/proc/{m.group(2)}"):
            _ip("link", "del", m.group(1), check=False)
    # Blackhole routes a killed run's cut(h, "test") left in this namespace,
    # for subnets no bridge holds now (a later run may take the subnet).
    held = {m.group(1) for m in re.finditer(r" (10\.201\.\d+)\.1/24 ", _ip("-4", "-o", "addr", "show").stdout)}
    for m in re.finditer(r"^blackhole ((10\.201\.\d+)\.\d+)\b", _ip("-4", "route", "show", check=False).stdout,
                         flags=re.M):
        if m.group(2) not in held:
            _ip("route", "del", "blackhole", f"{m.group(1)}/32", check=False)


@dataclass
class Host:
    """One "host": a namespace, its address, its rack, the daemons on it."""

    name: str  # "meta-0", "storage-3", "client-0"
    ns: str
    ip: str
    veth: str  # our end of the pair, on the bridge
    rack: str = ""
    procs: list[str] = field(default_factory=list)  # LocalCluster process names
    partitioned: bool = False
    cut: set[str] = field(default_factory=set)  # hosts it cannot reach (HostCluster.cut)


class HostNet:
    """The network of :class:`HostCluster`: a bridge, and hosts (each a
    namespace with an address on it) that can be partitioned and cut
    apart; the daemons are the subclass's business."""

    tag: str
    bridge: str
    subnet: str
    hosts: dict[str, Host]
    _bridge_made: bool

    def _init_net(self) -> None:
        why = hosts_unavailable()
        if why:
            pytest.skip(why)
        self.tag = f"{os.getpid()}x{next(_counter) % 10}"
        self.bridge = f"tfb{self.tag}"
        self.hosts = {}
        self._bridge_made = False
        self.subnet = ""

    # --- the network --------------------------------------------------------------

    @property
    def gateway(self) -> str:
        """The bridge's address, in the test's own namespace."""
        return f"{self.subnet}.1"

    def _make_bridge(self) -> None:
        _LOCK.touch(exist_ok=True)
        with open(_LOCK) as lock:
            # Choosing a subnet and taking it must be one step across parallel runs.
            fcntl.flock(lock, fcntl.LOCK_EX)
            _sweep_stale()
            used = _ip("-4", "-o", "addr", "show").stdout
            start = os.getpid() % 250 + 1
            free = [n for n in [*range(start, 255), *range(1, start)] if f" 10.201.{n}." not in used]
            if not free:
                pytest.skip("netns hosts: no free 10.201.<n>.0/24 subnet")
            self.subnet = f"10.201.{free[0]}"
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")

    def _add_host(self, name: str, octet: int, rack: str = "") -> Host:
        if not 1 < octet < 255:
            raise ValueError(f"{name}: no address left in {self.subnet}.0/24")
        h = Host(name, f"tfhost-{self.tag}-{name}", f"{self.subnet}.{octet}", f"tfv{self.tag}h{len(self.hosts)}", rack)
        inner = f"tfw{self.tag}h{len(self.hosts)}"
        self.hosts[name] = h
        _ip("netns", "add", h.ns)
        _ip("link", "add", h.veth, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", h.ns)
        _ip("-n", h.ns, "link", "set", inner, "name", "eth0")
        _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        _ip("-n", h.ns, "link", "set", "eth0", "up")
        _ip("-n", h.ns, "link", "set", "lo", "up")
        _ip("link", "set", h.veth, "master", self.bridge, "up")
        return h

    def partition(self, name: str) -> None:
        """Cut host ``name`` off: its ``eth0`` goes down; its daemons keep running."""
        h = self.hosts[name]
        _ip("-n", h.ns, "link", "set", "eth0", "down")
        h.partitioned = True

    def heal(self, name: str) -> None:
        h = self.hosts[name]
        _ip("-n", h.ns, "link", "set", "eth0", "up")
        h.partitioned = False

    def cut(self, a: str, b: str) -> None:
        """Cut the link between hosts ``a`` and ``b`` only: each gets a
        blackhole route to the other's address, so neither can reach the
        other (a connect from one side fails at once, from the other it
        times out, established connections stall), while both still reach
        every other host and the test's namespace. A partial partition: a
        meta leader cut from its followers while clients still reach it.
        ``b`` "test": cut ``a`` from the test's own namespace (its clients)
        only."""
        ha = self.hosts[a]
        if b == "test":  # the test's own namespace (its clients): the bridge's address
            _ip("-n", ha.ns, "route", "add", "blackhole", f"{self.gateway}/32")
            _ip("route", "add", "blackhole", f"{ha.ip}/32")
            ha.cut.add(b)
            return
        hb = self.hosts[b]
        _ip("-n", ha.ns, "route", "add", "blackhole", f"{hb.ip}/32")
        _ip("-n", hb.ns, "route", "add", "blackhole", f"{ha.ip}/32")
        ha.cut.add(b)
        hb.cut.add(a)

    def mend(self, a: str, b: str) -> None:
        """Undo :meth:`cut`."""
        ha = self.hosts[a]
        if b == "test":
            _ip("-n", ha.ns, "route", "del", "blackhole", f"{self.gateway}/32", check=False)
            _ip("route", "del", "blackhole", f"{ha.ip}/32", check=False)
            ha.cut.discard(b)
            return
        hb = self.hosts[b]
        _ip("-n", ha.ns, "route", "del", "blackhole", f"{hb.ip}/32", check=False)
        _ip("-n", hb.ns, "route", "del", "blackhole", f"{ha.ip}/32", check=False)
        ha.cut.discard(b)
        hb.cut.discard(a)

    def mend_all(self) -> None:
        """Undo every :meth:`cut`."""
        for h in list(self.hosts.values()):
            for other in sorted(h.cut):
                self.mend(h.name, other)

    def reachable(self, name: str, port: int, timeout: float = 1.0) -> bool:
        """Whether the test's namespace can open a TCP connection to ``name:port``."""
        import socket

        try:
            with socket.create_connection((self.hosts[name].ip, port), timeout=timeout):
                return True
        except OSError:
            return False

    def _close_net(self) -> None:
        for h in self.hosts.values():
            # Deleting a namespace destroys its end of the veth, and with it ours.
            _ip("netns", "del", h.ns, check=False)
            if _ip("link", "show", h.veth, check=False).returncode == 0:
                _ip("link", "del", h.veth, check=False)
        for h in self.hosts.values():  # routes the test's namespace kept (cut from "test")
            if "test" in h.cut:
                _ip("route", "del", "blackhole", f"{h.ip}/32", check=False)
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_made = False


class HostCluster(HostNet):
    """Meta replicas, storage daemons and client hosts, each in its own
    network namespace on one bridge (see the module docstring)."""

    def __init__(self, root: Path, *, n_meta: int = 3, n_storage: int = 6,
                 racks: Sequence[str] | None = None, n_clients: int = 1,
                 extra_meta_args: Sequence[str] = FAST_META, extra_storage_args: Sequence[str] = (),
                 gc_grace: float | None = FAST_GC_GRACE, tls: bool = False, start: bool = True,
                 timeout: float = 120.0) -> None:
        """``racks``: the rack label of each storage host (``--rack R``; a
        list of n_storage labels, '' for none). ``start=False`` builds the
        network and the plan only (call :meth:`start`)."""
        if racks is not None and len(racks) != n_storage:
            raise ValueError(f"racks: {len(racks)} labels for {n_storage} storage hosts")
        self._init_net()
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._closed = False
        self._wrapper = self.root / "python-in-host"
        _live.add(self)
        try:
            self._make_bridge()
            self.cl = LocalCluster(self.root / "cluster", n_meta=n_meta, n_storage=1, host=self.gateway,
                                   python=str(self._wrapper), extra_meta_args=list(extra_meta_args),
                                   extra_storage_args=["--transport=tcp", *extra_storage_args],
                                   gc_grace=gc_grace, tls=tls)
            # Our own plan: fixed ports on each host's address, as deployed.
            self.cl.procs = []
            for i in range(n_meta):
                self._add_host(f"meta-{i}", 10 + i)
            meta_hosts = [self.hosts[f"meta-{i}"] for i in range(n_meta)]
            for i, h in enumerate(meta_hosts):
                self.cl.procs.append(self._meta_proc(i, h, meta_hosts))
            for i in range(n_storage):
                self._plan_storage(i, (racks or [""] * n_storage)[i])
            for i in range(n_clients):
                self._add_host(f"client-{i}", 200 + i)
            self._write_wrapper()
            if start:
                self.start(timeout=timeout)
        except BaseException:
            self.close()
            raise

    # --- the plan -----------------------------------------------------------------

    def _meta_proc(self, i: int, h: Host, metas: Sequence[Host]) -> ProcInfo:
        me = f"{h.ip}:{META_RAFT}"
        peers = [f"--peer={m.ip}:{META_RAFT}={m.ip}:{META_GRPC}" for m in metas if m is not h]
        argv = ["-m", "tierfs.meta.daemon", f"--node-id={h.name}", f"--raft-addr={me}",
                f"--grpc-addr={h.ip}:{META_GRPC}", f"--data-dir={self.cl.dir / h.name}", *peers]
        h.procs.append(h.name)
        return ProcInfo(h.name, "meta", argv, f"{h.ip}:{META_GRPC}", extra={"raft": me})

    def _plan_storage(self, i: int, rack: str) -> ProcInfo:
        h = self._add_host(f"storage-{i}", 100 + i, rack)
        node_dir = self.cl.dir / h.name
        argv = ["-m", "tierfs.storage.daemon", f"--data-dir={node_dir}", f"--target={node_dir / 't0'}",
                *[f"--meta={a}" for a in self.meta_addrs], f"--host={h.ip}", f"--port={STORAGE_PORT}",
                *([f"--rack={rack}"] if rack else [])]
        h.procs.append(h.name)
        p = ProcInfo(h.name, "storage", argv, f"{h.ip}:{STORAGE_PORT}")
        self.cl.procs.append(p)
        return p

    def _write_wrapper(self) -> None:
        # The data dir (storage) or node id (meta) names the daemon, and so its host.
        cases = []
        for h in self.hosts.values():
            for name in h.procs:
                key = f"--node-id={name}" if name.startswith("meta-") else f"--data-dir={self.cl.dir / name}"
                cases.append(f'  *" {key} "*) exec ip netns exec {h.ns} {sys.executable} "$@" ;;\n')
        tmp = self._wrapper.with_suffix(".tmp")
        tmp.write_text("#!/bin/sh\n" 'case " $* " in\n' + "".join(cases)
                       + '  *) echo "no host for: $*" >&2; exit 97 ;;\nesac\n')
        tmp.chmod(0o755)
        os.replace(tmp, self._wrapper)

    def add_storage_host(self, rack: str = "", timeout: float = 60.0) -> Host:
        """Plan, network and start one more storage host (growing the cluster)."""
        i = sum(p.kind == "storage" for p in self.cl.procs)
        p = self._plan_storage(i, rack)
        self._write_wrapper()
        self.cl.start(names=[p.name], timeout=timeout)
        return self.hosts[p.name]

    # --- processes ----------------------------------------------------------------

    @property
    def meta_addrs(self) -> list[str]:
        return self.cl.meta_addrs

    def storage_hosts(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.name.startswith("storage-")]

    def rack_hosts(self, rack: str) -> list[Host]:
        return [h for h in self.storage_hosts() if h.rack == rack]

    def start(self, names: Sequence[str] | None = None, timeout: float = 120.0) -> None:
        """Start what is not running (or the daemons of hosts ``names``) and
        wait until the cluster is healthy."""
        procs = None if names is None else [p for n in names for p in self.hosts[n].procs]
        self.cl.start(timeout=timeout, names=procs)
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 60.0) -> dict[str, Any]:
        return asyncio.run(self.cl.wait_healthy(timeout))

    def kill_host(self, name: str) -> list[int]:
        """SIGKILL every daemon on host ``name``; returns their pids."""
        return [self.cl.kill(p, signal.SIGKILL) for p in self.hosts[name].procs if self.cl.proc(p).alive()]

    def kill_rack(self, rack: str) -> list[str]:
        """SIGKILL every daemon of every storage host in ``rack``; returns the hosts."""
        hosts = self.rack_hosts(rack)
        if not hosts:
            raise KeyError(f"no storage host in rack {rack!r}")
        for h in hosts:
            self.kill_host(h.name)
        return [h.name for h in hosts]

    def restart_host(self, name: str, timeout: float = 60.0) -> None:
        """Start the daemons of host ``name`` again (same address, same data)."""
        self.cl.start(names=self.hosts[name].procs, timeout=timeout)

    def leader(self, deadline: float = 8.0) -> str:
        """The host whose meta replica says it leads ('' if none does)."""
        h = asyncio.run(self.cl.health(deadline=deadline))
        return next((str(m["name"]) for m in h["meta"] if m["role"] == "leader"), "")

    def wait_leader(self, timeout: float = 30.0, exclude: Sequence[str] = ()) -> str:
        """Wait until a replica (not one of ``exclude``) leads; returns its host."""
        deadline = time.monotonic() + timeout
        last: object = "?"
        while time.monotonic() < deadline:
            try:
                lead = self.leader(deadline=max(1.0, min(8.0, deadline - time.monotonic())))
                if lead and lead not in exclude:
                    return lead
                last = lead
            except Exception as exc:  # any failure is "not yet"; the last one is reported
                last = exc
            time.sleep(0.2)
        raise AssertionError(f"no meta leader outside {list(exclude)} after {timeout:.0f}s (last: {last!r})")

    # --- clients ------------------------------------------------------------------

    def client(self, **kw: Any) -> Client:
        """A client in the test's own namespace (reaches every host through the bridge)."""
        kw.setdefault("request_timeout", 2.0)
        kw.setdefault("connect_timeout", 1.0)
        tls = self.cl.client_tls()
        if tls is not None:
            kw.setdefault("tls_ca", tls.ca)
            kw.setdefault("tls_cert", tls.cert)
            kw.setdefault("tls_key", tls.key)
        return Client(self.meta_addrs, **kw)

    def client_env(self) -> dict[str, str]:
        """The environment of a client program on a client host: this
        repository on PYTHONPATH, the meta addresses, the cluster's admin
        token (a file, as deployed) and TLS files when the cluster has TLS."""
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        env["TIERFS_META"] = ",".join(self.meta_addrs)
        env.pop("TIERFS_TOKEN", None)
        env["TIERFS_TOKEN_FILE"] = str(self.cl.admin_token_file)
        tls = self.cl.client_tls()
        if tls is not None:
            env.update(TIERFS_TLS_CA=tls.ca, TIERFS_TLS_CERT=tls.cert, TIERFS_TLS_KEY=tls.key)
        return env

    def client_argv(self, host: str, *args: str) -> list[str]:
        """``tests/hosts_worker.py ARGS`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].ns, sys.executable, "-m", "tests.hosts_worker", *args]

    def run_client(self, host: str, *args: str, timeout: float = 60.0) -> dict[str, Any]:
        """Run the worker in ``host`` to completion; returns its JSON answer
        (AssertionError with its stderr if it fails)."""
        argv = self.client_argv(host, *args)
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.client_env(),
                             cwd=str(REPO))
        if res.returncode != 0:
            raise AssertionError(f"{shlex.join(argv)} exited {res.returncode}:\n{res.stderr[-4000:]}")
        doc = json.loads(res.stdout.strip().splitlines()[-1])
        assert isinstance(doc, dict)
        return doc

    def start_client(self, host: str, *args: str, out: Path) -> subprocess.Popen[bytes]:
        """Start the worker in ``host`` in the background (stdout to ``out``,
        stderr next to it); the caller waits for it."""
        with open(out, "wb") as o, open(out.with_suffix(".log"), "wb") as e:
            return subprocess.Popen(self.client_argv(host, *args), stdout=o, stderr=e, env=self.client_env(),
                                    cwd=str(REPO), start_new_session=True)

    # --- teardown -----------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if hasattr(self, "cl"):
                for p in self.cl.procs:  # a stopped daemon ignores SIGTERM until continued
                    if p.alive():
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(p.pid, signal.SIGCONT)
                self.cl.stop()
        finally:
            self._close_net()

    def __enter__(self) -> HostCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``cond`` until it returns something truthy; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            v = cond()
            if v:
                return v
            last = v
        except Exception as exc:  # retried until the deadline; reported then
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f}s (last: {last!r})")
        time.sleep(interval)


@atexit.register
def _close_all() -> None:
    for hc in list(_live):
        with contextlib.suppress(Exception):
            hc.close()


class HostMetaCluster(HostNet, MetaCluster):
    """A :class:`tests.cluster.MetaCluster` whose replicas each run on a
    host of their own (``meta<i>`` at 10.201.<s>.10+i, raft :7100, gRPC
    :7000), so that the link between two replicas, or between a replica
    and the test's namespace (its clients), can be cut and mended
    (:meth:`HostNet.cut` with host names ``meta<i>`` and ``"test"``). The
    meta checker's partitions run on it (tests/checker/meta_walk.py)."""

    def __init__(self, root: Path, n: int = 3, **kw: Any) -> None:
        self._init_net()
        _live.add(self)
        try:
            self._make_bridge()
            MetaCluster.__init__(self, root, n, start=False, **kw)
            hosts = [self._add_host(f"meta{i}", 10 + i) for i in range(n)]
            for r, h in zip(self.replicas, hosts, strict=True):
                r.raft_addr, r.grpc_addr = f"{h.ip}:{META_RAFT}", f"{h.ip}:{META_GRPC}"
            for r in self.replicas:
                r.peers = [f"{o.raft_addr}={o.grpc_addr}" for o in self.replicas if o is not r]
            for i in range(n):
                self.start(i)
        except BaseException:
            self.close()
            raise

    def host_of(self, i: int) -> Host:
        return self.hosts[f"meta{i}"]

    def command(self, r: Any) -> list[str]:
        return ["ip", "netns", "exec", self.host_of(r.index).ns, *MetaCluster.command(self, r)]

    def _answers(self, r: Any) -> bool:
        """Started: it answers, or, when its host is cut from the test's
        namespace (nothing here can reach it), it listens in its own."""
        h = self.host_of(r.index)
        if "test" not in h.cut:
            return MetaCluster._answers(self, r)
        if r.proc is not None and r.proc.poll() is not None:
            raise AssertionError(f"replica {r.index} exited with {r.proc.returncode}; log:\n{self.log(r.index)}")
        res = subprocess.run(["ip", "netns", "exec", h.ns, "ss", "-Hltn", f"sport = :{META_GRPC}"],
                             capture_output=True, text=True, timeout=20)
        if res.returncode != 0 or not res.stdout.strip():
            raise OSError(f"replica {r.index} not listening on :{META_GRPC} in {h.ns} yet")
        return True

    def add_replica(self) -> int:
        from tests.cluster import Replica

        i = len(self.replicas)
        h = self._add_host(f"meta{i}", 10 + i)
        peers = [f"{r.raft_addr}={r.grpc_addr}" for r in self.replicas if r.alive]
        self.replicas.append(Replica(i, f"{h.ip}:{META_RAFT}", f"{h.ip}:{META_GRPC}", self.data_root / f"meta{i}",
                                     peers))
        self.start(i)
        return i

    def close(self) -> None:
        try:
            MetaCluster.close(self)
        finally:
            self._close_net()

    def __enter__(self) -> HostMetaCluster:
        return self
