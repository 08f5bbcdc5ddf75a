"""A real ``tierfs-meta`` cluster for tests: processes on loopback.

``MetaCluster(tmp_path, n=3)`` starts ``n`` replicas (``python -m
tierfs.meta.daemon``) on free loopback ports, each with its own data dir
under ``tmp_path``; ``start/stop/kill/restart(i)`` act on replica ``i``
(``kill`` is SIGKILL); ``leader()``/``wait_leader()`` find the leader;
``addresses`` are the gRPC addresses; ``digests()`` asks every live replica
for its state digest. Replica calls go through the generated stubs: status,
digest, snapshot and membership through ``MetaService`` (every replica serves
them), put/get on the toy ``kv`` state machine through ``KVDebug``
(proto/tierfs/v1/kv_debug.proto).

If ``TIERFS_TEST_META=host:port,...`` is set, :func:`meta_cluster_from_env`
returns a cluster bound to that deployment instead: nothing is started, and
anything that needs to stop or kill a replica skips the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from tierfs.errors import NotLeaderError, TierFSError, TimeoutError_, UnavailableError, from_grpc
from tierfs.local import free_ports
from tierfs.meta.auth import AUTH_KEY
from tierfs.meta.secret import SECRET_FILE_NAME, ensure_secret_file, load_secret
from tierfs.proto.v1 import kv_debug_pb2 as kvpb
from tierfs.proto.v1 import kv_debug_pb2_grpc, meta_pb2_grpc
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.security import admin_token, node_key, write_private_file

__all__ = [
    "MetaCluster",
    "Replica",
    "auth_channel",
    "free_ports",
    "kv_get",
    "kv_put",
    "meta_cluster_from_env",
    "replica_call",
    "replica_status",
    "session_credentials",
    "wait_for",
]

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_for(cond: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``cond`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            v = cond()
            if v:
                return v
        except (TierFSError, grpc.RpcError, OSError) as exc:
            last_exc = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what} (last error: {last_exc!r})")
        time.sleep(interval)


_CRED_DIR_ENV = "TIERFS_TEST_CREDENTIALS"


def session_credentials() -> Path:
    """The session's credentials directory (made once, shared with every
    subprocess through the environment): ``cluster.secret``,
    ``admin.token`` and ``node.key``. Exports TIERFS_TOKEN (the admin token),
    TIERFS_STORAGE_NODE_KEY_FILE and TIERFS_CLUSTER_SECRET_FILE (adopted by
    new LocalClusters). Idempotent; a pytest-xdist worker or a nested run
    reuses what its parent made."""
    d = os.environ.get(_CRED_DIR_ENV)
    if d and (Path(d) / SECRET_FILE_NAME).exists():
        path = Path(d)
    else:
        import atexit
        import shutil
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="tierfs-test-creds-"))
        os.environ[_CRED_DIR_ENV] = str(path)
        atexit.register(shutil.rmtree, path, True)  # the process that made it cleans it up
    secret = load_secret(ensure_secret_file(path / SECRET_FILE_NAME))
    write_private_file(path / "admin.token", admin_token(secret) + "\n")
    write_private_file(path / "node.key", node_key(secret) + "\n")
    os.environ["TIERFS_TOKEN"] = admin_token(secret)
    os.environ["TIERFS_STORAGE_NODE_KEY_FILE"] = str(path / "node.key")
    os.environ["TIERFS_CLUSTER_SECRET_FILE"] = str(path / SECRET_FILE_NAME)
    return path


class _Bearer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._md = (AUTH_KEY, f"Bearer {token}")

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        md = [*(details.metadata or ()), self._md]
        return continuation(details._replace(metadata=md), request)


def auth_channel(addr: str, token: str | None = None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel to ``addr`` whose every call carries ``token``
    (default: $TIERFS_TOKEN, the session's admin token)."""
    ch = grpc.insecure_channel(addr, options=list(options))
    tok = os.environ.get("TIERFS_TOKEN", "") if token is None else token
    return grpc.intercept_channel(ch, _Bearer(tok)) if tok else ch


def replica_call(addr: str, call: Callable[[grpc.Channel], T], token: str | None = None) -> T:
    """Run ``call`` with a channel to one replica (no retries, no leader
    following; ``token``, default the session's admin token); a failed RPC
    raises its TierFSError."""
    with auth_channel(addr, token) as ch:
        try:
            return call(ch)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from None


def replica_status(addr: str, timeout: float = 5.0, token: str | None = None) -> pb.GetStatusReply:
    """``MetaService.GetStatus`` of one replica (``.raft`` holds the Raft internals)."""
    return replica_call(addr, lambda ch: meta_pb2_grpc.MetaServiceStub(ch).GetStatus(pb.Empty(), timeout=timeout),
                        token)


def kv_put(addr: str, key: str, value: str, timeout: float = 5.0) -> kvpb.KVPutReply:
    """``KVDebug.Put`` on one replica (NotLeaderError on a follower)."""
    req = kvpb.KVPutRequest(key=key, value=value)
    return replica_call(addr, lambda ch: kv_debug_pb2_grpc.KVDebugStub(ch).Put(req, timeout=timeout))


def kv_get(addr: str, keys: Sequence[str], *, stale: bool = False, timeout: float = 5.0) -> dict[str, str | None]:
    """``KVDebug.Get`` on one replica: key -> value (None if absent).
    Linearizable (leader only) unless ``stale``."""
    req = kvpb.KVGetRequest(keys=list(keys), stale=stale)
    reply = replica_call(addr, lambda ch: kv_debug_pb2_grpc.KVDebugStub(ch).Get(req, timeout=timeout))
    return {v.key: (v.value if v.present else None) for v in reply.values}


@dataclass
class Replica:
    index: int
    raft_addr: str
    grpc_addr: str
    data_dir: Path
    peers: list[str]
    extra_args: list[str] = field(default_factory=list)
    #: extra environment of this replica's process (e.g. TIERFS_TEST_CLOCK_OFFSET)
    env: dict[str, str] = field(default_factory=dict)
    #: the token calls to this replica carry (None: the session's admin
    #: token); a replica started with another secret needs its own
    token: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    _log_file: Any = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class MetaCluster:
    """Real meta replicas on loopback (see the module docstring)."""

    def __init__(
        self,
        tmp_path: Path | None,
        n: int = 3,
        *,
        state_machine: str = "kv",
        extra_args: Sequence[str] = (),
        external: Sequence[str] = (),
        data_root: Path | None = None,
        start: bool = True,
        peer_grpc: bool = True,
        cluster_secret: bool = True,
        gc_grace: float | None = None,
    ) -> None:
        """``peer_grpc=False`` gives replicas only their peers' raft
        addresses: the leader's gRPC address then comes from the log.
        ``cluster_secret=False`` runs them with ``--insecure-no-cluster-secret``.
        ``gc_grace``: ``--gc-grace`` of every replica (None: its default)."""
        self.state_machine = state_machine
        self.cluster_secret = cluster_secret
        self.extra_args = list(extra_args) + ([f"--gc-grace={gc_grace}"] if gc_grace is not None else [])
        self.external = list(external)
        self.replicas: list[Replica] = []
        self.failover_times: list[float] = []
        if self.external:
            return
        assert tmp_path is not None
        self.root = Path(tmp_path)
        self.data_root = data_root or self.root
        self.root.mkdir(parents=True, exist_ok=True)
        #: the cluster secret every replica is started with (a replica's own
        #: ``--cluster-secret-file`` in its extra_args wins: argparse keeps the
        #: last): the session's, so that TIERFS_TOKEN is its admin token
        self.secret_file = write_private_file(
            self.root / SECRET_FILE_NAME, load_secret(session_credentials() / SECRET_FILE_NAME).decode() + "\n",
            overwrite=True)
        ports = free_ports(2 * n)
        rafts = [f"127.0.0.1:{p}" for p in ports[:n]]
        grpcs = [f"127.0.0.1:{p}" for p in ports[n:]]
        for i in range(n):
            peers = [f"{rafts[j]}={grpcs[j]}" if peer_grpc else rafts[j] for j in range(n) if j != i]
            self.replicas.append(Replica(i, rafts[i], grpcs[i], self.data_root / f"meta{i}", peers))
        if start:
            try:
                for i in range(n):
                    self.start(i)
            except BaseException:
                self.close()  # never leave the replicas that did start running
                raise

    # --- processes ---------------------------------------------------------------

    @property
    def can_kill(self) -> bool:
        return not self.external

    def _need_local(self) -> None:
        if self.external:
            pytest.skip("needs local replica processes (TIERFS_TEST_META points at a deployment)")

    @property
    def addresses(self) -> list[str]:
        """gRPC addresses of every replica (live or not)."""
        if self.external:
            return list(self.external)
        return [r.grpc_addr for r in self.replicas]

    def live(self) -> list[int]:
        if self.external:
            return list(range(len(self.external)))
        return [r.index for r in self.replicas if r.alive]

    def command(self, r: Replica) -> list[str]:
        cmd = [
            sys.executable, "-m", "tierfs.meta.daemon",
            "--raft-addr", r.raft_addr, "--grpc-addr", r.grpc_addr,
            "--data-dir", str(r.data_dir), "--node-id", f"meta{r.index}",
            "--state-machine", self.state_machine, "--log-format", "text",
            *(["--cluster-secret-file", str(self.secret_file)] if self.cluster_secret
              else ["--insecure-no-cluster-secret", "--insecure-no-auth"]),
        ]
        for p in r.peers:
            cmd += ["--peer", p]
        return cmd + self.extra_args + r.extra_args

    def start(self, i: int, timeout: float = 30.0) -> None:
        """Start replica ``i`` and wait until its gRPC server answers."""
        self._need_local()
        r = self.replicas[i]
        assert not r.alive, f"replica {i} already running"
        self.root.mkdir(parents=True, exist_ok=True)
        r.log_path = self.root / f"meta{i}.log"
        r._log_file = open(r.log_path, "ab")  # noqa: SIM115 - closed in _reap
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.pop("TIERFS_TEST_META", None)
        env.update(r.env)
        r.proc = subprocess.Popen(
            self.command(r), stdout=subprocess.DEVNULL, stderr=r._log_file, env=env, cwd=str(REPO),
        )
        wait_for(lambda: self._answers(r), timeout, f"replica {i} to start (log {r.log_path})")

    def _answers(self, r: Replica) -> bool:
        if r.proc is not None and r.proc.poll() is not None:
            raise AssertionError(f"replica {r.index} exited with {r.proc.returncode}; log:\n{self.log(r.index)}")
        replica_status(r.grpc_addr, timeout=1.0, token=r.token)
        return True

    def _reap(self, r: Replica, timeout: float) -> None:
        if r.proc is not None:
            try:
                r.proc.wait(timeout)
            finally:
                r.proc = None
        if r._log_file is not None:
            r._log_file.close()
            r._log_file = None

    def stop(self, i: int, timeout: float = 20.0) -> None:
        """Clean stop (SIGTERM), waiting for exit."""
        self._need_local()
        r = self.replicas[i]
        if r.alive:
            assert r.proc is not None
            r.proc.send_signal(signal.SIGTERM)
        self._reap(r, timeout)

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` (no flush, no goodbye)."""
        self._need_local()
        r = self.replicas[i]
        if r.alive:
            assert r.proc is not None
            r.proc.kill()
        self._reap(r, 10.0)

    def restart(self, i: int, *, hard: bool = False) -> None:
        (self.kill if hard else self.stop)(i)
        self.start(i)

    def add_replica(self) -> int:
        """Start a new replica that knows the current members (not yet added:
        call :meth:`add_member` on the leader next). Returns its index."""
        self._need_local()
        i = len(self.replicas)
        raft_port, grpc_port = free_ports(2)
        peers = [f"{r.raft_addr}={r.grpc_addr}" for r in self.replicas if r.alive]
        r = Replica(i, f"127.0.0.1:{raft_port}", f"127.0.0.1:{grpc_port}", self.data_root / f"meta{i}", peers)
        self.replicas.append(r)
        self.start(i)
        return i

    def log(self, i: int) -> str:
        r = self.replicas[i]
        return r.log_path.read_text(errors="replace") if r.log_path and r.log_path.exists() else ""

    def close(self) -> None:
        if self.external:
            return
        for r in self.replicas:
            if r.alive:
                assert r.proc is not None
                r.proc.kill()
            self._reap(r, 10.0)

    def __enter__(self) -> MetaCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- queries -------------------------------------------------------------------

    def _token(self, i: int) -> str | None:
        return self.replicas[i].token if i < len(self.replicas) else None

    def status(self, i: int) -> pb.GetStatusReply:
        return replica_status(self.addresses[i], timeout=2.0, token=self._token(i))

    def meta_stub_call(self, i: int, call: Callable[[meta_pb2_grpc.MetaServiceStub], T]) -> T:
        """Run ``call`` with a ``MetaService`` stub for replica ``i``."""
        return replica_call(self.addresses[i], lambda ch: call(meta_pb2_grpc.MetaServiceStub(ch)), self._token(i))

    def add_member(self, i: int, new: int, timeout: float = 20.0) -> None:
        """Ask replica ``i`` (the leader) to add replica ``new`` (started by :meth:`add_replica`)."""
        r = self.replicas[new]
        req = pb.MetaMemberRequest(raft_addr=r.raft_addr, grpc_addr=r.grpc_addr)
        self.meta_stub_call(i, lambda s: s.AddMetaMember(req, timeout=timeout))

    def remove_member(self, i: int, gone: int, timeout: float = 20.0) -> None:
        """Ask replica ``i`` (the leader) to remove replica ``gone``."""
        req = pb.MetaMemberRequest(raft_addr=self.replicas[gone].raft_addr)
        self.meta_stub_call(i, lambda s: s.RemoveMetaMember(req, timeout=timeout))

    def force_snapshot(self, i: int) -> None:
        self.meta_stub_call(i, lambda s: s.ForceSnapshot(pb.Empty(), timeout=5.0))

    def leader(self) -> int | None:
        """Index of the replica that says it leads (None if none does)."""
        for i in self.live():
            try:
                if self.status(i).role == "leader":
                    return i
            except TierFSError:
                continue
        return None

    def wait_leader(self, timeout: float = 20.0) -> int:
        return wait_for(lambda: _plus1(self.leader()), timeout, "a leader") - 1

    def digests(self, timeout: float = 5.0) -> dict[int, tuple[str, int]]:
        """replica -> (state digest, applied index), for every live replica
        (``timeout`` per call: a digest serializes the whole state)."""
        out = {}
        for i in self.live():
            d = self.meta_stub_call(i, lambda s: s.Digest(pb.Empty(), timeout=timeout))
            out[i] = (d.digest, d.applied_index)
        return out

    def wait_converged(self, timeout: float = 30.0, members: Sequence[int] | None = None,
                       digest_timeout: float = 5.0) -> str:
        """Wait until every live replica (or ``members``) reports the same
        digest at the same applied index; returns the digest."""

        def check() -> str | None:
            ds = self.digests(digest_timeout)
            if members is not None:
                ds = {i: ds[i] for i in members if i in ds}
                if len(ds) != len(members):
                    return None
            if len(set(ds.values())) == 1:
                return next(iter(ds.values()))[0]
            return None

        return wait_for(check, timeout, "replica digests to converge", interval=0.2)

    # --- kv helpers (state_machine="kv") ---------------------------------------------

    def put(self, key: str, value: str, timeout: float = 15.0) -> float:
        """Put through whichever replica leads, following NotLeader answers;
        returns how long it took (retries through a failover included)."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        target: int | None = None
        while True:
            i = target if target is not None else (self.leader() or 0)
            target = None
            try:
                kv_put(self.addresses[i], key, value, timeout=max(0.5, deadline - time.monotonic()))
                return time.monotonic() - t0
            except NotLeaderError as err:
                if err.leader in self.addresses:
                    target = self.addresses.index(err.leader)
            except (UnavailableError, TierFSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"put {key} not acknowledged within {timeout}s")
            time.sleep(0.02)

    def get(self, key: str, i: int | None = None) -> str | None:
        v = self.get_many([key], i)[key]
        return None if v is None else str(v)

    def get_many(self, keys: Sequence[str], i: int | None = None, *, stale: bool = False,
                 timeout: float = 20.0) -> dict[str, str | None]:
        """Linearizable read on the leader (retried across leader changes),
        or from replica ``i``; ``stale`` reads that replica's local state."""
        deadline = time.monotonic() + timeout
        while True:
            idx = self.wait_leader(max(1.0, deadline - time.monotonic())) if i is None else i
            try:
                return kv_get(self.addresses[idx], keys, stale=stale, timeout=15.0)
            except (NotLeaderError, UnavailableError, TimeoutError_):
                if i is not None or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)


def _plus1(v: int | None) -> int | None:
    return None if v is None else v + 1


def meta_cluster_from_env() -> MetaCluster | None:
    """A cluster bound to ``TIERFS_TEST_META`` (comma-separated gRPC
    addresses of a running deployment), or None when unset."""
    spec = os.environ.get("TIERFS_TEST_META", "").strip()
    if not spec:
        return None
    return MetaCluster(None, external=[a.strip() for a in spec.split(",") if a.strip()])
