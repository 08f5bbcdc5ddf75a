"""Configuration of the client SDK (TOML top level or ``[client]``-less file,
environment ``TIERFS_<FIELD>``: ``TIERFS_META=host:port,host:port`` names the
meta replicas)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from tierfs.config import BaseConfig, field
from tierfs.errors import ConfigError
from tierfs.tls import TlsFiles, resolve_client_tls

__all__ = ["ClientConfig", "client_tls"]


@dataclasses.dataclass(frozen=True)
class ClientConfig(BaseConfig):
    SECTION: ClassVar[str] = ""

    meta: list[str] = field([], "gRPC addresses (host:port) of the meta replicas; any subset will do.")
    token: str | None = field(
        None, "Credential every meta call carries (a user or admin token). Given, even empty or wrong, it is "
        "used as is; unset: token_file, else $TIERFS_TOKEN, else $TIERFS_TOKEN_FILE, else "
        "data_dir/admin.token of a local cluster (docs/security.md).")
    token_file: str | None = field(None, "File holding the token (one line, mode 0600).")
    data_dir: str = field("./.tierfs", "Local cluster directory whose admin.token is the last-resort credential.")
    transport: str = field("tcp", "Data-plane transport: tcp, shm (same host), rdma, or auto (shm on loopback).")
    connections_per_peer: int = field(2, "Data-plane connections per storage node.")
    request_timeout: float = field(10.0, "Deadline of one data-plane request (one attempt).", kind="duration")
    connect_timeout: float = field(3.0, "Deadline of one data-plane connection attempt.", kind="duration")
    meta_deadline: float = field(
        20.0, "Total time a metadata call may spend, retries and leader fail-over included.", kind="duration")
    meta_attempt_timeout: float = field(3.0, "Deadline of one metadata RPC attempt.", kind="duration")
    abort_deadline: float = field(
        5.0, "Total time an aborted write (an error, a cancel) spends telling meta to end its session; "
        "past it the session ends when its lease runs out.", kind="duration")
    retries: int = field(3, "Attempts per fragment before it counts as lost (the read then decodes around it).")
    backoff_initial: float = field(0.05, "First retry delay; doubles per attempt.", kind="duration")
    backoff_max: float = field(1.0, "Largest retry delay.", kind="duration")
    read_concurrency: int = field(16, "Chunks one read keeps in flight.")
    write_concurrency: int = field(8, "Chunks one writer keeps in flight (encoded, being sent).")
    lease_ms: int = field(30_000, "Write-session lease asked of meta; renewed every third of it.")
    failed_target_ttl: float = field(
        5.0, "A target that just failed is skipped (reads go straight to parity) for this long "
        "(four times as long after a timeout).", kind="duration")
    map_refresh_interval: float = field(
        0.5, "Least time between two cluster-map refreshes caused by errors.", kind="duration")
    map_max_age: float = field(
        10.0, "A cluster map older than this is re-checked with meta before use (cheap when unchanged).",
        kind="duration")
    hedged_reads: bool = field(
        True, "Hedged reads: when a chunk's data-fragment fetches have not all arrived after the hedge delay, "
        "the stragglers are cancelled and parity is fetched instead (decode from any K).")
    hedge_after: float = field(
        0.0, "Hedge delay. 0: adaptive, twice the p95 of recent fragment latencies, clamped to "
        "[hedge_min, request_timeout / 4]; a straggler is also given three times its peers' time.",
        kind="duration")
    hedge_min: float = field(
        0.02, "Least adaptive hedge delay (a busy but healthy node must not trigger needless decodes).",
        kind="duration")
    hedged_writes: bool = field(
        True, "Degraded writes around a lagging member: once min_write_fragments of a chunk's fragments are "
        "durable, a fragment write still unanswered after a quarter of request_timeout and three times its "
        "peers' time is given up and its position left missing (rebuilt by repair, like a failed one), "
        "instead of waiting out the request timeout and its retries on a stalled node.")
    slow_target_ttl: float = field(
        2.0, "A target whose fetch was hedged is read around (parity first) for this long.", kind="duration")
    verify_partial_reads: bool = field(
        True, "A read of part of an EC chunk also checks, once per chunk generation (remembered for the last "
        "65,536), that the stored CRC32Cs of its K data fragments (asked of their targets alongside the read) "
        "combine to the chunk record's: a wrong but self-consistent fragment is then read around as on a "
        "whole-chunk read. Costs K small requests on the first partial read of each chunk. A partial read of a "
        "replicated chunk checks the copy it reads in the same way (its stored length and CRC32C), once per copy "
        "and generation. Where those stats cannot all be had (a target down or slow), the whole chunk (or copy) "
        "is read and checked instead; a fragment file checked once is not asked again until it is replaced.")
    min_write_fragments: int = field(
        0, "Degraded writes: a chunk write succeeds once this many of its fragments are durable; the missing "
        "ones are recorded in meta at commit and rebuilt at once by the storage node holding their "
        "position. 0: K+1 for ec:K+M (one more failure survivable before repair), 2 for replica:N with "
        "N >= 2 (two durable copies), 1 for replica:1; never fewer than K, never more than K+M.")
    buffer_pool_bytes: int = field(512 << 20, "Idle bytes the client's buffer pool keeps for reuse.", kind="size")
    read_cache_bytes: int = field(
        256 << 20, "Bytes the read caches of all of this client's files may hold together (small reads of files "
        "open read-only load whole chunks, up to four per file). Past it the least recently used loaded chunks "
        "go first; a read that finds no room reads its bytes directly. 0: no read cache.", kind="size")
    tls_ca: str = field(
        "", "PEM CA that meta and storage daemons' certificates are checked against: set, every connection is "
        "TLS (docs/security-tls.md). '': TIERFS_TLS_CA, else ./.tierfs/tls/ca.pem of a local `tierfs up --tls` "
        "cluster when it exists, else plaintext.")
    tls_cert: str = field("", "PEM client certificate, for clusters that require one (tls_require_client_cert).")
    tls_key: str = field("", "PEM private key of tls_cert.")
    # --- KV cache (tierfs.kv; see docs/kv.md) ---
    kv_pool: str = field("default", "KV pool that client.kv names.")
    kv_timeout: float = field(
        2.0, "Deadline of one KV data-plane request: a target that does not answer in time is a miss "
        "(a get) or a skipped copy (a put), never a hang.", kind="duration")
    kv_min_bandwidth: int = field(
        100 << 20, "Slowest rate (bytes/s) a KV request's bytes may move at: a request's deadline is "
        "kv_timeout plus its bytes at this rate, so a large batch (an engine's whole prefix) is not cut off "
        "for its size. 0: kv_timeout alone.", kind="size")
    kv_verify_copies: bool = field(
        True, "Replica pools: a get compares the copy it reads with the next copy's stored CRC32C (asked "
        "alongside, from that daemon's index); when they differ the get is a miss and both copies are dropped, "
        "so a copy rewritten with other bytes and its own CRC32C is never served where another copy is "
        "reachable (docs/kv.md, \"Forged copies\").")
    kv_require_witness: bool = field(
        False, "Replica pools, with kv_verify_copies: a copy read that no other copy can vouch for (the other "
        "copies evicted, down, slow, or of a release before stop 39; every copy of a replica:1 pool), and whose "
        "CRC32C this client does not know (it put the value, or two copies agreed), is a miss instead of a "
        "hit. A forged copy is then never served, at the cost of misses while copies are apart "
        "(docs/kv.md, \"Forged copies\").")
    kv_dram_bytes: int = field(
        0, "Client DRAM tier for KV objects (pre-allocated at first use); 0 = none. Leave it 0 behind an "
        "engine adapter: the engine's own CPU buffer is the DRAM tier.", kind="size")
    kv_dram_policy: str = field("lru", "Eviction policy of the DRAM tier.")
    kv_ssd_path: str = field("", "File of the local-SSD tier (pre-allocated at first use); empty = none.")
    kv_ssd_bytes: int = field(0, "Size of the local-SSD tier file.", kind="size")
    kv_ssd_policy: str = field("lru", "Eviction policy of the local-SSD tier.")
    kv_ssd_inline_bytes: int = field(
        256 << 10, "Local-SSD tier: objects up to this size, read while no other read of the tier is in "
        "flight or asked for, are read in the calling thread (no hop through the I/O backend; the event loop "
        "waits for that one read); 0 = always through the backend (docs/kv_tiers.md, \"Inline reads\").",
        kind="size")
    kv_write_back: bool = field(
        False, "Write-back: a put returns once the object is in the local tiers and reaches the cluster in "
        "the background (flush() waits). Off: write-through.")
    kv_write_back_bytes: int = field(
        256 << 20, "Most bytes a write-back client holds not yet in the cluster; a put waits for room.",
        kind="size")

    def __post_init__(self) -> None:
        # "h1:p1,h2:p2" as the CLI, TIERFS_META and AsyncClient take it (a
        # str was iterated one character at a time: "not a host:port
        # address: '1'").
        if isinstance(self.meta, str):
            object.__setattr__(self, "meta", [a.strip() for a in self.meta.split(",") if a.strip()])
        elif not isinstance(self.meta, list):
            object.__setattr__(self, "meta", list(self.meta))
        super().__post_init__()

    def validate(self) -> None:
        for addr in self.meta:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"not a host:port address: {addr!r}", field="meta")
            if not 0 < int(port) < 65536:
                raise ConfigError(f"port {port} out of range (1-65535): {addr!r}", field="meta")
        if self.transport not in ("tcp", "shm", "rdma", "auto"):
            raise ConfigError(f"unknown transport {self.transport!r} (tcp, shm, rdma, auto)", field="transport")
        for name in ("connections_per_peer", "retries", "read_concurrency", "write_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError("must be >= 1", field=name)
        for name in ("request_timeout", "connect_timeout", "meta_deadline", "meta_attempt_timeout", "abort_deadline"):
            if getattr(self, name) <= 0:
                raise ConfigError("must be > 0", field=name)
        if self.backoff_initial < 0 or self.backoff_max < self.backoff_initial:
            raise ConfigError("must be >= 0 and <= backoff_max", field="backoff_initial")
        if self.lease_ms < 1000:
            raise ConfigError("must be >= 1000 (renewals need time to reach meta)", field="lease_ms")
        if self.kv_timeout <= 0:
            raise ConfigError("must be > 0", field="kv_timeout")
        for name in ("kv_dram_bytes", "kv_ssd_bytes", "kv_ssd_inline_bytes", "kv_write_back_bytes",
                     "kv_min_bandwidth"):
            if getattr(self, name) < 0:
                raise ConfigError("must be >= 0", field=name)
        if self.kv_ssd_bytes and not self.kv_ssd_path:
            raise ConfigError("kv_ssd_bytes needs kv_ssd_path", field="kv_ssd_path")
        if self.kv_write_back and not (self.kv_dram_bytes or self.kv_ssd_bytes):
            raise ConfigError("write-back needs a local tier (kv_dram_bytes or kv_ssd_bytes)", field="kv_write_back")
        for name in ("hedge_after", "hedge_min", "slow_target_ttl"):
            if getattr(self, name) < 0:
                raise ConfigError("must be >= 0", field=name)
        if self.min_write_fragments < 0:
            raise ConfigError("must be >= 0 (0: the default for the layout)", field="min_write_fragments")
        for name in ("failed_target_ttl", "map_refresh_interval", "buffer_pool_bytes", "read_cache_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError("must be >= 0", field=name)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key go together", field="tls_cert")


def client_tls(c: ClientConfig) -> TlsFiles | None:
    """The TLS files of a client built from ``c`` (None: plaintext), by
    :func:`tierfs.tls.resolve_client_tls`'s precedence."""
    return resolve_client_tls(c.tls_ca or None, c.tls_cert or None, c.tls_key or None, addrs=c.meta)
