"""Configuration of a ``tierfs-storage`` daemon (TOML table ``[storage]``,
environment ``TIERFS_STORAGE_<FIELD>``, flags of :mod:`tierfs.storage.daemon`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from tierfs.config import BaseConfig, field, parse_size
from tierfs.errors import ConfigError
from tierfs.meta.ops import MAX_GC_PAGE
from tierfs.tls import TlsFiles

__all__ = ["StorageConfig"]

_IO_BACKENDS = ("auto", "uring", "posix")
_TRANSPORTS = ("tcp", "shm", "rdma")


def _split_addr(addr: str, name: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"not a host:port address: {addr!r}", field=name)
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class StorageConfig(BaseConfig):
    SECTION: ClassVar[str] = "storage"

    data_dir: Path = field(
        Path("tierfs-storage-data"),
        "Directory for this node's identity (node.uuid); also holds the default target.",
    )
    targets: list[str] = field(
        [],
        "Target directories, one per disk (default: <data_dir>/target0). Each keeps its fragments "
        "and its target.json identity.",
    )
    meta_addrs: list[str] = field([], "gRPC addresses (host:port) of the meta replicas; empty runs without meta.")
    node_key_file: str = field(
        "", "File holding the cluster's node key (tfn1..., mode 0600; `tierfs up` writes DATA/node.key): "
        "meta refuses registrations and heartbeats without it when authentication is on.")
    rack: str = field(
        "", "Failure domain of this node (a rack, a power domain): placement never puts two fragments of one group "
        "in one rack when there are enough racks. '' = the node is its own failure domain (docs/rebalance.md).")
    host: str = field("127.0.0.1", "Address the data plane listens on.")
    port: int = field(0, "Data-plane TCP port (0 picks a free one).")
    advertise_host: str = field("", "Host other nodes use to reach this one (default: host).")
    transports: list[str] = field(["tcp", "shm"], "Data-plane transports to offer: tcp, shm, rdma.")

    heartbeat_interval: float = field(1.0, "Period of heartbeats (capacity, used, state per target) to meta.", kind="duration")
    gc_interval: float = field(2.0, "Period of polling meta's GC queue for fragments to delete.", kind="duration")
    gc_batch: int = field(1000, "GC items fetched per poll (at most meta's page cap, 10000).")

    scrub_rate: int = field(
        32 << 20, "Bytes per second the background scrubber re-reads and verifies (0 turns it off).", kind="size"
    )
    scrub_interval: float = field(3600.0, "Pause between two full scrub passes.", kind="duration")
    orphan_grace: float = field(
        3600.0, "Scrub deletes an orphan fragment (no file needs it) only once its file is this old.", kind="duration"
    )
    rebuild_rate: int = field(
        256 << 20, "Bytes per second the rebuild worker fetches from peers (0: unlimited).", kind="size"
    )
    rebuild_interval: float = field(2.0, "How often the rebuild worker looks for groups to rebuild (it also looks at once when the cluster map changes).", kind="duration")
    rebuild_concurrency: int = field(
        16, "Fragments this node rebuilds at once, over all groups and the repair queue (each holds K fetched "
        "fragments in pooled buffers meanwhile: 16 x 5 x 1.25 MiB for ec:4+2 with 4 MiB chunks).")
    repair_interval: float = field(
        2.0, "How often the repair-queue worker asks meta for fragments of ours known missing or bad (degraded "
        "writes, scrub findings) and rebuilds them; it also asks at once at start and when heartbeats resume.",
        kind="duration")
    control_port: int = field(0, "Port of the control gRPC service (scrub, repair status) on host (0 picks one).")

    io_backend: str = field("auto", "Disk I/O: auto (io_uring if the kernel allows, else posix) | uring | posix.")
    queue_depth: int = field(64, "io_uring submission queue depth (operations in the kernel at once).")
    io_threads: int = field(8, "Worker threads of the posix backend.")
    buffer_pool_bytes: int = field(256 << 20, "Idle aligned buffers kept for reuse (bytes).", kind="size")
    buffer_pool_max_bytes: int = field(
        4 << 30, "Most buffer memory the node maps at once (in use + idle); past it requests get Unavailable.",
        kind="size",
    )

    max_fragment_size: int = field(64 << 20, "Largest fragment a target accepts.", kind="size")
    reserved_bytes: int = field(256 << 20, "Free space kept on each target's file system; writes past it get NoSpace.", kind="size")
    min_free: str = field(
        "64MiB", "Free space (beyond reserved_bytes) under which a target reports READ_ONLY to meta: still read, "
        "skipped by writes and placement until space returns. A size (64MiB) or a percentage of the file "
        "system (1%).")

    max_frame_bytes: int = field(128 << 20, "Largest data-plane frame payload.", kind="size")
    max_inflight_bytes: int = field(512 << 20, "Payload bytes one data-plane connection may hold in flight.", kind="size")
    max_inflight_requests: int = field(256, "Requests one data-plane connection may have in flight.")
    shm_ring_bytes: int = field(16 << 20, "Size of each direction's shared-memory ring (shm transport).", kind="size")

    require_capabilities: bool = field(
        True, "Serve a data-plane request only under a capability meta signed (docs/security-caps.md); off only "
        "when meta runs with auth off. Without meta (--no-meta) nothing can be checked.")
    tls_cert: str = field(
        "", "PEM certificate this daemon serves TLS with (its gRPC and data-plane ports then speak TLS only) and "
        "presents when it dials another daemon. '' = plaintext (docs/security-tls.md).")
    tls_key: str = field("", "PEM private key of tls_cert (keep it mode 0600).")
    tls_ca: str = field("", "PEM CA certificate(s) this daemon verifies peers with (servers it dials, client "
                        "certificates presented to it).")
    tls_require_client_cert: bool = field(
        False, "Require every client to present a certificate signed by tls_ca (mutual TLS for all clients, "
        "daemons included). Off: TLS authenticates the server only; clients authenticate with their token.")

    metrics_addr: str = field("", "host:port of the Prometheus endpoint ('' disables; port 0 picks one).")
    log_level: str = field("info", "debug | info | warning | error")

    def validate(self) -> None:
        TlsFiles.from_config(self, load=False)
        if not 0 <= self.port < 65536:
            raise ConfigError("must be in 0..65535", field="port")
        for a in self.meta_addrs:
            _split_addr(a, "meta_addrs")
        if self.io_backend not in _IO_BACKENDS:
            raise ConfigError(f"must be one of {', '.join(_IO_BACKENDS)}", field="io_backend")
        for t in self.transports:
            if t not in _TRANSPORTS:
                raise ConfigError(f"unknown transport {t!r} (one of {', '.join(_TRANSPORTS)})", field="transports")
        if not 1 <= self.queue_depth <= 4096:
            raise ConfigError("must be in 1..4096", field="queue_depth")
        if self.io_threads < 1:
            raise ConfigError("must be >= 1", field="io_threads")
        if self.heartbeat_interval <= 0:
            raise ConfigError("must be positive", field="heartbeat_interval")
        if self.gc_interval <= 0:
            raise ConfigError("must be positive", field="gc_interval")
        if not 1 <= self.gc_batch <= MAX_GC_PAGE:
            raise ConfigError(f"must be in 1..{MAX_GC_PAGE} (meta's ListGC page cap)", field="gc_batch")
        if self.scrub_rate < 0:
            raise ConfigError("must be >= 0", field="scrub_rate")
        if self.scrub_interval <= 0:
            raise ConfigError("must be positive", field="scrub_interval")
        if self.orphan_grace < 0:
            raise ConfigError("must be >= 0", field="orphan_grace")
        if self.rebuild_rate < 0:
            raise ConfigError("must be >= 0", field="rebuild_rate")
        if self.rebuild_interval <= 0:
            raise ConfigError("must be positive", field="rebuild_interval")
        if not 1 <= self.rebuild_concurrency <= 4096:
            raise ConfigError("must be in 1..4096", field="rebuild_concurrency")
        if self.repair_interval <= 0:
            raise ConfigError("must be positive", field="repair_interval")
        if not 0 <= self.control_port < 65536:
            raise ConfigError("must be in 0..65535", field="control_port")
        if self.buffer_pool_bytes < 0:
            raise ConfigError("must be >= 0", field="buffer_pool_bytes")
        if self.buffer_pool_max_bytes < max(self.max_frame_bytes, self.buffer_pool_bytes):
            raise ConfigError("must be at least max_frame_bytes and buffer_pool_bytes", field="buffer_pool_max_bytes")
        if self.reserved_bytes < 0:
            raise ConfigError("must be >= 0", field="reserved_bytes")
        self.min_free_limit()
        if not 0 < self.max_fragment_size <= self.max_frame_bytes:
            raise ConfigError("must be positive and at most max_frame_bytes", field="max_fragment_size")
        if self.max_inflight_bytes < self.max_frame_bytes:
            raise ConfigError("must be at least max_frame_bytes", field="max_inflight_bytes")
        if self.metrics_addr:
            _split_addr(self.metrics_addr, "metrics_addr")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError("must be debug, info, warning or error", field="log_level")
        dirs = [str(Path(t).resolve()) for t in self.target_dirs()]
        if len(set(dirs)) != len(dirs):
            raise ConfigError("a directory is listed twice", field="targets")

    def min_free_limit(self) -> tuple[int, float]:
        """``min_free`` as (bytes, fraction of the file system); one is 0."""
        raw = self.min_free.strip()
        try:
            if raw.endswith("%"):
                pct = float(raw[:-1])
                if not 0 <= pct < 100:
                    raise ValueError
                return 0, pct / 100
            n = parse_size(raw)
            if n < 0:
                raise ValueError
            return n, 0.0
        except ValueError:
            raise ConfigError(f"not a size or a percentage below 100: {self.min_free!r} (examples: 64MiB, 1%)",
                              field="min_free") from None

    def target_dirs(self) -> list[Path]:
        return [Path(t) for t in self.targets] or [Path(self.data_dir) / "target0"]
