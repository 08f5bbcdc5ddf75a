"""``tierfs-meta``: one replica of the metadata service.

Starts the Raft replicator (:mod:`tierfs.meta.raft`) and a grpc.aio server
carrying the metadata API (``MetaService`` from :mod:`tierfs.meta.service`)
and a small JSON admin/debug service ``tierfs.meta.RaftAdmin`` (status,
digest, snapshot, membership; plus put/get on the toy ``kv`` state machine
used by the test cluster and the benchmark). Optionally serves Prometheus
metrics. Logs are one JSON object per line on stderr; the first line on
stdout is ``{"event": "ready", ...}`` with the bound addresses. SIGTERM or
SIGINT stop it cleanly (journal synced, snapshot not required).

Example::

    tierfs-meta --raft-addr 127.0.0.1:7101 --grpc-addr 127.0.0.1:7001 \\
        --peer 127.0.0.1:7102=127.0.0.1:7002 --peer 127.0.0.1:7103=127.0.0.1:7003 \\
        --data-dir /var/lib/tierfs/meta1
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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from tierfs.config import load
from tierfs.errors import InvalidArgumentError, TierFSError, error_from_code
from tierfs.meta.config import MetaConfig, split_addr
from tierfs.meta.interfaces import StateMachine
from tierfs.meta.raft import RaftReplicator, RaftTimings

__all__ = ["ADMIN_SERVICE", "KVStateMachine", "build_parser", "main", "serve"]

log = logging.getLogger("tierfs.meta")

ADMIN_SERVICE = "tierfs.meta.RaftAdmin"


class KVStateMachine:
    """A toy deterministic state machine: ops are JSON ``{"k":..,"v":..}``
    (put) or ``{"k":..,"del":true}``. Used by the test cluster and the
    benchmark to exercise Raft without the namespace."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.ops = 0

    def apply(self, op: bytes) -> bytes:
        self.ops += 1
        try:
            req = json.loads(op)
            key = str(req["k"])
        except (ValueError, KeyError, TypeError) as exc:
            return json.dumps({"error": f"bad op: {exc}"}).encode()
        if req.get("del"):
            existed = self.data.pop(key, None) is not None
            return json.dumps({"deleted": existed}).encode()
        prev = self.data.get(key)
        self.data[key] = str(req.get("v", ""))
        return json.dumps({"prev": prev}).encode()

    def snapshot(self) -> bytes:
        return json.dumps({"data": self.data, "ops": self.ops}, sort_keys=True).encode()

    def restore(self, data: bytes) -> None:
        doc = json.loads(data)
        self.data = dict(doc["data"])
        self.ops = int(doc["ops"])

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.data, sort_keys=True).encode()).hexdigest()


# --- the JSON admin service ------------------------------------------------------

_Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _admin_handlers(rep: RaftReplicator, cfg: MetaConfig) -> dict[str, _Handler]:
    sm = rep.state_machine

    async def status(req: dict[str, Any]) -> dict[str, Any]:
        st = rep.status()
        j = rep.journal
        return {
            "id": st.id, "role": st.role, "leader": st.leader, "term": st.term,
            "commit_index": st.commit_index, "applied_index": st.applied_index,
            "members": st.members, "raft_members": rep.raft_members(), "addr_map": rep.addr_map(),
            "raft_addr": rep.raft_addr, "grpc_addr": rep.grpc_addr, "ready": rep.is_ready(),
            "log_len": len(j), "journal_syncs": j.syncs, "snapshots": rep.snapshots_written,
            "fatal": rep.fatal, "pid": os.getpid(),
            "truncation": dict(rep.truncation_stats),
        }

    async def digest(req: dict[str, Any]) -> dict[str, Any]:
        return {"digest": sm.digest(), "applied_index": rep.status().applied_index}

    async def snapshot(req: dict[str, Any]) -> dict[str, Any]:
        rep.force_snapshot()
        return {}

    async def add_member(req: dict[str, Any]) -> dict[str, Any]:
        await rep.add_member(str(req["raft_addr"]), str(req.get("grpc_addr", "")), cfg.submit_timeout * 2)
        return {}

    async def remove_member(req: dict[str, Any]) -> dict[str, Any]:
        await rep.remove_member(str(req["raft_addr"]), str(req.get("grpc_addr", "")), cfg.submit_timeout * 2)
        return {}

    async def put(req: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(sm, KVStateMachine):
            raise InvalidArgumentError("put is only available with state_machine = 'kv'")
        op = json.dumps({"k": req["k"], "v": req.get("v", "")}).encode()
        res = await rep.submit(op, cfg.submit_timeout)
        return {"result": json.loads(res), "index": rep.status().applied_index}

    async def get(req: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(sm, KVStateMachine):
            raise InvalidArgumentError("get is only available with state_machine = 'kv'")
        if not req.get("stale"):
            await rep.read_barrier(cfg.submit_timeout)
        keys = req.get("keys")
        if keys is None:
            return {"value": sm.data.get(str(req["k"]))}
        return {"values": {k: sm.data.get(k) for k in keys}}

    return {
        "Status": status, "Digest": digest, "Snapshot": snapshot, "AddMember": add_member,
        "RemoveMember": remove_member, "Put": put, "Get": get,
    }


def _admin_service(handlers: dict[str, _Handler]) -> grpc.GenericRpcHandler:  # type: ignore[type-arg,unused-ignore]
    def wrap(fn: _Handler) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]:
        async def call(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            try:
                req = json.loads(request or b"{}")
                return json.dumps(await fn(req)).encode()
            except TierFSError as err:
                leader = getattr(err, "leader", "")
                return json.dumps({"error": {"code": int(err.code), "message": err.message,
                                             "leader": leader}}).encode()
            except (KeyError, ValueError, TypeError) as exc:
                err2 = InvalidArgumentError(f"bad request: {exc!r}")
                return json.dumps({"error": {"code": int(err2.code), "message": err2.message}}).encode()

        return call

    methods = {
        name: grpc.unary_unary_rpc_method_handler(wrap(fn)) for name, fn in handlers.items()
    }
    return grpc.method_handlers_generic_handler(ADMIN_SERVICE, methods)


def admin_error(reply: dict[str, Any]) -> TierFSError | None:
    """The TierFSError carried by an admin reply, if any (client side)."""
    err = reply.get("error")
    if not err:
        return None
    return error_from_code(int(err["code"]), str(err["message"]), leader=str(err.get("leader", "")))


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


def _make_state_machine(cfg: MetaConfig) -> StateMachine:
    if cfg.state_machine == "kv":
        return KVStateMachine()
    from tierfs.meta.state import MetaStateMachine  # type: ignore[import-not-found,unused-ignore]

    sm: StateMachine = MetaStateMachine()
    return sm


async def serve(cfg: MetaConfig, stop: asyncio.Event | None = None) -> None:
    """Run one replica until ``stop`` is set (or SIGTERM/SIGINT)."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    sm = _make_state_machine(cfg)
    rep = RaftReplicator(
        sm,
        raft_addr=cfg.raft_addr,
        grpc_addr=cfg.grpc_addr,
        peers=cfg.peer_map(),
        data_dir=cfg.data_dir,
        timings=RaftTimings(
            heartbeat=cfg.heartbeat_interval, election_min=cfg.election_timeout_min,
            election_max=cfg.election_timeout_max, connection_timeout=cfg.connection_timeout,
            connection_retry=cfg.connection_retry, step_down=cfg.leader_step_down,
        ),
        snapshot_min_entries=cfg.snapshot_min_entries,
        snapshot_min_interval=cfg.snapshot_min_interval,
        fsync=cfg.fsync,
        node_id=cfg.node_id,
        exit_on_fatal=True,
    )
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    svc: Any = None
    if cfg.state_machine == "meta":
        from tierfs.meta.service import add_meta_service  # type: ignore[import-not-found,unused-ignore]

        svc = add_meta_service(
            server, rep, heartbeat_timeout=cfg.heartbeat_timeout, lease_duration=cfg.lease_duration,
            tick_interval=cfg.tick_interval, submit_timeout=cfg.submit_timeout,
        )
    server.add_generic_rpc_handlers((_admin_service(_admin_handlers(rep, cfg)),))
    host, _ = split_addr(cfg.grpc_addr, "grpc_addr")
    port = server.add_insecure_port(cfg.grpc_addr)
    if port == 0:
        raise OSError(f"cannot bind gRPC address {cfg.grpc_addr}")
    rep.grpc_addr = f"{host}:{port}"
    await rep.start()
    await server.start()
    if svc is not None:
        await svc.start()
    metrics = ""
    metrics_server: Any = None
    if cfg.metrics_addr:
        from prometheus_client import start_http_server

        mhost, mport = split_addr(cfg.metrics_addr, "metrics_addr")
        metrics_server, _thread = start_http_server(mport, addr=mhost)
        metrics = f"{mhost}:{metrics_server.server_port}"
    ready = {"event": "ready", "node": rep.node_id, "raft": cfg.raft_addr, "grpc": rep.grpc_addr,
             "metrics": metrics, "pid": os.getpid(), "data_dir": str(cfg.data_dir)}
    print(json.dumps(ready), flush=True)
    log.info("tierfs-meta ready: raft %s grpc %s metrics %s", cfg.raft_addr, rep.grpc_addr, metrics or "off")
    try:
        await stop.wait()
    finally:
        log.info("tierfs-meta stopping")
        t0 = time.monotonic()
        if svc is not None:
            await svc.stop()
        await server.stop(1.0)
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
    for name, doc in docs.items():
        if name in ("peers", "fsync", "state_machine", "log_format"):
            continue
        p.add_argument("--" + name.replace("_", "-"), dest=name, help=doc.replace("%", "%%"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    try:
        cfg: MetaConfig = load(MetaConfig, args.config, overrides=overrides)
    except TierFSError as err:
        print(f"tierfs-meta: {err}", file=sys.stderr)
        return 2
    _setup_logging(cfg, cfg.node_id or cfg.raft_addr)
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:
        log.critical("tierfs-meta: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
