"""``tierfs-storage``: one storage node (one chunk engine per target directory).

Startup: load the node identity (``<data_dir>/node.uuid``, created once and
kept across restarts), open every target (wiping half-written temp files and
scanning its index), start the data-plane server, then register the node and
its targets with meta (retried until meta answers; targets whose id is
already known from their ``target.json`` are served meanwhile). Afterwards
loops run: heartbeats with capacity/used/state per target; garbage
collection (``ListGC`` -> delete the fragment generation -> ``AckGC``;
deleting a fragment that is already gone counts as done); the rebuild
worker; the repair-queue worker (``ListRepairs`` -> rebuild ours ->
``MarkFragments``, a round at once after registering and whenever
heartbeats resume after a gap); and the background scrubber.

The first line on stdout is ``{"event": "ready", ...}`` with the data-plane
address, node uuid/id and the target ids. SIGTERM or SIGINT stop it cleanly:
the listener closes, in-flight requests end, engines and the I/O backend are
shut down.

Without meta (``--no-meta`` or no ``meta_addrs``) the node serves its
targets under the ids from their ``target.json``, or from ``--target-id``
(one per target, in order) the first time.

Example::

    tierfs-storage --data-dir /var/lib/tierfs/node1 --target /mnt/nvme0/tierfs \\
        --target /mnt/nvme1/tierfs --meta 10.0.0.1:7000 --meta 10.0.0.2:7000 \\
        --host 0.0.0.0 --advertise-host 10.0.0.11 --port 7200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tierfs.aio import cancel_and_wait
from tierfs.buffers import BufferPool
from tierfs.config import load
from tierfs.errors import (
    ConfigError,
    NotFoundError,
    TierFSError,
    UnauthenticatedError,
    UnavailableError,
)
from tierfs.fsutil import fsync_dir, lock_dir, makedirs_durable
from tierfs.kv.placement import KVPoolRoute, placement
from tierfs.meta.ops import MAX_GC_ACKS
from tierfs.storage.api import FragmentKey
from tierfs.storage.config import StorageConfig
from tierfs.storage.engine import ChunkEngine, TargetState
from tierfs.storage.io import IOBackend, open_backend
from tierfs.storage.kvstore import KVStore
from tierfs.tls import TlsFiles

__all__ = ["StorageNode", "build_parser", "load_node_uuid", "main", "serve"]

log = logging.getLogger("tierfs.storage")

#: Lifetime of the node capability a daemon mints for its own repair reads
#: (re-minted at every heartbeat).
_NODE_CAP_TTL_MS = 300_000
#: The least time between two heartbeats, however often one is asked for.
HEARTBEAT_MIN_GAP = 0.1
#: How long one map watch (GetClusterMap wait) may be held by meta.
MAP_WATCH_WAIT = 2.0


def load_node_uuid(data_dir: Path) -> str:
    """This node's persistent identity, created (durably) on first start."""
    makedirs_durable(data_dir)
    path = data_dir / "node.uuid"
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    if text:
        try:
            return str(uuid.UUID(text))
        except ValueError:
            raise ConfigError(f"{path} does not hold a UUID: {text[:60]!r}", field="data_dir") from None
    node = str(uuid.uuid4())
    tmp = data_dir / "node.uuid.tmp"
    with open(tmp, "w") as f:
        f.write(node + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(data_dir)
    return node


def _state_code(state: str) -> Any:
    from tierfs.proto.v1 import meta_pb2 as pb

    return {
        TargetState.ONLINE: pb.TARGET_STATE_ONLINE,
        TargetState.READ_ONLY: pb.TARGET_STATE_READ_ONLY,
        TargetState.FAILED: pb.TARGET_STATE_FAILED,
    }[state]


class _Collector:
    """Prometheus view of a node: per-target stats and counters, node and
    data-plane counters, buffer-pool usage (read at scrape time)."""

    def __init__(self, node: StorageNode) -> None:
        self.node = node

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        node = self.node
        lbl = ["target"]
        cap = GaugeMetricFamily("tierfs_target_capacity_bytes", "Target file-system capacity minus reserve", labels=lbl)
        used = GaugeMetricFamily("tierfs_target_used_bytes", "Bytes of fragment files", labels=lbl)
        free = GaugeMetricFamily("tierfs_target_free_bytes", "Writable bytes left", labels=lbl)
        frags = GaugeMetricFamily("tierfs_target_fragments", "Fragments stored", labels=lbl)
        up = GaugeMetricFamily("tierfs_target_state", "1 for the target's current state", labels=["target", "state"])
        ops = CounterMetricFamily("tierfs_target_events", "Engine counters", labels=["target", "event"])
        for e in list(node.engines):
            st = e.stats()
            t = str(st.target_id)
            cap.add_metric([t], st.capacity)
            used.add_metric([t], st.used)
            free.add_metric([t], st.free)
            frags.add_metric([t], st.fragments)
            for s in (TargetState.ONLINE, TargetState.READ_ONLY, TargetState.FAILED):
                up.add_metric([t, s], 1.0 if st.state == s else 0.0)
            for k, v in st.counters.items():
                ops.add_metric([t, k], v)
        yield from (cap, used, free, frags, up, ops)
        nc = CounterMetricFamily("tierfs_storage_node_events", "Node counters (heartbeats, GC)", labels=["event"])
        for k, v in node.counters.items():
            nc.add_metric([k], v)
        yield nc
        kvmap = GaugeMetricFamily("tierfs_storage_kv_map_version",
                                  "Cluster-map version the KV placement checks use (-1: no map yet)")
        kvmap.add_metric([], node._kv_map_version)
        yield kvmap
        lease = GaugeMetricFamily("tierfs_storage_kv_lease_seconds",
                                  "KV map lease time left (docs/kv.md, 'Map leases'; -1: meta grants none)")
        lease.add_metric([], -1.0 if node._kv_leases is False else
                         max(0.0, node._kv_lease_until - time.monotonic()))
        yield lease
        pub = GaugeMetricFamily("tierfs_storage_kv_published_version",
                                "The latest map version meta said has taken effect on every leased node")
        pub.add_metric([], node._kv_published)
        yield pub
        if node.server is not None:
            dp = GaugeMetricFamily("tierfs_dataplane", "Data-plane server counters", labels=["counter"])
            counters = dict(node.server.counters)
            for k, v in counters.items():
                dp.add_metric([k], v)
            yield dp
            from tierfs.storage.dataplane import CAP_REFUSALS

            refused = CounterMetricFamily("tierfs_dataplane_cap_refusals",
                                          "Data-plane requests refused for their capability", labels=["reason"])
            for reason in CAP_REFUSALS:
                refused.add_metric([reason], counters.get(f"cap_refused_{reason}", 0))
            yield refused
        for prefix, src in (("tierfs_repair", node.repairer), ("tierfs_scrub", node.scrubber)):
            if src is not None:
                c = CounterMetricFamily(prefix, f"{prefix.split('_')[1].capitalize()} counters", labels=["event"])
                for k, v in src.counters.items():
                    c.add_metric([k], v)
                yield c
        if node.repairer is not None:
            lbl2 = ["group", "target"]
            done = GaugeMetricFamily("tierfs_rebuild_done_chunks", "Chunks present on a rebuilding target", labels=lbl2)
            total = GaugeMetricFamily("tierfs_rebuild_total_chunks", "Committed chunks of a rebuilding group",
                                      labels=lbl2)
            active = GaugeMetricFamily("tierfs_rebuild_active", "1 while the group is being rebuilt here", labels=lbl2)
            for p in node.repairer.status():
                ls = [str(p.group_id), str(p.target_id)]
                done.add_metric(ls, p.done)
                total.add_metric(ls, p.total)
                active.add_metric(ls, 0.0 if p.state == "finished" else 1.0)
            yield from (done, total, active)
            q = GaugeMetricFamily("tierfs_repair_queue_pending",
                                  "Fragment positions known missing or bad, cluster-wide, as last seen")
            q.add_metric([], node.repairer.queue_pending)
            yield q
        kv_lbl = ["target", "pool"]
        kv_g = {name: GaugeMetricFamily(f"tierfs_kv_{name}", doc, labels=kv_lbl) for name, doc in (
            ("objects", "KV objects stored"), ("memory_used_bytes", "KV bytes held in memory"),
            ("disk_used_bytes", "KV bytes on disk"), ("pinned_bytes", "KV bytes pinned"))}
        kv_c = CounterMetricFamily("tierfs_kv_events", "KV store counters (hits, misses, evictions, ...)",
                                   labels=["target", "pool", "event"])
        for kv in list(node.kvstores):
            for u in kv.usage():
                ls = [str(kv.target_id), u.name]
                kv_g["objects"].add_metric(ls, u.objects)
                kv_g["memory_used_bytes"].add_metric(ls, u.memory_used)
                kv_g["disk_used_bytes"].add_metric(ls, u.disk_used)
                kv_g["pinned_bytes"].add_metric(ls, u.pinned_bytes)
                for ev in ("puts", "hits", "misses", "evictions", "expired", "corrupt", "bytes_in", "bytes_out"):
                    kv_c.add_metric([*ls, ev], getattr(u, ev, 0))
        yield from kv_g.values()
        yield kv_c
        ps = node.pool.stats()
        pool = GaugeMetricFamily("tierfs_buffer_pool_bytes", "Aligned buffer pool", labels=["kind"])
        pool.add_metric(["idle"], ps.idle_bytes)
        pool.add_metric(["in_use"], ps.in_use_bytes)
        yield pool


class StorageNode:
    """A running storage node; ``await node.start()``, ``await node.stop()``."""

    def __init__(self, cfg: StorageConfig, *, use_meta: bool = True, target_ids: Sequence[int] = ()) -> None:
        self.cfg = cfg
        self.use_meta = use_meta and bool(cfg.meta_addrs)
        # One daemon per data_dir: its node.uuid is the node's identity, and
        # a second daemon with it took the running node's place in the map.
        self._dir_lock: int | None = lock_dir(cfg.data_dir, "storage daemon")
        try:
            self.node_uuid = load_node_uuid(Path(cfg.data_dir))
        except BaseException:
            self._release_dir()
            raise
        self.node_id = 0
        self.pool = BufferPool(cfg.buffer_pool_bytes, max_total_bytes=cfg.buffer_pool_max_bytes)
        self.backend: IOBackend | None = None
        self.engines: list[ChunkEngine] = []
        #: The KV store of each target (parallel to ``engines``).
        self.kvstores: list[Any] = []
        self._kv_map_version = -1
        self._kv_policy_warned: set[tuple[str, str]] = set()
        self._kv_routes: dict[int, Any] = {}  # pool id -> KVPoolRoute of the last map applied (kv_gate)
        self._kv_gate_task: asyncio.Task[None] | None = None
        self._kv_pool_names: list[str] = []
        self._kv_refresh_lock = asyncio.Lock()
        self._kv_refreshed = 0.0
        # KV map leases (docs/kv.md, "Map leases"): None until meta's first
        # heartbeat answer, False where it grants none (leases off, or a
        # leader of a release before them).
        self._kv_leases: bool | None = None
        self._kv_lease_s = 0.0  # the length meta grants
        self._kv_lease_until = 0.0  # time.monotonic()
        self._kv_published = 0  # the latest map version meta said has taken effect
        self._kv_lease_changed = asyncio.Event()
        self._target_ids = list(target_ids)
        self.server: Any = None
        self.meta: Any = None
        self.metrics_addr = ""
        self._metrics: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.registered = asyncio.Event()
        self.repairer: Any = None
        self.scrubber: Any = None
        self.tls: TlsFiles | None = None
        self.control: Any = None
        self._catchup: asyncio.Task[Any] | None = None
        self._hb_wake = asyncio.Event()
        self._purge_warned: set[int] = set()  # purge ids whose failed delete was logged
        self.counters: dict[str, int] = dict.fromkeys(
            ("heartbeats", "heartbeat_errors", "gc_deleted", "gc_acked", "gc_errors", "purge_deleted",
             "purges_done", "purge_errors", "scrub_passes",
             "scrub_bytes", "catch_ups", "kv_lease_waits", "kv_lease_refusals"), 0
        )

    @property
    def data_addr(self) -> str:
        host = self.cfg.advertise_host or self.cfg.host
        if host in ("0.0.0.0", "::", ""):
            # a wildcard bind is not an address others can dial
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return f"{host}:{self.server.port if self.server else self.cfg.port}"

    async def start(self) -> None:
        from tierfs.net import Limits
        from tierfs.storage.dataplane import start_dataplane

        cfg = self.cfg
        self.backend = open_backend(cfg.io_backend, self.pool, queue_depth=cfg.queue_depth, threads=cfg.io_threads)
        log.info("disk I/O backend: %s", self.backend.name)
        dirs = cfg.target_dirs()
        if self._target_ids and len(self._target_ids) != len(dirs):
            raise ConfigError(f"{len(self._target_ids)} target ids for {len(dirs)} targets", field="target_ids")
        min_free, min_free_fraction = cfg.min_free_limit()
        for i, d in enumerate(dirs):
            tid = self._target_ids[i] if self._target_ids else 0
            eng = ChunkEngine(
                d, tid, self.backend, self.pool,
                reserved_bytes=cfg.reserved_bytes, max_fragment_size=cfg.max_fragment_size,
                min_free=min_free, min_free_fraction=min_free_fraction,
            )
            eng.on_full = self._heartbeat_now
            await eng.open()
            self.engines.append(eng)
            kv = KVStore(eng.root, target_id=tid, pool=self.pool, backend=self.backend)
            await kv.open()
            self.kvstores.append(kv)
            log.info("target %s at %s: %d fragments", eng.target_id, d, len(eng))
        limits = Limits(
            max_frame_bytes=cfg.max_frame_bytes, max_inflight_bytes=cfg.max_inflight_bytes,
            max_inflight_requests=cfg.max_inflight_requests, shm_ring_bytes=cfg.shm_ring_bytes,
        )
        known = {e.target_id: e for e in self.engines if e.target_id}
        known_kv = {e.target_id: kv for e, kv in zip(self.engines, self.kvstores, strict=True) if e.target_id}
        tls = TlsFiles.from_config(cfg)
        self.tls = tls
        self.server = await start_dataplane(known, cfg.host, cfg.port, limits=limits, transports=cfg.transports,
                                            kvstores=known_kv,
                                            tls=tls.server_ssl_context() if tls is not None else None)
        # Until meta's keys arrive every request but PING is refused
        # (Unavailable, retried by clients): never served unchecked.
        self.server.require_capabilities = cfg.require_capabilities and self.use_meta
        if cfg.metrics_addr:
            self._start_metrics(cfg.metrics_addr)
        if self.use_meta:
            from tierfs.meta.client import MetaClient

            # The node key or nothing: a storage daemon never falls back to a
            # client's credential lookup (TIERFS_TOKEN, ./.tierfs).
            from tierfs.security import load_token_file
            from tierfs.storage.control import start_control
            from tierfs.storage.repair import Repairer
            from tierfs.storage.scrub import Scrubber

            node_key = load_token_file(cfg.node_key_file, "node key") if cfg.node_key_file else ""
            # As a client (of meta, of peers in repair) the daemon presents its own certificate.
            dial = tls.client_side() if tls is not None else None
            self.meta = MetaClient(list(cfg.meta_addrs), token=node_key, tls=dial)
            # Repair and scrub need meta (layouts, groups) and the peers.
            self.repairer = Repairer(self.meta, lambda: self.engines, rate=cfg.rebuild_rate,
                                     concurrency=cfg.rebuild_concurrency, poll_interval=cfg.rebuild_interval,
                                     tls=dial.client_ssl_context() if dial is not None else None)
            self.repairer.data.cap_refresher = self._refresh_node_cap
            self.scrubber = Scrubber(self.repairer, orphan_grace=cfg.orphan_grace, node_id=lambda: self.node_id)
            self.control = await start_control(cfg.host, cfg.control_port, self.scrubber, self.repairer,
                                               advertise_host=self.data_addr.rpartition(":")[0],
                                               whoami=self.meta.whoami, tls=tls)
            self._tasks.append(asyncio.create_task(self._meta_main(), name="storage-meta"))
        else:
            missing = [str(e.root) for e in self.engines if not e.target_id]
            if missing:
                raise ConfigError(
                    f"without meta every target needs an id (--target-id); none for {', '.join(missing)}",
                    field="target_ids",
                )
            if cfg.scrub_rate > 0:
                self._tasks.append(asyncio.create_task(self._scrub_loop(), name="storage-scrub"))
            self.registered.set()

    def _start_metrics(self, addr: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        host, _, port = addr.rpartition(":")
        registry = CollectorRegistry()
        registry.register(_Collector(self))  # type: ignore[arg-type]
        server, _thread = start_http_server(int(port), addr=host, registry=registry)
        self._metrics = server
        self.metrics_addr = f"{host}:{server.server_port}"

    def ready_doc(self) -> dict[str, Any]:
        return {
            "event": "ready", "pid": os.getpid(), "node_uuid": self.node_uuid, "node_id": self.node_id,
            "data_addr": self.data_addr, "port": self.server.port,
            "backend": self.backend.name if self.backend else "",
            "targets": {str(e.root): e.target_id for e in self.engines},
            "meta": self.use_meta, "metrics": self.metrics_addr,
            "control": self.control.addr if self.control else "",
            "tls": "off" if self.tls is None else ("mutual" if self.tls.require_client_cert else "server"),
        }

    # -- meta -----------------------------------------------------------------

    async def _meta_main(self) -> None:
        await self._register()
        # Before ready: a restarted node serves its KV pools (and keeps the
        # objects on its disks) from its first request on.
        await self._refresh_kv_pools()
        self.server.on_unknown_kv_pool = self._kv_pool_missing
        self.server.kv_gate = self._kv_gate
        self.server.kv_group = self._kv_group
        self.server.kv_lease_ok = self._kv_lease_ok
        self.server.kv_settle = self._kv_settle
        self.registered.set()
        # The repair queue first thing: a restarted node may hold positions
        # that degraded writes recorded missing while it was away.
        loops = [self._heartbeat_loop(), self._map_watch_loop(), self._gc_loop(), self.repairer.run(),
                 self.repairer.run_queue(self.cfg.repair_interval)]
        if self.cfg.scrub_rate > 0:
            loops.append(self.scrubber.run(self.cfg.scrub_rate, self.cfg.scrub_interval))
        await asyncio.gather(*loops)

    async def _register(self) -> None:
        delay = 0.2
        while True:
            try:
                specs = [(str(e.root.resolve()), e.stats().capacity) for e in self.engines]
                reply = await self.meta.register_node(self.node_uuid, socket.gethostname(), self.data_addr, specs,
                                                      control_addr=self.control.addr if self.control else "",
                                                      rack=self.cfg.rack)
                break
            except TierFSError as err:
                why = str(err)
                if isinstance(err, UnauthenticatedError) and not self.cfg.node_key_file:
                    # meta's own words are for clients (TIERFS_TOKEN, --token-file), which a daemon ignores
                    why = ("no credential: this daemon has no node key; give it the cluster's (--node-key-file, "
                           "node_key_file in [storage] or TIERFS_STORAGE_NODE_KEY_FILE; `python -m "
                           "tierfs.meta.auth SECRET_FILE DIR` derives it)")
                elif isinstance(err, UnauthenticatedError):
                    why = f"{err} (node key from {self.cfg.node_key_file})"
                log.warning("registering with meta failed (%s); retrying in %.1fs", why, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.node_id = int(reply.node_id)
        self._take_cap_keys(reply.cap_keys, first=True)
        by_path = {str(e.root.resolve()): e for e in self.engines}
        for t in reply.targets:
            eng = by_path.get(t.path)
            if eng is None:
                log.warning("meta returned unknown target path %s", t.path)
                continue
            if eng.target_id and eng.target_id != t.target_id:
                self.server.remove_store(eng.target_id)
            eng.set_target_id(int(t.target_id))
            self.server.add_store(eng)
            kv = self.kvstores[self.engines.index(eng)]
            kv.target_id = int(t.target_id)
            self.server.add_kvstore(int(t.target_id), kv)
        log.info("registered with meta as node %d: targets %s", self.node_id,
                 {str(e.root): e.target_id for e in self.engines})

    def _take_cap_keys(self, keys: Any, *, first: bool = False) -> None:
        """Install the capability keys meta sent (epochs e-1, e, e+1) and
        mint this node's own capability for repair reads from its peers."""
        from tierfs.capability import Keyring

        if not keys:
            if first and self.server.require_capabilities:
                # A meta without a cluster secret mints no capabilities:
                # nothing could pass a check.
                log.warning("meta hands out no capability keys (no cluster secret): data-plane capabilities "
                            "are not checked on this node")
                self.server.require_capabilities = False
            return
        ring = Keyring((int(k.epoch), bytes(k.key)) for k in keys)
        old = self.server.keyring
        if old is None or not old.same(ring):
            log.info("capability keys: epochs %d..%d%s", ring.oldest, ring.newest,
                     f" (and {sum(map(len, ring.also.values()))} of secrets being rotated)" if ring.also else "",
                     extra={"event": "storage.cap_keys", "oldest": ring.oldest, "newest": ring.newest})
        self.server.keyring = ring
        self._mint_node_cap()

    def _mint_node_cap(self) -> None:
        """A node capability (read, every inode) for the repairer's data
        client, under the current epoch's key: whoever holds the keys can
        mint anything, which is why they stay on storage nodes."""
        from tierfs import capability as capmod

        ring = self.server.keyring
        if ring is None or self.repairer is None:
            return
        epochs = sorted(ring.keys)
        epoch = epochs[len(epochs) // 2]  # meta sends e-1, e, e+1: the middle one is now
        cap = capmod.mint(ring.keys[epoch], kind=capmod.KIND_NODE, ops=capmod.OP_READ, epoch=epoch,
                          scope=self.node_id, principal=self.node_id,
                          expiry_ms=int(time.time() * 1000) + _NODE_CAP_TTL_MS)
        self.repairer.data.caps.add(capmod.encode(cap))

    async def _refresh_node_cap(self, kind: int, scope: int, op: int) -> None:
        self._mint_node_cap()

    def reports(self) -> list[Any]:
        from tierfs.proto.v1 import meta_pb2 as pb

        out = []
        for e in self.engines:
            if not e.target_id:
                continue  # meta did not accept it: nothing to report against
            st = e.stats()
            out.append(pb.TargetReport(target_id=st.target_id, used=st.used, capacity=st.capacity,
                                       state=_state_code(st.state), free=st.free))
        return out

    def kv_reports(self) -> list[Any]:
        """Per (pool, target) KV usage for meta (``tierfs status``, ``kv pool ls``)."""
        from tierfs.proto.v1 import meta_pb2 as pb

        out = []
        for kv in self.kvstores:
            if not kv.target_id:
                continue
            for u in kv.usage():
                out.append(pb.KVTargetUsage(
                    pool_id=u.pool_id, target_id=kv.target_id, objects=u.objects, memory_used=u.memory_used,
                    disk_used=u.disk_used, pinned=u.pinned_bytes, hits=u.hits, misses=u.misses,
                    evictions=u.evictions, puts=u.puts, expired=u.expired, corrupt=u.corrupt,
                    bytes_in=u.bytes_in, bytes_out=u.bytes_out))
        return out

    def _heartbeat_now(self) -> None:
        """A target just found itself full: report READ_ONLY now, not at the
        next beat, so clients and placement skip it sooner."""
        self._hb_wake.set()

    async def _heartbeat_loop(self) -> None:
        from tierfs.proto.v1 import meta_pb2 as pb

        last_ok = t_sent = time.monotonic()
        missed = False
        sent: dict[int, int] = {}
        while True:
            self._hb_wake.clear()
            try:
                reports = self.reports()
                t_sent = time.monotonic()
                reply = await self.meta.heartbeat(self.node_id, reports, kv_usage=self.kv_reports(),
                                                  kv_map_version=max(self._kv_map_version, 0))
                self.counters["heartbeats"] += 1
                back = [r.target_id for r in reports if r.state == pb.TARGET_STATE_ONLINE
                        and sent.get(r.target_id) == pb.TARGET_STATE_READ_ONLY]
                sent = {r.target_id: r.state for r in reports}
                if back and self.repairer is not None:
                    # Space returned: the positions degraded writes skipped
                    # while it was full are in meta's repair queue.
                    log.info("target(s) %s writable again", back)
                    self.repairer.wake()
                self._take_cap_keys(reply.cap_keys)
                if reply.map_version != self._kv_map_version:
                    await self._refresh_kv_pools(retry=False)
                self._take_kv_lease(reply, t_sent)
                now = time.monotonic()
                if missed or now - last_ok > 3 * self.cfg.heartbeat_interval + 1.0:
                    # Back after failed heartbeats or a freeze (SIGSTOP, a
                    # stalled host): clients may have written chunks without
                    # our fragments meanwhile (degraded writes): catch up.
                    self._catch_up()
                last_ok, missed = now, False
            except NotFoundError as err:
                # meta does not know this node id (state restored from an
                # older snapshot, or the node was removed): register again
                log.warning("meta does not know node %d (%s); registering again", self.node_id, err)
                await self._register()
                self._catch_up()
            except TierFSError as err:
                self.counters["heartbeat_errors"] += 1
                missed = True
                log.warning("heartbeat failed: %s", err)
            except Exception:  # a bug (or a disk error applying the map) must not stop the heartbeats
                self.counters["heartbeat_errors"] += 1
                missed = True
                log.exception("heartbeat failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hb_wake.wait(), self.cfg.heartbeat_interval)
            # Woken early (a map to report, a KV request waiting on meta):
            # no more than one beat per HEARTBEAT_MIN_GAP all the same.
            await asyncio.sleep(max(0.0, t_sent + HEARTBEAT_MIN_GAP - time.monotonic()))

    async def _map_watch_loop(self) -> None:
        """Watch the cluster map: a GetClusterMap that meta holds until the
        map changes, so a change reaches this node in a round trip rather
        than at its next heartbeat, and takes effect for KV that much sooner
        (every leased node must have it: docs/kv.md, "Map leases")."""
        while True:
            t0 = time.monotonic()
            try:
                cmap = await self.meta.get_cluster_map(max(self._kv_map_version, 0), wait=MAP_WATCH_WAIT)
            except TierFSError as err:
                log.debug("watching the cluster map: %s", err)
                await asyncio.sleep(self.cfg.heartbeat_interval)
                continue
            if not cmap.unchanged:
                try:
                    self._apply_kv_pools(cmap)
                except Exception:  # as in the heartbeat loop: logged, tried again with the next map
                    log.exception("applying the cluster map's KV pools failed")
                    await asyncio.sleep(self.cfg.heartbeat_interval)
            elif time.monotonic() - t0 < MAP_WATCH_WAIT / 2:
                # A leader of a release before map watching answers at once.
                await asyncio.sleep(self.cfg.heartbeat_interval)

    def _take_kv_lease(self, reply: Any, t_sent: float) -> None:
        """A heartbeat answer: a KV map lease from ``t_sent`` when meta
        grants one (this node had applied the map meta's previous answer
        named; after fetching a newer map it beats again at once)."""
        if not reply.kv_lease_ms:
            self._kv_leases = False
        else:
            self._kv_leases = True
            self._kv_lease_s = reply.kv_lease_ms / 1000
            if reply.kv_lease_granted:
                self._kv_lease_until = max(self._kv_lease_until, t_sent + self._kv_lease_s)
        self._kv_published = max(self._kv_published, int(reply.kv_published))
        self._kv_lease_changed.set()

    def _kv_lease_ok(self) -> bool:
        """Whether this node may act on stamped KV requests now: its map was
        found current within the lease (or meta grants no leases)."""
        if self._kv_leases is None:
            return False
        return not self._kv_leases or time.monotonic() < self._kv_lease_until

    async def _kv_settle(self, stamp: int) -> None:
        """Wait until this node holds a lease and a copy stamped ``stamp``
        may be taken: every leased node has that map, or its lease ran out
        (meta's ``kv_published``), so none can still take the key where it
        was. Raises UnavailableError after a lease and a few beats."""
        now = time.monotonic()
        deadline = now + max(self._kv_lease_s, 1.0) + 3 * self.cfg.heartbeat_interval
        if self._kv_leases and now >= self._kv_lease_until:
            deadline = now + self.cfg.heartbeat_interval  # ran out: meta unreachable? one more beat
        waited = False
        while True:
            if self._kv_lease_ok() and (not self._kv_leases or stamp <= self._kv_published):
                if waited:
                    self.counters["kv_lease_waits"] += 1
                return
            left = deadline - time.monotonic()
            if left <= 0:
                self.counters["kv_lease_refusals"] += 1
                if not self._kv_lease_ok():
                    raise UnavailableError(
                        f"storage node {self.node_id}: its KV map has not been confirmed by meta for "
                        f"{self._kv_lease_s:.1f}s (meta unreachable?); KV puts, deletes and pins wait for it")
                raise UnavailableError(
                    f"storage node {self.node_id}: map version {stamp} has not taken effect on every storage "
                    f"node yet (meta says {self._kv_published}); put again")
            waited = True
            self._kv_lease_changed.clear()
            self._hb_wake.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kv_lease_changed.wait(), min(left, 0.5))

    async def _kv_pool_missing(self, pool_id: int) -> None:
        """A KV request named a pool this node has not configured: refresh
        from the map (one refresh at a time, at most one every 0.2 s)."""
        async with self._kv_refresh_lock:
            if time.monotonic() - self._kv_refreshed < 0.2:
                return
            with contextlib.suppress(TierFSError):
                cmap = await asyncio.wait_for(self.meta.get_cluster_map(), 2.0)
                self._apply_kv_pools(cmap)
            self._kv_refreshed = time.monotonic()

    async def _refresh_kv_pools(self, *, retry: bool = True) -> None:
        """Configure every target's KV store with the pools in the cluster
        map. ``retry``: until meta answers (start-up); else try once (the
        heartbeat loop must not stall: the next heartbeat tries again)."""
        delay = 0.2
        while True:
            try:
                cmap = await self.meta.get_cluster_map()
                break
            except TierFSError as err:
                if not retry:
                    log.warning("fetching the cluster map failed (%s); KV pools not refreshed", err)
                    return
                log.warning("fetching the cluster map failed (%s); retrying in %.1fs", err, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self._apply_kv_pools(cmap)

    def _apply_kv_pools(self, cmap: Any) -> None:
        from tierfs.storage.kvstore import KVPoolSpec

        if int(cmap.version) < self._kv_map_version:
            return  # an older map (a lagging replica answered): it may lack pools we serve

        specs = [KVPoolSpec(pool_id=int(p.pool_id), name=p.name, memory_bytes=int(p.target_memory),
                            disk_bytes=int(p.target_disk), fsync=bool(p.fsync), pin_quota_bytes=int(p.pin_quota),
                            policy=self._kv_policy(p.name, p.policy or "lru"))
                 for p in getattr(cmap, "kv_pools", ())]
        for kv in self.kvstores:
            kv.configure(specs)
        up = {t.target_id: t.up_since for t in cmap.targets if getattr(t, "up_since", 0)}
        self._kv_routes = {int(p.pool_id): KVPoolRoute.of(p, up) for p in getattr(cmap, "kv_pools", ())}
        if self._kv_map_version < 0 or [s.name for s in specs] != self._kv_pool_names:
            log.info("KV pools: %s", ", ".join(f"{s.name} (id {s.pool_id})" for s in specs) or "none")
        self._kv_pool_names = [s.name for s in specs]
        if self._kv_map_version >= 0 and int(cmap.version) > self._kv_map_version:
            # Tell meta at once (the next beat): a change takes effect for KV
            # once every leased node has its map.
            self._hb_wake.set()
            if self.repairer is not None:
                self.repairer.map_changed()  # a group to rebuild starts now, not at the next poll
        self._kv_map_version = int(cmap.version)

    def _kv_policy(self, pool: str, name: str) -> str:
        """The eviction policy to run for ``pool``: ``name``, or LRU when this
        release does not know it (a pool defined through a meta of a later
        release, or before meta checked the name). Eviction order is a
        matter of hit rates, never of correctness; a pool this daemon could
        not build would fail every map update, and with them the KV map
        lease for every pool."""
        from tierfs.kv.policy import policy_names

        if name in policy_names():
            return name
        if (pool, name) not in self._kv_policy_warned:
            self._kv_policy_warned.add((pool, name))
            log.warning("KV pool %r asks for eviction policy %r, which this release does not have (%s): "
                        "running LRU for it", pool, name, ", ".join(policy_names()))
        return "lru"

    def _kv_gate(self, pool_id: int, target: int, key: bytes, asked: int) -> int | None:
        """The placement stamp to require of ``target``'s copy of ``key``
        (docs/kv.md, "Overwrites and map changes"): the later of what the
        client asked (``asked``, from its map) and what this daemon's map
        says, which follows meta within a heartbeat while a client's may be
        older. None (a miss) when this map puts the key elsewhere and is no
        older than the client's (its stamp is no later than this map). A
        client of a release before stamps asks 0 and is not checked."""
        route = self._kv_routes.get(pool_id)
        if not asked or route is None or not route.groups:
            return asked
        members, stamps = placement(route, key)
        if target in members:
            return max(asked, stamps[members.index(target)])
        if asked > self._kv_map_version:
            # The client has seen a newer map (the key came to this target
            # since): trust it, and catch up.
            self._kv_gate_refresh()
            return asked
        return None

    def _kv_group(self, pool_id: int, key: bytes) -> int:
        """The latest placement stamp of any position in ``key``'s group in
        this daemon's map (0: the pool is not known here). A writer whose
        group stamp is older has a map from before a change to a position it
        may have skipped (dataplane ``_kv_group_check``)."""
        route = self._kv_routes.get(pool_id)
        if route is None or not route.groups:
            return 0
        return max(placement(route, key)[1])

    def _kv_gate_refresh(self) -> None:
        if self._kv_gate_task is None or self._kv_gate_task.done():
            self._kv_gate_task = asyncio.get_running_loop().create_task(
                self._kv_pool_missing(0), name="storage-kv-map-refresh")

    def _catch_up(self) -> None:
        if self.repairer is not None:
            self.repairer.wake()  # positions recorded missing meanwhile: rebuilt at once
        if self.scrubber is None or (self._catchup is not None and not self._catchup.done()):
            return
        self.counters["catch_ups"] += 1
        self._catchup = asyncio.create_task(self.scrubber.catch_up(), name="storage-catch-up")
        self._tasks.append(self._catchup)

    async def _gc_loop(self) -> None:
        while True:
            try:
                await self.gc_once()
            except TierFSError as err:
                self.counters["gc_errors"] += 1
                log.warning("gc round failed: %s", err)
            except Exception:  # a bug must not stop GC and purges on this node for good
                self.counters["gc_errors"] += 1
                log.exception("gc round failed")
            await asyncio.sleep(self.cfg.gc_interval)

    async def gc_once(self) -> int:
        """Delete every fragment meta's GC queue lists for our targets; ack
        them. Then the group purges the first page brought (:meth:`purge`)."""
        engines = {e.target_id: e for e in self.engines if e.target_id}
        items, purges = await self.meta.list_gc_and_purges(list(engines), limit=self.cfg.gc_batch)
        done = await self._gc_pages(engines, items)
        if purges:
            await self.purge(purges)
        return done

    async def _gc_pages(self, engines: dict[int, ChunkEngine], items: list[Any]) -> int:
        after = 0
        done = 0
        while True:
            if not items:
                return done
            acks: list[tuple[int, int]] = []
            for it in items:
                after = max(after, int(it.id))
                eng = engines.get(int(it.target_id))
                if eng is None:
                    continue
                key = FragmentKey(int(it.inode), int(it.chunk), int(it.fragment), int(it.version))
                try:
                    if await eng.delete(key):
                        self.counters["gc_deleted"] += 1
                except TierFSError as err:
                    log.warning("gc delete of %s on target %d failed: %s", key, eng.target_id, err)
                    continue
                acks.append((int(it.id), eng.target_id))
            # A page may exceed its limit by the rest of its last item's rows:
            # ack in slices that stay under meta's cap.
            for i in range(0, len(acks), MAX_GC_ACKS):
                part = acks[i:i + MAX_GC_ACKS]
                done += await self.meta.ack_gc(part)
                self.counters["gc_acked"] += len(part)
            if len(items) < self.cfg.gc_batch:
                return done
            items = await self.meta.list_gc(list(engines), after_id=after, limit=self.cfg.gc_batch)

    async def purge(self, purges: list[Any]) -> int:
        """Delete the copies of group positions our targets no longer hold
        (meta's group purges, as ListGC listed them: a move or drain off
        them finished, or they were replaced), then acknowledge them.
        Returns the purges done.

        A purge names the map version from which the target left the
        position; while our map is older it waits (the next round). Meta
        makes no target a member of a group it still has to purge in, so
        nothing copied onto it afterwards can be deleted here; a map that
        shows the target holding the position again all the same keeps the
        copy (and says so)."""
        engines = {e.target_id: e for e in self.engines if e.target_id}
        if not engines or self.repairer is None:
            return 0
        await self.repairer.refresh_map()
        cmap = self.repairer.cmap
        done: list[Any] = []
        for p in purges:
            eng = engines.get(int(p.target_id))
            if eng is None or cmap is None or int(cmap.version) < int(p.map_version):
                continue
            members = self.repairer.groups.get(int(p.group_id), [])
            if int(p.position) < len(members) and members[int(p.position)] == eng.target_id:
                log.warning("purge of group %d position %d on target %d: the map shows the target holding it "
                            "again; the copy is kept", p.group_id, p.position, eng.target_id)
                done.append(p)
                continue
            deleted = 0
            for ino, chunk, gen in await self.repairer.group_chunks(int(p.group_id)):
                try:
                    if await eng.delete(FragmentKey(ino, chunk, int(p.position), gen)):
                        deleted += 1
                except TierFSError as err:
                    # Retried every round (a failed disk: until the target
                    # is removed); said once per purge.
                    if int(p.id) not in self._purge_warned:
                        self._purge_warned.add(int(p.id))
                        log.warning("purge of group %d on target %d: delete failed (retried every gc_interval): %s",
                                    p.group_id, eng.target_id, err)
                    self.counters["purge_errors"] += 1
                    break
            else:
                done.append(p)
            self.counters["purge_deleted"] += deleted
            if deleted:
                log.info("purged %d fragment(s) of group %d position %d from target %d (it no longer holds "
                         "the position)", deleted, p.group_id, p.position, eng.target_id)
        if done:
            await self.meta.ack_purges(done)
            self.counters["purges_done"] += len(done)
        return len(done)

    # -- scrub --------------------------------------------------------------------

    async def _scrub_loop(self) -> None:
        """Re-read every fragment at ``scrub_rate`` bytes/s, suspects (fragments
        a read found corrupt) first; corrupt ones are quarantined so that they
        read as missing and get rebuilt."""
        while True:
            for eng in list(self.engines):
                try:
                    await self._scrub_target(eng)
                except TierFSError as err:
                    log.warning("scrub of target %s stopped: %s", eng.target_id, err)
            self.counters["scrub_passes"] += 1
            await self._wait_or_suspect(self.cfg.scrub_interval)

    async def _scrub_target(self, eng: ChunkEngine) -> None:
        for key in eng.keys(inode=None):
            for suspect in eng.suspects():
                await self._scrub_key(eng, suspect)
            await self._scrub_key(eng, key)

    async def _scrub_key(self, eng: ChunkEngine, key: FragmentKey) -> None:
        n = await eng.scrub_one(key)
        self.counters["scrub_bytes"] += n
        await asyncio.sleep(n / self.cfg.scrub_rate)

    async def _wait_or_suspect(self, seconds: float) -> None:
        """Sleep between passes, but deal with new suspects within a second."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for eng in list(self.engines):
                for key in eng.suspects():
                    try:
                        await self._scrub_key(eng, key)
                    except TierFSError as err:
                        log.warning("scrub of %s failed: %s", key, err)
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    # -- shutdown ---------------------------------------------------------------

    def _release_dir(self) -> None:
        if self._dir_lock is not None:
            os.close(self._dir_lock)
            self._dir_lock = None

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, swallow=True)  # cancelled again until done (tierfs.aio)
        if self.control is not None:
            await self.control.close()
        if self.repairer is not None:
            await self.repairer.close()
        if self.server is not None:
            await self.server.close()
        for e in self.engines:
            await e.close()
        for kv in self.kvstores:
            await kv.close()
        if self.backend is not None:
            await self.backend.aclose()
        if self.meta is not None:
            await self.meta.close()
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
        self.pool.close()
        self._release_dir()


# --- process --------------------------------------------------------------------------


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


async def serve(
    cfg: StorageConfig, *, use_meta: bool = True, target_ids: Sequence[int] = (), stop: asyncio.Event | None = None
) -> None:
    """Run a storage node until ``stop`` is set or SIGTERM/SIGINT arrives."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    node = StorageNode(cfg, use_meta=use_meta, target_ids=target_ids)
    try:
        await node.start()
        if node.use_meta:
            waiter = asyncio.ensure_future(node.registered.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()
        if not stop.is_set():
            print(json.dumps(node.ready_doc()), flush=True)
            log.info("tierfs-storage ready: %s", node.ready_doc())
            await stop.wait()
    finally:
        t0 = time.monotonic()
        await node.stop()
        log.info("tierfs-storage stopped in %.2fs", time.monotonic() - t0)


def build_parser() -> argparse.ArgumentParser:
    """Flags for every ``StorageConfig`` field (help text from the field docs)
    plus ``--config``, ``--no-meta`` and ``--target-id``."""
    docs = StorageConfig.docs()
    p = argparse.ArgumentParser(
        prog="tierfs-storage", description="Run one TierFS storage node.",
        epilog="Every option is also TIERFS_STORAGE_<FIELD> in the environment and a key of the "
               "[storage] table of --config; flags win over both.",
    )
    p.add_argument("--config", help="TOML file with a [storage] table")
    p.add_argument("--no-meta", action="store_true", help="serve without registering with meta")
    p.add_argument("--target-id", action="append", type=int, dest="target_ids", default=[],
                   help="without meta: the id of each --target, in order (remembered in target.json)")
    repeated = {"targets": ("--target", "DIR"), "meta_addrs": ("--meta", "HOST:PORT"),
                "transports": ("--transport", "NAME")}
    choices = {"io_backend": ["auto", "uring", "posix"], "log_level": ["debug", "info", "warning", "error"],
               "transports": ["tcp", "shm", "rdma"]}
    for name, raw_doc in docs.items():
        doc = raw_doc.replace("%", "%%")  # argparse formats help strings
        if name in repeated:
            flag, metavar = repeated[name]
            p.add_argument(flag, action="append", dest=name, metavar=metavar, choices=choices.get(name),
                           help=f"{doc} (repeat)")
        else:
            p.add_argument(f"--{name.replace('_', '-')}", dest=name, choices=choices.get(name), help=doc)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    skip = {"config", "no_meta", "target_ids"}
    overrides = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    try:
        cfg: StorageConfig = load(StorageConfig, args.config, overrides=overrides)
    except TierFSError as err:
        print(f"tierfs-storage: {err}", file=sys.stderr)
        return 2
    _setup_logging(cfg.log_level)
    try:
        import uvloop

        uvloop.run(serve(cfg, use_meta=not args.no_meta, target_ids=args.target_ids))
    except ConfigError as err:
        print(f"tierfs-storage: {err}", file=sys.stderr)
        return 2
    except (OSError, TierFSError) as exc:
        log.critical("tierfs-storage: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
