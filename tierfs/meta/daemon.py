"""``tierfs-meta``: one replica of the metadata service.

Starts the Raft replicator (:mod:`tierfs.meta.raft`) and a grpc.aio server
carrying ``MetaService`` (:mod:`tierfs.meta.service`; its replica RPCs
GetStatus, Digest, ForceSnapshot, AddMetaMember and RemoveMetaMember work
whatever the state machine). With ``--state-machine kv`` the replica runs
:class:`KVStateMachine`, a toy key-value state machine for the Raft tests and
the benchmark, and also serves its test-only ``KVDebug`` service
(proto/tierfs/v1/kv_debug.proto). Optionally serves Prometheus metrics. Logs
are one JSON object per line on stderr; the first line on stdout is
``{"event": "ready", ...}`` with the bound addresses. SIGTERM or SIGINT stop
it cleanly (journal synced, snapshot not required).

Example::

    tierfs-meta --raft-addr 127.0.0.1:7101 --grpc-addr 127.0.0.1:7001 \\
        --peer 127.0.0.1:7102=127.0.0.1:7002 --peer 127.0.0.1:7103=127.0.0.1:7003 \\
        --data-dir /var/lib/tierfs/meta1 --cluster-secret-file /etc/tierfs/cluster.secret

Every replica of a cluster reads the same secret file; without one the
daemon refuses to start unless ``--insecure-no-cluster-secret`` is given
(docs/raft.md, "Authenticated frames").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tierfs.config import load
from tierfs.errors import ErrorCode, TierFSError, error_from_code, grpc_errors
from tierfs.fsutil import lock_dir
from tierfs.meta.auth import Authenticator
from tierfs.meta.config import MetaConfig, split_addr
from tierfs.meta.interfaces import Replicator, StateMachine
from tierfs.meta.raft import RaftReplicator, RaftTimings
from tierfs.meta.service import MAX_REQUEST_BYTES, add_meta_service
from tierfs.meta.state import MetaStateMachine
from tierfs.proto.v1 import kv_debug_pb2 as kvpb
from tierfs.proto.v1 import kv_debug_pb2_grpc
from tierfs.tls import TlsFiles

__all__ = ["KVDebugServicer", "KVStateMachine", "build_parser", "main", "serve"]

log = logging.getLogger("tierfs.meta")

Ctx = grpc.aio.ServicerContext[Any, Any]


class KVStateMachine:
    """A toy deterministic state machine: ops are serialized
    :class:`tierfs.v1.KVOp` (put or delete one key), results
    :class:`tierfs.v1.KVResult`. Used by the test cluster and the benchmark
    to exercise Raft without the namespace. Snapshots are canonical JSON."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.ops_applied = 0

    def apply(self, op: bytes) -> bytes:
        self.ops_applied += 1
        try:
            req = kvpb.KVOp.FromString(op)
        except DecodeError as exc:
            # Part of the result, not raised: every replica records the same outcome.
            res = kvpb.KVResult()
            res.error.code = ErrorCode.ERROR_CODE_INVALID_ARGUMENT
            res.error.message = f"bad kv op: {exc}"
            return res.SerializeToString()
        prev = self.data.pop(req.key, None) if req.delete else self.data.get(req.key)
        if not req.delete:
            self.data[req.key] = req.value
        return kvpb.KVResult(existed=prev is not None, previous=prev or "").SerializeToString()

    def snapshot(self) -> bytes:
        return json.dumps({"data": self.data, "ops": self.ops_applied}, sort_keys=True).encode()

    def restore(self, data: bytes) -> None:
        doc = json.loads(data)
        self.data = dict(doc["data"])
        self.ops_applied = int(doc["ops"])

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.data, sort_keys=True).encode()).hexdigest()


class KVDebugServicer(kv_debug_pb2_grpc.KVDebugServicer):
    """``KVDebug`` (tests and benchmark only) over a replicator of a :class:`KVStateMachine`."""

    def __init__(self, replicator: Replicator, submit_timeout: float) -> None:
        if not isinstance(replicator.state_machine, KVStateMachine):
            raise TypeError("KVDebug needs a replicator of a KVStateMachine")
        self._r = replicator
        self._sm: KVStateMachine = replicator.state_machine
        self._timeout = submit_timeout

    @grpc_errors
    async def Put(self, request: kvpb.KVPutRequest, context: Ctx) -> kvpb.KVPutReply:
        op = kvpb.KVOp(key=request.key, value=request.value)
        res = kvpb.KVResult.FromString(await self._r.submit(op.SerializeToString(), self._timeout))
        if res.error.code:
            raise error_from_code(res.error.code, res.error.message, leader=res.error.leader)
        return kvpb.KVPutReply(existed=res.existed, previous=res.previous,
                               applied_index=self._r.status().applied_index)

    @grpc_errors
    async def Get(self, request: kvpb.KVGetRequest, context: Ctx) -> kvpb.KVGetReply:
        if not request.stale:
            await self._r.read_barrier(self._timeout)
        data = self._sm.data
        return kvpb.KVGetReply(values=[
            kvpb.KVValue(key=k, present=k in data, value=data.get(k, "")) for k in request.keys
        ])


# --- logging ---------------------------------------------------------------------------


class _JsonFormatter(logging.Formatter):
    def __init__(self, node: str) -> None:
        super().__init__()
        self._node = node

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6), "level": record.levelname.lower(),
            "logger": record.name, "node": self._node, "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def _setup_logging(cfg: MetaConfig, node: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if cfg.log_format == "json":
        handler.setFormatter(_JsonFormatter(node))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {node} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.log_level.upper())


# --- serve ---------------------------------------------------------------------------------


def _wall_clock() -> Callable[[], int]:
    """The wall clock; tests fake a replica's clock running ahead or behind
    with TIERFS_TEST_CLOCK_OFFSET (seconds, may be negative)."""
    offset = int(float(os.environ.get("TIERFS_TEST_CLOCK_OFFSET", "0") or 0) * 1e9)
    if not offset:
        return time.time_ns
    log.warning("TIERFS_TEST_CLOCK_OFFSET: this replica's wall clock is off by %.0f s (tests only)", offset / 1e9)
    return lambda: time.time_ns() + offset


def _make_state_machine(cfg: MetaConfig) -> StateMachine:
    if cfg.state_machine == "kv":
        return KVStateMachine()
    return MetaStateMachine()


async def serve(cfg: MetaConfig, stop: asyncio.Event | None = None) -> None:
    """Run one replica until ``stop`` is set (or SIGTERM/SIGINT)."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    secrets = cfg.cluster_secrets()
    secret, accepted = (secrets[0], secrets[1:]) if secrets else (None, [])
    cfg.check_auth(secret)
    if accepted:
        log.warning("cluster secret rotation under way: %d more secret(s) accepted besides the current one "
                    "(docs/security.md, 'Rotating the cluster secret')", len(accepted))
    if not cfg.auth:
        log.warning("authentication is OFF (--insecure-no-auth): every caller is anonymous root with admin rights")
    # One replica per data_dir: a second one opened the same journal.
    dir_lock = lock_dir(cfg.data_dir, "meta replica")
    try:
        await _serve_locked(cfg, stop, secret, accepted)
    finally:
        os.close(dir_lock)


async def _serve_locked(cfg: MetaConfig, stop: asyncio.Event, secret: Any, accepted: Any) -> None:
    sm = _make_state_machine(cfg)
    rep = RaftReplicator(
        sm,
        raft_addr=cfg.raft_addr,
        raft_bind_addr=cfg.raft_bind_addr,
        grpc_addr=cfg.grpc_addr,
        peers=cfg.peer_map(),
        data_dir=cfg.data_dir,
        timings=RaftTimings(
            heartbeat=cfg.heartbeat_interval, election_min=cfg.election_timeout_min,
            election_max=cfg.election_timeout_max, connection_timeout=cfg.connection_timeout,
            connection_retry=cfg.connection_retry, step_down=cfg.leader_step_down,
            leader_lost=cfg.leader_lost_election, pre_vote=cfg.pre_vote,
        ),
        snapshot_min_entries=cfg.snapshot_min_entries,
        snapshot_min_interval=cfg.snapshot_min_interval,
        fsync=cfg.fsync,
        node_id=cfg.node_id,
        exit_on_fatal=True,
        cluster_secret=secret, accepted_secrets=accepted,
        journal_recovery=cfg.journal_recovery,
    )
    tls = TlsFiles.from_config(cfg)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
    svc = add_meta_service(
        server, rep, heartbeat_timeout=cfg.heartbeat_timeout, lease_duration=cfg.lease_duration,
        kv_lease=cfg.kv_lease,
        tick_interval=cfg.tick_interval, submit_timeout=cfg.submit_timeout, replace_after=cfg.replace_after,
        gc_grace=cfg.gc_grace, purge_grace=cfg.purge_grace, root_squash=cfg.root_squash, cluster_secret=secret, accepted_secrets=accepted,
        cap_key_rotation=cfg.cap_key_rotation, file_cap_ttl=cfg.file_cap_ttl, kv_cap_ttl=cfg.kv_cap_ttl,
        rebalance=cfg.rebalance, rebalance_interval=cfg.rebalance_interval,
        rebalance_max_moving=cfg.rebalance_max_moving, rebalance_write_defer=cfg.rebalance_write_defer,
        rebalance_redirect_after=cfg.rebalance_redirect_after,
        kv_default_pool=cfg.kv_default_pool_request() if cfg.kv_default_pool else None,
        clock=_wall_clock(), monotonic=time.monotonic_ns,
        auth=Authenticator(secret, accepted) if cfg.auth and secret is not None else None,
        forward=cfg.forward_to_leader, peer_tls=tls.client_side() if tls is not None else None,
    )
    rep.export_metrics()
    # The namespace's periodic tick only makes sense for the namespace.
    ticking = cfg.state_machine == "meta"
    if isinstance(sm, KVStateMachine):
        kv_debug_pb2_grpc.add_KVDebugServicer_to_server(KVDebugServicer(rep, cfg.submit_timeout), server)
    host, _ = split_addr(cfg.grpc_addr, "grpc_addr")
    try:
        if tls is None:
            port = server.add_insecure_port(cfg.grpc_addr)
        else:
            port = server.add_secure_port(cfg.grpc_addr, tls.grpc_server_credentials())
    except RuntimeError:  # grpc's "Failed to bind to address ...": a traceback until stop 47
        port = 0
    if port == 0:
        raise OSError(f"cannot bind gRPC address {cfg.grpc_addr}: in use (is this replica running already?) "
                      f"or not an address of this host")
    rep.grpc_addr = cfg.advertise_grpc_addr or f"{host}:{port}"
    await rep.start()
    await server.start()
    if ticking:
        await svc.start()
    metrics = ""
    metrics_server: Any = None
    if cfg.metrics_addr:
        from prometheus_client import start_http_server

        mhost, mport = split_addr(cfg.metrics_addr, "metrics_addr")
        metrics_server, _thread = start_http_server(mport, addr=mhost)
        metrics = f"{mhost}:{metrics_server.server_port}"
    ready = {"event": "ready", "node": rep.node_id, "raft": cfg.raft_addr, "grpc": rep.grpc_addr,
             "metrics": metrics, "pid": os.getpid(), "data_dir": str(cfg.data_dir),
             "tls": "off" if tls is None else ("mutual" if tls.require_client_cert else "server")}
    print(json.dumps(ready), flush=True)
    log.info("tierfs-meta ready: raft %s grpc %s (tls %s) metrics %s", cfg.raft_addr, rep.grpc_addr,
             ready["tls"], metrics or "off")
    try:
        await stop.wait()
    finally:
        log.info("tierfs-meta stopping")
        t0 = time.monotonic()
        await svc.stop()
        await server.stop(1.0)
        await svc.close_peers()
        await rep.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        log.info("tierfs-meta stopped in %.2fs", time.monotonic() - t0)


def build_parser() -> argparse.ArgumentParser:
    """One flag per MetaConfig field (help text from the field docs)."""
    docs = MetaConfig.docs()
    p = argparse.ArgumentParser(
        prog="tierfs-meta", description="Run one TierFS metadata replica (see docs/raft.md).",
        epilog="Precedence: flags > TIERFS_META_<FIELD> environment > --config TOML [meta] > defaults.",
    )
    p.add_argument("--config", help="TOML file with a [meta] table")
    p.add_argument("--peer", action="append", dest="peers", metavar="RAFT[=GRPC]", help=docs["peers"])
    p.add_argument("--fsync", dest="fsync", action="store_const", const="true", help=docs["fsync"])
    p.add_argument("--no-fsync", dest="fsync", action="store_const", const="false")
    p.add_argument("--state-machine", choices=["meta", "kv"], help=docs["state_machine"])
    p.add_argument("--log-format", choices=["json", "text"], help=docs["log_format"])
    p.add_argument("--insecure-no-cluster-secret", dest="insecure_no_cluster_secret", action="store_const",
                   const="true", help=docs["insecure_no_cluster_secret"])
    p.add_argument("--insecure-no-auth", dest="auth", action="store_const", const="false",
                   help="authenticate no meta RPC: every caller is anonymous root with admin rights "
                        "(for tests only; config: auth = false)")
    p.add_argument("--auth", dest="auth", action="store_const", const="true", help=argparse.SUPPRESS)
    for name, doc in docs.items():
        if name in ("peers", "fsync", "state_machine", "log_format", "insecure_no_cluster_secret", "auth"):
            continue
        p.add_argument("--" + name.replace("_", "-"), dest=name, help=doc.replace("%", "%%"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    try:
        cfg: MetaConfig = load(MetaConfig, args.config, overrides=overrides)
        cfg.check_auth(cfg.cluster_secret())  # refuse to start without one, before anything binds
        TlsFiles.from_config(cfg)  # and with unreadable TLS files
    except TierFSError as err:
        print(f"tierfs-meta: {err}", file=sys.stderr)
        return 2
    _setup_logging(cfg, cfg.node_id or cfg.raft_addr)
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        log.critical("tierfs-meta: %s", exc)
        return 1
    except TierFSError as err:  # its data_dir in use by another replica
        log.critical("tierfs-meta: %s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
