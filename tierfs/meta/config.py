"""Configuration of a ``tierfs-meta`` replica (TOML table ``[meta]``,
environment ``TIERFS_META_<FIELD>``, flags of :mod:`tierfs.meta.daemon`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from tierfs.config import BaseConfig, field
from tierfs.errors import ConfigError, TierFSError
from tierfs.meta.ops import MAX_GC_GRACE, check_kv_budget_floor, check_kv_pool_create
from tierfs.meta.secret import load_secrets
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.tls import TlsFiles

__all__ = ["MetaConfig", "parse_peer", "split_addr"]


def split_addr(addr: str, name: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); ConfigError naming ``name`` otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"not a host:port address: {addr!r}", field=name)
    return host, int(port)


def parse_peer(spec: str) -> tuple[str, str]:
    """``"RAFT"`` or ``"RAFT=GRPC"`` -> (raft address, gRPC address or "")."""
    raft, _, grpc_addr = spec.partition("=")
    split_addr(raft.strip(), "peers")
    if grpc_addr:
        split_addr(grpc_addr.strip(), "peers")
    return raft.strip(), grpc_addr.strip()


@dataclasses.dataclass(frozen=True)
class MetaConfig(BaseConfig):
    SECTION: ClassVar[str] = "meta"

    node_id: str = field("", "Name of this replica in logs and metrics (default: its raft address).")
    raft_addr: str = field("127.0.0.1:7100", "host:port this replica's Raft transport binds and is known by.")
    raft_bind_addr: str = field(
        "",
        "host:port the Raft transport listens on; default: raft_addr (its host resolved, so a replica "
        "listens on that address only). Set it where raft_addr is not a local address (NAT, a proxy), "
        "e.g. 0.0.0.0:7100 for every interface.",
    )
    grpc_addr: str = field("127.0.0.1:7000", "host:port of this replica's gRPC server (port 0 picks a free port).")
    advertise_grpc_addr: str = field(
        "",
        "host:port clients are told to use for this replica (leader hints in NotLeader answers); "
        "default: the bound gRPC address. Set it when clients reach the replica through a proxy, "
        "NAT or a different interface.",
    )
    peers: list[str] = field(
        [],
        "The other members at first start, each RAFT_ADDR or RAFT_ADDR=GRPC_ADDR. A replica being "
        "added at runtime lists the current members. The gRPC half seeds the raft->gRPC map "
        "(replicated afterwards) used in NotLeader answers.",
    )
    data_dir: Path = field(Path("tierfs-meta-data"), "Directory for the Raft journal and snapshots.")
    cluster_secret_file: str = field(
        "",
        "File holding the cluster secret every replica shares (one line, >= 32 characters, not "
        "accessible to other users; `python -m tierfs.meta.secret FILE` makes one). Raft frames are "
        "sealed with a key derived from it and frames that are not are dropped unread. Required "
        "unless insecure_no_cluster_secret is set.",
    )
    insecure_no_cluster_secret: bool = field(
        False,
        "Run without a cluster secret: the Raft port then unpickles whatever it receives, so anyone "
        "who can reach it runs code as this user. Only for throwaway tests on a trusted host.",
    )
    auth: bool = field(
        True,
        "Authenticate every meta RPC (admin token, node key or user token; docs/security.md). Needs the "
        "cluster secret. false (--insecure-no-auth): every caller is anonymous root with admin rights, as "
        "`tierfs status` shows. Only for throwaway tests on a trusted host.",
    )
    state_machine: str = field("meta", "'meta' (the namespace) or 'kv' (a toy key-value store for tests and benchmarks).")

    heartbeat_interval: float = field(0.05, "Leader's AppendEntries period.", kind="duration")
    election_timeout_min: float = field(0.4, "Lower bound of the randomized election timeout.", kind="duration")
    election_timeout_max: float = field(0.8, "Upper bound of the randomized election timeout.", kind="duration")
    connection_timeout: float = field(1.0, "A Raft connection silent this long is dropped (>= election_timeout_max).", kind="duration")
    connection_retry: float = field(0.5, "Delay between reconnection attempts to a peer.", kind="duration")
    leader_step_down: float = field(1.5, "A leader without a majority's answers this long steps down.", kind="duration")
    leader_lost_election: float = field(
        0.25, "A follower whose connection to the leader closes (the leader process died) campaigns after a delay "
        "up to this, staggered by rank among the survivors, instead of a whole election timeout (0: wait the "
        "election timeout; docs/raft.md).",
        kind="duration")
    pre_vote: bool = field(
        True, "Ask the other replicas before campaigning (Raft pre-vote): a replica cut off from a working "
        "leader does not raise its term, so healing it does not depose that leader (docs/raft.md).")

    snapshot_min_entries: int = field(10000, "Take a snapshot (and compact the journal) once it holds this many entries.")
    snapshot_min_interval: float = field(600.0, "... or this long after the previous snapshot.", kind="duration")
    journal_recovery: str = field(
        "refuse",
        "What to do when the Raft journal is corrupt in the middle (not a torn tail): 'refuse' to start "
        "(the default), or 'resync': move the journal and snapshot aside (data_dir/corrupt-TIME/) and "
        "rejoin as an empty member that catches up from the leader, not voting until it has.",
    )
    fsync: bool = field(True, "fdatasync the journal before acknowledging (turn off only for throwaway tests).")

    submit_timeout: float = field(5.0, "How long a mutation may wait for its commit.", kind="duration")
    heartbeat_timeout: float = field(10.0, "A storage node missing heartbeats this long goes offline.", kind="duration")
    lease_duration: float = field(30.0, "Write-session lease.", kind="duration")
    kv_lease: float = field(
        5.0,
        "KV map lease: a storage node acts on stamped KV requests only this long after a heartbeat found its map "
        "current, and a change that moves KV keys takes effect once every node has it or its lease ran out "
        "(docs/kv.md, 'Map leases'). A meta outage longer than this stops KV puts and turns gets into misses. "
        "At most heartbeat_timeout is used. 0 = no leases (the window before them: a writer and a daemon both on an old map).",
        kind="duration",
    )
    tick_interval: float = field(1.0, "Period of the leader's housekeeping tick op.", kind="duration")
    replace_after: float = field(
        30.0,
        "A target down (offline or failed) this long is replaced in its placement groups by a target on another "
        "node, which rebuilds the lost fragments (0 = never; `tierfs target rm` replaces at once).",
        kind="duration",
    )
    gc_grace: float = field(
        300.0,
        "Fragments of a replaced, truncated or deleted chunk version are deleted only this long after the change, "
        "so readers that opened the file before it can finish (0 = at once).",
        kind="duration",
    )
    purge_grace: float = field(
        30.0,
        "A target's copy of a group position it no longer holds (a move or drain off it finished, or it was "
        "replaced) is deleted by its node this long after the change (at most gc_grace): readers holding the map "
        "from before may still read it meanwhile (0 = at once).",
        kind="duration",
    )

    rebalance: bool = field(
        True,
        "Move placement-group members so that every eligible target holds its share of bytes (within 10% of "
        "the mean) when nodes join or come back, and fix groups that break the rack rule after a label "
        "change (docs/rebalance.md). Off: new nodes only get new groups.",
    )
    rebalance_interval: float = field(5.0, "How often the leader plans a rebalance round (also at once when a node "
                                      "registers, a label changes or a move finishes).", kind="duration")
    rebalance_max_moving: int = field(
        4, "Most placement groups the rebalancer moves at once (each copies under the storage rebuild_rate).")
    rebalance_write_defer: float = field(
        30.0, "How long a move of a placement group waits while an open write session has uploads in it (its "
        "writer would re-send those fragments to the new member at close); the group moves after that even if "
        "it is still being written. 0: moves never wait.", kind="duration")
    rebalance_redirect_after: float = field(
        10.0, "How long a move may wait on a new member that is full (read-only) or failed before the leader "
        "sends it on to another target (the copy source keeps serving meanwhile). 0: such moves wait until the "
        "member has room again or its node is drained.", kind="duration")

    kv_default_pool: bool = field(
        True,
        "Create the 'default' KV pool once the cluster has storage targets (with the kv_default_* settings "
        "below, of the leader at that moment). It is made once: removed, it is not made again.",
    )
    kv_default_redundancy: str = field("replica:1", "Redundancy of the default KV pool (replica:N or ec:K+M).")
    kv_default_target_memory: int = field(256 << 20, "Per-target memory budget of the default KV pool.", kind="size")
    kv_default_target_disk: int = field(1 << 30, "Per-target disk budget of the default KV pool.", kind="size")

    root_squash: bool = field(
        True,
        "Judge a non-admin user whose uid is 0 as uid/gid 65534 (nobody) in permission checks, so a user "
        "record made with uid 0 is not root over the namespace (admins are never squashed).",
    )
    cap_key_rotation: float = field(
        3600.0, "Length of a data-plane capability key epoch (keys rotate without restarts; docs/security-caps.md).",
        kind="duration")
    file_cap_ttl: float = field(600.0, "Lifetime of the file capabilities meta mints (at most cap_key_rotation).",
                                kind="duration")
    kv_cap_ttl: float = field(300.0, "Lifetime of KV capabilities (clients renew them in the background).",
                              kind="duration")
    tls_cert: str = field(
        "", "PEM certificate this replica serves gRPC over TLS with (the port then speaks TLS only; the Raft port "
        "keeps its sealed frames, not TLS). '' = plaintext (docs/security-tls.md).")
    tls_key: str = field("", "PEM private key of tls_cert (keep it mode 0600).")
    tls_ca: str = field("", "PEM CA certificate(s) this daemon verifies peers with (servers it dials, client "
                        "certificates presented to it).")
    tls_require_client_cert: bool = field(
        False, "Require every client to present a certificate signed by tls_ca (mutual TLS for all clients, "
        "daemons included). Off: TLS authenticates the server only; clients authenticate with their token.")

    forward_to_leader: bool = field(
        True, "A follower forwards every leader call (mutations, linearizable reads) to the leader with the "
        "caller's own credentials and returns its answer, so a client that reaches only a follower works "
        "(docs/meta.md, 'Followers forward'). false: it answers NotLeaderError naming the leader.")
    metrics_addr: str = field("", "host:port of the Prometheus endpoint ('' disables; port 0 picks one).")
    log_level: str = field("info", "debug | info | warning | error")
    log_format: str = field("json", "json (one object per line) | text")

    def validate(self) -> None:
        if self.cap_key_rotation < 1:
            raise ConfigError("must be at least 1 second", field="cap_key_rotation")
        for name in ("file_cap_ttl", "kv_cap_ttl"):
            if not 0 < getattr(self, name) <= self.cap_key_rotation:
                raise ConfigError("must be positive and at most cap_key_rotation (a capability must not outlive "
                                  "the keys daemons hold)", field=name)
        TlsFiles.from_config(self, load=False)
        split_addr(self.raft_addr, "raft_addr")
        split_addr(self.grpc_addr, "grpc_addr")
        if self.raft_bind_addr:
            split_addr(self.raft_bind_addr, "raft_bind_addr")
        if self.advertise_grpc_addr:
            split_addr(self.advertise_grpc_addr, "advertise_grpc_addr")
        if self.metrics_addr:
            split_addr(self.metrics_addr, "metrics_addr")
        seen = set()
        for spec in self.peers:
            raft, _ = parse_peer(spec)
            if raft == self.raft_addr:
                raise ConfigError("a replica must not list itself", field="peers")
            if raft in seen:
                raise ConfigError(f"duplicate peer {raft}", field="peers")
            seen.add(raft)
        if self.journal_recovery not in ("refuse", "resync"):
            raise ConfigError("must be 'refuse' or 'resync'", field="journal_recovery")
        if self.state_machine not in ("meta", "kv"):
            raise ConfigError("must be 'meta' or 'kv'", field="state_machine")
        if self.rebalance_max_moving < 1:
            raise ConfigError("must be >= 1", field="rebalance_max_moving")
        if self.rebalance_interval <= 0:
            raise ConfigError("must be > 0", field="rebalance_interval")
        if self.rebalance_write_defer < 0:
            raise ConfigError("must be >= 0", field="rebalance_write_defer")
        if self.rebalance_redirect_after < 0:
            raise ConfigError("must be >= 0", field="rebalance_redirect_after")
        if self.heartbeat_interval <= 0:
            raise ConfigError("must be > 0", field="heartbeat_interval")
        if not 0 <= self.kv_lease <= 60:
            raise ConfigError("must be between 0 and 60 seconds", field="kv_lease")
        if self.election_timeout_min <= 3 * self.heartbeat_interval:
            raise ConfigError("must exceed 3 x heartbeat_interval", field="election_timeout_min")
        if self.election_timeout_max <= self.election_timeout_min:
            raise ConfigError("must exceed election_timeout_min", field="election_timeout_max")
        if self.connection_timeout < self.election_timeout_max:
            raise ConfigError("must be >= election_timeout_max", field="connection_timeout")
        if self.connection_retry < 0:
            raise ConfigError("must be >= 0", field="connection_retry")
        if not 0 <= self.leader_lost_election <= self.election_timeout_max:
            raise ConfigError("must be between 0 and election_timeout_max", field="leader_lost_election")
        if self.leader_step_down <= self.heartbeat_interval:
            raise ConfigError("must exceed heartbeat_interval", field="leader_step_down")
        if self.snapshot_min_entries < 2:
            raise ConfigError("must be >= 2", field="snapshot_min_entries")
        if self.snapshot_min_interval <= 0:
            raise ConfigError("must be > 0", field="snapshot_min_interval")
        if self.replace_after < 0:
            raise ConfigError("must be >= 0 (0 = never)", field="replace_after")
        if not 0 <= self.gc_grace <= MAX_GC_GRACE:
            raise ConfigError(f"must be between 0 and {MAX_GC_GRACE:.0f} seconds", field="gc_grace")
        if not 0 <= self.purge_grace <= MAX_GC_GRACE:
            raise ConfigError(f"must be between 0 and {MAX_GC_GRACE:.0f} seconds", field="purge_grace")
        if self.submit_timeout <= 0:
            raise ConfigError("must be > 0", field="submit_timeout")
        if self.kv_default_pool:
            try:
                check_kv_pool_create(self.kv_default_pool_request())
                check_kv_budget_floor(self.kv_default_pool_request())
            except TierFSError as exc:
                raise ConfigError(exc.message, field="kv_default_pool") from None
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError("must be debug, info, warning or error", field="log_level")
        if self.log_format not in ("json", "text"):
            raise ConfigError("must be json or text", field="log_format")

    def cluster_secret(self) -> bytes | None:
        """The Raft cluster secret read from ``cluster_secret_file``; ``None``
        when ``insecure_no_cluster_secret`` is set. ConfigError when neither
        (or both) is given, or when the file is unusable. Kept out of
        :meth:`validate` so that a config can be built and inspected without
        the file; the daemon calls this before it binds anything."""
        if self.cluster_secret_file and self.insecure_no_cluster_secret:
            raise ConfigError("give either cluster_secret_file or insecure_no_cluster_secret, not both",
                              field="cluster_secret_file")
        if self.insecure_no_cluster_secret:
            return None
        if not self.cluster_secret_file:
            raise ConfigError("a cluster secret is required (--cluster-secret-file FILE, "
                              "TIERFS_META_CLUSTER_SECRET_FILE or cluster_secret_file in [meta]; "
                              "`python -m tierfs.meta.secret FILE` creates one); "
                              "--insecure-no-cluster-secret runs without (see docs/raft.md)",
                              field="cluster_secret_file")
        return load_secrets(self.cluster_secret_file)[0]

    def cluster_secrets(self) -> list[bytes]:
        """Every secret in ``cluster_secret_file``, the current one first
        (more than one while it is rotated: docs/security.md); [] when
        ``insecure_no_cluster_secret`` is set. Errors as :meth:`cluster_secret`."""
        if self.cluster_secret() is None:
            return []
        return load_secrets(self.cluster_secret_file)

    def check_auth(self, secret: bytes | None) -> None:
        """ConfigError when authentication is on without a cluster secret
        (the admin token and node key are derived from it)."""
        if self.auth and secret is None:
            raise ConfigError("auth = true needs the cluster secret (the admin token and the node key are derived "
                              "from it): give --cluster-secret-file, or turn authentication off too with "
                              "--insecure-no-auth (auth = false)", field="auth")

    def kv_default_pool_request(self) -> pb.CreateKVPoolRequest:
        """The default KV pool this replica stamps on registrations while it leads."""
        return pb.CreateKVPoolRequest(name="default", redundancy=self.kv_default_redundancy,
                                      target_memory=self.kv_default_target_memory,
                                      target_disk=self.kv_default_target_disk)

    def peer_map(self) -> dict[str, str]:
        """raft address -> gRPC address ("" where not configured)."""
        return dict(parse_peer(s) for s in self.peers)
