"""``tierfs-meta`` as a process: config precedence and validation, the ready
line, Prometheus metrics, clean SIGTERM, the replica RPCs (status, digest,
snapshot, membership, KVDebug) on the wire; and the follower-side guard
against needless log truncation, on a real journal."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import REPO, MetaCluster, free_ports, kv_get, kv_put, replica_status, wait_for
from tierfs.config import load
from tierfs.errors import ConfigError, InvalidArgumentError, UnsupportedError
from tierfs.meta.config import MetaConfig
from tierfs.meta.daemon import KVStateMachine
from tierfs.meta.journal import DurableJournal
from tierfs.meta.raft import SNAPSHOT_FILE, RaftReplicator
from tierfs.meta.secret import ensure_secret_file, load_secret
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.security import admin_token


def test_config_precedence_and_validation(tmp_path: Path) -> None:
    toml = tmp_path / "meta.toml"
    toml.write_text('[meta]\nraft_addr = "127.0.0.1:7101"\nelection_timeout_min = "300ms"\n'
                    'peers = ["127.0.0.1:7102=127.0.0.1:7002", "127.0.0.1:7103"]\n')
    env = {"TIERFS_META_ELECTION_TIMEOUT_MIN": "350ms", "TIERFS_META_SNAPSHOT_MIN_ENTRIES": "500"}
    cfg = load(MetaConfig, toml, env=env, overrides={"snapshot_min_entries": "700", "grpc_addr": None})
    assert cfg.raft_addr == "127.0.0.1:7101"
    assert cfg.election_timeout_min == pytest.approx(0.35)  # env beats TOML
    assert cfg.snapshot_min_entries == 700  # flag beats env
    assert cfg.peer_map() == {"127.0.0.1:7102": "127.0.0.1:7002", "127.0.0.1:7103": ""}
    bad = [
        ({"election_timeout_min": "0.1"}, "election_timeout_min"),  # <= 3 x heartbeat
        ({"election_timeout_max": "0.2"}, "election_timeout_max"),
        ({"connection_timeout": "0.5"}, "connection_timeout"),
        ({"peers": "127.0.0.1:7100"}, "peers"),  # itself
        ({"raft_addr": "nohost"}, "raft_addr"),
        ({"state_machine": "sql"}, "state_machine"),
        ({"snapshot_min_entries": "1"}, "snapshot_min_entries"),
    ]
    for overrides, fld in bad:
        with pytest.raises(ConfigError) as ei:
            load(MetaConfig, None, env={}, overrides=overrides)
        assert ei.value.field == fld, (overrides, ei.value)


@pytest.mark.timeout(60)
def _listening(pid: int) -> set[tuple[str, int]]:
    """The TCP (v4 and v6) addresses process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexip, hexport = f[1].split(":")
            raw = bytes.fromhex(hexip)
            if width == 8:
                ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            out.add((ip.removeprefix("::ffff:"), int(hexport, 16)))  # a v4-mapped address as v4
    return out


def test_daemon_ready_line_metrics_and_clean_sigterm(tmp_path: Path) -> None:
    raft, grpc_port, metrics = free_ports(3)
    env = dict(os.environ, PYTHONPATH=str(REPO), TIERFS_META_SNAPSHOT_MIN_ENTRIES="1000")
    cmd = [sys.executable, "-m", "tierfs.meta.daemon", "--raft-addr", f"127.0.0.1:{raft}",
           "--grpc-addr", f"127.0.0.1:{grpc_port}", "--data-dir", str(tmp_path / "d"),
           "--state-machine", "kv", "--metrics-addr", f"127.0.0.1:{metrics}",
           "--cluster-secret-file", str(ensure_secret_file(tmp_path / "cluster.secret"))]
    # Its own secret, so not the session's TIERFS_TOKEN: the admin token derived from it.
    token = admin_token(load_secret(tmp_path / "cluster.secret"))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO) as p:
        try:
            assert p.stdout is not None
            ready = json.loads(p.stdout.readline())
            assert ready["event"] == "ready" and ready["grpc"] == f"127.0.0.1:{grpc_port}"
            assert ready["metrics"] == f"127.0.0.1:{metrics}"
            wait_for(lambda: replica_status(ready["grpc"], token=token).role == "leader", 20, "single-node leader")
            # Every port listens where it was told: the Raft port listened
            # on every interface (pysyncobj's default) until stop 46.
            assert _listening(p.pid) == {("127.0.0.1", raft), ("127.0.0.1", grpc_port), ("127.0.0.1", metrics)}
            for i in range(5):
                kv_put(ready["grpc"], f"k{i}", "v")
            # A second replica on its data_dir (other ports): refused, one
            # line (until stop 47 it opened the same journal); on its gRPC
            # port: refused without a traceback.
            r2, g2 = free_ports(2)
            again = [*cmd]
            again[again.index("--raft-addr") + 1] = f"127.0.0.1:{r2}"
            again[again.index("--grpc-addr") + 1] = f"127.0.0.1:{g2}"
            res = subprocess.run(again, capture_output=True, text=True, env=env, cwd=REPO, timeout=30)
            assert res.returncode == 2 and f"in use by pid {p.pid}" in res.stderr, res.stderr
            assert "Traceback" not in res.stderr
            same_port = [*cmd]
            same_port[same_port.index("--raft-addr") + 1] = f"127.0.0.1:{r2}"
            same_port[same_port.index("--data-dir") + 1] = str(tmp_path / "d2")
            res = subprocess.run(same_port, capture_output=True, text=True, env=env, cwd=REPO, timeout=30)
            assert res.returncode == 1 and "cannot bind gRPC address" in res.stderr, res.stderr
            assert "Traceback" not in res.stderr
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
                text = r.read().decode()
            assert 'tierfs_meta_ops_total{outcome="ok"} 5.0' in text
            assert "tierfs_meta_commit_seconds_count 5.0" in text
            p.send_signal(signal.SIGTERM)
            assert p.wait(20) == 0
            assert p.stderr is not None
            log_lines = [json.loads(x) for x in p.stderr.read().decode().splitlines() if x.startswith("{")]
            assert any("stopped" in x["msg"] for x in log_lines)
        finally:
            if p.poll() is None:
                p.kill()
    # the state survived the clean stop
    j = DurableJournal(tmp_path / "d")
    assert sum(1 for e in j if b"k4" in e[0]) == 1
    j.close()


@pytest.mark.timeout(150)
def test_kv_replica_serves_typed_admin_rpcs(tmp_path: Path) -> None:
    with MetaCluster(tmp_path, n=1, extra_args=["--snapshot-min-entries", "1000"]) as c:
        c.wait_leader()
        r = c.replicas[0]
        st = c.status(0)
        assert r.proc is not None and st.pid == r.proc.pid
        assert (st.raft.raft_addr, st.raft.grpc_addr, st.raft.snapshots) == (r.raft_addr, r.grpc_addr, 0)
        assert list(st.raft.raft_members) == [r.raft_addr] and st.raft.addr_map[r.raft_addr] == r.grpc_addr

        first = kv_put(r.grpc_addr, "a", "1")
        second = kv_put(r.grpc_addr, "a", "2")
        assert (first.existed, second.existed, second.previous) == (False, True, "1")
        assert second.applied_index > first.applied_index
        assert kv_get(r.grpc_addr, ["a", "missing"]) == {"a": "2", "missing": None}
        d = c.meta_stub_call(0, lambda s: s.Digest(pb.Empty(), timeout=5))
        expect = KVStateMachine()
        expect.data = {"a": "2"}
        assert (d.ops_applied, d.digest) == (2, expect.digest())

        # no namespace here: refused before anything reaches the log
        with pytest.raises(UnsupportedError):
            c.meta_stub_call(0, lambda s: s.Mkdir(pb.MkdirRequest(loc=pb.Loc(path="/x")), timeout=5))
        with pytest.raises(InvalidArgumentError, match="already a member"):
            c.meta_stub_call(0, lambda s: s.AddMetaMember(
                pb.MetaMemberRequest(raft_addr=r.raft_addr, grpc_addr=r.grpc_addr), timeout=5))
        assert c.meta_stub_call(0, lambda s: s.Digest(pb.Empty(), timeout=5)).ops_applied == 2

        c.force_snapshot(0)
        wait_for(lambda: c.status(0).raft.snapshots == 1, 90, "the forced snapshot")
        assert (r.data_dir / SNAPSHOT_FILE).exists()


def test_bad_config_exits_2(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "tierfs.meta.daemon", "--election-timeout-min", "0.01"],
                         capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO,
                         timeout=60, check=False)
    assert res.returncode == 2
    assert b"election_timeout_min" in res.stderr


def test_stale_resend_is_not_truncated(tmp_path: Path) -> None:
    """A resend of entries the follower holds (same terms) must not make
    pysyncobj truncate: the message is rewritten; a real conflict is not."""
    rep = RaftReplicator(KVStateMachine(), raft_addr="127.0.0.1:1", grpc_addr="127.0.0.1:2",
                         peers={}, data_dir=tmp_path)
    j = DurableJournal(tmp_path)
    for i in range(1, 11):
        j.add(b"c%d" % i, i, 1 if i <= 5 else 2)
    rep._journal = j
    msg = {"type": "append_entries", "term": 2, "commit_index": 10, "prevLogIdx": 6, "prevLogTerm": 2,
           "entries": [(b"c7", 7, 2), (b"c8", 8, 2)]}
    # our last entry (10) has the leader's term: heartbeat at our end, nothing dropped
    out, ack = rep._check_append(msg, last_applied=9)
    assert (out["prevLogIdx"], out["prevLogTerm"], out["entries"], ack) == (10, 2, [], None)
    # the message covers and extends our log: only the new tail is passed on
    longer = {**msg, "entries": [(b"c%d" % i, i, 2) for i in range(7, 13)]}
    out, ack = rep._check_append(longer, last_applied=9)
    assert out["prevLogIdx"] == 10 and [e[1] for e in out["entries"]] == [11, 12]
    # an older-term tail not covered: heartbeat with a clamped commit, ack what was verified
    old = {**msg, "term": 3, "commit_index": 10}
    out, ack = rep._check_append(old, last_applied=9)
    assert "prevLogIdx" not in out and out["commit_index"] == 8 and ack == 9
    # a real conflict (entry 8 with another term) goes to pysyncobj unchanged
    conflict = {**msg, "term": 3, "entries": [(b"c7", 7, 2), (b"x8", 8, 3)]}
    out, ack = rep._check_append(conflict, last_applied=6)
    assert out is conflict and ack is None
    assert rep.truncation_stats["conflict"] == 1
    j.close()
