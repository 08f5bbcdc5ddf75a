"""A whole TierFS cluster on one machine, under one directory.

:class:`LocalCluster` owns the processes (``tierfs-meta`` replicas and
``tierfs-storage`` daemons), their ports and their files::

    DIR/cluster.toml        addresses, ports and pids (rewritten on each start)
    DIR/cluster.secret      the Raft cluster secret (mode 0600, made on the first start)
    DIR/admin.token         the admin token, derived from the secret (0600; the CLI's default credential)
    DIR/node.key            the node key the storage daemons present to meta (0600)
    DIR/tls/                with ``tls=True``: ca.pem (+ ca.key), <daemon>.pem/.key, client.pem/.key
    DIR/meta-<i>/           a meta replica's journal and snapshots
    DIR/storage-<i>/        a storage node's identity; targets in t<j>/
    DIR/logs/<name>.log     stderr (structured logs); <name>.out: stdout

Ports are chosen once, on the first start, and reused afterwards, so a
cluster stopped and started again on the same directory keeps its identity
and its data. Daemons run in their own sessions and outlive the process that
started them; :meth:`stop` ends them (SIGTERM, then SIGKILL after a grace
period). It is the engine behind ``make run`` and ``tierfs up``/``down``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierfs.errors import ConfigError, NotFoundError, TierFSError, UnavailableError
from tierfs.fsutil import makedirs_durable, write_durable
from tierfs.meta.secret import SECRET_FILE_NAME, ensure_secret_file, load_secret
from tierfs.security import (
    ADMIN_TOKEN_FILE,
    NODE_KEY_FILE,
    admin_token,
    node_key,
    write_private_file,
)
from tierfs.tls import CA_FILE, CLIENT_NAME, TLS_DIR, TlsFiles, issue, make_local_ca

__all__ = ["LocalCluster", "ProcInfo", "free_ports", "pid_alive"]

STATE_FILE = "cluster.toml"
#: A cluster secret file a new local cluster adopts instead of making one.
SECRET_ENV = "TIERFS_CLUSTER_SECRET_FILE"


@dataclass
class ProcInfo:
    """One daemon of the local cluster."""

    name: str  # "meta-0", "storage-3"
    kind: str  # "meta" | "storage"
    argv: list[str]
    addr: str  # gRPC address (meta) or data-plane address (storage)
    pid: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def marker(self) -> str | None:
        """The argument that tells this daemon's process from any other
        TierFS daemon's: its ``--data-dir=`` (one per daemon)."""
        return next((a for a in self.argv if a.startswith("--data-dir=")), None)

    def alive(self) -> bool:
        """True if :attr:`pid` still runs this daemon (see :func:`pid_alive`)."""
        return pid_alive(self.pid, self.marker)


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback TCP ports, bound and then released.

    They are drawn from below the kernel's ephemeral range, so no outgoing
    connection (a client's, a daemon's) can take one between this call and
    the daemon's bind, and a daemon restarted later finds its port still
    free. Port 0 (kernel's choice) would hand out ephemeral ports, and a
    busy test run did lose that race (EADDRINUSE at a storage daemon's start).

    ``$TIERFS_PORT_RANGE`` (``LO-HI``) narrows the draw: parallel test
    workers each get their own slice (tests/conftest.py), so one worker's
    ports, released before its daemons bind them, cannot be drawn by
    another in between.
    """
    import random

    lo, _ = _ephemeral_range()
    top = max(lo - 1, 2048)
    bottom = min(10000, top - 1000)
    window = os.environ.get("TIERFS_PORT_RANGE", "").strip()
    if window:
        try:
            a, b = (int(x) for x in window.split("-", 1))
        except ValueError:
            raise ConfigError(f"{window!r}: expected LO-HI, e.g. 10000-20000", field="TIERFS_PORT_RANGE") from None
        if not 1024 <= a <= b <= 65535:
            raise ConfigError(f"{window!r}: need 1024 <= LO <= HI <= 65535", field="TIERFS_PORT_RANGE")
        bottom, top = a, b
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(n * 200):
            if len(ports) == n:
                break
            port = rng.randint(bottom, top)
            if port in ports:
                continue
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        if len(ports) < n:
            raise UnavailableError(f"found only {len(ports)} of {n} free loopback ports in {bottom}-{top}")
        return ports
    finally:
        for s in socks:
            s.close()


#: pid -> how a child of this process ended (``os.waitpid`` status), kept when
#: :func:`pid_alive` reaps it: a daemon that dies during start-up is reported
#: with it (a signal leaves nothing in its log).
_ENDED: dict[int, int] = {}


def exit_description(pid: int) -> str:
    """How child ``pid`` ended, as far as :func:`pid_alive` saw it reaped."""
    status = _ENDED.get(pid)
    if status is None:
        return "its exit status is not known (not reaped here)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(ValueError):
            return f"killed by signal {sig} ({signal.Signals(sig).name})"
        return f"killed by signal {sig}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def pid_alive(pid: int, marker: str | None = None) -> bool:
    """True if ``pid`` runs a TierFS daemon (not a zombie, not a reused pid).

    ``marker``: an argument that daemon was started with (its
    ``--data-dir=``; :attr:`ProcInfo.marker`). Without it any TierFS
    process passes, and with pids wrapping at 32,768 a dead daemon's pid
    does get reused by another cluster's daemon: a test run's ``stop()`` of
    one cluster once SIGTERMed a meta replica another cluster was starting."""
    if pid <= 0:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, status = os.waitpid(pid, os.WNOHANG)  # reap it if it is our child and has exited
        if done == pid:
            if len(_ENDED) > 4096:
                _ENDED.clear()
            _ENDED[pid] = status
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    # cmdline reads empty while the kernel is still exec'ing a just-spawned
    # child: that is one of ours starting, not a foreign process.
    if state in (b"Z", b"X"):
        return False
    if not cmd:
        return True
    return b"tierfs" in cmd and (marker is None or marker.encode() in cmd.split(b"\0"))


def _toml_str(v: str) -> str:
    return json.dumps(v)  # a JSON string is a valid TOML basic string


class LocalCluster:
    """Start, stop and inspect a local cluster rooted at ``data_dir``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        n_meta: int = 3,
        n_storage: int = 6,
        targets_per_node: int = 1,
        host: str = "127.0.0.1",
        python: str = sys.executable,
        extra_meta_args: Sequence[str] = (),
        extra_storage_args: Sequence[str] = (),
        gc_grace: float | None = None,
        tls: bool = False,
        racks: Sequence[str] = (),
    ) -> None:
        """``gc_grace``: seconds before meta lists replaced fragments for
        deletion (``tierfs-meta --gc-grace``; None: the daemon's default,
        300 s). Tests that wait for GC pass a short one. Like the extra
        arguments it applies to the daemons this object starts.

        ``tls``: make a local CA and certificates under DIR/tls/ and run
        every daemon with TLS and client certificates required (mutual TLS;
        docs/security-tls.md). A directory that has DIR/tls/ca.pem stays a
        TLS cluster whatever is passed here.

        ``racks``: the rack label of each storage daemon of a new plan, in
        order (``--rack``; missing or "" = unlabelled)."""
        self.dir = Path(data_dir).resolve()
        self.python = python
        self.host = host
        self._extra_meta = list(extra_meta_args)
        if gc_grace is not None:
            self._extra_meta.append(f"--gc-grace={gc_grace}")
        self._extra_storage = list(extra_storage_args)
        self.tls = tls or (self.tls_dir / CA_FILE).exists()
        state = self._load_state()
        #: True when the directory already held a cluster (its plan is reused
        #: and the counts passed here are ignored).
        self.reused = state is not None
        if state is not None:
            self.procs = state
        else:
            if n_meta < 1 or n_meta % 2 == 0:
                raise ConfigError("must be an odd number >= 1 (Raft majority)", field="meta")
            if n_storage < 1:
                raise ConfigError("must be >= 1", field="storage")
            if targets_per_node < 1:
                raise ConfigError("must be >= 1", field="targets_per_node")
            self.procs = self._plan(n_meta, n_storage, targets_per_node, racks)

    @classmethod
    def open(cls, data_dir: str | os.PathLike[str], **kw: Any) -> LocalCluster:
        """The cluster already planned in ``data_dir`` (``NotFoundError`` if none)."""
        path = Path(data_dir).resolve() / STATE_FILE
        if not path.exists():
            raise NotFoundError(f"no local cluster in {Path(data_dir).resolve()} (no {STATE_FILE}); "
                                "start one with `tierfs up --data DIR`")
        return cls(data_dir, **kw)

    # --- layout -------------------------------------------------------------

    @property
    def counts(self) -> dict[str, int]:
        """``{"meta": n, "storage": n, "targets_per_node": n}`` of the plan."""
        storage = [p for p in self.procs if p.kind == "storage"]
        tpn = sum(a.startswith("--target=") for a in storage[0].argv) if storage else 0
        return {"meta": len(self.meta_addrs), "storage": len(storage), "targets_per_node": tpn}

    @property
    def secret_file(self) -> Path:
        """The cluster secret every meta replica is started with."""
        return self.dir / SECRET_FILE_NAME

    @property
    def admin_token_file(self) -> Path:
        """The admin token (derived from the secret; written by :meth:`start`)."""
        return self.dir / ADMIN_TOKEN_FILE

    @property
    def node_key_file(self) -> Path:
        """The node key every storage daemon is started with."""
        return self.dir / NODE_KEY_FILE

    def admin_token(self) -> str:
        """The cluster's admin token (from its secret, which :meth:`start` makes)."""
        return admin_token(load_secret(self.secret_file))

    def export_token(self) -> str:
        """Make the credentials now and put the admin token in this process's
        TIERFS_TOKEN (benchmarks: their clients and worker processes then use
        this cluster's token). Returns it."""
        makedirs_durable(self.dir)
        self._write_credentials()
        os.environ["TIERFS_TOKEN"] = tok = self.admin_token()
        return tok

    def _write_credentials(self) -> None:
        given = os.environ.get(SECRET_ENV, "")
        if given and not self.secret_file.exists():
            # A new cluster adopts the secret named there (tests share one;
            # an operator may bring their own) instead of making one.
            write_private_file(self.secret_file, load_secret(given).decode() + "\n")
        secret = load_secret(ensure_secret_file(self.secret_file))
        # Rewritten each start: they follow the secret if an operator replaced it.
        write_private_file(self.admin_token_file, admin_token(secret) + "\n", overwrite=True)
        write_private_file(self.node_key_file, node_key(secret) + "\n", overwrite=True)

    @property
    def tls_dir(self) -> Path:
        return self.dir / TLS_DIR

    def client_tls(self) -> TlsFiles | None:
        """What a client of this cluster dials with (None: plaintext)."""
        if not self.tls:
            return None
        d = self.tls_dir
        return TlsFiles(ca=str(d / CA_FILE), cert=str(d / f"{CLIENT_NAME}.pem"), key=str(d / f"{CLIENT_NAME}.key"))

    def _make_certs(self) -> None:
        make_local_ca(self.tls_dir)
        issue(self.tls_dir, CLIENT_NAME, client_only=True)
        for p in self.procs:
            issue(self.tls_dir, p.name, [p.addr.rpartition(":")[0]])

    def _tls_flags(self, p: ProcInfo) -> list[str]:
        d = self.tls_dir
        return [f"--tls-cert={d / (p.name + '.pem')}", f"--tls-key={d / (p.name + '.key')}",
                f"--tls-ca={d / CA_FILE}", "--tls-require-client-cert=true"]

    @property
    def meta_addrs(self) -> list[str]:
        return [p.addr for p in self.procs if p.kind == "meta"]

    @property
    def metrics_addrs(self) -> dict[str, str]:
        """Prometheus endpoint of each meta replica (name -> host:port;
        a cluster planned before meta had one has none)."""
        return {p.name: p.extra["metrics"] for p in self.procs if p.kind == "meta" and p.extra.get("metrics")}

    @property
    def storage_metrics_addrs(self) -> dict[str, str]:
        """Prometheus endpoint of each storage daemon (name -> host:port;
        daemons planned before stop 45 have none)."""
        return {p.name: p.extra["metrics"] for p in self.procs if p.kind == "storage" and p.extra.get("metrics")}

    def proc(self, name: str) -> ProcInfo:
        for p in self.procs:
            if p.name == name:
                return p
        raise KeyError(f"no process {name!r} in {self.dir}")

    def _plan(self, n_meta: int, n_storage: int, tpn: int, racks: Sequence[str] = ()) -> list[ProcInfo]:
        ports = free_ports(3 * n_meta + 2 * n_storage)
        h = self.host
        raft = [f"{h}:{ports[i]}" for i in range(n_meta)]
        grpc = [f"{h}:{ports[n_meta + i]}" for i in range(n_meta)]
        metrics = [f"{h}:{ports[2 * n_meta + n_storage + i]}" for i in range(n_meta)]
        procs: list[ProcInfo] = []
        for i in range(n_meta):
            peers = [f"--peer={raft[j]}={grpc[j]}" for j in range(n_meta) if j != i]
            argv = [
                "-m", "tierfs.meta.daemon", f"--node-id=meta-{i}", f"--raft-addr={raft[i]}",
                f"--grpc-addr={grpc[i]}", f"--data-dir={self.dir / f'meta-{i}'}", *peers,
                f"--metrics-addr={metrics[i]}",
            ]
            procs.append(ProcInfo(f"meta-{i}", "meta", argv, grpc[i], extra={"raft": raft[i], "metrics": metrics[i]}))
        for i in range(n_storage):
            procs.append(self._storage_proc(i, ports[2 * n_meta + i], tpn, grpc, racks[i] if i < len(racks) else "",
                                            metrics_port=ports[3 * n_meta + n_storage + i]))
        return procs

    def _storage_proc(self, i: int, port: int, tpn: int, meta: Sequence[str], rack: str, *,
                      metrics_port: int = 0) -> ProcInfo:
        h = self.host
        node_dir = self.dir / f"storage-{i}"
        targets = [f"--target={node_dir / f't{j}'}" for j in range(tpn)]
        metrics = f"{h}:{metrics_port}" if metrics_port else ""
        argv = [
            "-m", "tierfs.storage.daemon", f"--data-dir={node_dir}", *targets, *[f"--meta={a}" for a in meta],
            f"--host={h}", f"--port={port}", *([f"--rack={rack}"] if rack else []),
            *([f"--metrics-addr={metrics}"] if metrics else []),
        ]
        return ProcInfo(f"storage-{i}", "storage", argv, f"{h}:{port}", extra={"metrics": metrics} if metrics else {})

    def grow(self, n_storage: int, racks: Sequence[str] = ()) -> list[str]:
        """Plan storage daemons up to ``n_storage`` (``tierfs up --storage
        N`` on an existing cluster): the new ones get fresh ports, the
        plan's targets per node and ``racks[i]`` for the i-th new one; the
        daemons planned already are untouched. Fewer than planned is refused
        (drain and remove nodes instead). Returns the new names; :meth:`start`
        (or :meth:`up`) starts them."""
        have = [p for p in self.procs if p.kind == "storage"]
        if n_storage < len(have):
            raise ConfigError(f"the cluster has {len(have)} storage daemons; --storage {n_storage} would remove "
                              f"some (drain them: `tierfs node drain ID`, then `tierfs node rm ID`)", field="storage")
        tpn = self.counts["targets_per_node"] or 1
        # Past every name planned and every storage-<i> directory left on
        # disk: `tierfs node rm` drops a node from the plan but keeps its
        # directory, and a new daemon given that name would start with the
        # removed node's identity (node.uuid) and its old fragment files.
        left = (int(d.name.rsplit("-", 1)[1]) for d in self.dir.glob("storage-*")
                if d.is_dir() and d.name.rsplit("-", 1)[1].isdigit())
        first = 1 + max((*(int(p.name.rsplit("-", 1)[1]) for p in have), *left), default=-1)
        n_new = n_storage - len(have)
        ports = free_ports(2 * n_new)
        used = {p.addr for p in self.procs}
        new: list[ProcInfo] = []
        for k, port in enumerate(ports[:n_new]):
            p = self._storage_proc(first + k, port, tpn, self.meta_addrs, racks[k] if k < len(racks) else "",
                                   metrics_port=ports[n_new + k])
            if p.addr in used:  # a port of a daemon not running now: planned already
                raise UnavailableError(f"port {port} is planned for another daemon; try again")
            new.append(p)
        self.procs += new
        if new:
            makedirs_durable(self.dir)
            self._save_state()
        return [p.name for p in new]

    def _load_state(self) -> list[ProcInfo] | None:
        path = self.dir / STATE_FILE
        if not path.exists():
            return None
        try:
            doc = tomllib.loads(path.read_text())
            return [
                ProcInfo(p["name"], p["kind"], list(p["argv"]), p["addr"], int(p.get("pid", 0)),
                         dict(p.get("extra", {})))
                for p in doc["process"]
            ]
        except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path} is damaged ({exc}); remove it to re-plan the cluster",
                              field="cluster.toml") from None

    def _save_state(self) -> None:
        lines = [
            "# Written by TierFS (tierfs.local). Addresses and pids of this local cluster.",
            "[cluster]",
            f"meta = [{', '.join(_toml_str(a) for a in self.meta_addrs)}]",
            f"data_dir = {_toml_str(str(self.dir))}",
            "",
        ]
        for p in self.procs:
            lines += [
                "[[process]]",
                f"name = {_toml_str(p.name)}",
                f"kind = {_toml_str(p.kind)}",
                f"addr = {_toml_str(p.addr)}",
                f"pid = {p.pid}",
                f"argv = [{', '.join(_toml_str(a) for a in p.argv)}]",
                "extra = { " + ", ".join(f"{k} = {_toml_str(v)}" for k, v in p.extra.items()) + " }",
                "",
            ]
        # Durably: after a power cut the plan is the old one or the new one,
        # and it is there (as the data directories it names are).
        write_durable(self.dir / STATE_FILE, "\n".join(lines).encode())

    # --- processes ------------------------------------------------------------

    def running(self) -> dict[str, bool]:
        return {p.name: p.alive() for p in self.procs}

    def _spawn(self, p: ProcInfo) -> int:
        logs = self.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        extra = self._extra_meta if p.kind == "meta" else self._extra_storage
        if p.kind == "meta" and not any(a.startswith(("--cluster-secret-file", "--insecure-no-cluster-secret"))
                                        for a in [*p.argv, *extra]):
            # Here rather than in the plan: a cluster.toml written before the
            # secret existed gets it too.
            extra = [f"--cluster-secret-file={self.secret_file}", *extra]
        if p.kind == "storage" and not any(a.startswith("--node-key-file") for a in [*p.argv, *extra]):
            extra = [f"--node-key-file={self.node_key_file}", *extra]
        if self.tls:
            extra = [*self._tls_flags(p), *extra]
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(logs / f"{p.name}.out"), flags, 0o644),
            (os.POSIX_SPAWN_OPEN, 2, str(logs / f"{p.name}.log"), flags, 0o644),
        ]
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # posix_spawn leaves no Popen object behind: the daemons outlive us.
        return os.posix_spawn(self.python, [self.python, *p.argv, *extra], env,
                              file_actions=actions, setsid=True)

    def _wait_ready(self, p: ProcInfo, offset: int, deadline: float) -> None:
        out = self.dir / "logs" / f"{p.name}.out"
        while True:
            with contextlib.suppress(FileNotFoundError), out.open("rb") as f:
                f.seek(offset)
                for line in f:
                    with contextlib.suppress(ValueError):
                        if isinstance(json.loads(line), dict):
                            return
            if not p.alive():
                raise UnavailableError(f"{p.name} (pid {p.pid}) exited during start-up, {exit_description(p.pid)}; "
                                       f"see {self.dir / 'logs' / (p.name + '.log')}:\n" + self._tail(p.name))
            if time.monotonic() > deadline:
                raise UnavailableError(f"{p.name} did not become ready in time; see {self.dir / 'logs' / (p.name + '.log')}:\n"
                                       + self._tail(p.name))
            time.sleep(0.05)

    def _tail(self, name: str, n: int = 15) -> str:
        try:
            lines = (self.dir / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join("    " + ln for ln in lines[-n:])

    def start(self, timeout: float = 60.0, names: Sequence[str] | None = None) -> list[str]:
        """Start every daemon that is not running (meta first: storage nodes
        register with meta before they report ready). Returns the names started."""
        makedirs_durable(self.dir)
        self._write_credentials()
        if self.tls:
            self._make_certs()
        deadline = time.monotonic() + timeout
        started: list[str] = []
        for kind in ("meta", "storage"):
            batch: list[tuple[ProcInfo, int]] = []
            for p in self.procs:
                if p.kind != kind or (names is not None and p.name not in names) or p.alive():
                    continue
                out = self.dir / "logs" / f"{p.name}.out"
                offset = out.stat().st_size if out.exists() else 0
                p.pid = self._spawn(p)
                batch.append((p, offset))
                started.append(p.name)
            self._save_state()
            for p, offset in batch:
                self._wait_ready(p, offset, deadline)
        return started

    def up(self, timeout: float = 90.0) -> list[str]:
        """Start what is not running and wait until the cluster is healthy; if
        that fails, stop again the daemons this call started. Returns their names."""
        before = {name for name, alive in self.running().items() if alive}
        try:
            started = self.start(timeout=timeout)
            asyncio.run(self.wait_healthy(timeout))
        except BaseException:
            # Also when start itself failed half-way (a daemon that could not
            # bind its port): nothing this call started is left running.
            new = [name for name, alive in self.running().items() if alive and name not in before]
            if new:
                self.stop(names=new)
            raise
        return started

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one daemon (SIGKILL by default); returns its pid."""
        p = self.proc(name)
        if not p.alive():
            raise UnavailableError(f"{name} is not running")
        os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            self._wait_gone([p], time.monotonic() + 10)
        return p.pid

    def _wait_gone(self, procs: Sequence[ProcInfo], deadline: float) -> list[ProcInfo]:
        left = [p for p in procs if p.alive()]
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [p for p in left if p.alive()]
        return left

    def stop(self, timeout: float = 15.0, names: Sequence[str] | None = None) -> list[str]:
        """SIGTERM every daemon (or those in ``names``; storage first), SIGKILL
        what is left after ``timeout``. Returns the names that were running."""
        stopped: list[str] = []
        for kind in ("storage", "meta"):
            procs = [p for p in self.procs if p.kind == kind and p.alive()
                     and (names is None or p.name in names)]
            stopped += [p.name for p in procs]
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
            for p in self._wait_gone(procs, time.monotonic() + timeout):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            self._wait_gone(procs, time.monotonic() + 5)
        for p in self.procs:
            if names is None or p.name in names:
                p.pid = 0
        if self.dir.exists():
            self._save_state()
        return stopped

    # --- health -------------------------------------------------------------

    async def health(self, deadline: float = 5.0) -> dict[str, Any]:
        """Roles of the meta replicas and states from the cluster map."""
        from tierfs.meta import MetaClient
        from tierfs.proto.v1 import meta_pb2 as pb

        alive = self.running()
        out: dict[str, Any] = {"meta": [], "storage": [], "groups": 0, "map_version": 0}
        async with MetaClient(self.meta_addrs, deadline=deadline, attempt_timeout=min(1.0, deadline / 3),
                              token=self.admin_token(), tls=self.client_tls()) as mc:
            for p in self.procs:
                if p.kind != "meta":
                    continue
                role = "down"
                if alive[p.name]:
                    try:
                        role = (await mc.status(addr=p.addr)).role
                    except TierFSError:
                        role = "unreachable"
                out["meta"].append({"name": p.name, "addr": p.addr, "role": role, "pid": p.pid})
            cmap = await mc.get_cluster_map()
            try:  # what new files under / get (`tierfs up` warns when the cluster is too small for it)
                out["root_layout"] = (await mc.get_layout("/")).redundancy
            except TierFSError:
                out["root_layout"] = ""
        by_addr = {n.data_addr: n for n in cmap.nodes}
        for p in self.procs:
            if p.kind != "storage":
                continue
            node = by_addr.get(p.addr)
            state = pb.NodeState.Name(node.state).removeprefix("NODE_STATE_").lower() if node else "unregistered"
            out["storage"].append({"name": p.name, "addr": p.addr, "pid": p.pid, "state": state,
                                   "node_id": node.node_id if node else 0,
                                   "targets": list(node.target_ids) if node else []})
        out["groups"] = len(cmap.groups)
        out["map_version"] = cmap.version
        # Full targets (under their daemon's min_free): still read, no new writes.
        out["read_only_targets"] = [{"id": t.target_id, "path": t.path, "free": t.free}
                                    for t in cmap.targets if t.state == pb.TARGET_STATE_READ_ONLY]
        out["targets"] = len(cmap.targets)
        return out

    async def wait_healthy(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until one meta replica leads and every storage node is online."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | str = "no answer yet"
        while time.monotonic() < deadline:
            try:
                h = await self.health(deadline=max(1.0, min(5.0, deadline - time.monotonic())))
                if any(m["role"] == "leader" for m in h["meta"]) and all(
                    s["state"] == "online" for s in h["storage"]
                ):
                    return h
                last = h
            except TierFSError as exc:
                last = str(exc)
            await asyncio.sleep(0.2)
        raise UnavailableError(f"cluster in {self.dir} not healthy after {timeout:.0f}s: {last}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierfs.local up|down|status --data DIR``: the same as ``tierfs up|down|status``."""
    from tierfs.cli.main import run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
